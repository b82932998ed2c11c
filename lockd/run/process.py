"""COMMAND's processes for ``lockd run``: spawning, guarding, signalling.

COMMAND runs (no shell) in a session of its own, with ``PR_SET_PDEATHSIG`` so
that it is SIGKILLed if ``lockd run`` dies, and a :class:`GroupGuard` that does
the same to the rest of its process group; :class:`SignalForwarder` passes
SIGINT, SIGTERM and SIGHUP on to that group.

Everything that sends signals runs on the main thread, which also forked
COMMAND: ``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits, and
Python runs signal handlers only on the main thread anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

__all__ = [
    "FORWARDED_SIGNALS",
    "GroupGuard",
    "SignalForwarder",
    "exit_status",
    "group_alive",
    "killpg",
    "spawn_in_own_session",
]


#: Signals ``lockd run`` passes on to COMMAND's process group.
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: death by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


_PR_SET_PDEATHSIG = 1
_prctl: Any = None


def _load_prctl() -> Any:
    """libc's prctl via ctypes, loaded in the parent (never in the forked child); None if absent."""
    global _prctl
    if _prctl is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
        else:
            fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
            fn.restype = ctypes.c_int
            _prctl = fn
    return _prctl or None


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn``: SIGKILL this child when the thread that forked it dies.

    After setting the parent-death signal, the parent is checked once more:
    if it died between fork and prctl, the signal will never come, so the
    child kills itself. The kernel clears the setting when COMMAND is a
    set-uid/set-gid or file-capability binary.
    """
    prctl = _load_prctl()
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sigkill)

    return preexec


def spawn_in_own_session(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` (no shell) as leader of a new session and process group.

    A session rather than just a process group: a background process group
    that reads the terminal is stopped by SIGTTIN, while a process in its own
    session has no controlling terminal and reads an inherited tty fd freely
    (it cannot open /dev/tty, as under setsid(1)). Must be called on the main
    thread (see the module docstring). Raises OSError when ``argv[0]`` cannot
    be executed.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("spawn_in_own_session must run on the main thread (PDEATHSIG)")
    return subprocess.Popen(
        list(argv),
        env=dict(env),
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid()),
    )


# The guard's whole program: wait for the pipe to close; unless lockd run
# said "done" first, it died, so kill COMMAND's group. Kept tiny because it
# runs as `python -I -S -c` (no site, no lockd import: ~15 ms to start).
_GUARD_PROGRAM = """
import os, signal, sys
said = b""
while True:
    chunk = os.read(0, 64)
    if not chunk:
        break
    said += chunk
if said != b"done":
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    except OSError:
        pass
"""


class GroupGuard:
    """Kills COMMAND's whole process group if ``lockd run`` dies first.

    PR_SET_PDEATHSIG reaches only COMMAND's first process; its children
    (``sh -c 'a; b'``, a worker pool) would run on without the lock once a
    killed ``lockd run`` freed the key. The guard is a separate process in a
    session of its own (so neither a group kill nor the terminal's SIGINT
    takes it down) that blocks on a pipe only ``lockd run`` can write: the
    kernel closes it however ``lockd run`` ends, and without a "done" first
    the guard SIGKILLs the group.
    """

    def __init__(self, pgid: int) -> None:
        read_end, write_end = os.pipe()  # both close-on-exec
        self._write_end: int | None = write_end
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARD_PROGRAM, str(pgid)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read_end)

    def dismiss(self) -> None:
        """COMMAND ended while we held the lease: leave its group alone."""
        if self._write_end is not None:
            with contextlib.suppress(OSError):
                os.write(self._write_end, b"done")
        self.close()

    def close(self) -> None:
        """Stop guarding (without "done" first, the guard kills the group)."""
        if self._write_end is None:
            return
        fd, self._write_end = self._write_end, None
        os.close(fd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group; a group that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (one we may not signal counts as alive)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SignalForwarder:
    """While installed, passes SIGINT, SIGTERM and SIGHUP on to COMMAND's process group.

    Installed before COMMAND starts: a signal that arrives before the group
    exists is kept and sent once :meth:`attach` names the group. A signal that
    ``lockd run`` inherited as ignored (``nohup``) stays ignored and is not
    forwarded: COMMAND inherits the ignoring too. Handlers are restored on exit.
    """

    def __init__(self, signals: Sequence[int] = FORWARDED_SIGNALS) -> None:
        self._signals = tuple(signals)
        self._saved: dict[int, Any] = {}
        self._pgid: int | None = None
        self._pending: list[int] = []

    def __enter__(self) -> SignalForwarder:
        for sig in self._signals:
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN:
                continue
            self._saved[sig] = previous
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, previous in self._saved.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._saved.clear()

    def attach(self, pgid: int) -> None:
        """Forward to ``pgid`` from now on, starting with any signal already received."""
        self._pgid = pgid
        pending, self._pending = self._pending, []
        for sig in pending:
            killpg(pgid, sig)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._pgid is None:
            self._pending.append(signum)
        else:
            killpg(self._pgid, signum)
