"""The ``async with client.lock(...)`` block of the asyncio and trio clients.

:func:`hold` takes the key, renews it in a background task (:func:`keep`),
cancels the block when the daemon says the hold is gone, and releases it on
the way out, as :meth:`lockd_client.LockClient.lock` does for the blocking
client (:mod:`lockd_client._lock`).
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ._errors import LockdError, LockLostError
from ._events import Loss
from ._lock import call_on_lost, check_released, granted_ttl_ms, lease_end
from ._results import Handle
from ._wire import seconds_to_ms

if TYPE_CHECKING:
    from ._async import AsyncClientBase

__all__ = ["hold", "keep"]

log = logging.getLogger("lockd_client")

#: at most this long before the lease's end, the loss is declared (a tenth of the TTL below)
_MAX_MARGIN = 2.0
_MAX_RETRY_PAUSE = 1.0


@asynccontextmanager
async def hold(
    client: AsyncClientBase[Any],
    key: str,
    ttl: float,
    timeout: float | None,
    owner: str | None,
    auto_renew: bool,
    on_lost: Callable[[Handle], object] | None,
    release_on_close: bool,
    shared: bool,
    limit: int,
) -> AsyncIterator[Handle]:
    """The block of ``client.lock(...)``: see :meth:`AsyncClientBase.lock`."""
    ttl_ms = seconds_to_ms(ttl, "ttl", allow_zero=False)
    client._events_wanted = True  # every connection from now on asks for events
    if client._pipe is not None and not client._pipe.dead:
        client._pipe.ask_events()
    handle = await client.acquire(
        key, ttl, timeout, owner, release_on_close, shared=shared, limit=limit
    )
    lost: list[str] = []
    told: list[Loss] = []
    stop: Callable[[], Awaitable[None]] | None = None
    guard = client._block_guard()
    pipe = client._pipe
    if auto_renew:
        stop = client._background(lambda: keep(client, handle, ttl_ms, on_lost, lost))
    if pipe is not None and pipe.events_asked:

        def on_loss(loss: Loss) -> None:
            # The daemon says the hold is gone: the block is cancelled
            # now, and ends in LockLostError with the daemon's reason.
            if told:
                return
            told.append(loss)
            if not handle.lost:
                _lose(handle, on_lost, lost, loss.describe())
            guard.cancel()

        pipe.loss_listeners[handle.handle] = on_loss
        early = pipe.losses.get(handle.handle)  # told before the reply was read
        if early is not None:
            on_loss(early)
    failure: BaseException | None = None
    try:
        with guard:
            yield handle
    except BaseException as exc:
        failure = exc
    if pipe is not None:
        pipe.loss_listeners.pop(handle.handle, None)
    if failure is not None and not (guard.fired and await guard.absorb(failure)):
        with client._cleanup_scope():  # also when the block was cancelled
            if stop is not None:
                await stop()
            try:
                await client.release(handle)
            except Exception as exc:
                log.warning("lockd: releasing %r after an error failed: %s", key, exc)
        raise failure
    if guard.fired and failure is None:
        await guard.absorb(None)
    if stop is not None:
        await stop()
    if lost:
        try:
            await client.release(handle)
        except LockdError as exc:
            log.warning("lockd: releasing %r after losing it failed: %s", key, exc)
        cause = told[0].cause if told else None
        raise LockLostError(handle.key, handle.fence, lost[0], cause=cause) from None
    if told:  # lost without a renewer: the daemon's word
        await _release_quietly(client, handle)
        raise LockLostError(
            handle.key, handle.fence, told[0].describe(), cause=told[0].cause
        ) from None
    check_released(await client.release(handle), handle, on_lost)


async def keep(
    client: AsyncClientBase[Any],
    handle: Handle,
    ttl_ms: int,
    on_lost: Callable[[Handle], object] | None,
    lost: builtins.list[str],
) -> None:
    """Renew every ttl/3 until stopped; declare the loss before the lease ends.

    The TTL that paces it is the grant's (an etcd daemon's is whole
    seconds, at least 2), as in the blocking client's ``AutoRenewer``.
    """
    lease_ms = granted_ttl_ms(handle, ttl_ms)
    interval = lease_ms / 3000
    margin = min(lease_ms / 10_000, _MAX_MARGIN)
    deadline = lease_end(handle, time.monotonic(), lease_ms)
    pause = min(interval, max(0.0, deadline - margin - time.monotonic()) / 2)
    while True:
        await client._sleep(pause)
        sent_at = time.monotonic()
        try:
            result = await client.renew(handle, ttl_ms / 1000)
        except LockdError as exc:
            left = deadline - margin - time.monotonic()
            pause = min(interval, _MAX_RETRY_PAUSE)
            log.warning("lockd: renewing %r failed (%s)", handle.key, exc)
            if left <= pause:
                reason = f"renewals failed until the lease was about to run out ({exc})"
                _lose(handle, on_lost, lost, reason)
                return
            continue
        if not result.renewed:
            reason = f"renew answered {result.reason or 'renewed: false'}"
            _lose(handle, on_lost, lost, reason)
            return
        deadline = sent_at + lease_ms / 1000
        pause = interval


async def _release_quietly(client: AsyncClientBase[Any], handle: Handle) -> None:
    try:
        await client.release(handle)
    except LockdError as exc:
        log.warning("lockd: releasing %r after losing it failed: %s", handle.key, exc)


def _lose(
    handle: Handle,
    on_lost: Callable[[Handle], object] | None,
    lost: list[str],
    reason: str,
) -> None:
    lost.append(reason)
    handle.lost = True
    if on_lost is None:  # a caller that passed on_lost handles it: no noise
        log.warning("lockd: lease on %r lost: %s", handle.key, reason)
    else:
        call_on_lost(on_lost, handle)
