"""``LockClient.lock()``: hold a key for a ``with`` block, optionally renewing it.

The renewer itself is :mod:`lockd_client._renewer` (``lockd run`` uses it
without this module's contextlib); its names are re-exported here.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

try:  # the C datetime, as in _results (issue 24)
    from _datetime import UTC, datetime
except ImportError:
    from datetime import UTC, datetime

from ._errors import LockdError, LockLostError
from ._renewer import AutoRenewer, call_on_lost, granted_ttl_ms, log
from ._results import Handle, ReleaseResult
from ._wire import seconds_to_ms

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from ._client import LockClient

__all__ = [
    "AutoRenewer",
    "call_on_lost",
    "check_released",
    "granted_ttl_ms",
    "hold",
    "lease_end",
    "log",
]


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
