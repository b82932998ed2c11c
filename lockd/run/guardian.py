"""The guardian of ``lockd run``: the reaper of everything COMMAND starts.

``lockd run`` starts it before it asks for the key: by ``fork()`` of
itself while it has no thread yet, the child made to look as this file run
as a program of its own (``python -I -S guardian.py``: stdlib only, no lockd
import) would (:class:`lockd.run.process.Guardian`), or by running this
file so when it cannot fork safely. The guardian

- marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so every
  process COMMAND starts, ``setsid`` or double-forked, is re-parented to it
  when its own parent dies and stays in the tree it can walk;
- forks COMMAND's process at once (so that ``lockd run`` can name its pid in
  the acquire) and lets it exec COMMAND (no shell) once the key is taken: in
  a session of its own without a terminal, or, when ``lockd run`` owns the
  terminal, in a process group of its own that it makes the terminal's
  foreground group (same session, like a shell's job);
- receives a duplicate of ``lockd run``'s daemon connection with the ``go``
  and never uses it: the daemon frees a ``releaseOnClose`` hold only when
  the last copy closes, so if ``lockd run`` is killed (even ``kill -9``) the
  key stays held until the guardian has killed and reaped every descendant
  and exited.

It talks with ``lockd run`` one line per message. From ``lockd run`` (the
control socket): ``go ENV_JSON`` (start COMMAND with that environment; the
connection's descriptor rides along, SCM_RIGHTS), then ``kill GRACE_MS``
(SIGTERM every descendant, SIGKILL what is left after GRACE_MS; 0 = SIGKILL
at once). ``lockd run`` always waits for ``empty``, so end of file on the
control socket means ``lockd run`` died (or, before ``go``, did not get the
key): every descendant is SIGKILLed and reaped, then the guardian exits.

To ``lockd run`` (the status pipe): ``ready PID`` (COMMAND's pid-to-be),
``pid PID`` (COMMAND runs) or ``error ERRNO TEXT`` (it could not be exec'd),
``stopped SIG`` / ``continued`` (COMMAND's first process stopped or resumed:
job control), ``exit RC`` (it ended; RC as ``Popen.returncode``), ``eperm
PID NAME`` (a descendant could not be signalled), ``empty`` (no descendant
is left: the last message).

Descendants are found by walking ``/proc/*/stat`` parent links from the
guardian; as subreaper it is sure that none is left when ``waitpid`` says it
has no children (a live descendant always has an ancestor chain ending here).
"""

from __future__ import annotations

# socket's and signal's C layers: both modules build enums at import (signal
# loads the enum module for them), a cost every ``lockd run`` paid (issue 24);
# a Unix socket pair and plain signal numbers need none of it. Nor is
# contextlib imported (with collections and functools behind it).
import _socket
import errno
import os
import select
import sys
import time

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    import signal
    from collections.abc import Callable, Iterable, Mapping
    from typing import NoReturn
else:
    import _signal as signal  # signal's functions and numbers, without its enums

#: A C int's size (SCM_RIGHTS carries an array of them): 4 on every Linux ABI.
C_INT = 4
#: How COMMAND meets the terminal (the MODE argument).
NO_TERMINAL, TERMINAL_FOREGROUND, TERMINAL_BACKGROUND = 0, 1, 2
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: How often the tree is walked again while killing it.
KILL_POLL = 0.005
#: ... and while only processes that cannot be signalled are left.
REFUSED_POLL = 0.2
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


_libc_prctl: Callable[[int, int, int, int], int] | None = None
_prctl_loaded = False


def load_prctl() -> Callable[[int, int, int, int], int] | None:
    """libc's prctl (loaded once; a forked guardian inherits it), or None."""
    global _libc_prctl, _prctl_loaded
    if not _prctl_loaded:
        _prctl_loaded = True
        _libc_prctl = _prctl_from_c_layer() or _prctl_from_ctypes()
    return _libc_prctl


def _prctl_from_c_layer() -> Callable[[int, int, int, int], int] | None:
    """prctl called through ``_ctypes``, ctypes' C layer, or None if it lacks the calls.

    The ctypes package builds dozens of classes at import (struct with them):
    about a fifth of ``python -c pass`` in every ``lockd run`` (issue 24,
    bench/startup.py). ``call_function(address, args)`` passes each int as a
    C int, which libffi widens, sign-extended, to the 64-bit register
    prctl's variadic ``unsigned long`` is read from; every argument here is
    small and not negative.
    """
    try:
        import _ctypes

        program = _ctypes.dlopen(None)  # type: ignore[arg-type]  # None: the program, its libc
        address = _ctypes.dlsym(program, "prctl")
        call = _ctypes.call_function
    except (ImportError, OSError, AttributeError):
        return None
    return lambda option, arg2, arg3, arg4: int(call(address, (option, arg2, arg3, arg4)))


def _prctl_from_ctypes() -> Callable[[int, int, int, int], int] | None:
    """prctl through the ctypes package (an interpreter whose _ctypes lacks the calls)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


def prctl(option: int, arg: int) -> bool:
    """libc prctl(option, arg); False when it failed or libc has none."""
    fn = load_prctl()
    return fn is not None and fn(option, arg, 0, 0) == 0


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
            # Only processes we may not signal are left: no need to walk /proc
            # every few ms while waiting for them.
            stuck = bool(pids) and self._refused.issuperset(pids)
            time.sleep(REFUSED_POLL if stuck else KILL_POLL)


class Command:
    """COMMAND's process, forked before the key is taken and exec'd once it is.

    Forking first gives ``lockd run`` the pid COMMAND will have, to name it
    as the hold's process in the acquire (docs/contract.md §12.2): the daemon verifies it
    (a descendant of ``lockd run``) and records it with its start time, which
    exec does not change. Until :meth:`go` the child waits on a pipe; if the
    guardian goes away first, it is killed (PR_SET_PDEATHSIG).
    """

    def __init__(self, argv: list[str], mode: int, inherited: dict[int, object]) -> None:
        go_r, self._go_w = os.pipe()
        self._err_r, err_w = os.pipe()  # close-on-exec: stays empty when exec succeeds
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 127
            try:
                os.close(self._go_w)
                os.close(self._err_r)
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != parent:
                    os._exit(code)
                signal.set_wakeup_fd(-1)
                # The name exec will give it, so that the daemon records it
                # with the pid at the grant (status shows COMMAND, not python).
                set_name(os.path.basename(argv[0]))
                os.write(err_w, b".")  # named: the guardian may say "ready"
                env = read_all(go_r)
                if not env:
                    os._exit(code)  # no key for COMMAND: end without running it
                self._exec(argv, mode, inherited, load_env(env.decode()), err_w)
            except BaseException as exc:  # the child must never return into the guardian's code
                err = exc.errno if isinstance(exc, OSError) and exc.errno else errno.ENOEXEC
                text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                    os.write(err_w, f"{err} {text}".encode())
                except OSError:
                    pass
            os._exit(code)
        os.close(go_r)
        os.close(err_w)
        os.read(self._err_r, 1)  # "." once it has its name (nothing if it died)
        self.pid = pid

    @staticmethod
    def _exec(
        argv: list[str], mode: int, inherited: dict[int, object], env: dict[str, str], err_w: int
    ) -> None:
        """In the child: meet the terminal as ``mode`` says, then exec COMMAND.

        NO_TERMINAL: a session of its own (no controlling terminal).
        TERMINAL_FOREGROUND: a process group of its own in this session, made
        the terminal's foreground group (SIGTTOU ignored around the call: the
        child is in a background group when it makes it). TERMINAL_BACKGROUND:
        a group of its own, the terminal stays where it is (``lockd run`` was
        started in the background).
        """
        if mode == NO_TERMINAL:
            os.setsid()
        else:
            os.setpgid(0, 0)
        if mode == TERMINAL_FOREGROUND:
            signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                os.tcsetpgrp(0, os.getpgrp())
            except OSError:
                pass
        for sig, disposition in inherited.items():  # a SIGHUP ignored under nohup stays so
            signal.signal(sig, disposition)  # type: ignore[arg-type]
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # what Python changed at start-up
            signal.signal(sig, signal.SIG_DFL)
        execvpe(argv[0], argv, env)

    def go(self, env_json: str) -> tuple[int, str] | None:
        """Let the child exec COMMAND with the environment ``env_json`` (:func:`dump_env`'s
        text, as ``lockd run`` sent it: the child reads it, the guardian passes it
        on unread); (errno, text) if exec failed."""
        try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
            os.write(self._go_w, env_json.encode())
        except OSError:
            pass
        os.close(self._go_w)
        said = read_all(self._err_r).decode(errors="replace")
        os.close(self._err_r)
        if not said:
            return None
        code, _, text = said.partition(" ")
        return (int(code) if code.isdigit() else errno.ENOEXEC), text

    def cancel(self) -> None:
        """No key: the child ends without running COMMAND."""
        os.close(self._go_w)
        os.close(self._err_r)
        try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def set_name(name: str) -> None:
    """This process's name in ``ps`` and ``/proc/PID/comm`` (15 bytes at most); quiet if refused.

    Raw descriptor writes: ``open()`` in text mode builds a text layer (and
    looks up the locale's encoding) for one short write.
    """
    try:
        fd = os.open("/proc/self/comm", os.O_WRONLY)
    except OSError:
        return
    try:
        os.write(fd, os.fsencode(name)[:15])
    except OSError:
        pass
    finally:
        os.close(fd)


def execvpe(file: str, argv: list[str], env: Mapping[str, str]) -> NoReturn:
    """``os.execvpe``: ``file`` searched for in ``env``'s PATH as a shell searches, then exec'd.

    The same search and the same error as ``os.execvpe`` (the first error
    other than "not there", else the last one), without the ``warnings``
    module it imports to read PATH: a cost every ``lockd run`` paid in the
    process that becomes COMMAND (issue 24).
    """
    if os.path.dirname(file):
        os.execve(file, argv, env)
    first_error: OSError | None = None
    last_error: OSError | None = None
    path = env.get("PATH")
    for folder in (os.defpath if path is None else path).split(os.pathsep):
        try:
            os.execve(os.path.join(folder, file), argv, env)
        except (FileNotFoundError, NotADirectoryError) as exc:
            last_error = exc
        except OSError as exc:
            last_error = exc
            first_error = first_error or exc
    # "".split(os.pathsep) is [""] (the current folder, as os.execvpe reads
    # an empty PATH): at least one exec was tried, so an error was kept.
    assert last_error is not None
    raise first_error or last_error


def send_fds(sock: _socket.socket, data: bytes, fds: list[int]) -> None:
    """``socket.send_fds(sock, [data], fds)``: ``data`` with ``fds`` riding along (SCM_RIGHTS).

    The descriptors are packed as native C ints with ``int.to_bytes``: neither
    array (it imports collections) nor struct (a C library of its own to load),
    start-up costs of every ``lockd run`` (issue 24).
    """
    packed = b"".join(fd.to_bytes(C_INT, sys.byteorder, signed=True) for fd in fds)
    sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, packed)])


def recv_fds(sock: _socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int]]:
    """``socket.recv_fds``: up to ``bufsize`` bytes and the descriptors sent with them."""
    size = C_INT
    fds: list[int] = []
    data, ancdata, _flags, _addr = sock.recvmsg(bufsize, _socket.CMSG_LEN(maxfds * size))
    for level, kind, cmsg in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            whole = len(cmsg) - (len(cmsg) % size)
            fds.extend(
                int.from_bytes(cmsg[i : i + size], sys.byteorder, signed=True)
                for i in range(0, whole, size)
            )
    return data, fds


def dump_env(env: Mapping[str, str]) -> str:
    """``json.dumps(dict(env))``: ASCII, so a variable that is not UTF-8 (a lone
    surrogate from os.environ) comes back as it went.

    Written with json's C pieces when the interpreter has them: the json
    module compiles regular expressions at import, pulling in ``re``, a cost
    every ``lockd run`` paid for one object of strings (issue 24).
    """
    try:
        from _json import encode_basestring_ascii as quote
    except ImportError:
        import json

        return json.dumps(dict(env))
    return "{" + ", ".join(f"{quote(name)}: {quote(value)}" for name, value in env.items()) + "}"


class _JSONDefaults:
    """What ``json.loads`` hands json's C scanner (see :func:`load_env`)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {
        "-Infinity": -float("inf"),
        "Infinity": float("inf"),
        "NaN": float("nan"),
    }.__getitem__


def load_env(text: str) -> dict[str, str]:
    """``json.loads(text)`` for :func:`dump_env`'s output (the scanner, when C has one)."""
    try:
        from _json import make_scanner
    except ImportError:
        pass
    else:
        try:
            env, end = make_scanner(_JSONDefaults())(text, 0)  # type: ignore[arg-type]
        except (StopIteration, ValueError):
            pass
        else:
            if end == len(text) and isinstance(env, dict):
                return env
    import json  # anything else: json's own answer, errors included

    loaded: dict[str, str] = json.loads(text)
    return loaded


def read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    return data


class Control:
    """Lines from ``lockd run`` on the control socket, and the descriptors sent with them."""

    def __init__(self, fd: int) -> None:
        self.sock = _socket.socket(fileno=fd)
        self.fds: list[int] = []  # kept open, never used: the daemon connection's copy
        self._pending = b""
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[str]:
        """What one read brings (whole lines); sets ``closed`` at end of file."""
        data, fds = recv_fds(self.sock, 1 << 16, 4)
        for fd in fds:
            os.set_inheritable(fd, False)
        self.fds.extend(fds)
        if not data:
            self.closed = True
            return []
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        return [line.decode() for line in lines]


def main(args: list[str]) -> int:
    """``guardian.py CTRL_FD STATUS_FD MODE -- COMMAND...``.

    Says ``ready PID`` (COMMAND's pid-to-be) at once, then waits for ``go
    ENV_JSON`` from ``lockd run`` (sent with the daemon connection's
    descriptor once the key is taken) to start COMMAND; end of file before
    that means no key: the waiting child ends without running COMMAND.
    """
    ctrl_fd, status_w, mode = (int(a) for a in args[:3])
    argv = args[4:]
    for fd in (ctrl_fd, status_w):  # inherited through pass_fds: not for COMMAND
        os.set_inheritable(fd, False)
    inherited: dict[int, object] = {}
    for sig in IGNORED:
        inherited[sig] = signal.signal(sig, signal.SIG_IGN)
    prctl(PR_SET_CHILD_SUBREAPER, 1)

    def say(line: str) -> None:
        try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
            os.write(status_w, (line + "\n").encode())
        except OSError:  # lockd run is gone: nobody to tell
            pass

    # SIGCHLD wakes the select below through a self-pipe.
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)

    command = Command(argv, mode, inherited)
    ctrl = Control(ctrl_fd)
    say(f"ready {command.pid}")
    lines: list[str] = []
    while not lines and not ctrl.closed:
        lines = ctrl.read()
    word, _, env = lines[0].partition(" ") if lines else ("", "", "")
    if word != "go":
        command.cancel()
        return 0
    failed = command.go(env)
    if failed is not None:
        say(f"error {failed[0]} {failed[1]}")
        Tree(say, command.pid).end(0)
        return 0
    say(f"pid {command.pid}")
    tree = Tree(say, command.pid)
    lines = lines[1:]
    while True:
        for line in lines:
            word, _, rest = line.partition(" ")
            if word == "kill":
                tree.end(int(rest or 0))
                say("empty")
                return 0
        lines = []
        if tree.reap():
            say("empty")
            return 0
        ready, _, _ = select.select([ctrl.fileno(), wake_r], [], [])
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        if ctrl.fileno() in ready:
            lines = ctrl.read()
            if ctrl.closed:  # lockd run died: nothing of COMMAND may outlive its key
                tree.end(0)
                return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
