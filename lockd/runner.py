"""Run a command while holding a lease: the engine of ``lockd run`` (SPEC §9).

``lockd run`` replaces flock(1) for programs that should not overlap, with two
differences a lease forces on us: the lease runs out unless renewed, and it can
be taken away (broken by an admin, re-taken by the same owner). So this module:

1. takes the key once (``tryAcquire``) or waits for it (``acquire``), always
   with ``releaseOnClose`` so that a ``lockd run`` killed outright frees the key
   at once: the kernel closes its connection and the daemon releases;
2. starts COMMAND (no shell) in a session of its own, with ``LOCKD_KEY``,
   ``LOCKD_HANDLE``, ``LOCKD_FENCE`` (and ``LOCKD_SOCKET``) in its environment,
   and with ``PR_SET_PDEATHSIG`` so that it is SIGKILLed if ``lockd run`` dies;
3. renews the lease every third of the TTL from a :class:`LeaseKeeper` thread;
   when the lease is lost (renew answers ``renewed: false``, or renewals keep
   failing until the lease is about to run out) the main thread acts on the
   whole process group before the lease expires (``--on-lost``);
4. forwards SIGINT, SIGTERM and SIGHUP to COMMAND's process group;
5. releases the key when COMMAND exits and returns COMMAND's status the way a
   shell reports it (128+N for death by signal N).

Everything that sends signals runs on the main thread, which also forked
COMMAND: ``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits, and
Python runs signal handlers only on the main thread anyway. Nothing here knows
about click; :mod:`lockd.cli_run` is the thin command on top.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import FrameType
from typing import IO, Any

from lockd_client import (
    DaemonUnavailableError,
    Handle,
    InvalidRequestError,
    LockAccessDeniedError,
    LockClient,
    LockdError,
    LockTimeoutError,
    RateLimitedError,
    ShuttingDownError,
)

from .exitcodes import (
    EXIT_BUG,
    EXIT_BUSY,
    EXIT_CANNOT_EXECUTE,
    EXIT_DENIED,
    EXIT_INTERRUPTED,
    EXIT_LOST,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_RATE_LIMITED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)

__all__ = [
    "EXIT_BUG",
    "EXIT_BUSY",
    "EXIT_CANNOT_EXECUTE",
    "EXIT_DENIED",
    "EXIT_INTERRUPTED",
    "EXIT_LOST",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_RATE_LIMITED",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "FORWARDED_SIGNALS",
    "LeaseKeeper",
    "OnLost",
    "Reporter",
    "RunOptions",
    "SignalForwarder",
    "exit_status",
    "run_locked",
    "spawn_in_own_session",
    "take_lease",
]


#: Signals ``lockd run`` passes on to COMMAND's process group.
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: Upper bound of the safety margin kept before the lease's end.
_MAX_MARGIN = 2.0
#: Bounds of the pause between renewal attempts while they fail.
_MIN_RETRY_PAUSE = 0.01
_MAX_RETRY_PAUSE = 0.5
#: Time allowed for the final release and for the "who holds it" lookup.
_RELEASE_TIMEOUT = 5.0
_RELEASE_RETRY_WINDOW = 2.0
_STATUS_TIMEOUT = 2.0
#: How often a group that outlived its leader is checked during --grace.
_GROUP_POLL = 0.05
_PR_SET_PDEATHSIG = 1


class OnLost(StrEnum):
    """What to do to COMMAND when the lease is lost (``--on-lost``)."""

    TERM = "term"  # SIGTERM to the group, SIGKILL after --grace
    KILL = "kill"  # SIGKILL to the group at once
    IGNORE = "ignore"  # only report; exit 6 once COMMAND is done


@dataclass(frozen=True)
class RunOptions:
    """What ``lockd run`` was asked to do. Durations are whole milliseconds."""

    key: str
    command: tuple[str, ...]
    ttl_ms: int = 60_000
    wait_ms: int | None = None  # None: a single tryAcquire
    owner: str | None = None
    on_lost: OnLost = OnLost.TERM
    grace_ms: int = 10_000
    conflict_exit_code: int = EXIT_BUSY
    socket_path: str | None = None
    quiet: bool = False  # no stderr line when the key is busy / the wait timed out


class Reporter:
    """``lockd run``'s own voice: one line per event on stderr.

    stdout belongs to COMMAND, so nothing is ever written there. With
    ``json_lines`` each line is ``{"error": {"code", "message", "details"}}``,
    the shape of the daemon's errors, for scripts that parse stderr.
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        *,
        json_lines: bool = False,
        prog: str = "lockd run",
    ) -> None:
        self._stream = stream
        self.json_lines = json_lines
        self.prog = prog

    def __call__(self, code: str, message: str, **details: Any) -> None:
        """Write one line: ``code`` is a stable name such as ``KEY_BUSY`` or ``LEASE_LOST``."""
        stream = self._stream if self._stream is not None else sys.stderr
        if self.json_lines:
            body = {"code": code, "message": message, "details": details}
            line = json.dumps({"error": body}, ensure_ascii=False)
        else:
            line = f"{self.prog}: {message}"
        with contextlib.suppress(OSError, ValueError):  # a closed stderr must not hide the exit
            stream.write(line + "\n")
            stream.flush()


def format_ms(ms: int) -> str:
    """A duration for humans: ``600ms``, ``10s``, ``1.5s``, ``2m``."""
    if ms < 1000:
        return f"{ms}ms"
    if ms % 60_000 == 0:
        return f"{ms // 60_000}m"
    return f"{ms / 1000:g}s"


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: death by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


# -- taking the key -----------------------------------------------------------


@dataclass
class Lease:
    """A granted lease and our conservative estimate of its end (monotonic clock)."""

    handle: Handle
    expires_at: float


def take_lease(client: LockClient, opts: RunOptions, report: Reporter) -> Lease | int:
    """Take the key as ``opts`` asks; return the Lease, or the exit code when we did not get it.

    The lease's end is estimated on the monotonic clock so that a wall-clock
    step cannot fool the keeper: for one attempt, from the moment the request
    was sent (the grant came later, so the real end is later); after a wait,
    the grant moment is unknown, so the daemon's ``leaseExpiresAt`` is read
    against our wall clock (same host, same clock) and capped at the TTL.
    """
    ttl = opts.ttl_ms / 1000
    sent = time.monotonic()
    try:
        if opts.wait_ms is None:
            handle = client.try_acquire(opts.key, ttl, owner=opts.owner, release_on_close=True)
        else:
            handle = client.acquire(
                opts.key, ttl, opts.wait_ms / 1000, owner=opts.owner, release_on_close=True
            )
    except LockTimeoutError:
        wait = format_ms(opts.wait_ms or 0)
        if not opts.quiet:
            hint = _holder_hint(client, opts.key)
            report(
                "LOCK_TIMEOUT",
                f"timed out after {wait} waiting for key {opts.key!r}{hint}; COMMAND not run",
                key=opts.key,
            )
        return opts.conflict_exit_code
    except KeyboardInterrupt:
        report("INTERRUPTED", f"interrupted while waiting for key {opts.key!r}", key=opts.key)
        return EXIT_INTERRUPTED
    except LockdError as exc:
        return _report_error(report, exc, opts.key)
    except ValueError as exc:  # the client's own checks: key, owner, ttl out of range
        report("INVALID_REQUEST", f"invalid request: {exc}", key=opts.key)
        return EXIT_USAGE
    if handle is None:
        if not opts.quiet:
            hint = _holder_hint(client, opts.key)
            report("KEY_BUSY", f"key {opts.key!r} is busy{hint}; COMMAND not run", key=opts.key)
        return opts.conflict_exit_code
    received = time.monotonic()
    if opts.wait_ms is None:
        expires_at = sent + ttl
    else:
        left = ttl
        if handle.lease_expires_at is not None:
            left = min(ttl, handle.lease_expires_at.timestamp() - time.time())
        expires_at = received + left
    return Lease(handle, expires_at)


def _report_error(report: Reporter, exc: LockdError, key: str) -> int:
    """Map a daemon/client error to its exit code (SPEC §9) and say it in one line."""
    if isinstance(exc, LockAccessDeniedError):
        report(exc.code, f"access denied for key {key!r}: {exc.message}", key=key)
        return EXIT_DENIED
    if isinstance(exc, RateLimitedError):
        after = "" if exc.retry_after is None else f"; retry in {exc.retry_after:g}s"
        report(exc.code, f"rate limited: {exc.message}{after}", key=key)
        return EXIT_RATE_LIMITED
    if isinstance(exc, InvalidRequestError):
        report(exc.code, f"invalid request: {exc.message}", key=key)
        return EXIT_USAGE
    if isinstance(exc, DaemonUnavailableError):
        report(exc.code, exc.message, socket=exc.socket_path)
        return EXIT_UNAVAILABLE
    if isinstance(exc, ShuttingDownError):
        report(exc.code, f"the daemon is shutting down: {exc.message}", key=key)
        return EXIT_UNAVAILABLE
    # INTERNAL, PROTOCOL_ERROR, ...: the daemon could not serve us.
    report(exc.code, f"daemon error: {exc.message}", key=key)
    return EXIT_UNAVAILABLE


def _holder_hint(client: LockClient, key: str) -> str:
    """`` (held by user:alice, owner run-1)`` for the busy message; empty if unknown."""
    client.request_timeout = _STATUS_TIMEOUT
    try:
        status = client.status(key)
    except LockdError:
        return ""
    if not status.held:
        return ""
    parts = [f"held by {status.held_by}"] if status.held_by else []
    if status.owner:
        parts.append(f"owner {status.owner}")
    return f" ({', '.join(parts)})" if parts else ""


# -- keeping the lease ----------------------------------------------------------


class LeaseKeeper:
    """Renews a lease every ``ttl/3`` in a daemon thread and decides when it is lost.

    The lease's end (``expires_at``, monotonic) moves to ``sent + ttl`` after
    each successful renew, ``sent`` being when that renew was *sent*: the
    daemon renewed later, so the real end is never earlier than ours. The
    lease counts as lost when

    - renew answers ``renewed: false`` (broken, re-taken, or expired), or
    - no renew has succeeded by ``expires_at - margin`` (daemon unreachable,
      stuck, or refusing): ``margin`` is a tenth of the TTL, at most 2 s, so
      that COMMAND is signalled while the lease still holds.

    While renewals fail they are retried every ``interval/4`` (10 ms to 0.5 s),
    each bounded to end by the give-up point. The keeper never signals
    anything: it records the reason and sets ``wake``; the main thread acts.
    :meth:`check_deadline` lets the main thread declare the loss itself, so a
    renew call stuck past its bound cannot delay it.

    ``client`` should be used by this keeper alone: its timeouts are adjusted
    before each call.
    """

    def __init__(
        self,
        client: LockClient,
        handle: Handle,
        *,
        ttl_ms: int,
        expires_at: float,
        wake: threading.Event,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._handle = handle
        self._ttl_ms = ttl_ms
        self._ttl = ttl_ms / 1000
        self.interval = self._ttl / 3
        self.margin = min(self._ttl / 10, _MAX_MARGIN)
        self._retry_pause = min(max(self.interval / 4, _MIN_RETRY_PAUSE), _MAX_RETRY_PAUSE)
        self._clock = clock
        self._wake = wake
        self._lock = threading.Lock()
        self._expires_at = expires_at
        self._lost_reason: str | None = None
        self._fenced = False
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lockd-run-renew:{handle.key[:64]}", daemon=True
        )

    @property
    def lost_reason(self) -> str | None:
        """Why the lease is lost, or None while it holds."""
        with self._lock:
            return self._lost_reason

    @property
    def fenced(self) -> bool:
        """True when the daemon said the handle no longer holds the key (no release needed)."""
        with self._lock:
            return self._fenced

    def give_up_at(self) -> float:
        """The monotonic time by which a renewal must have succeeded."""
        with self._lock:
            return self._expires_at - self.margin

    def start(self) -> None:
        """Start renewing (the first renewal comes a third of the TTL after the grant)."""
        self._thread.start()

    def stop(self, join_timeout: float = 1.0) -> None:
        """Stop renewing. A renew still in flight is left to finish on its own."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_timeout)

    def check_deadline(self) -> None:
        """Declare the lease lost if the give-up point has passed without a renewal."""
        if self._lost_reason is None and self._clock() >= self.give_up_at():
            self._declare_lost(self._failing_reason())

    def _failing_reason(self) -> str:
        last = f" (last error: {self._last_error})" if self._last_error else ""
        return f"no successful renewal in time, the lease is about to run out{last}"

    def _declare_lost(self, reason: str, *, fenced: bool = False) -> None:
        with self._lock:
            if self._lost_reason is not None:
                return
            self._lost_reason = reason
            self._fenced = fenced
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        next_at = self._expires_at - self._ttl + self.interval
        while not self._stop.wait(max(0.0, next_at - self._clock())):
            sent = self._clock()
            give_up = self.give_up_at()
            if sent >= give_up:
                self._declare_lost(self._failing_reason())
                return
            bound = give_up - sent
            self._client.connect_timeout = bound
            self._client.request_timeout = bound
            self._client.retry_window = bound
            try:
                result = self._client.renew(self._handle, self._ttl)
            except LockdError as exc:
                if self._stop.is_set():
                    return
                self._last_error = f"{exc.code}: {exc.message}"
                next_at = min(self._clock() + self._retry_pause, give_up)
                continue
            if self._stop.is_set():
                return
            if not result.renewed:
                self._declare_lost(
                    f"renew answered {result.reason or 'renewed: false'}: the key was"
                    " broken or re-taken",
                    fenced=True,
                )
                return
            with self._lock:
                if self._lost_reason is not None:
                    return
                self._expires_at = sent + self._ttl
            self._last_error = None
            next_at = sent + self.interval


# -- the command ------------------------------------------------------------------

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


def _killpg(pgid: int, sig: int) -> None:
    """Signal a process group; a group that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
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
            _killpg(pgid, sig)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._pgid is None:
            self._pending.append(signum)
        else:
            _killpg(self._pgid, signum)


# -- the whole run -------------------------------------------------------------------


def run_locked(opts: RunOptions, report: Reporter | None = None) -> int:
    """Do everything ``lockd run`` does and return its exit status.

    Must run on the main thread (signal handlers, PDEATHSIG). While we wait
    for the key, signals keep their usual effect (SIGINT ends the wait with
    130; SIGTERM and SIGHUP end the process, and the daemon drops the waiter
    with the connection); once the key is ours, they are forwarded.
    """
    report = report or Reporter()
    client = LockClient(opts.socket_path)
    try:
        got = take_lease(client, opts, report)
        if isinstance(got, int):
            return got
        with SignalForwarder() as forwarder:
            return _run_holding(client, got, opts, report, forwarder)
    finally:
        client.close()


def _run_holding(
    client: LockClient,
    lease: Lease,
    opts: RunOptions,
    report: Reporter,
    forwarder: SignalForwarder,
) -> int:
    """Run COMMAND under ``lease``, then release; return the exit status."""
    handle = lease.handle
    env = {
        **os.environ,
        "LOCKD_KEY": handle.key,
        "LOCKD_HANDLE": handle.handle,
        "LOCKD_FENCE": str(handle.fence),
        "LOCKD_SOCKET": client.socket_path,
    }
    try:
        proc = spawn_in_own_session(opts.command, env)
    except OSError as exc:
        _release(client, handle, report, quiet_not_holder=True)
        missing = isinstance(exc, FileNotFoundError)
        what = "not found" if missing else f"cannot be executed ({exc.strerror or exc})"
        report(
            "COMMAND_NOT_FOUND" if missing else "COMMAND_NOT_EXECUTABLE",
            f"{opts.command[0]}: command {what}",
            command=opts.command[0],
        )
        return EXIT_NOT_FOUND if missing else EXIT_CANNOT_EXECUTE
    forwarder.attach(proc.pid)
    guard = GroupGuard(proc.pid)

    wake = threading.Event()
    exited = threading.Event()
    renew_client = LockClient(client.socket_path)
    keeper = LeaseKeeper(
        renew_client, handle, ttl_ms=opts.ttl_ms, expires_at=lease.expires_at, wake=wake
    )
    keeper.start()
    reaper = threading.Thread(
        target=_reap, args=(proc, exited, wake), name="lockd-run-reaper", daemon=True
    )
    reaper.start()
    try:
        _supervise(proc, keeper, exited, wake, opts, report)
        guard.dismiss()
    finally:
        guard.close()  # after an error in lockd run itself: the group goes too
        keeper.stop()
        renew_client.close()
    status = exit_status(proc.returncode)
    if keeper.lost_reason is not None:
        # No release: either the daemon fenced the handle already, or it did
        # not answer in time and the lease is about to run out; in both cases
        # our exit closes the connection, which frees a lease still bound to it.
        if opts.on_lost is OnLost.IGNORE:
            report(
                "LEASE_LOST",
                f"COMMAND exited with status {status}; exiting {EXIT_LOST}: the lease on"
                f" {handle.key!r} was lost while it ran",
                key=handle.key,
                commandStatus=status,
            )
        return EXIT_LOST
    if not _release(client, handle, report, quiet_not_holder=False):
        return EXIT_LOST
    return status


def _reap(proc: subprocess.Popen[bytes], exited: threading.Event, wake: threading.Event) -> None:
    proc.wait()
    exited.set()
    wake.set()


def _supervise(
    proc: subprocess.Popen[bytes],
    keeper: LeaseKeeper,
    exited: threading.Event,
    wake: threading.Event,
    opts: RunOptions,
    report: Reporter,
) -> None:
    """Wait for COMMAND to exit, acting on a lost lease as ``opts.on_lost`` says.

    Runs on the main thread; signal handlers (forwarding) run in between.
    """
    pgid = proc.pid
    acted = False
    kill_at: float | None = None  # --on-lost term: when SIGKILL follows
    while not exited.is_set():
        now = time.monotonic()
        timeout: float | None = None
        if keeper.lost_reason is None:
            timeout = max(0.0, keeper.give_up_at() - now)
        elif kill_at is not None:
            timeout = max(0.0, kill_at - now)
        wake.wait(timeout)
        wake.clear()
        if exited.is_set():
            break
        keeper.check_deadline()
        reason = keeper.lost_reason
        if reason is not None and not acted:
            acted = True
            kill_at = _act_on_lost(pgid, reason, opts, report)
        if kill_at is not None and time.monotonic() >= kill_at:
            _killpg(pgid, signal.SIGKILL)
            kill_at = None
    if kill_at is not None:
        # The leader obeyed SIGTERM; anything left in its group gets the rest
        # of --grace, then SIGKILL: no process of a lost lease keeps working.
        while _group_alive(pgid) and time.monotonic() < kill_at:
            time.sleep(_GROUP_POLL)
        if _group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)


def _act_on_lost(pgid: int, reason: str, opts: RunOptions, report: Reporter) -> float | None:
    """Signal the group as ``--on-lost`` says and report it; return when SIGKILL is due."""
    head = f"lease on {opts.key!r} lost ({reason})"
    if opts.on_lost is OnLost.IGNORE:
        report(
            "LEASE_LOST",
            f"{head}; --on-lost ignore: COMMAND keeps running without the lock",
            key=opts.key,
            action="ignore",
        )
        return None
    if opts.on_lost is OnLost.KILL:
        _killpg(pgid, signal.SIGKILL)
        report(
            "LEASE_LOST",
            f"{head}; sent SIGKILL to COMMAND's process group",
            key=opts.key,
            action="kill",
        )
        return None
    _killpg(pgid, signal.SIGTERM)
    report(
        "LEASE_LOST",
        f"{head}; sent SIGTERM to COMMAND's process group, SIGKILL in {format_ms(opts.grace_ms)}",
        key=opts.key,
        action="term",
    )
    return time.monotonic() + opts.grace_ms / 1000


def _release(
    client: LockClient, handle: Handle, report: Reporter, *, quiet_not_holder: bool
) -> bool:
    """Release the key; False only when the daemon says we no longer held it.

    A release that cannot reach the daemon is reported but not fatal: the key
    is freed anyway when this process exits (``releaseOnClose``) or, after a
    daemon restart, when the TTL runs out.
    """
    client.request_timeout = _RELEASE_TIMEOUT
    client.retry_window = _RELEASE_RETRY_WINDOW
    try:
        result = client.release(handle)
    except LockdError as exc:
        report(
            "RELEASE_FAILED",
            f"could not release key {handle.key!r} ({exc.message}); it is freed when this"
            " process exits, or when its TTL runs out",
            key=handle.key,
        )
        return True
    if result.released or quiet_not_holder:
        return True
    report(
        "LEASE_LOST",
        f"lease on {handle.key!r} was lost before COMMAND finished (release answered"
        f" {result.reason or 'released: false'}); exiting {EXIT_LOST}",
        key=handle.key,
    )
    return False
