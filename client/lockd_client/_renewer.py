"""The background renewal of a hold: :class:`AutoRenewer` (``LockClient.lock()``, ``lockd run``).

On ``_thread`` alone, not ``threading``: ``threading`` (with functools,
collections and contextlib behind it) was about half of ``python -c pass``
in every ``lockd run`` (issue 24, bench/startup.py), and a renewer needs
one thread, a flag to stop it and a way to wait for its end, nothing more.
"""

from __future__ import annotations

import time
from _thread import TIMEOUT_MAX, allocate_lock, get_ident, start_new_thread

from ._events import Loss
from ._results import Handle

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Callable
    from logging import Logger
    from typing import Any

    from ._client import LockClient
    from ._connection import Connection

__all__ = ["AutoRenewer", "Flag", "call_on_lost", "granted_ttl_ms", "log"]


class Flag:
    """``threading.Event``'s ``set``, ``is_set`` and ``wait``, on ``_thread`` locks alone.

    A lock held from the start stands for "not set": :meth:`set` releases it
    (once), :meth:`wait` acquires it (with a time-out) and hands it straight
    back, so every waiter sees it set.
    """

    __slots__ = ("_gate", "_mutex", "_set")

    def __init__(self) -> None:
        self._gate = allocate_lock()
        self._gate.acquire()
        self._mutex = allocate_lock()  # two set() at once must not release the gate twice
        self._set = False

    def set(self) -> None:
        with self._mutex:
            if not self._set:
                self._set = True
                self._gate.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set, at most ``timeout`` seconds (None: no limit); True once set."""
        if self._set:
            return True
        limit = -1.0 if timeout is None else min(max(timeout, 0.0), TIMEOUT_MAX)
        if self._gate.acquire(True, limit):
            self._gate.release()
            return True
        return self._set


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
        self._stop = Flag()
        #: held while the thread runs: stop() waits on it as Thread.join would
        self._running = allocate_lock()
        self._thread_id: int | None = None

    def start(self) -> None:
        """Start renewing (a daemon thread: it never keeps the interpreter from exiting)."""
        if self._thread_id is not None:
            raise RuntimeError("threads can only be started once")  # as Thread.start
        self._running.acquire()
        try:
            self._thread_id = start_new_thread(self._main, ())
        except BaseException:
            self._running.release()
            raise

    @property
    def alive(self) -> bool:
        """Whether its thread is still running (``Thread.is_alive``: a ``_thread`` thread
        is not in ``threading.enumerate()``). While :meth:`stop` briefly holds the lock
        after the thread ended, this may still say True: a caller polls, or asks after stop()."""
        return self._running.locked()

    @property
    def lost_cause(self) -> str | None:
        """``break``, ``retake``, ``expired``, ``session`` when the daemon said so."""
        return self.loss.cause if self.loss is not None else None

    def stop(self) -> None:
        """Stop renewing and wait (briefly) for the thread to end."""
        self._stop.set()
        if self._events is not None:
            self._events.wake()
        running = self._running
        # Thread.join(timeout): the lock is free again once the thread has ended.
        if (
            running.locked()
            and self._thread_id != get_ident()
            and running.acquire(True, _JOIN_TIMEOUT)
        ):
            running.release()

    def _main(self) -> None:
        self._thread_id = get_ident()  # before anything it runs may call stop()
        try:
            self._run()
        finally:
            self._running.release()

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


def call_on_lost(on_lost: Callable[[Handle], object], handle: Handle) -> None:
    try:
        on_lost(handle)
    except Exception:
        log.exception("lockd: on_lost callback for %r raised", handle.key)


def granted_ttl_ms(handle: Handle, asked_ms: int) -> int:
    """The TTL the grant reports (``ttlMs``: whole seconds, at least 2, on etcd), else as asked."""
    return handle.ttl_ms if handle.ttl_ms > 0 else asked_ms
