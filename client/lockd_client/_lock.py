"""``LockClient.lock()``: hold a key for a ``with`` block, optionally renewing it."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

try:  # the C datetime, as in _results (issue 24)
    from _datetime import UTC, datetime
except ImportError:
    from datetime import UTC, datetime

from ._errors import LockdError, LockLostError
from ._events import Loss
from ._results import Handle, ReleaseResult
from ._wire import seconds_to_ms

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from logging import Logger
    from typing import Any

    from ._client import LockClient
    from ._connection import Connection

__all__ = ["AutoRenewer", "call_on_lost", "check_released", "hold", "lease_end"]


class _ClientLogger:
    """``logging.getLogger("lockd_client")``, made at its first message.

    A renewal that never has to warn never imports logging (its import, with
    traceback and tokenize, is a start-up cost of ``lockd run``: issue 24).
    """

    def __init__(self) -> None:
        self._quiet = False

    def quiet(self) -> None:
        """Give the logger a NullHandler (when made): no last-resort lines on stderr.

        ``lockd run`` says what matters itself, one line per event.
        """
        self._quiet = True

    def __getattr__(self, name: str) -> Any:  # the Logger's
        return getattr(self._logger(), name)

    def _logger(self) -> Logger:
        import logging

        logger = logging.getLogger("lockd_client")
        if self._quiet and not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
            logger.addHandler(logging.NullHandler())
        return logger


log = _ClientLogger()

_JOIN_TIMEOUT = 5.0
_MAX_RETRY_PAUSE = 1.0
#: the loss is reported this long (at most; a tenth of the TTL below 20 s)
#: before the lease would run out.
_MAX_MARGIN = 2.0


class AutoRenewer:
    """A daemon thread that renews ``handle`` every ``ttl/3`` until stopped or lost.

    The lease is taken as lost when renew answers ``renewed: false``, or when
    renewals keep failing into a safety margin before the lease would run out
    (a tenth of the TTL, at most 2 s): the loss is reported while the lease
    still holds, so the caller can stop before anyone else gets the key. The
    lease's end is counted on the monotonic clock from when each successful
    renewal was *sent* (the daemon extended it no earlier). Then
    ``handle.lost`` is set, ``on_lost(handle)`` is called once and the thread
    ends. Nothing is reported after :meth:`stop`.

    Between renewals the thread listens on the connection the hold was
    granted on (``events_from``, by default ``client``; its connection as
    it is when the renewer is made) for the daemon's lease-loss event (docs/contract.md
    §12): a break, a re-take or an expiry is reported the moment it is
    told, with ``lost_cause`` and ``loss`` set, instead of at the next
    renewal. Renewal stays the fallback: a daemon that sends no events, or
    a connection that broke, is noticed as before.

    Public (``lockd_client.AutoRenewer``): ``LockClient.lock()`` and ``lockd
    run`` both keep their leases with it. Give it a client of its own when
    the caller's client may be busy (a renewal must not queue behind a
    blocking acquire), and the client that took the hold as ``events_from``.
    """

    def __init__(
        self,
        client: LockClient,
        handle: Handle,
        ttl_ms: int,
        on_lost: Callable[[Handle], object] | None,
        *,
        expires_at: float,
        events_from: LockClient | None = None,
    ) -> None:
        """``expires_at``: when the lease runs out, on ``time.monotonic()``."""
        self._client = client
        self._handle = handle
        self._ttl_ms = ttl_ms
        self._on_lost = on_lost
        # What each renew gives, as the grant said: a daemon on etcd rounds
        # the TTL up to whole seconds (at least 2), and its renews take a few
        # etcd round trips: pacing them by the TTL asked for would give a
        # slow renew up for lost long before the lease could end.
        self._lease_ms = granted_ttl_ms(handle, ttl_ms)
        self._interval = self._lease_ms / 3000
        self._margin = min(self._lease_ms / 10_000, _MAX_MARGIN)
        self._deadline = expires_at
        self.lost_reason: str | None = None
        #: the daemon's word on the loss, when it pushed one (docs/contract.md §12).
        self.loss: Loss | None = None
        self._events: Connection | None = (events_from or client).events_connection()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lockd-renew:{handle.key[:64]}", daemon=True
        )

    def start(self) -> None:
        """Start renewing."""
        self._thread.start()

    @property
    def lost_cause(self) -> str | None:
        """``break``, ``retake``, ``expired``, ``session`` when the daemon said so."""
        return self.loss.cause if self.loss is not None else None

    def stop(self) -> None:
        """Stop renewing and wait (briefly) for the thread to end."""
        self._stop.set()
        if self._events is not None:
            self._events.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT)

    def give_up_at(self) -> float:
        """The monotonic time by which a renewal must have succeeded, or the lease counts as lost.

        A caller that acts on the loss itself (``lockd run`` signals its
        command) may wait until then, and declare the loss on its own if the
        renewer has not by then (a renew call stuck in the kernel).
        """
        return self._deadline - self._margin

    def _run(self) -> None:
        # A lease that is already old (a long blocking wait) renews sooner.
        pause = min(self._interval, max(0.0, self.give_up_at() - time.monotonic()) / 2)
        while not self._pause(pause):
            sent_at = time.monotonic()
            try:
                result = self._client._renew(
                    self._handle, self._ttl_ms, give_up_at=self.give_up_at()
                )
            except Exception as exc:
                if self._stop.is_set():
                    return
                pause = min(self._interval, _MAX_RETRY_PAUSE)
                left = self.give_up_at() - time.monotonic()
                log.warning(
                    "lockd: renewing %r failed (%s); %.3f s before giving the lease up",
                    self._handle.key,
                    exc,
                    left,
                )
                if left <= pause:
                    self._lose(f"renewals failed until the lease was about to run out ({exc})")
                    return
                continue
            if self._stop.is_set():
                return
            if not result.renewed:
                self._lose(f"renew answered {result.reason or 'renewed: false'}")
                return
            self._deadline = sent_at + self._lease_ms / 1000
            pause = self._interval

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` for the next renewal; True to end (stopped, or lost by event)."""
        conn = self._events
        if conn is None or conn.dead:
            return self._stop.wait(seconds)
        loss = conn.wait_for_loss(self._handle.handle, seconds, self._stop)
        if self._stop.is_set():
            return True
        if loss is not None:
            self.loss = loss
            self._lose(loss.describe())
            return True
        if conn.dead:  # the rest of the pause without it; renewals tell from here on
            self._events = None
            return self._stop.wait(max(0.0, seconds / 2))
        return False

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        self._handle.lost = True
        if self._on_lost is None:  # a caller that passed on_lost handles it: no noise
            log.warning("lockd: lease on %r lost", self._handle.key)
        else:
            call_on_lost(self._on_lost, self._handle)


@contextmanager
def hold(
    client: LockClient,
    key: str,
    ttl: float,
    timeout: float | None,
    *,
    owner: str | None,
    auto_renew: bool,
    on_lost: Callable[[Handle], object] | None,
    release_on_close: bool,
    shared: bool = False,
    limit: int = 1,
) -> Iterator[Handle]:
    """Implementation of :meth:`LockClient.lock`."""
    ttl_ms = seconds_to_ms(ttl, "ttl", allow_zero=False)
    if on_lost is not None and not callable(on_lost):
        raise TypeError("on_lost must be callable or None")
    if on_lost is not None and not auto_renew:
        # Without a renewer nothing watches the lease, so it would never be called.
        raise ValueError("on_lost needs auto_renew=True")
    if auto_renew:
        client.listen_for_losses()  # the hold is granted on a connection that hears its loss
    sent_at = time.monotonic()
    handle = client.acquire(
        key,
        ttl,
        timeout,
        owner=owner,
        release_on_close=release_on_close,
        shared=shared,
        limit=limit,
    )
    renewer: AutoRenewer | None = None
    if auto_renew:

        def lost(handle: Handle) -> None:
            assert renewer is not None
            # The next call of the client raises it, so work in the block
            # that talks to the daemon stops there (docs/contract.md §12).
            client._note_lost(_lost_error(handle, renewer))
            if on_lost is not None:
                on_lost(handle)

        renewer = AutoRenewer(
            client,
            handle,
            ttl_ms,
            lost,
            expires_at=lease_end(handle, sent_at, granted_ttl_ms(handle, ttl_ms)),
        )
        renewer.start()
    try:
        yield handle
    except BaseException:
        if renewer is not None:
            renewer.stop()
            client._forget_lost(handle.key, handle.fence)  # the block ended on its own error
        try:
            client.release(handle)
        except Exception as exc:
            log.warning("lockd: releasing %r after an error failed: %s", key, exc)
        raise
    if renewer is not None:
        renewer.stop()
    if handle.lost:  # the renewer saw it: release what may remain, then say so
        try:
            client.release(handle)
        except LockdError as exc:
            log.warning("lockd: releasing %r after losing it failed: %s", key, exc)
        client._forget_lost(handle.key, handle.fence)
        if renewer is not None:
            raise _lost_error(handle, renewer)
        raise LockLostError(handle.key, handle.fence, "lost")
    check_released(client.release(handle), handle, on_lost)


def _lost_error(handle: Handle, renewer: AutoRenewer) -> LockLostError:
    return LockLostError(
        handle.key, handle.fence, renewer.lost_reason or "lost", cause=renewer.lost_cause
    )


def check_released(
    result: ReleaseResult, handle: Handle, on_lost: Callable[[Handle], object] | None
) -> None:
    """The end of a ``lock()`` block: a release that found the hold gone raises LockLostError.

    ``on_lost`` is called first: that is the moment the loss is seen.
    """
    if not result.released:
        handle.lost = True
        if on_lost is not None:
            call_on_lost(on_lost, handle)
        reason = result.reason or "released: false"
        raise LockLostError(handle.key, handle.fence, f"the release answered {reason}")


def call_on_lost(on_lost: Callable[[Handle], object], handle: Handle) -> None:
    try:
        on_lost(handle)
    except Exception:
        log.exception("lockd: on_lost callback for %r raised", handle.key)


def granted_ttl_ms(handle: Handle, asked_ms: int) -> int:
    """The TTL the grant reports (``ttlMs``: whole seconds, at least 2, on etcd), else as asked."""
    return handle.ttl_ms if handle.ttl_ms > 0 else asked_ms


def lease_end(handle: Handle, sent_at: float, ttl_ms: int) -> float:
    """When the lease runs out, on the monotonic clock.

    The daemon shares this host's clock, so its ``leaseExpiresAt`` is exact;
    a blocking acquire may have waited long, so the send time alone would be
    far too early. Never later than the send time plus the TTL's worth from
    the reply, as a guard against a wall clock stepped meanwhile.
    """
    now = time.monotonic()
    latest = now + ttl_ms / 1000
    expires = handle.lease_expires_at
    if expires is None:
        return max(sent_at + ttl_ms / 1000, now)
    left = (expires - datetime.now(UTC)).total_seconds()
    return min(now + left, latest)
