"""``lockd run``: flock(1) with a lease, against a real daemon and real processes.

Most tests start ``lockd run`` as a subprocess (``python -m lockd run`` once
the command is registered on the ``lockd`` group, else a one-line launcher),
because what matters is process behaviour: exit statuses, signals, process
groups, PDEATHSIG, connections closed by the kernel. Leases are a few hundred
ms so that renewals (every TTL/3) happen within the test; nothing sleeps to
wait for an expiry: we poll with deadlines.
"""

from __future__ import annotations

import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from lockd_client import (
    DaemonUnavailableError,
    Handle,
    InvalidRequestError,
    LockAccessDeniedError,
    LockClient,
    RateLimitedError,
    ShuttingDownError,
)

from lockd.cli.common import parse_duration_ms
from lockd.cli.run import run
from lockd.exitcodes import (
    EXIT_BUSY,
    EXIT_DENIED,
    EXIT_LOST,
    EXIT_RATE_LIMITED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from lockd.run.lease import take_lease
from lockd.run.options import Reporter, RunOptions
from lockd.run.process import exit_status
from lockd.testing.daemon import LOCKD, DaemonProcess
from lockd.testing.polling import wait_for
from tests.conftest import Backend

PY = sys.executable


def _run_argv() -> list[str]:
    """How to start ``lockd run``: via the ``lockd`` group once it is registered there."""
    from lockd.cli import main

    if "run" in main.list_commands(click.Context(main)):  # lazy: not in .commands until used
        return [*LOCKD, "run"]
    return [PY, "-c", "from lockd.cli_run import run; run(prog_name='lockd run')"]


LOCKD_RUN = _run_argv()

#: How long lockd run may take to exit once COMMAND is gone or it was told to
#: stop: COMMAND's exit, the release round trip and lockd run's own exit took
#: over 5 s on a 2-core box at load 9 (test_signals_are_forwarded, in CI).
RUN_EXIT = 20.0

# Child programs (run by lockd run as COMMAND). argv[1] is a marker file. Each then
# waits for a signal (signal.pause): lockd run's, or the SIGKILL of a test's end.
TRAP_TERM = """
import signal, sys, time, pathlib
p = pathlib.Path(sys.argv[1])
def on(sig, frame):
    p.write_text(f"{signal.Signals(sig).name} {time.time()!r}")
    sys.exit(7)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on)
p.write_text("ready")
signal.pause()
"""
IGNORE_TERM = """
import os, signal, sys, pathlib
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path(sys.argv[1]).write_text(f"ready {os.getpid()}")
signal.pause()
"""
PID_THEN_SLEEP = """
import os, signal, sys, pathlib
pathlib.Path(sys.argv[1]).write_text(f"ready {os.getpid()}")
signal.pause()
"""


def _default_signal_dispositions() -> None:
    """In the child: SIGINT, SIGTERM and SIGHUP back to their defaults.

    lockd run, like a shell, keeps a signal ignored that was ignored when it
    started; a test runner started in the background by a non-interactive
    shell (``bash .ci/run &``) inherits SIGINT ignored, which would turn the
    forwarding tests into tests of that rule.
    """
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def start_run(
    daemon: DaemonProcess,
    *args: str,
    stdout: int | None = subprocess.PIPE,
    stdin: int | None = None,
) -> subprocess.Popen[str]:
    """``lockd run`` in the background; ``stdin=PIPE`` reaches COMMAND (it inherits it)."""
    return subprocess.Popen(
        [*LOCKD_RUN, *args],
        env=daemon.env,
        stdin=stdin,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signal_dispositions,
    )


def lockd_run(
    daemon: DaemonProcess, *args: str, timeout: float = 15
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LOCKD_RUN, *args], env=daemon.env, capture_output=True, text=True, timeout=timeout
    )


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    wait_for(pred, timeout, what)


def stderr_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next line ``lockd run`` writes to stderr, waiting up to ``timeout`` s for it."""
    assert proc.stderr is not None
    readable, _, _ = select.select([proc.stderr], [], [], timeout)
    assert readable, f"lockd run wrote nothing to stderr within {timeout} s"
    return proc.stderr.readline()


def tell(proc: subprocess.Popen[str], line: str = "go") -> None:
    """A line on COMMAND's stdin: what it waits for before going on."""
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def wait_ready(marker: Path, timeout: float = 5.0) -> str:
    wait_until(
        lambda: marker.exists() and marker.read_text().startswith("ready"), timeout, "COMMAND"
    )
    return marker.read_text()


def pid_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie nobody reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.fixture(scope="module")
def shared(backend: Backend) -> Iterator[DaemonProcess]:
    """One daemon for the tests of this module that leave it running (each uses its own keys).

    Starting a daemon costs ~0.5 s; the test that freezes the daemon gets its own.
    """
    root = Path(tempfile.mkdtemp(prefix="lockd-run-", dir="/tmp"))
    proc = backend.daemon_in(root)
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def client(shared: DaemonProcess) -> Iterator[LockClient]:
    with LockClient(shared.socket) as c:
        yield c


def held(client: LockClient, key: str) -> bool:
    return client.status(key).held


# -- click surface (no daemon) ------------------------------------------------------


def test_help_documents_options_and_exit_codes() -> None:
    result = CliRunner().invoke(run, ["--help"], prog_name="lockd run")
    assert result.exit_code == 0
    out = result.output
    assert "Usage: lockd run [OPTIONS] KEY -- COMMAND [ARGS]..." in out
    for option in (
        "--ttl",
        "--wait",
        "--owner",
        "--on-lost",
        "--grace",
        "--conflict-exit-code",
        "--quiet",
        "--socket",
        "--json",
    ):
        assert option in out
    for line in ("1    key busy", "2    usage", "3    access denied", "4    rate limited"):
        assert line in out
    assert "5    daemon unreachable" in out
    assert "6    lease lost" in out
    assert "127 COMMAND not found" in out
    assert "LOCKD_FENCE" in out


@pytest.mark.parametrize(
    "args",
    [
        ["k"],  # no -- at all
        ["k", "--"],  # no COMMAND
        ["k", "true"],  # COMMAND without --
        ["--", "true"],  # no KEY
        ["k", "--ttl", "soon", "--", "true"],
        ["k", "--ttl", "25h", "--", "true"],
        ["k", "--ttl", "50ms", "--", "true"],  # too short to renew
        ["k", "--wait", "-1s", "--", "true"],
        ["k", "--on-lost", "pray", "--", "true"],
        ["k", "--conflict-exit-code", "256", "--", "true"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = CliRunner().invoke(run, args)
    assert result.exit_code == EXIT_USAGE, result.output


def test_missing_dashdash_says_so() -> None:
    result = CliRunner().invoke(run, ["k", "make"])
    assert result.exit_code == EXIT_USAGE
    assert "missing '--' before COMMAND" in result.output


def test_daemon_unreachable_exits_5_naming_the_socket(short_tmp: Path) -> None:
    sock = short_tmp / "nobody.sock"
    marker = short_tmp / "ran"
    result = CliRunner().invoke(run, ["--socket", str(sock), "k", "--", "touch", str(marker)])
    assert result.exit_code == EXIT_UNAVAILABLE
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(sock) in lines[0]
    assert not marker.exists()


@pytest.mark.parametrize(
    ("text", "ms"),
    [("250", 250), ("600ms", 600), ("1.5s", 1500), ("2m", 120_000), ("1h", 3_600_000),
     ("0.0004s", 1), (" 10s ", 10_000), (".5s", 500), ("1.s", 1000), ("1.1s", 1100)],
)  # fmt: skip
def test_duration_parser(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "s", "1d", "-1s", "10S", "1 2s", "nan"])
def test_duration_parser_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration_ms(text)


def test_exit_status_like_a_shell() -> None:
    assert exit_status(0) == 0
    assert exit_status(3) == 3
    assert exit_status(-signal.SIGTERM) == 143
    assert exit_status(-signal.SIGKILL) == 137


# -- error mapping and the keeper, with fake clients --------------------------------


class _RaisingClient:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.request_timeout: float | None = 30.0

    def listen_for_losses(self) -> None:
        pass  # take_lease asks for lease-loss events before the grant

    def try_acquire(self, *args: object, **kwargs: object) -> Handle | None:
        raise self.exc

    def status(self, key: str) -> object:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (LockAccessDeniedError("no", code="LOCK_ACCESS_DENIED", status=403), EXIT_DENIED),
        (RateLimitedError("slow down", code="RATE_LIMITED", status=429), EXIT_RATE_LIMITED),
        (InvalidRequestError("bad", code="INVALID_REQUEST", status=400), EXIT_USAGE),
        (DaemonUnavailableError("/x.sock", "cannot connect"), EXIT_UNAVAILABLE),
        (ShuttingDownError("bye", code="SHUTTING_DOWN", status=503), EXIT_UNAVAILABLE),
        (ValueError("key must be 1-1024 bytes"), EXIT_USAGE),
    ],
)
def test_take_lease_maps_errors_to_exit_codes(exc: Exception, code: int) -> None:
    err = io.StringIO()
    opts = RunOptions(key="k", command=("true",))
    got = take_lease(_RaisingClient(exc), opts, Reporter(err))  # type: ignore[arg-type]
    assert got == code
    assert len(err.getvalue().splitlines()) == 1


# -- against the daemon: the basics -------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("raise SystemExit(0)", 0),
        ("raise SystemExit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", 128 + signal.SIGTERM),
    ],
)
def test_exit_status_passthrough(
    shared: DaemonProcess, client: LockClient, code: str, expected: int
) -> None:
    result = lockd_run(shared, "k", "--", PY, "-c", code)
    assert result.returncode == expected, result.stderr
    assert result.stderr == ""
    assert not held(client, "k")  # released after the command exited


@pytest.mark.both_backends
def test_env_reaches_command_and_handle_is_live(shared: DaemonProcess, client: LockClient) -> None:
    code = (
        "import json, os; from lockd_client import LockClient;"
        "env = {k: v for k, v in os.environ.items() if k.startswith('LOCKD_')};"
        "r = LockClient().renew((env['LOCKD_KEY'], env['LOCKD_HANDLE']), 30);"
        "print(json.dumps({**env, 'renewed': r.renewed}))"
    )
    result = lockd_run(shared, "--owner", "job-7", "env:key", "--", PY, "-c", code)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["LOCKD_KEY"] == "env:key"
    assert int(seen["LOCKD_FENCE"]) >= 1
    assert len(seen["LOCKD_HANDLE"]) >= 22
    assert seen["LOCKD_SOCKET"] == str(shared.socket)
    assert seen["renewed"] is True  # the handle in the env is the one holding the key
    assert not held(client, "env:key")


@pytest.mark.both_backends
def test_busy_key_exits_1_with_one_line(
    shared: DaemonProcess, client: LockClient, short_tmp: Path
) -> None:
    holder = client.try_acquire("busy", ttl=30, owner="first")
    assert holder is not None
    marker = short_tmp / "ran"
    result = lockd_run(shared, "busy", "--", "touch", str(marker))
    assert result.returncode == EXIT_BUSY
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "'busy' is busy" in lines[0] and "owner first" in lines[0]
    assert not marker.exists()

    result = lockd_run(shared, "--conflict-exit-code", "75", "busy", "--", "touch", str(marker))
    assert result.returncode == 75
    result = lockd_run(
        shared, "-q", "--conflict-exit-code", "0", "busy", "--", "touch", str(marker)
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert not marker.exists()
    assert client.release(holder).released  # the busy attempts did not disturb the holder


def test_everything_after_dashdash_is_command(shared: DaemonProcess) -> None:
    code = "import sys; print(sys.argv[1:])"
    result = lockd_run(shared, "argv", "--", PY, "-c", code, "--help", "--", "-x", "--ttl")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['--help', '--', '-x', '--ttl']"


def test_json_messages(shared: DaemonProcess, client: LockClient) -> None:
    assert client.try_acquire("busy-json", ttl=30) is not None
    result = lockd_run(shared, "--json", "busy-json", "--", "true")
    assert result.returncode == EXIT_BUSY
    (line,) = result.stderr.strip().splitlines()
    error = json.loads(line)["error"]
    assert error["code"] == "KEY_BUSY"
    assert error["details"]["key"] == "busy-json"


def test_wait_times_out_with_conflict_code(shared: DaemonProcess, client: LockClient) -> None:
    assert client.try_acquire("slow", ttl=30) is not None
    started = time.monotonic()
    result = lockd_run(shared, "--wait", "200ms", "--conflict-exit-code", "9", "slow", "--", "true")
    assert result.returncode == 9
    assert time.monotonic() - started >= 0.2
    assert "timed out after 200ms" in result.stderr


@pytest.mark.both_backends
def test_wait_gets_the_key_in_fifo_order(
    shared: DaemonProcess, client: LockClient, short_tmp: Path
) -> None:
    log = short_tmp / "log"
    holder = client.try_acquire("fifo", ttl=30)
    assert holder is not None
    script = (
        "import sys, time; f = open(sys.argv[1], 'a'); f.write(sys.argv[2] + '+'); f.flush();"
        # COMMAND's work: a window in which an overlapping next holder would write.
        "time.sleep(0.15); f.write(sys.argv[2] + '-'); f.flush()"
    )
    procs = []
    for n, name in enumerate(("A", "B"), start=1):
        procs.append(
            start_run(shared, "--wait", "10s", "fifo", "--", PY, "-c", script, str(log), name)
        )
        wait_until(lambda n=n: client.status("fifo").waiters == n, what=f"{n} waiters")
    client.release(holder)
    for proc in procs:
        assert proc.wait(15) == 0, proc.stderr.read() if proc.stderr else ""
    assert log.read_text() == "A+A-B+B-"  # in arrival order, never overlapping
    assert not held(client, "fifo")


def test_command_not_found_exits_127_and_releases(
    shared: DaemonProcess, client: LockClient, short_tmp: Path
) -> None:
    result = lockd_run(shared, "nf", "--", "/nonexistent/command-xyz")
    assert result.returncode == 127
    assert "not found" in result.stderr
    assert not held(client, "nf")
    script = short_tmp / "not-executable.sh"
    script.write_text("#!/bin/sh\n")
    result = lockd_run(shared, "nf", "--", str(script))
    assert result.returncode == 126
    assert not held(client, "nf")


# -- dying and signals --------------------------------------------------------------------


@pytest.mark.both_backends
def test_sigkill_frees_the_key_at_once_and_kills_command(
    shared: DaemonProcess, client: LockClient, short_tmp: Path
) -> None:
    marker = short_tmp / "m"
    proc = start_run(shared, "--ttl", "60s", "doomed", "--", PY, "-c", PID_THEN_SLEEP, str(marker))
    pid = int(wait_ready(marker).split()[1])
    assert held(client, "doomed")
    proc.kill()
    proc.wait(5)
    # releaseOnClose: freed when the connection closes, not after the 60 s TTL
    # (on etcd the release is a raft write: 1 s was tight for a loaded box).
    wait_until(lambda: not held(client, "doomed"), 10.0, "the key to be freed")
    wait_until(lambda: pid_gone(pid), 2.0, "COMMAND to die (PDEATHSIG)")


# COMMAND that starts a worker (its own child, same process group) and waits.
# argv[1] is a marker file: "ready <worker pid>".
WORKER_IN_GROUP = """
import signal, subprocess, sys, pathlib
worker = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
pathlib.Path(sys.argv[1]).write_text(f"ready {worker.pid}")
signal.pause()
"""


def test_kill9_of_lockd_run_kills_the_whole_command_group(
    daemon: DaemonProcess, short_tmp: Path
) -> None:
    """docs/contract.md §9: COMMAND runs in its own process group and dies with ``lockd run``.

    The key is freed at once (releaseOnClose), so anything of COMMAND's group
    that survives works on without the lock, overlapping the next holder.
    """
    marker = short_tmp / "m"
    proc = start_run(daemon, "--ttl", "60s", "grp", "--", PY, "-c", WORKER_IN_GROUP, str(marker))
    worker = 0
    try:
        worker = int(wait_ready(marker).split()[1])
        proc.kill()
        proc.wait(5)
        with LockClient(daemon.socket) as own:
            wait_until(lambda: not own.status("grp").held, 2.0, "the key to be free")  # at once ...
        # ... so nothing of COMMAND may still be running.
        wait_until(lambda: pid_gone(worker), 2.0, "COMMAND's worker to die with lockd run")
    finally:
        if worker and not pid_gone(worker):
            os.kill(worker, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_command_runs_in_its_own_process_group(shared: DaemonProcess, short_tmp: Path) -> None:
    marker = short_tmp / "m"
    proc = start_run(shared, "pg", "--", PY, "-c", PID_THEN_SLEEP, str(marker))
    try:
        pid = int(wait_ready(marker).split()[1])
        assert os.getpgid(pid) == pid
        assert os.getsid(pid) == pid
        assert os.getpgid(pid) != os.getpgid(proc.pid)
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_are_forwarded(
    shared: DaemonProcess, client: LockClient, short_tmp: Path, sig: signal.Signals
) -> None:
    marker = short_tmp / "m"
    key = f"fwd-{sig.name}"  # one of its own: a run stuck under load fails only its own case
    proc = start_run(shared, key, "--", PY, "-c", TRAP_TERM, str(marker))
    wait_ready(marker)
    proc.send_signal(sig)
    assert proc.wait(RUN_EXIT) == 7  # COMMAND's own status after handling the signal
    assert marker.read_text().startswith(sig.name)
    assert not held(client, key)


def test_sigterm_to_lockd_run_ends_plain_command_with_143(
    shared: DaemonProcess, short_tmp: Path
) -> None:
    marker = short_tmp / "m"
    proc = start_run(shared, "fwd2", "--", PY, "-c", PID_THEN_SLEEP, str(marker))
    wait_ready(marker)
    proc.terminate()
    assert proc.wait(RUN_EXIT) == 128 + signal.SIGTERM


def test_sigint_while_waiting_exits_130_and_leaves_the_queue(
    shared: DaemonProcess, client: LockClient
) -> None:
    assert client.try_acquire("queue", ttl=30) is not None
    proc = start_run(shared, "--wait", "20s", "queue", "--", "true")
    wait_until(lambda: client.status("queue").waiters == 1, what="the waiter")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(RUN_EXIT) == 130
    wait_until(lambda: client.status("queue").waiters == 0, what="the waiter to leave")


# -- losing the lease ---------------------------------------------------------------------


@pytest.mark.both_backends
def test_break_sends_sigterm_and_exits_6(
    shared: DaemonProcess, client: LockClient, short_tmp: Path
) -> None:
    marker = short_tmp / "m"
    proc = start_run(shared, "--ttl", "600ms", "brk", "--", PY, "-c", TRAP_TERM, str(marker))
    wait_ready(marker)
    broke_at = time.monotonic()
    assert client.break_lock("brk", "test: take it away").broken
    assert proc.wait(10) == EXIT_LOST
    noticed = time.monotonic() - broke_at
    assert marker.read_text().startswith("SIGTERM")
    assert noticed < 2.0  # at the next renewal (<= 200 ms), with room for a busy machine
    stderr = proc.stderr.read() if proc.stderr else ""
    assert "lease on 'brk' lost" in stderr and "SIGTERM" in stderr


def test_on_lost_kill(shared: DaemonProcess, client: LockClient, short_tmp: Path) -> None:
    marker = short_tmp / "m"
    proc = start_run(
        shared,
        "--ttl",
        "600ms",
        "--on-lost",
        "kill",
        "lk",
        "--",
        PY,
        "-c",
        IGNORE_TERM,
        str(marker),
    )
    pid = int(wait_ready(marker).split()[1])
    assert client.break_lock("lk", "test").broken
    assert proc.wait(RUN_EXIT) == EXIT_LOST
    assert pid_gone(pid)
    assert "SIGKILL" in (proc.stderr.read() if proc.stderr else "")


def test_on_lost_term_escalates_to_sigkill_after_grace(
    shared: DaemonProcess, client: LockClient, short_tmp: Path
) -> None:
    marker = short_tmp / "m"
    proc = start_run(
        shared, "--ttl", "600ms", "--grace", "400ms", "gr", "--", PY, "-c", IGNORE_TERM, str(marker)
    )
    pid = int(wait_ready(marker).split()[1])
    broke_at = time.monotonic()
    assert client.break_lock("gr", "test").broken
    assert proc.wait(10) == EXIT_LOST
    assert time.monotonic() - broke_at >= 0.4  # SIGTERM was ignored; SIGKILL came after --grace
    assert pid_gone(pid)
    assert "SIGKILL in 400ms" in (proc.stderr.read() if proc.stderr else "")


def test_on_lost_ignore_lets_command_finish_then_exits_6(
    shared: DaemonProcess, client: LockClient, short_tmp: Path
) -> None:
    marker = short_tmp / "m"
    script = (
        "import sys, pathlib; p = pathlib.Path(sys.argv[1]); p.write_text('ready');"
        "sys.stdin.readline(); p.write_text('done')"
    )
    proc = start_run(
        shared,
        *("--ttl", "300ms", "--on-lost", "ignore", "ig", "--", PY, "-c", script, str(marker)),
        stdin=subprocess.PIPE,
    )
    wait_ready(marker)
    assert client.break_lock("ig", "test").broken
    # lockd run says it saw the loss, and COMMAND still runs: it finishes when told.
    said = stderr_line(proc, 10)
    assert "--on-lost ignore" in said
    assert marker.read_text() == "ready"
    tell(proc)
    assert proc.wait(10) == EXIT_LOST
    assert marker.read_text() == "done"
    stderr = said + (proc.stderr.read() if proc.stderr else "")
    assert "--on-lost ignore" in stderr
    assert "COMMAND exited with status 0" in stderr


@pytest.mark.both_backends
def test_owner_retake_takes_the_lease_from_the_first_run(
    shared: DaemonProcess, client: LockClient, short_tmp: Path
) -> None:
    marker = short_tmp / "m"
    first = start_run(
        shared, "--ttl", "600ms", "--owner", "job-1", "rt", "--", PY, "-c", TRAP_TERM, str(marker)
    )
    wait_ready(marker)
    second = lockd_run(shared, "--owner", "job-1", "rt", "--", PY, "-c", "print('second')")
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "second"
    assert first.wait(10) == EXIT_LOST
    assert marker.read_text().startswith("SIGTERM")
    assert not held(client, "rt")  # the second run released what it re-took


def test_unresponsive_daemon_acts_before_the_lease_expires(
    daemon: DaemonProcess, short_tmp: Path
) -> None:
    marker = short_tmp / "m"
    args = ["--ttl", "1500ms", "--grace", "200ms", "hang", "--", PY, "-c", TRAP_TERM, str(marker)]
    proc = start_run(daemon, *args)
    wait_ready(marker)
    with LockClient(daemon.socket) as own:
        # The lease cannot end before this (a renewal after the status only moves it later).
        expires = own.status("hang").lease_expires_at
    assert expires is not None
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        assert proc.wait(10) == EXIT_LOST
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    name, at = marker.read_text().split()
    assert name == "SIGTERM"
    assert datetime.fromtimestamp(float(at), UTC) < expires
    # Said by the renewer (renewals failed) or by lockd run (none succeeded in time).
    assert "about to run out" in (proc.stderr.read() if proc.stderr else "")


@pytest.mark.both_backends
def test_release_on_close_lease_survives_a_clean_daemon_restart(daemon: DaemonProcess) -> None:
    with LockClient(daemon.socket) as own:
        assert own.try_acquire("survive", ttl=30, release_on_close=True) is not None
        daemon.stop()
        daemon.start()
        assert own.status("survive").held


@pytest.mark.both_backends
@pytest.mark.parametrize(
    "how",
    ["kill9", "sigterm"],
)
def test_daemon_restart_keeps_the_run_going(
    daemon: DaemonProcess, short_tmp: Path, how: str, backend: Backend
) -> None:
    marker = short_tmp / "m"
    script = "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text('ready'); input()"
    # A TTL long enough for a daemon restart on a loaded machine (1.5 s was not).
    proc = start_run(
        daemon,
        "--ttl",
        "10s",
        "restart",
        "--",
        PY,
        "-c",
        script,
        str(marker),
        stdin=subprocess.PIPE,
    )
    with LockClient(daemon.socket) as own:
        # The COMMAND runs only once lockd run has its grant. The key shows as
        # held as soon as it is committed, before the reply reaches lockd run,
        # and a daemon killed in between leaves the run not knowing whether it
        # holds the key (it exits 5, rightly): not what this test is about.
        wait_ready(marker)
        assert own.status("restart").held
        if how == "kill9":
            daemon.kill9()
        else:
            daemon.stop()
        daemon.start()
        if how == "kill9" and backend.differs("session_ends_release_on_close"):
            # docs/contract.md §11: a daemon on etcd that dies takes its releaseOnClose
            # holds with its session; the restart ends that session at once
            # (it can prove the old daemon dead), so lockd run loses the key.
            assert not own.status("restart").held
            assert proc.wait(30) == 6, proc.stderr.read() if proc.stderr else ""
            return
        # The lease survives the restart (same boot) ...
        first = own.status("restart").lease_expires_at
        assert first is not None
        # ... and lockd run's renewals reach the new daemon.
        wait_until(
            lambda: (own.status("restart").lease_expires_at or first) > first,
            10.0,
            "a renewal after the restart",
        )
        tell(proc)
        assert proc.wait(10) == 0, proc.stderr.read() if proc.stderr else ""
        assert not own.status("restart").held
