"""``lockd run`` hears its loss from the daemon (docs/contract.md §12) and the break waits for it.

The leases here last a minute: a renewal (every 20 s) cannot be what made
``lockd run`` act, the daemon's event did. A break of ``lockd run``'s hold
is answered only once COMMAND is gone: ``lockd run`` says ``stopped`` after
acting on the loss, or its connection closes when it exits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lockd_client import LockClient

from lockd.exitcodes import EXIT_LOST
from lockd.testing.daemon import DaemonProcess

from .test_cli_run import (
    IGNORE_TERM,
    PID_THEN_SLEEP,
    PY,
    RUN_EXIT,
    TRAP_TERM,
    pid_gone,
    start_run,
    wait_ready,
)

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """One daemon for the module (conftest's ``lockd``): each test's key ends free or held."""
    return lockd


@pytest.mark.parametrize("on_lost", ["kill", "term"])
def test_break_reason_on_stderr_and_command_gone_before_the_break_returns(
    daemon: DaemonProcess, short_tmp: Path, on_lost: str
) -> None:
    marker = short_tmp / "m"
    program = PID_THEN_SLEEP if on_lost == "kill" else TRAP_TERM
    args = ["--ttl", "60s", "--on-lost", on_lost, "job", "--", PY, "-c", program, str(marker)]
    proc = start_run(daemon, *args)
    ready = wait_ready(marker)
    with LockClient(daemon.socket) as admin:
        result = admin.break_lock("job", "moving the rack")
        assert result.broken
        if on_lost == "kill":
            # The key went on only after COMMAND was killed and reaped.
            assert pid_gone(int(ready.split()[1]))
        else:
            assert marker.read_text().startswith("SIGTERM")
        assert not admin.status("job").held
    assert proc.wait(RUN_EXIT) == EXIT_LOST
    stderr = proc.stderr.read() if proc.stderr else ""
    assert "lease on 'job' lost (broken by user:" in stderr
    assert "moving the rack" in stderr


def test_break_waits_out_sigterm_grace_then_sigkill(daemon: DaemonProcess, short_tmp: Path) -> None:
    marker = short_tmp / "m"
    args = ["--ttl", "60s", "--grace", "300ms", "g", "--", PY, "-c", IGNORE_TERM, str(marker)]
    proc = start_run(daemon, *args)
    pid = int(wait_ready(marker).split()[1])
    with LockClient(daemon.socket) as admin:
        assert admin.break_lock("g", "test").broken
        assert pid_gone(pid)  # SIGTERM ignored, SIGKILL after --grace, and only then the reply
    assert proc.wait(RUN_EXIT) == EXIT_LOST


def test_retake_names_the_new_holder(daemon: DaemonProcess, short_tmp: Path) -> None:
    marker = short_tmp / "m"
    args = ["--ttl", "60s", "--owner", "run-9", "rt", "--", PY, "-c", TRAP_TERM, str(marker)]
    proc = start_run(daemon, *args)
    wait_ready(marker)
    with LockClient(daemon.socket) as again:
        handle = again.acquire("rt", ttl=60, timeout=5, owner="run-9")
        assert proc.wait(RUN_EXIT) == EXIT_LOST
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "lease on 'rt' lost (re-taken by user:" in stderr
        assert again.status("rt").fence == handle.fence  # the re-take keeps the key
