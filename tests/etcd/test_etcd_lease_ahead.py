"""A kept lease that comes back ageing is refreshed in the background (docs/etcd-design.md §3a).

So the grant that takes it next (a hand-off to another daemon's waiter
waits for a stale lease's keepalive before its transaction) finds it fresh.
"""

from __future__ import annotations

import pytest

from lockd.daemon.backends.etcd.leases import HEADROOM_S
from lockd.testing.clock import SkippedClock
from tests.etcd.test_etcd_backend import (
    Backends,
    acquired,
    backends,
    count_keepalives,
    request,
    until,
)

__all__ = ["backends"]  # the fixture these tests use


async def test_an_ageing_lease_given_back_is_refreshed_before_its_next_grant(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SkippedClock()
    backend = await backends(clock=clock)
    sent = count_keepalives(backend, monkeypatch)
    first = await acquired(backend, request("a", ttl_ms=3000))
    # Past half its headroom: still fresh, but not for much longer.
    clock.skip(HEADROOM_S * 700)
    assert await backend.release("a", first.handle)
    await until(lambda: sent == [first.lease] and not backend.supply._refreshing)
    # Once more as long: without that keepalive the lease would be stale now,
    # and the grant would wait for one of its own.
    clock.skip(HEADROOM_S * 700)
    again = await acquired(backend, request("a", ttl_ms=3000))
    assert again.lease == first.lease and sent == [first.lease]
    assert again.expires_at >= first.expires_at + HEADROOM_S * 1400
    assert await backend.release("a", again.handle)


async def test_a_fresh_lease_given_back_is_not_refreshed(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = await backends()
    sent = count_keepalives(backend, monkeypatch)
    # A long TTL: the lease is granted with a whole headroom, so a loaded
    # machine has HEADROOM_S / 2 to get from its grant to its release.
    first = await acquired(backend, request("b", ttl_ms=600_000))
    assert await backend.release("b", first.handle)
    again = await acquired(backend, request("b", ttl_ms=600_000))
    assert again.lease == first.lease and sent == []
    assert await backend.release("b", again.handle)
