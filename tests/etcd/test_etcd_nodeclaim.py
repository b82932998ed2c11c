"""One daemon per node name (lockd/daemon/backends/etcd/nodeclaim.py).

The claim itself against the session's real cluster, in process: a holder
provably gone is taken over at once, one on another host is waited out
until its lease ends, one whose lease is kept alive refuses. The daemons'
side (a second daemon refused, a restart after ``kill -9``) is in
tests/etcd/test_etcd_hosts.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import trio

from lockd.daemon.backends.etcd.gateway import EtcdGateway, GatewaySettings
from lockd.daemon.backends.etcd.nodeclaim import (
    Claimant,
    NodeTaken,
    claim_node,
    process_start,
    provably_gone,
)
from lockd.daemon.backends.etcd.wire import PutOp
from lockd.testing.etcd_cluster import EtcdCluster

ME = Claimant.this_process()
ELSEWHERE = Claimant("far", "another-boot", "pid:[1]", 7, 1, 0)


@pytest.fixture
async def etcd(etcd_cluster: EtcdCluster) -> AsyncIterator[EtcdGateway]:
    async with EtcdGateway(GatewaySettings(etcd_cluster.endpoints)) as gateway:
        yield gateway


def node_key(name: str) -> bytes:
    return f"/test-nodeclaim/{time.monotonic_ns()}/n/{name}".encode()


async def held_by(etcd: EtcdGateway, key: bytes, holder: Claimant, ttl: int) -> int:
    """Put a claim of ``holder`` on a new lease of ``ttl`` s; the lease."""
    lease = (await etcd.lease_grant(ttl)).id
    await etcd.txn([], [PutOp(key, holder.value(), lease=lease)])
    return lease


async def our_claim(etcd: EtcdGateway, key: bytes) -> Claimant | None:
    found = (await etcd.get(key)).kvs
    return Claimant.parse(found[0].value) if found else None


def test_process_start_tells_a_live_process_from_a_gone_one() -> None:
    assert process_start(os.getpid()) == ME.start > 0
    assert process_start(2**22 + 17) is None  # above any pid_max: no such process


def test_only_a_holder_of_this_boot_and_pid_namespace_can_be_proven_gone() -> None:
    assert provably_gone(ME, ME)  # this very process: an earlier session of it
    assert not provably_gone(replace(ME, pid=1, start=process_start(1) or 0), ME)  # alive
    assert provably_gone(replace(ME, pid=1, start=-5), ME)  # pid 1 reused: not the holder
    assert provably_gone(replace(ME, pid=2**22 + 17), ME)  # gone
    assert not provably_gone(replace(ME, pid=2**22 + 17, boot="other"), ME)  # another boot
    assert not provably_gone(replace(ME, pid=2**22 + 17, pidns="pid:[9]"), ME)  # a container
    assert not provably_gone(replace(ME, pid=2**22 + 17, boot=""), ME)  # nothing to compare


def test_a_claim_reads_back_and_anything_else_is_no_claimant() -> None:
    assert Claimant.parse(ME.value()) == ME
    assert Claimant.parse(b"not json") is None
    assert Claimant.parse(b'{"host": "h"}') is None


async def test_a_free_name_is_claimed_on_the_lease(etcd: EtcdGateway) -> None:
    key = node_key("free")
    lease = (await etcd.lease_grant(5)).id
    await claim_node(etcd, key, "free", lease)
    assert (await etcd.get(key)).kvs[0].lease == lease
    await claim_node(etcd, key, "free", lease)  # ours already: nothing to do
    claim = await our_claim(etcd, key)
    assert claim is not None and replace(claim, since=0) == replace(ME, since=0)


async def test_a_holder_provably_gone_is_taken_over_at_once(etcd: EtcdGateway) -> None:
    """A daemon of this host killed with -9: its session is revoked, its keys go now."""
    key = node_key("phoenix")
    dead = replace(ME, pid=2**22 + 17)
    old = await held_by(etcd, key, dead, ttl=30)
    lease = (await etcd.lease_grant(5)).id
    with trio.fail_after(5):  # well within the old lease's 30 s
        await claim_node(etcd, key, "phoenix", lease)
    assert (await etcd.get(key)).kvs[0].lease == lease
    assert (await etcd.lease_time_to_live(old)).ttl == -1  # revoked


async def test_a_holder_on_another_host_is_waited_out(etcd: EtcdGateway) -> None:
    """No proof either way: the lease of a daemon that died elsewhere runs out by itself."""
    key = node_key("moved")
    await held_by(etcd, key, ELSEWHERE, ttl=2)
    lease = (await etcd.lease_grant(5)).id
    started = trio.current_time()
    with trio.fail_after(15):
        await claim_node(etcd, key, "moved", lease)
    assert trio.current_time() - started >= 0.5  # it did wait for the old lease
    assert (await etcd.get(key)).kvs[0].lease == lease


async def test_a_holder_whose_lease_is_kept_alive_refuses_the_claim(etcd: EtcdGateway) -> None:
    key = node_key("busy")
    old = await held_by(etcd, key, ELSEWHERE, ttl=3)
    lease = (await etcd.lease_grant(5)).id

    async def keep_alive() -> None:
        while True:
            await trio.sleep(0.3)  # the other holder's keeper, at its own pace
            await etcd.lease_keepalive(old)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_alive)
        with pytest.raises(NodeTaken, match=r"backend.node 'busy' is in use by another lockd"):
            await claim_node(etcd, key, "busy", lease)
        nursery.cancel_scope.cancel()
    assert (await etcd.get(key)).kvs[0].lease == old  # untouched
