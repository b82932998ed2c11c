"""The guardian of ``lockd run``: the reaper of everything COMMAND starts.

``lockd run`` starts this file as a program of its own (``python -I -S
guardian.py``: stdlib only, no lockd import, no threads inherited) right after
it took the key. The guardian

- marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every
  process COMMAND starts, ``setsid`` or double-forked, is re-parented to it
  when its own parent dies and stays in the tree it can walk;
- starts COMMAND (no shell): in a session of its own without a terminal, or,
  when ``lockd run`` owns the terminal, in a process group of its own that it
  makes the terminal's foreground group (same session, like a shell's job);
- holds a duplicate of ``lockd run``'s daemon connection and never uses it:
  the daemon frees a ``releaseOnClose`` hold only when the last copy closes,
  so if ``lockd run`` is killed (even ``kill -9``) the key stays held until
  the guardian has killed and reaped every descendant and exited;
- talks with ``lockd run`` over two pipes, one line per message.

From ``lockd run`` (control pipe): ``kill GRACE_MS`` (SIGTERM every
descendant, SIGKILL what is left after GRACE_MS; 0 = SIGKILL at once).
``lockd run`` always waits for ``empty``, so end of file on the control pipe
means ``lockd run`` died: every descendant is SIGKILLed and reaped, then the
guardian exits.

To ``lockd run`` (status pipe): ``pid N`` (COMMAND started), ``error ERRNO
TEXT`` (COMMAND could not be started), ``stopped SIG`` / ``continued``
(COMMAND's first process stopped or resumed: job control), ``exit RC``
(COMMAND's first process ended; RC as ``Popen.returncode``), ``eperm PID
NAME`` (a descendant could not be signalled), ``empty`` (no descendant is
left: the last message).

Descendants are found by walking ``/proc/*/stat`` parent links from the
guardian; as subreaper it is sure that none is left when ``waitpid`` says it
has no children (a live descendant always has an ancestor chain ending here).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

#: How COMMAND meets the terminal (the MODE argument).
NO_TERMINAL, TERMINAL_FOREGROUND, TERMINAL_BACKGROUND = 0, 1, 2
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: How often the tree is walked again while killing it.
KILL_POLL = 0.005
#: Signals the guardian must not die of: the terminal's (it is in a group of
#: its own, but a terminal hang-up or a signal to the whole job may reach it).
IGNORED = (
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGPIPE,
)


def prctl(option: int, arg: int) -> bool:
    """libc prctl(option, arg); False when it failed or libc has none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return bool(fn(option, arg, 0, 0) == 0)


def parent_links() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    links: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            links[int(name)] = int(fields[1])
    return links


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_links().items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


class Tree:
    """The processes below this one, and how to end them."""

    def __init__(self, say: Callable[[str], None], command_pid: int) -> None:
        self.say = say
        self.command_pid = command_pid
        self.command_done = False
        self._refused: set[int] = set()

    def reap(self, *, job_control: bool = True) -> bool:
        """Collect every ended child; True once no child (so no descendant) is left."""
        flags = os.WNOHANG | (os.WUNTRACED | os.WCONTINUED if job_control else 0)
        while True:
            try:
                pid, status = os.waitpid(-1, flags)
            except ChildProcessError:
                return True
            if pid == 0:
                return False
            if pid != self.command_pid or self.command_done:
                continue
            if os.WIFSTOPPED(status):
                self.say(f"stopped {os.WSTOPSIG(status)}")
            elif os.WIFCONTINUED(status):
                self.say("continued")
            else:
                self.command_done = True
                code = os.waitstatus_to_exitcode(status)
                self.say(f"exit {code}")

    def signal_all(self, sig: int, pids: Iterable[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
                if sig == signal.SIGTERM:
                    os.kill(pid, signal.SIGCONT)  # a stopped process must see its SIGTERM
            except ProcessLookupError:
                pass
            except PermissionError:
                if pid not in self._refused:
                    self._refused.add(pid)
                    self.say(f"eperm {pid} {process_name(pid)}")

    def end(self, grace_ms: int) -> None:
        """SIGTERM every descendant, SIGKILL what is left after ``grace_ms``; reap them all.

        Returns only when no descendant is left: one that cannot be signalled
        (a set-uid program) is waited for, as it keeps the key held.
        """
        me = os.getpid()
        termed: set[int] = set()
        kill_at = time.monotonic() + grace_ms / 1000
        while True:
            if self.reap(job_control=False):
                return
            pids = descendants(me)
            if time.monotonic() >= kill_at:
                self.signal_all(signal.SIGKILL, pids)
            else:
                fresh = [pid for pid in pids if pid not in termed]
                termed.update(fresh)
                self.signal_all(signal.SIGTERM, fresh)
            time.sleep(KILL_POLL)


def start_command(
    argv: list[str], mode: int, status_w: int, inherited: dict[int, object]
) -> subprocess.Popen[bytes] | None:
    """Start COMMAND; report ``pid`` or ``error`` on the status pipe.

    ``mode``: NO_TERMINAL (a session of its own), TERMINAL_FOREGROUND (a
    process group of its own, made the terminal's foreground group) or
    TERMINAL_BACKGROUND (a process group of its own; ``lockd run`` itself
    was in the background, so the terminal stays where it is).
    ``inherited`` are the dispositions the guardian found for the signals it
    ignores: COMMAND gets them back (a SIGHUP ignored under nohup stays so).
    """
    parent = os.getpid()
    take_terminal = mode == TERMINAL_FOREGROUND

    def preexec() -> None:
        # In the child, before exec: die with the guardian; then either a
        # session of its own (no terminal, as before) or a process group of
        # its own in this session, made the terminal's foreground group. The
        # child is in a background group when it calls tcsetpgrp: SIGTTOU is
        # ignored around the call, then back to default for COMMAND.
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        for sig, disposition in inherited.items():
            signal.signal(sig, disposition)  # type: ignore[arg-type]
        if mode == NO_TERMINAL:
            os.setsid()
            return
        os.setpgid(0, 0)
        if not take_terminal:
            return
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        with contextlib.suppress(OSError):
            os.tcsetpgrp(0, os.getpgrp())
        signal.signal(signal.SIGTTOU, inherited.get(signal.SIGTTOU, signal.SIG_DFL))  # type: ignore[arg-type]

    try:
        proc = subprocess.Popen(argv, preexec_fn=preexec, restore_signals=True)
    except OSError as exc:
        code = exc.errno or errno.ENOEXEC
        os.write(status_w, f"error {code} {exc.strerror or exc}\n".encode())
        return None
    os.write(status_w, f"pid {proc.pid}\n".encode())
    return proc


def main(args: list[str]) -> int:
    """``guardian.py CTRL_FD STATUS_FD CONN_FD MODE -- COMMAND...``."""
    ctrl_r, status_w, _conn_fd, mode = (int(a) for a in args[:4])
    argv = args[5:]
    inherited: dict[int, object] = {}
    for sig in IGNORED:
        inherited[sig] = signal.signal(sig, signal.SIG_IGN)
    prctl(PR_SET_CHILD_SUBREAPER, 1)

    def say(line: str) -> None:
        with contextlib.suppress(OSError):  # lockd run is gone: nobody to tell
            os.write(status_w, (line + "\n").encode())

    # SIGCHLD wakes the select below through a self-pipe.
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)

    proc = start_command(argv, mode, status_w, inherited)
    if proc is None:
        return 0
    tree = Tree(say, proc.pid)
    pending = b""
    while True:
        if tree.reap():
            say("empty")
            return 0
        ready, _, _ = select.select([ctrl_r, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        if ctrl_r not in ready:
            continue
        chunk = os.read(ctrl_r, 512)
        if not chunk:  # lockd run died: nothing of COMMAND may outlive its key
            tree.end(0)
            return 0
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            word, _, rest = line.decode().partition(" ")
            if word == "kill":
                tree.end(int(rest or 0))
                say("empty")
                return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
