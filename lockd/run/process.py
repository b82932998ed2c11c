"""COMMAND's processes for ``lockd run``: starting, containing, signalling.

COMMAND is started by a guardian process (:mod:`lockd.run.guardian`, driven
through :class:`Guardian`): a child subreaper that holds a copy of the daemon
connection, so that nothing COMMAND starts (``setsid``, double fork, ``nohup
... &``) outlives the key, even when ``lockd run`` is killed outright.
:class:`SignalForwarder` passes SIGINT, SIGTERM and SIGHUP on to COMMAND's
process group; the terminal helpers give COMMAND the terminal as a shell
gives it to a job.

Everything that sends signals runs on the main thread: Python runs signal
handlers only there.
"""

from __future__ import annotations

# The C layers of socket and signal: the socket module builds its enums,
# and signal loads the enum module for its own (issue 24). Plain signal
# numbers need none of it.
import _socket
import os
import select
import sys
import time

from lockd_client._record import Frozen
from lockd_client._wire import ceil

from lockd.run import guardian
from lockd.run.forked import fork_guardian, only_thread, wait_child

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    import signal
    from collections.abc import Callable, Mapping, Sequence
    from types import FrameType
    from typing import Any
else:
    import _signal as signal  # signal's functions and numbers, without its enums

__all__ = [
    "FORWARDED_SIGNALS",
    "CommandNotStarted",
    "Guardian",
    "Message",
    "SignalForwarder",
    "become_subreaper",
    "end_descendants",
    "exit_status",
    "foreground_group",
    "killpg",
    "set_foreground",
    "terminal_mode",
]


#: Signals ``lockd run`` passes on to COMMAND's process group.
FORWARDED_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: death by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def become_subreaper() -> bool:
    """Make orphaned descendants this process's children (Linux 3.4+); False if refused.

    ``lockd run`` does it as a fallback: if its guardian is killed, what the
    guardian had adopted comes here and is ended by :func:`end_descendants`.
    """
    return guardian.prctl(guardian.PR_SET_CHILD_SUBREAPER, 1)


def end_descendants(say: Callable[[str], None]) -> None:
    """SIGKILL and reap every descendant of this process (the guardian-died fallback)."""
    guardian.Tree(say, command_pid=-1).end(0)


# -- the terminal ---------------------------------------------------------------


def terminal_mode() -> int:
    """How COMMAND meets the terminal, decided from ``lockd run``'s stdin.

    Stdin is our controlling terminal and we are its foreground process group:
    COMMAND takes the terminal over (a job of its own, as a shell runs it).
    Our controlling terminal but we run in the background: a group of its own,
    the terminal stays (a read stops it with SIGTTIN, as it would stop us).
    Anything else (no terminal, a file, a pipe, another terminal): a session
    of its own, as before.
    """
    try:
        foreground = os.tcgetpgrp(0)  # ENOTTY unless stdin is our controlling terminal
    except OSError:
        return guardian.NO_TERMINAL
    if foreground == os.getpgrp():
        return guardian.TERMINAL_FOREGROUND
    return guardian.TERMINAL_BACKGROUND


def set_foreground(pgid: int) -> bool:
    """Make ``pgid`` the terminal's (stdin's) foreground group; False if that failed.

    SIGTTOU is blocked around the call: from a background group the kernel
    would otherwise stop us for trying.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        os.tcsetpgrp(0, pgid)
    except OSError:
        return False
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return True


def foreground_group() -> int | None:
    try:
        return os.tcgetpgrp(0)
    except OSError:
        return None


# -- the guardian ---------------------------------------------------------------


class Message(Frozen):
    """One line from the guardian (see :mod:`lockd.run.guardian`); ``gone`` at its end."""

    __slots__ = ("rest", "word")
    __match_args__ = ("word", "rest")
    _fields = __match_args__

    word: str
    rest: str

    def __init__(self, word: str, rest: str = "") -> None:
        object.__setattr__(self, "word", word)
        object.__setattr__(self, "rest", rest)


class CommandNotStarted(OSError):
    """The guardian could not start COMMAND (``errno`` and ``strerror`` as exec said)."""


class Guardian:
    """``lockd run``'s side of the guardian process that starts and reaps COMMAND.

    The guardian (:mod:`lockd.run.guardian`) is started before the key is
    taken (forked from this process while it has no other thread, see
    :mod:`lockd.run.forked`; else run as a program): it forks the process
    that will become COMMAND at once, so that :attr:`command_pid` can be
    named in the acquire (docs/contract.md §12.2). :meth:`go`
    sends it COMMAND's environment and a copy of the daemon connection once
    the key is ours. Its lines are then read by :meth:`next_message`, which
    also returns what :meth:`post` adds: ``lockd run``'s own wake-ups (a
    signal, the renewer), which end its wait through a pipe. No reader
    thread: a thread of its own, and the GIL handed back and forth with it,
    was a start-up cost of every ``lockd run`` (issue 24). Closing our end of the control socket
    without waiting for ``empty`` makes it kill everything (or, before
    :meth:`go`, end the waiting child without running COMMAND).
    """

    def __init__(self, argv: Sequence[str], mode: int) -> None:
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        status_r, status_w = os.pipe()  # close-on-exec: pass_fds makes the child's copy inheritable
        args = [str(theirs.fileno()), str(status_w), str(mode), "--", *argv]
        self._proc: Any = None  # the Popen of a guardian run as a program
        self._pid = 0  # a forked guardian's pid
        try:
            if only_thread():
                self._pid = fork_guardian(args, keep=(theirs.fileno(), status_w))
            else:  # fork() would copy locks other threads hold: a new interpreter
                import subprocess

                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", guardian.__file__, *args],
                    pass_fds=(theirs.fileno(), status_w),
                    process_group=0,
                )
        except BaseException:
            ours.close()
            os.close(status_r)
            raise
        finally:
            theirs.close()
            os.close(status_w)
        self._ctrl: _socket.socket | None = ours
        self._status: int | None = status_r
        #: what was read from the status pipe past the last whole line
        self._unread = b""
        #: post()ed messages, oldest first; appended from a signal handler
        #: or the renewer's thread (list.append holds the GIL: it is atomic)
        self._posted: list[Message] = []
        #: a byte written here ends next_message's wait for the status pipe
        #: (made after the fork: the guardian has no copy)
        self._wake: tuple[int, int] | None = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        #: a thread that may still post() (the renewer, when stop() did not see it end)
        self.posters_left = False
        self._status_ended = False  # the status pipe's end was read
        self.finished = False  # "empty" (or the guardian's end) was seen
        first = self._read_line()
        word, _, rest = first.partition(" ")
        if word != "ready":
            self.close()
            raise RuntimeError(f"the guardian of COMMAND did not start ({first!r})")
        #: COMMAND's pid (forked already, exec'd by go()).
        self.command_pid = int(rest)

    def go(self, env: Mapping[str, str], conn_fd: int | None) -> None:
        """Start COMMAND with ``env``; the guardian keeps a copy of ``conn_fd``.

        Raises :class:`CommandNotStarted` when exec failed.
        """
        assert self._ctrl is not None
        body = guardian.dump_env(env).encode() + b"\n"
        guardian.send_fds(self._ctrl, b"go ", [conn_fd] if conn_fd is not None else [])
        self._ctrl.sendall(body)
        first = self._read_line()
        word, _, rest = first.partition(" ")
        if word == "error":
            code, _, text = rest.partition(" ")
            self.close()
            raise CommandNotStarted(int(code), text)
        if word != "pid":
            self.close()
            raise RuntimeError(f"the guardian of COMMAND ended before starting it ({first!r})")

    def next_message(self, timeout: float | None) -> Message | None:
        """The next posted message or guardian line, or None after ``timeout`` seconds.

        Called from the main thread only; a signal that arrives while it
        waits runs its handler, whose post() ends the wait.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        looked = False  # a time-out of 0 still takes what the pipe holds, as Queue.get did
        while True:
            if self._posted:
                return self._posted.pop(0)
            if self._status is not None:
                line = self._whole_line()
                if line is not None:
                    word, _, rest = line.partition(" ")
                    if word in ("empty", "gone"):
                        self.finished = True
                        self._close_status()
                    return Message(word, rest)
            wait_ms = -1
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 and looked:
                    return None
                wait_ms = max(0, ceil(left * 1000))  # rounded up: not before the deadline
            self._wait_for_input(wait_ms)
            looked = True

    def _whole_line(self) -> str | None:
        """The next whole line already read, "gone" at the end of the pipe, else None."""
        if b"\n" in self._unread:
            line, _, self._unread = self._unread.partition(b"\n")
            return line.decode(errors="replace")
        if self._status_ended:
            return "gone"
        return None

    def _wait_for_input(self, wait_ms: int) -> None:
        """Wait up to ``wait_ms`` (-1: no limit) for the status pipe or a post(); read it."""
        wake = self._wake
        assert wake is not None, "next_message after dispose()"
        poller = select.poll()
        poller.register(wake[0], select.POLLIN)
        if self._status is not None:
            poller.register(self._status, select.POLLIN)
        for fd, _events in poller.poll(wait_ms):
            if fd == wake[0]:
                try:
                    while os.read(fd, 512):
                        pass
                except BlockingIOError:
                    pass
            elif fd == self._status:
                chunk = os.read(fd, 4096)
                self._unread += chunk
                self._status_ended = not chunk

    def post(self, message: Message) -> None:
        """Add a message of our own (a signal handler, the renewer) and end a wait for one."""
        self._posted.append(message)
        wake = self._wake
        if wake is None:  # disposed of: nobody waits any more
            return
        try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
            os.write(wake[1], b".")
        except OSError:  # full: a wake-up is pending already (or closed meanwhile)
            pass

    def end_all(self, grace_ms: int) -> None:
        """Ask for every descendant to end: SIGTERM, SIGKILL after ``grace_ms`` (0: SIGKILL)."""
        if self._ctrl is not None:
            try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                self._ctrl.sendall(f"kill {grace_ms}\n".encode())
            except OSError:
                pass

    def dispose(self) -> None:
        """Close the wake pipe (after :meth:`close`, once nothing will post() any more)."""
        wake, self._wake = self._wake, None
        if wake is not None:
            os.close(wake[0])
            os.close(wake[1])

    def close(self) -> None:
        """Close our end; unless ``empty`` came first, the guardian kills everything. Waits."""
        if self._ctrl is not None:
            ctrl, self._ctrl = self._ctrl, None
            ctrl.close()
        # The wake pipe stays open: the renewer may still post() (lockd run
        # stops it after this, so that the lease is renewed while the
        # guardian ends COMMAND), and a closed number may be reused by then.
        # dispose() closes it, once the renewer has been stopped.
        self._close_status()
        if self._proc is not None:
            import subprocess

            try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                self._proc.wait(timeout=_GUARDIAN_EXIT)
            except subprocess.TimeoutExpired:
                pass
        elif self._pid and wait_child(self._pid, _GUARDIAN_EXIT):
            self._pid = 0

    def _read_line(self) -> str:
        """The guardian's next line, waited for (before go() returns: ``ready``, ``pid``)."""
        while b"\n" not in self._unread:
            chunk = os.read(self._status, 4096) if self._status is not None else b""
            if not chunk:
                line, self._unread = self._unread, b""
                return line.decode(errors="replace") if line else "gone"
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return line.decode(errors="replace")

    def _close_status(self) -> None:
        if self._status is not None:
            fd, self._status = self._status, None
            os.close(fd)


#: How long close() waits for the guardian to finish killing.
_GUARDIAN_EXIT = 30.0


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group; a group that is already gone is not an error."""
    try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class SignalForwarder:
    """While installed, passes SIGINT, SIGTERM and SIGHUP on to COMMAND's process group.

    Installed before COMMAND starts: a signal that arrives before the group
    exists is kept and sent once :meth:`attach` names the group. A signal that
    ``lockd run`` inherited as ignored (``nohup``) stays ignored and is not
    forwarded: COMMAND inherits the ignoring too. Handlers are restored on exit.
    ``signalled`` records that one was forwarded (``lockd run`` was told to
    stop: what COMMAND leaves behind is ended, not waited for), and
    ``on_signal`` runs after each forwarding (to wake the main loop).
    """

    def __init__(self, signals: Sequence[int] = FORWARDED_SIGNALS) -> None:
        self._signals = tuple(signals)
        self._saved: dict[int, Any] = {}
        self._pgid: int | None = None
        self._pending: list[int] = []
        self.signalled = False
        self.on_signal: Callable[[int], None] | None = None

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
            self._forward(sig)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._pgid is None:
            self._pending.append(signum)
        else:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        assert self._pgid is not None
        self.signalled = True
        killpg(self._pgid, signum)
        if self.on_signal is not None:
            self.on_signal(signum)
