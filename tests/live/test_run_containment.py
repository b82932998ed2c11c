"""``lockd run`` contains what COMMAND starts (issue 20): nothing outlives the key.

COMMAND here starts a ``setsid`` grandchild (orphaned at once: its parent
subshell exits) and a ``nohup ... &`` child, both immune to SIGTERM so that
they last the whole ``--grace``: a second holder, waiting for the key, must
get it only once both are gone (killed and reaped, not merely signalled).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shlex
import signal
import subprocess
import sys
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lockd_client import LockClient

from lockd.exitcodes import EXIT_LOST
from lockd.run import guardian
from lockd.testing.daemon import DaemonProcess

from . import test_cli_run
from .test_cli_run import LOCKD_RUN, RUN_EXIT, held, start_run, wait_until

# The daemon and client fixtures of test_cli_run (one daemon for the module).
shared = test_cli_run.shared
client = test_cli_run.client

#: COMMAND: argv[1] is a folder. A nohup'd child and a setsid'd grandchild,
#: both ignoring SIGTERM; their pids go to files, then "ready", then wait.
ESCAPERS = r"""
d=$1
nohup sh -c 'trap "" TERM; exec sleep 600' >/dev/null 2>&1 &
echo $! > "$d/nohup"
( setsid sh -c 'trap "" TERM; exec sleep 600' & echo $! > "$d/setsid" )
echo ready > "$d/ready"
wait
"""


def exists(pid: int) -> bool:
    """True while ``pid`` is in /proc at all: a zombie not yet reaped still counts."""
    return Path(f"/proc/{pid}").exists()


def start_escapers(
    shared: DaemonProcess, tmp: Path, key: str, *opts: str
) -> tuple[subprocess.Popen[str], int, int]:
    proc = start_run(shared, *opts, key, "--", "sh", "-c", ESCAPERS, "sh", str(tmp))
    wait_until(lambda: (tmp / "ready").exists(), 10.0, "COMMAND to start its escapers")
    nohup = int((tmp / "nohup").read_text())
    setsid = int((tmp / "setsid").read_text())
    # it really leaves COMMAND's session (once setsid(1) has run)
    wait_until(lambda: os.getsid(setsid) == setsid, 10.0, "the grandchild's setsid")
    return proc, nohup, setsid


@dataclass
class Waiter:
    """A second holder, blocked on the key; records what it saw the moment it got it."""

    socket: Path
    key: str
    pids: tuple[int, ...]
    alive_at_grant: list[int] = field(default_factory=list)
    granted_at: float | None = None

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._wait, daemon=True)

    def start(self, client: LockClient) -> None:
        self._thread.start()
        wait_until(lambda: client.status(self.key).waiters == 1, 10.0, "the second holder")

    def _wait(self) -> None:
        with LockClient(self.socket) as own:
            handle = own.acquire(self.key, 30, 60)
            self.granted_at = time.monotonic()
            self.alive_at_grant = [pid for pid in self.pids if exists(pid)]
            own.release(handle)

    def join(self) -> None:
        self._thread.join(RUN_EXIT)
        assert self.granted_at is not None, "the second holder never got the key"


def cleanup(*pids: int) -> None:
    for pid in pids:
        if exists(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.both_backends
def test_kill9_of_lockd_run_frees_the_key_only_after_every_descendant_is_reaped(
    shared: DaemonProcess, client: LockClient, tmp_path: Path
) -> None:
    proc, nohup, setsid = start_escapers(shared, tmp_path, "c-kill9")
    try:
        waiter = Waiter(shared.socket, "c-kill9", (nohup, setsid))
        waiter.start(client)
        proc.kill()
        proc.wait(5)
        waiter.join()
        assert waiter.alive_at_grant == []
        assert not exists(nohup) and not exists(setsid)
    finally:
        cleanup(nohup, setsid)


def test_sigterm_to_lockd_run_ends_every_descendant_before_the_release(
    shared: DaemonProcess, client: LockClient, tmp_path: Path
) -> None:
    proc, nohup, setsid = start_escapers(shared, tmp_path, "c-term", "--grace", "1s")
    try:
        waiter = Waiter(shared.socket, "c-term", (nohup, setsid))
        waiter.start(client)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(RUN_EXIT) == 128 + signal.SIGTERM  # COMMAND's (sh's) own status
        waiter.join()
        assert waiter.alive_at_grant == []
        # Both ignore SIGTERM: they lasted the grace, and the key stayed held meanwhile.
        assert waiter.granted_at is not None and waiter.granted_at - signalled >= 0.9
    finally:
        cleanup(nohup, setsid)


@pytest.mark.parametrize("on_lost", ["kill", "term"])
def test_break_hands_the_key_on_only_after_every_descendant_is_reaped(
    shared: DaemonProcess, client: LockClient, tmp_path: Path, on_lost: str
) -> None:
    """A break of a listening holder waits for its ``stopped`` (docs/contract.md §12.1).

    lockd run hears the break at once, ends every process of COMMAND (both
    ignore SIGTERM: with ``term`` they last the grace), and says ``stopped``
    only once all are reaped; the second holder is granted after that.
    """
    key = f"c-brk-{on_lost}"
    proc, nohup, setsid = start_escapers(
        shared, tmp_path, key, "--on-lost", on_lost, "--grace", "300ms"
    )
    try:
        waiter = Waiter(shared.socket, key, (nohup, setsid))
        waiter.start(client)
        assert client.break_lock(key, "test: contain").broken
        waiter.join()
        assert waiter.alive_at_grant == []
        assert proc.wait(RUN_EXIT) == EXIT_LOST
        assert "test: contain" in (proc.stderr.read() if proc.stderr else "")
        assert not exists(nohup) and not exists(setsid)
    finally:
        cleanup(nohup, setsid)


def test_flock_default_keeps_the_key_until_background_children_exit(
    shared: DaemonProcess, client: LockClient, tmp_path: Path
) -> None:
    pids, go = tmp_path / "pids", tmp_path / "go"
    os.mkfifo(go)
    # The background child lives until the test writes to the FIFO.
    script = f'(read line < {go}) & echo "$$ $!" > {pids}'
    proc = start_run(shared, "c-flock", "--", "sh", "-c", script)
    wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 2, 10.0, "COMMAND")
    shell, child = (int(p) for p in pids.read_text().split())
    wait_until(lambda: not exists(shell), 10.0, "COMMAND itself to exit")
    assert exists(child) and held(client, "c-flock")  # kept while COMMAND's child runs
    assert proc.poll() is None
    go.write_text("go\n")  # the child reads it and exits
    assert proc.wait(RUN_EXIT) == 0
    assert not exists(child)
    assert not held(client, "c-flock")


def test_kill_descendants_ends_background_children_when_command_exits(
    shared: DaemonProcess, client: LockClient, tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    proc = start_run(
        shared, "--kill-descendants", "c-kd", "--", "sh", "-c", f"sleep 600 & echo $! > {pids}"
    )
    assert proc.wait(RUN_EXIT) == 0
    sleeper = int(pids.read_text())
    assert not exists(sleeper)
    assert not held(client, "c-kd")


# -- the terminal -------------------------------------------------------------------------

#: COMMAND on a terminal: opens /dev/tty, says whether it is the foreground
#: process group (in a group of its own, in lockd run's session), then waits
#: for SIGINT and exits 42.
TTY_PROBE = """
import os, signal, time
tty = os.open("/dev/tty", os.O_RDWR)
facts = (
    os.tcgetpgrp(tty) == os.getpgrp(),
    os.getpgrp() == os.getpid(),
    os.getsid(0) != os.getpid(),
)
def on_int(*_):
    os.write(tty, b"got SIGINT\\n")
    os._exit(42)
signal.signal(signal.SIGINT, on_int)
os.write(tty, ("probe fg=%s own-group=%s same-session=%s\\n" % facts).encode())
while True:
    signal.pause()  # until SIGINT (or the test's end)
"""

#: After lockd run: is the terminal back with the shell's (and lockd run's) group?
RESTORED = "import os; print('restored', os.tcgetpgrp(0) == os.getpgrp())"


class Pty:
    """A pseudo-terminal whose output is read until a text appears."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        self.seen = ""

    def expect(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} on the terminal; it showed {self.seen!r}")
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # EIO: every slave end closed
                    raise AssertionError(
                        f"terminal closed before {text!r}: {self.seen!r}"
                    ) from None

    def close(self) -> None:
        for fd in (self.master, self.slave):
            with contextlib.suppress(OSError):
                os.close(fd)


def test_command_owns_the_terminal_and_ctrl_c_reaches_it(shared: DaemonProcess) -> None:
    """A shell on a terminal runs lockd run; COMMAND gets the terminal as a shell's job would."""
    term = Pty()
    script = (
        f"{shlex.join([*LOCKD_RUN, 'c-tty', '--', sys.executable, '-c', TTY_PROBE])};"
        f' echo "status $?"; {shlex.join([sys.executable, "-c", RESTORED])}'
    )

    def controlling_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # after setsid: the pty is our terminal

    shell = subprocess.Popen(
        ["sh", "-c", script],
        stdin=term.slave,
        stdout=term.slave,
        stderr=term.slave,
        env=shared.env,
        start_new_session=True,
        preexec_fn=controlling_terminal,
    )
    try:
        term.expect("probe fg=True own-group=True same-session=True")
        os.write(term.master, b"\x03")  # Ctrl-C: SIGINT to the foreground group
        term.expect("got SIGINT")
        term.expect("status 42")
        term.expect("restored True")
        assert shell.wait(RUN_EXIT) == 0
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait(5)
        term.close()


def test_without_a_terminal_command_has_a_session_of_its_own(
    shared: DaemonProcess, tmp_path: Path
) -> None:
    """Stdin not a terminal: as before, COMMAND leads a session and cannot open /dev/tty."""
    out = tmp_path / "out"
    probe = (
        "import os, pathlib, sys\n"
        "try:\n    os.open('/dev/tty', os.O_RDWR); tty = 'tty'\n"
        "except OSError:\n    tty = 'no tty'\n"
        "pathlib.Path(sys.argv[1]).write_text(f'{os.getsid(0) == os.getpid()} {tty}')\n"
    )
    proc = subprocess.run(
        [*LOCKD_RUN, "c-notty", "--", sys.executable, "-c", probe, str(out)],
        env=shared.env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        start_new_session=True,  # no controlling terminal, whatever pytest runs under
        timeout=RUN_EXIT,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "True no tty"


#: COMMAND for Ctrl-Z: says when it is resumed and whether it has the terminal again.
TSTP_PROBE = """
import os, signal, time
tty = os.open("/dev/tty", os.O_RDWR)
def on_cont(*_):
    os.write(tty, ("resumed fg=%s\\n" % (os.tcgetpgrp(tty) == os.getpgrp())).encode())
def on_int(*_):
    os._exit(42)
signal.signal(signal.SIGCONT, on_cont)
signal.signal(signal.SIGINT, on_int)
os.write(tty, b"tstp-probe ready=%d\\n" % (6 * 7))
while True:
    signal.pause()  # SIGCONT's handler returns here; SIGINT ends it
"""


def test_ctrl_z_stops_the_job_and_fg_resumes_it(shared: DaemonProcess) -> None:
    """Under an interactive shell, Ctrl-Z stops COMMAND and lockd run (the shell's job).

    ``fg`` resumes lockd run, which gives COMMAND the terminal back and resumes it.
    """
    term = Pty()
    shell = subprocess.Popen(
        ["bash", "--norc", "--noprofile", "-i"],
        stdin=term.slave,
        stdout=term.slave,
        stderr=term.slave,
        env={**shared.env, "PS1": "$ ", "TERM": "dumb"},
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    run = shlex.join([*LOCKD_RUN, "c-tstp", "--", sys.executable, "-c", TSTP_PROBE])
    try:
        os.write(term.master, f"{run}\n".encode())
        term.expect("tstp-probe ready=42")  # its output, not the echo of the command line
        os.write(term.master, b"\x1a")  # Ctrl-Z
        term.expect("Stopped")
        os.write(term.master, b"fg\n")
        term.expect("resumed fg=True")
        os.write(term.master, b"\x03")
        os.write(term.master, b"echo status $?\n")  # the status of fg: lockd run's
        term.expect("status 42")
        os.write(term.master, b"exit\n")
        assert shell.wait(RUN_EXIT) == 0
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait(5)
        term.close()


# -- the self-lock idiom ------------------------------------------------------------------

#: The README's idiom, then a critical section that notices an overlap:
#: mkdir fails if another copy is inside. argv[1] is a shared folder.
SELF_LOCKING = """#!/bin/sh
[ "$LOCKD_KEY" = c-self ] || exec lockd run --wait 30s c-self -- "$0" "$@"
mkdir "$1/inside" 2>/dev/null || { echo overlap >> "$1/overlaps"; exit 1; }
sleep 0.3  # the work done inside: a window another copy would show up in
rmdir "$1/inside"
echo "$LOCKD_KEY" >> "$1/runs"
"""


def test_self_lock_idiom_nested_in_another_run_runs_one_copy_at_a_time(
    shared: DaemonProcess, tmp_path: Path
) -> None:
    """Each copy starts inside a ``lockd run`` of another key (LOCKD_HANDLE already set)."""
    script = tmp_path / "import.sh"
    script.write_text(SELF_LOCKING)
    script.chmod(0o755)
    env = {**shared.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    copies = [
        subprocess.Popen(
            [*LOCKD_RUN, f"c-outer-{n}", "--", str(script), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(3)
    ]
    for copy in copies:
        _, err = copy.communicate(timeout=RUN_EXIT * 2)
        assert copy.returncode == 0, err
    assert not (tmp_path / "overlaps").exists()
    assert (tmp_path / "runs").read_text().split() == ["c-self"] * 3


# -- the guardian's parts -----------------------------------------------------------------


def test_descendants_are_found_through_parent_links() -> None:
    child = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        wait_until(lambda: len(guardian.descendants(child.pid)) == 1, 10.0, "the grandchild")
        (grandchild,) = guardian.descendants(child.pid)
        assert {child.pid, grandchild} <= set(guardian.descendants(os.getpid()))
    finally:
        for pid in (*guardian.descendants(child.pid), child.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        child.wait(5)


def test_a_process_that_cannot_be_signalled_is_reported_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A set-uid descendant: kill() answers EPERM; lockd run hears of it once (and warns)."""

    def refuse(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    said: list[str] = []
    tree = guardian.Tree(said.append, command_pid=-1)
    monkeypatch.setattr(guardian.os, "kill", refuse)
    tree.signal_all(signal.SIGTERM, [4242])
    tree.signal_all(signal.SIGKILL, [4242])
    assert said == [f"eperm 4242 {guardian.process_name(4242)}"]
