"""The lease side of ``lockd run``: taking the key and keeping it (SPEC §9).

The key is taken once (``tryAcquire``) or waited for (``acquire``), always
with ``releaseOnClose`` so that a ``lockd run`` killed outright frees the key
at once: the kernel closes its connection and the daemon releases. Then a
:class:`LeaseKeeper` thread renews it every third of the TTL and decides when
it is lost; it never signals anything itself (see :mod:`lockd.runproc`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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

from lockd.describe import who_holds
from lockd.exitcodes import EXIT_INTERRUPTED, EXIT_USAGE, exit_code_for
from lockd.run.options import Reporter, RunOptions
from lockd.timefmt import format_duration_ms

__all__ = ["Grant", "LeaseKeeper", "take_lease"]

#: Upper bound of the safety margin kept before the lease's end.
_MAX_MARGIN = 2.0
#: Bounds of the pause between renewal attempts while they fail.
_MIN_RETRY_PAUSE = 0.01
_MAX_RETRY_PAUSE = 0.5
#: Time allowed for the "who holds it" lookup after a busy key or a timed-out wait.
_STATUS_TIMEOUT = 2.0


# -- taking the key -----------------------------------------------------------


@dataclass
class Grant:
    """A granted lease and our conservative estimate of its end (monotonic clock)."""

    handle: Handle
    expires_at: float


def take_lease(client: LockClient, opts: RunOptions, report: Reporter) -> Grant | int:
    """Take the key as ``opts`` asks; return the Grant, or the exit code when we did not get it.

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
            handle = client.try_acquire(
                opts.key,
                ttl,
                owner=opts.owner,
                release_on_close=True,
                shared=opts.shared,
                limit=opts.limit,
            )
        else:
            handle = client.acquire(
                opts.key,
                ttl,
                opts.wait_ms / 1000,
                owner=opts.owner,
                release_on_close=True,
                shared=opts.shared,
                limit=opts.limit,
            )
    except LockTimeoutError:
        wait = format_duration_ms(opts.wait_ms or 0)
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
    return Grant(handle, expires_at)


def _report_error(report: Reporter, exc: LockdError, key: str) -> int:
    """Say a daemon/client error in one line; its exit code is every command's (SPEC §9)."""
    if isinstance(exc, LockAccessDeniedError):
        report(exc.code, f"access denied for key {key!r}: {exc.message}", key=key)
    elif isinstance(exc, RateLimitedError):
        after = "" if exc.retry_after is None else f"; retry in {exc.retry_after:g}s"
        report(exc.code, f"rate limited: {exc.message}{after}", key=key)
    elif isinstance(exc, InvalidRequestError):
        report(exc.code, f"invalid request: {exc.message}", key=key)
    elif isinstance(exc, DaemonUnavailableError):
        report(exc.code, exc.message, socket=exc.socket_path)
    elif isinstance(exc, ShuttingDownError):
        report(exc.code, f"the daemon is shutting down: {exc.message}", key=key)
    else:  # INTERNAL, PROTOCOL_ERROR, ...: the daemon could not serve us.
        report(exc.code, f"daemon error: {exc.message}", key=key)
    return exit_code_for(exc)


def _holder_hint(client: LockClient, key: str) -> str:
    """`` (held by user:alice (owner run-1, pid 4242 backup.sh))`` for the busy message.

    Every holder of a shared key or a full semaphore is named (up to three);
    empty if unknown.
    """
    client.request_timeout = _STATUS_TIMEOUT
    try:
        status = client.status(key)
    except LockdError:
        return ""
    return f" (held by {who_holds(status)})" if status.held else ""


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
