"""Starting ``lockd run``'s guardian by ``fork()`` instead of a new interpreter.

A new ``python -I -S guardian.py`` costs ~13 ms of CPU before its first
import, about half of what ``python -c pass`` costs: too much for a command
scripts run in loops (issue 24, bench/startup.py). ``lockd run`` forks itself
instead, before it takes the key, and the child runs :func:`guardian.main`
with the arguments the program would get, once it looks as that program
would (what ``subprocess.Popen(..., pass_fds=KEEP, process_group=0)`` and
an ``exec`` give it):

- only when ``lockd run`` has no other thread (``/proc/self/task``): a
  fork copies locks another thread may hold. The caller starts the program
  otherwise;
- every descriptor but 0, 1, 2 and the two the guardian gets is closed (as
  ``close_fds`` with ``pass_fds``): the daemon connection, if open, is not
  held by the guardian before ``go`` sends it;
- handlers set from Python go back to what exec leaves (``SIG_DFL``;
  ``SIGINT`` to Python's own handler, as a fresh interpreter installs it);
  ignored signals stay ignored and the signal mask is inherited, as across
  exec;
- a process group of its own (``process_group=0``);
- the child never returns into ``lockd run``'s code: ``os._exit`` with
  main's status, or 1 and the traceback on stderr, as the program would. No
  ``atexit`` handler, no flush of ``lockd run``'s buffers. Objects of
  ``lockd run`` the child still references hold descriptors closed here, so
  the collector is frozen (``gc.freeze``): none is finalised, none closes a
  number the guardian reuses.

The subreaper and ``PR_SET_PDEATHSIG`` are the guardian's own calls (neither
is inherited through fork), unchanged. The guardian's prctl is loaded
(_ctypes) before the fork, so neither the guardian nor COMMAND's process
loads it again.
"""

from __future__ import annotations

import os
import time

from lockd.run import guardian

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    import signal
else:
    import _signal as signal  # the signal module without its enums (issue 24)

__all__ = ["fork_guardian", "only_thread", "wait_child"]

#: the guardian's name in ``ps`` and ``/proc/PID/comm`` (at most 15 bytes)
GUARDIAN_NAME = "lockd-guardian"


def only_thread() -> bool:
    """True when this process has one thread: a fork copies no lock held elsewhere."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def fork_guardian(args: list[str], keep: tuple[int, int]) -> int:
    """Fork the guardian running ``guardian.main(args)``, keeping descriptors ``keep``; its pid.

    The caller has checked :func:`only_thread`.
    """
    guardian.load_prctl()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        _as_a_new_program(keep)
        status = guardian.main(args)
    except BaseException:  # as an interpreter would: the traceback, status 1
        try:
            import traceback

            os.write(2, traceback.format_exc().encode(errors="replace"))
        except BaseException:
            pass
    os._exit(status)


def _as_a_new_program(keep: tuple[int, int]) -> None:
    """In the child: the state ``python -I -S guardian.py`` run by Popen would start in."""
    import gc

    gc.freeze()
    signal.set_wakeup_fd(-1)
    for sig in range(1, signal.NSIG):
        try:
            handler = signal.getsignal(sig)
        except ValueError:
            continue
        if callable(handler):  # exec resets a caught signal; Python then installs SIGINT's
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
    os.setpgid(0, 0)
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))
    guardian.set_name(GUARDIAN_NAME)  # raw writes: no file object for one short write


def wait_child(pid: int, timeout: float) -> bool:
    """Reap child ``pid``, waiting up to ``timeout`` s; False if it still runs.

    Polls as ``Popen.wait(timeout)`` does (0.5 ms, doubling up to 50 ms).
    """
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining, 0.05))
        delay *= 2
