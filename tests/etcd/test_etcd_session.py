"""The daemon's etcd session lease (lockd/daemon/backends/etcd/session.py) on a real cluster."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator

import pytest
import trio

from lockd.daemon.backends.etcd.gateway import EtcdGateway, GatewaySettings
from lockd.daemon.backends.etcd.session import Session
from lockd.testing.etcd_cluster import EtcdCluster
from lockd.testing.polling import wait_for_trio

_names = itertools.count()


@pytest.fixture
async def etcd(etcd_cluster: EtcdCluster) -> AsyncIterator[EtcdGateway]:
    async with EtcdGateway(GatewaySettings(etcd_cluster.endpoints, timeout=5.0)) as gateway:
        yield gateway


def waiter_key() -> str:
    return f"/test-session/{time.monotonic_ns()}-{next(_names)}"


async def test_keeps_its_lease_alive_past_the_ttl(etcd: EtcdGateway) -> None:
    session = Session(etcd, ttl=2)
    key = waiter_key()
    async with trio.open_nursery() as nursery:
        await nursery.start(session.run)
        assert session.ttl == 2 and session.lease_id
        await etcd.put(key, "waiter", lease=session.lease_id)
        # Four keepalives, one every third of the TTL: past the TTL (by 1.33 times), so
        # the key lives only through them.
        await wait_for_trio(lambda: session.keepalives >= 4, 20, "four keepalives")
        assert (await etcd.get(key)).kvs[0].lease == session.lease_id
        assert not session.lost.is_set()
        await session.close()
        nursery.cancel_scope.cancel()
    assert (await etcd.get(key)).kvs == []  # revoked: its keys went with it


async def test_a_revoked_lease_is_reported_lost(etcd: EtcdGateway) -> None:
    session = Session(etcd, ttl=2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(session.run)
            await etcd.lease_revoke(session.lease_id)  # e.g. an operator, or expiry in an outage
            await session.lost.wait()
    # run returned by itself: the nursery closed without a cancel.


async def test_a_dead_daemons_session_keys_go_within_the_ttl(etcd: EtcdGateway) -> None:
    session = Session(etcd, ttl=2)
    key = waiter_key()
    async with trio.open_nursery() as nursery:
        await nursery.start(session.run)
        await etcd.put(key, "waiter", lease=session.lease_id)
        nursery.cancel_scope.cancel()  # the keeper stops, as when the host dies
    stopped = trio.current_time()

    async def gone() -> bool:
        return not (await etcd.get(key)).kvs

    await wait_for_trio(gone, 10, "the key's end", interval=0.1)  # docs/contract.md: within 10 s
    assert trio.current_time() - stopped >= 0.5  # it lived on until the lease ran out


async def test_the_ttl_stays_within_etcds_minimum_and_the_specs_bound() -> None:
    async with EtcdGateway(GatewaySettings(["http://127.0.0.1:1"])) as gateway:
        for ttl in (1, 11):
            with pytest.raises(ValueError, match="2-10 s"):
                Session(gateway, ttl=ttl)
