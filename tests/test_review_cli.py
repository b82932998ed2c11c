"""Review of the client library, the CLI and ``lockd run``: reproductions of defects.

Each test marked ``xfail(strict=True)`` shows a defect found in review: it
fails today and must start passing once the defect is fixed (then drop the
mark). The tests use real daemons and real processes, because the defects are
about process behaviour (process groups, parent death, timing of a lost lease).
No test sleeps to wait for an expiry: leases are a few hundred ms and every
wait polls against a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from lockd_client import Handle, LockClient, LockLostError

from .conftest import LOCKD, DaemonProcess

PY = sys.executable


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> bool:
    """Poll ``pred`` until it holds; False (not an error) when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def pid_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie nobody reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def start_run(daemon: DaemonProcess, *args: str) -> subprocess.Popen[str]:
    """``lockd run ARGS`` as a subprocess, its output captured."""
    return subprocess.Popen(
        [*LOCKD, "run", *args],
        env=daemon.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# COMMAND that starts a worker (its own child, same process group) and waits.
# argv[1] is a marker file: "ready <worker pid>".
WORKER_IN_GROUP = """
import subprocess, sys, time, pathlib
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
pathlib.Path(sys.argv[1]).write_text(f"ready {worker.pid}")
time.sleep(60)
"""


def test_kill9_of_lockd_run_kills_the_whole_command_group(
    daemon: DaemonProcess, short_tmp: Path
) -> None:
    """SPEC §9: COMMAND runs in its own process group and dies with ``lockd run``.

    The key is freed at once (releaseOnClose), so anything of COMMAND's group
    that survives works on without the lock, overlapping the next holder.
    """
    marker = short_tmp / "m"
    proc = start_run(daemon, "--ttl", "60s", "grp", "--", PY, "-c", WORKER_IN_GROUP, str(marker))
    worker = 0
    try:
        assert wait_until(lambda: marker.exists() and marker.read_text().startswith("ready"))
        worker = int(marker.read_text().split()[1])
        proc.kill()
        proc.wait(5)
        with LockClient(daemon.socket) as own:
            assert wait_until(lambda: not own.status("grp").held, 2.0)  # free at once ...
        # ... so nothing of COMMAND may still be running.
        assert wait_until(lambda: pid_gone(worker), 2.0), "COMMAND's worker outlived lockd run"
    finally:
        if worker and not pid_gone(worker):
            os.kill(worker, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_auto_renew_reports_loss_before_the_lease_runs_out(daemon: DaemonProcess) -> None:
    """``lock(auto_renew=True)``: renewals failing "until the lease is about to run out".

    With a frozen daemon, ``on_lost`` must come while the lease still holds,
    so the block can stop before another holder may get the key; lockd run
    keeps a tenth of the TTL as margin, the library should too.
    """
    assert daemon.proc is not None
    lost_at: list[float] = []
    done = threading.Event()

    def on_lost(handle: Handle) -> None:
        lost_at.append(time.time())
        done.set()

    client = LockClient(daemon.socket)
    lock = client.lock("freeze", ttl=0.6, timeout=1, auto_renew=True, on_lost=on_lost)
    with client, pytest.raises(LockLostError), lock as h:  # the block ends after the loss
        expires = h.lease_expires_at
        assert expires is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            done.wait(5)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
    assert lost_at, "on_lost never called"
    # A fix with a margin of a tenth of the TTL (60 ms) passes; today it comes after expiry.
    assert datetime.fromtimestamp(lost_at[0], expires.tzinfo) < expires - timedelta(milliseconds=30)
