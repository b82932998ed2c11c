"""``LockClient.lock()``: hold a key for a ``with`` block, optionally renewing it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ._results import Handle
from ._wire import seconds_to_ms

if TYPE_CHECKING:
    from ._client import LockClient

__all__ = ["AutoRenewer", "hold"]

log = logging.getLogger("lockd_client")

_JOIN_TIMEOUT = 5.0
_MAX_RETRY_PAUSE = 1.0


class AutoRenewer:
    """A daemon thread that renews ``handle`` every ``ttl/3`` until stopped or lost.

    The lease is taken as lost when renew answers ``renewed: false``, or when
    renewals keep failing and the next attempt would come too late (the
    lease, counted from the last success on the monotonic clock, is about to
    run out). Then ``handle.lost`` is set, ``on_lost(handle)`` is called once
    and the thread ends. Nothing is reported after :meth:`stop`.
    """

    def __init__(
        self,
        client: LockClient,
        handle: Handle,
        ttl_ms: int,
        on_lost: Callable[[Handle], object] | None,
        *,
        granted_at: float,
    ) -> None:
        self._client = client
        self._handle = handle
        self._ttl_ms = ttl_ms
        self._on_lost = on_lost
        self._interval = ttl_ms / 3000
        self._deadline = granted_at + ttl_ms / 1000
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lockd-renew:{handle.key[:64]}", daemon=True
        )

    def start(self) -> None:
        """Start renewing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and wait (briefly) for the thread to end."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT)

    def _run(self) -> None:
        pause = self._interval
        while not self._stop.wait(pause):
            sent_at = time.monotonic()
            try:
                result = self._client._renew(self._handle, self._ttl_ms, give_up_at=self._deadline)
            except Exception as exc:
                if self._stop.is_set():
                    return
                pause = min(self._interval, _MAX_RETRY_PAUSE)
                left = self._deadline - time.monotonic()
                log.warning(
                    "lockd: renewing %r failed (%s); %.3f s of lease left",
                    self._handle.key,
                    exc,
                    left,
                )
                if left <= pause:
                    self._lose()
                    return
                continue
            if self._stop.is_set():
                return
            if not result.renewed:
                self._lose()
                return
            self._deadline = sent_at + self._ttl_ms / 1000
            pause = self._interval

    def _lose(self) -> None:
        self._handle.lost = True
        log.warning("lockd: lease on %r lost", self._handle.key)
        if self._on_lost is not None:
            try:
                self._on_lost(self._handle)
            except Exception:
                log.exception("lockd: on_lost callback for %r raised", self._handle.key)


@contextmanager
def hold(
    client: LockClient,
    key: str,
    ttl: float,
    timeout: float,
    *,
    owner: str | None,
    auto_renew: bool,
    on_lost: Callable[[Handle], object] | None,
    release_on_close: bool,
) -> Iterator[Handle]:
    """Implementation of :meth:`LockClient.lock`."""
    ttl_ms = seconds_to_ms(ttl, "ttl", allow_zero=False)
    if on_lost is not None and not callable(on_lost):
        raise TypeError("on_lost must be callable or None")
    handle = client.acquire(key, ttl, timeout, owner=owner, release_on_close=release_on_close)
    renewer: AutoRenewer | None = None
    if auto_renew:
        renewer = AutoRenewer(client, handle, ttl_ms, on_lost, granted_at=time.monotonic())
        renewer.start()
    try:
        yield handle
    except BaseException:
        if renewer is not None:
            renewer.stop()
        try:
            client.release(handle)
        except Exception as exc:
            log.warning("lockd: releasing %r after an error failed: %s", key, exc)
        raise
    if renewer is not None:
        renewer.stop()
    client.release(handle)
