"""The etcd gateway client against a real 3-member etcd cluster (lockd/testing/etcd_cluster.py).

Each test writes under its own key prefix, so tests sharing the session's
cluster never see each other's keys. Tests that kill members start their own
cluster.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from lockd.daemon.backends.etcd.gateway import (
    EtcdError,
    EtcdGateway,
    EtcdUnavailable,
    GatewaySettings,
    LeaseNotFound,
    WatchCompacted,
)
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    DeleteResult,
    PutOp,
    PutResult,
    RangeOp,
    RangeResult,
    WatchRequest,
)
from lockd.testing.etcd_cluster import EtcdCluster, free_ports
from lockd.testing.polling import wait_for_trio

_prefixes = itertools.count()


async def succeeds(call: Awaitable[object]) -> bool:
    """``call`` went through; False when etcd was unavailable (try again)."""
    try:
        await call
    except EtcdUnavailable:
        return False
    return True


@pytest.fixture
def prefix() -> str:
    return f"/test-gateway/{time.monotonic_ns()}-{next(_prefixes)}/"


@pytest.fixture
async def etcd(etcd_cluster: EtcdCluster) -> AsyncIterator[EtcdGateway]:
    async with EtcdGateway(GatewaySettings(etcd_cluster.endpoints, timeout=5.0)) as gateway:
        yield gateway


async def test_put_range_delete_with_prefix_sort_limit_and_count(
    etcd: EtcdGateway, prefix: str
) -> None:
    # Created in the order c, a, b: key order and create order differ.
    revisions = {}
    for name in ("c", "a", "b"):
        revisions[name] = (await etcd.put(prefix + name, name.upper())).header.revision
    await etcd.put(prefix.rstrip("/") + "-outside", "x")

    by_key = await etcd.range(RangeOp(prefix, prefix=True))
    assert [kv.key for kv in by_key.kvs] == [f"{prefix}{n}".encode() for n in "abc"]
    assert [kv.value for kv in by_key.kvs] == [b"A", b"B", b"C"]
    assert by_key.count == 3 and not by_key.more

    first_two = await etcd.range(
        RangeOp(prefix, prefix=True, sort_target="create_revision", limit=2)
    )
    assert [kv.key[-1:] for kv in first_two.kvs] == [b"c", b"a"]
    assert [kv.create_revision for kv in first_two.kvs] == [revisions["c"], revisions["a"]]
    assert first_two.count == 3 and first_two.more

    newest_first = await etcd.range(
        RangeOp(prefix, prefix=True, sort_target="create_revision", sort_order="descend")
    )
    assert [kv.key[-1:] for kv in newest_first.kvs] == [b"b", b"a", b"c"]

    counted = await etcd.range(RangeOp(prefix, prefix=True, count_only=True))
    assert counted.count == 3 and counted.kvs == []

    # A read at an old revision sees the store as it was then.
    then = await etcd.range(RangeOp(prefix, prefix=True, revision=revisions["a"]))
    assert sorted(kv.key[-1:] for kv in then.kvs) == [b"a", b"c"]

    deleted = await etcd.delete(DeleteOp(prefix, prefix=True, prev_kv=True))
    assert deleted.deleted == 3
    assert sorted(kv.value for kv in deleted.prev_kvs) == [b"A", b"B", b"C"]
    assert (await etcd.range(RangeOp(prefix, prefix=True))).kvs == []
    assert (await etcd.get(prefix.rstrip("/") + "-outside")).kvs[0].value == b"x"


async def test_binary_keys_and_values_survive_base64(etcd: EtcdGateway, prefix: str) -> None:
    key = prefix.encode() + bytes(range(256))
    value = bytes(range(255, -1, -1)) + "ü".encode()
    await etcd.put(key, value)
    [kv] = (await etcd.get(key)).kvs
    assert (kv.key, kv.value, kv.version) == (key, value, 1)


async def test_txn_guarded_by_revision_loses_when_the_key_moved(
    etcd: EtcdGateway, prefix: str
) -> None:
    key = prefix + "k"
    created = await etcd.put(key, "v1")
    seen = created.header.revision

    # Absent-key guard: fails (the key exists) and runs the failure branch.
    create = await etcd.txn(
        [Compare(key, "create_revision", "==", 0)],
        success=[PutOp(key, "other")],
        failure=[RangeOp(key)],
    )
    assert not create.succeeded
    [current] = create.responses
    assert isinstance(current, RangeResult) and current.kvs[0].value == b"v1"

    # Someone else moves the key after we read it...
    moved = await etcd.put(key, "v2")
    assert moved.header.revision > seen

    # ... so a decision guarded by the revision we read must lose.
    stale = await etcd.txn([Compare(key, "mod_revision", "==", seen)], [PutOp(key, "mine")])
    assert not stale.succeeded
    assert (await etcd.get(key)).kvs[0].value == b"v2"

    fresh = await etcd.txn(
        [
            Compare(key, "mod_revision", "==", moved.header.revision),
            Compare(key, "value", "==", "v2"),
        ],
        success=[PutOp(key, "mine"), DeleteOp(prefix + "absent")],
    )
    assert fresh.succeeded
    assert fresh.header.revision == moved.header.revision + 1
    put, delete = fresh.responses
    assert isinstance(put, PutResult)
    assert isinstance(delete, DeleteResult) and delete.deleted == 0
    [kv] = (await etcd.get(key)).kvs
    assert (kv.value, kv.mod_revision, kv.version) == (b"mine", fresh.header.revision, 3)

    version_guard = await etcd.txn([Compare(key, "version", ">", 3)], [DeleteOp(key)])
    assert not version_guard.succeeded


async def test_a_range_compare_guards_a_whole_directory(etcd: EtcdGateway, prefix: str) -> None:
    empty = Compare(prefix, "create_revision", "==", 0, prefix=True)
    first = await etcd.txn([empty], [PutOp(prefix + "a", "1")], [RangeOp(prefix, prefix=True)])
    assert first.succeeded
    again = await etcd.txn([empty], [PutOp(prefix + "b", "1")], [RangeOp(prefix, prefix=True)])
    assert not again.succeeded
    [current] = again.responses
    assert isinstance(current, RangeResult) and [kv.key for kv in current.kvs] == [
        (prefix + "a").encode()
    ]

    # "Nothing under the prefix written after the revision I read."
    seen = first.header.revision
    unchanged = Compare(prefix, "mod_revision", "<", seen + 1, prefix=True)
    assert (await etcd.txn([unchanged])).succeeded
    await etcd.put(prefix + "b", "2")
    assert not (await etcd.txn([unchanged])).succeeded
    await etcd.delete(DeleteOp(prefix + "b"))
    assert (await etcd.txn([unchanged])).succeeded  # a deletion leaves nothing to compare


async def test_txn_compares_on_lease(etcd: EtcdGateway, prefix: str) -> None:
    lease = await etcd.lease_grant(10)
    key = prefix + "leased"
    await etcd.put(key, "v", lease=lease.id)
    held = await etcd.txn([Compare(key, "lease", "==", lease.id)], [DeleteOp(key)])
    assert held.succeeded
    await etcd.lease_revoke(lease.id)


async def test_watch_sees_a_put_at_once(etcd: EtcdGateway, prefix: str) -> None:
    async with etcd.watch(WatchRequest(prefix, prefix=True)) as watch:
        created = await watch.__anext__()
        assert created.created and created.events == []
        started = time.monotonic()
        put = await etcd.put(prefix + "w", "1")
        with trio.fail_after(5):
            response = await watch.__anext__()
        latency_ms = (time.monotonic() - started) * 1000
        [event] = response.events
        assert event.type == "PUT"
        assert (event.kv.key, event.kv.mod_revision) == (
            (prefix + "w").encode(),
            put.header.revision,
        )
        assert watch.next_revision == put.header.revision + 1
    # The bound is loose on purpose (a shared, loaded machine); the point is
    # "pushed, not polled": milliseconds, where a poll would take its period.
    assert latency_ms < 1000, latency_ms


async def test_watch_from_a_revision_replays_history_with_prev_kv(
    etcd: EtcdGateway, prefix: str
) -> None:
    key = prefix + "h"
    first = await etcd.put(key, "1")
    await etcd.put(key, "2")
    await etcd.delete(DeleteOp(key))
    request = WatchRequest(key, start_revision=first.header.revision, prev_kv=True)
    events = []
    async with etcd.watch(request) as watch:
        with trio.fail_after(5):
            async for response in watch:
                events.extend(response.events)
                if len(events) >= 3:
                    break
    assert [e.type for e in events] == ["PUT", "PUT", "DELETE"]
    assert [e.kv.value for e in events[:2]] == [b"1", b"2"]
    assert events[2].prev_kv is not None and events[2].prev_kv.value == b"2"


async def test_watch_below_the_compacted_revision_raises(etcd: EtcdGateway, prefix: str) -> None:
    key = prefix + "c"
    old = await etcd.put(key, "1")
    newer = await etcd.put(key, "2")
    await etcd.call("/v3/kv/compaction", {"revision": str(newer.header.revision)}, idempotent=True)
    async with etcd.watch(WatchRequest(key, start_revision=old.header.revision)) as watch:
        with pytest.raises(WatchCompacted) as caught, trio.fail_after(5):
            async for response in watch:  # "created" first, then the refusal
                assert response.events == []
    assert caught.value.compact_revision == newer.header.revision


async def test_keepalive_keeps_a_lease_alive_and_revoke_ends_it(
    etcd: EtcdGateway, prefix: str
) -> None:
    lease = await etcd.lease_grant(1)
    assert lease.ttl == 2  # etcd 3.4's minimum TTL
    key = prefix + "session"
    await etcd.put(key, "alive", lease=lease.id)

    # Kept alive for 1.5 times the TTL: without the keepalives the key would be gone.
    # These sleeps stay: a real cluster's lease outliving its TTL is what is tested,
    # and etcd's time cannot be moved.
    for _ in range(6):
        await trio.sleep(0.5)
        assert await etcd.lease_keepalive(lease.id) == 2
    assert (await etcd.get(key)).kvs[0].lease == lease.id
    alive = await etcd.lease_time_to_live(lease.id, keys=True)
    assert alive.granted_ttl == 2 and 0 < alive.ttl <= 2 and alive.keys == [key.encode()]

    await etcd.lease_revoke(lease.id)
    assert (await etcd.get(key)).kvs == []
    assert (await etcd.lease_time_to_live(lease.id)).ttl == -1
    with pytest.raises(LeaseNotFound):
        await etcd.lease_keepalive(lease.id)
    with pytest.raises(LeaseNotFound):
        await etcd.lease_revoke(lease.id)
    with pytest.raises(EtcdError):  # a key on a lease that is gone is refused
        await etcd.put(key, "x", lease=lease.id)


async def test_unreachable_endpoints_raise_unavailable_within_the_timeout(
    etcd_cluster: EtcdCluster,
) -> None:
    dead = [f"http://127.0.0.1:{port}" for port in free_ports(2)]
    async with EtcdGateway(GatewaySettings(dead, timeout=0.5)) as gateway:
        started = trio.current_time()
        with pytest.raises(EtcdUnavailable) as caught:
            await gateway.get("k")
        assert trio.current_time() - started < 3
        assert "cannot connect" in str(caught.value)
        assert not caught.value.maybe_committed  # never connected: nothing was sent
    # A dead endpoint first in the list is skipped.
    endpoints = [*dead, *etcd_cluster.endpoints]
    async with EtcdGateway(GatewaySettings(endpoints, timeout=5)) as gateway:
        assert "version" in await gateway.status()
        assert gateway.endpoint in etcd_cluster.endpoints


async def test_leader_killed_mid_stream_fails_over_without_losing_events(
    new_etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    cluster = new_etcd_cluster()
    leader = cluster.leader()
    # The leader first: the watch and the first requests go to it.
    endpoints = [leader.client_url, *(m.client_url for m in cluster.members if m is not leader)]
    async with EtcdGateway(GatewaySettings(endpoints, timeout=10)) as etcd:
        before = await etcd.put("/failover/k", "before")
        async with etcd.watch(WatchRequest("/failover/", prefix=True)) as watch:
            assert (await watch.__anext__()).created
            assert etcd.endpoint == leader.client_url
            cluster.kill(leader)
            # The client saw the leader's endpoint refuse, so it holds the
            # write back until a follower has elected a new leader, instead
            # of sending it to a member that would forward it to the dead one
            # (held ~7 s, outcome unknown).
            with trio.fail_after(30):
                result = await etcd.put("/failover/k", "after")
            assert etcd.endpoint != leader.client_url
            [kv] = (await etcd.get("/failover/k")).kvs
            assert (kv.value, kv.version) == (b"after", 2)
            assert kv.mod_revision > before.header.revision
            assert result.header.revision == kv.mod_revision
            with trio.fail_after(10):
                response = await watch.__anext__()
            # The watch resumed elsewhere from the revision it had reached:
            # the write made while it had no member is delivered, once.
            [event] = response.events
            assert (event.kv.value, event.kv.mod_revision) == (b"after", kv.mod_revision)
            assert watch.next_revision == kv.mod_revision + 1


async def test_quorum_loss_raises_unavailable_within_the_timeout_then_recovers(
    new_etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    cluster = new_etcd_cluster()
    timeout = 2.0
    async with EtcdGateway(GatewaySettings(cluster.endpoints, timeout=timeout)) as etcd:
        await etcd.put("/quorum/k", "1")
        # One follower is left: it has no quorum, whatever it believes.
        survivor = cluster.followers()[0]
        for member in cluster.members:
            if member is not survivor:
                cluster.kill(member)

        for attempt in (etcd.get("/quorum/k"), etcd.put("/quorum/k", "2")):
            started = trio.current_time()
            with pytest.raises(EtcdUnavailable):
                await attempt
            # The bound holds whatever the member does (a member that still
            # believes in its old leader holds a request up to 7 s).
            assert trio.current_time() - started < timeout + 1.0

        for member in cluster.members:
            if not member.running:
                cluster.restart(member, wait=False)
        cluster.wait_healthy()
        # Only a hang fails here: on a loaded 2-core box the members' first
        # election after the restart has taken more than 15 s.
        await wait_for_trio(lambda: succeeds(etcd.put("/quorum/k", "3")), 60, interval=0.1)
        assert (await etcd.get("/quorum/k")).kvs[0].value == b"3"


async def test_a_member_seen_down_that_comes_back_as_leader_takes_writes(
    new_etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    """A killed member restarts and wins an election before this client saw another leader.

    Writes go through it. (They were refused as "follows a member that is
    down" for as long as it led: the quorum-loss test's 60 s hang under
    load, when a restarted member won the first election.)
    """
    cluster = new_etcd_cluster()
    first = cluster.leader()
    others = [m for m in cluster.members if m is not first]
    endpoints = [first.client_url, *(m.client_url for m in others)]
    async with EtcdGateway(GatewaySettings(endpoints, timeout=3.0)) as etcd:
        await etcd.put("/back/k", "1")  # through the leader: its member id is known
        cluster.kill(first)
        # A read finds the member gone and moves on (reads never ask for the leader).
        await wait_for_trio(lambda: succeeds(etcd.get("/back/k")), 30, interval=0.1)
        cluster.restart(first)
        status = first.status()
        assert status is not None
        header = status["header"]
        assert isinstance(header, dict)
        target = {"targetID": str(header["member_id"])}

        def leads_after_a_transfer() -> bool:
            """The member leading now hands the lead to it (a new term)."""
            leader = cluster.leader()
            if leader is first:
                return True
            leader.post("/v3/maintenance/transfer-leadership", target, timeout=5.0)
            return False

        await wait_for_trio(leads_after_a_transfer, 30, "the lead handed back", interval=0.2)
        with trio.fail_after(20):
            await etcd.put("/back/k", "2")
        assert (await etcd.get("/back/k")).kvs[0].value == b"2"


async def test_tls_with_client_certificates_and_auth(
    new_etcd_cluster: Callable[..., EtcdCluster], tmp_path: Path
) -> None:
    cluster = new_etcd_cluster(1, tls=True)
    tls = cluster.tls
    assert tls is not None
    cluster.enable_auth("s3cret")
    password_file = tmp_path / "etcd-password"
    password_file.write_text("s3cret\n")
    settings = GatewaySettings(
        cluster.endpoints,
        timeout=5,
        ca_file=tls.ca,
        cert_file=tls.client_cert,
        key_file=tls.client_key,
        username="root",
        password_file=password_file,
    )
    async with EtcdGateway(settings) as etcd:
        await etcd.put("/tls/k", "v")
        assert (await etcd.get("/tls/k")).kvs[0].value == b"v"

    # Without a client certificate the TLS handshake is refused: unreachable.
    no_cert = replace(settings, timeout=1, cert_file=None, key_file=None)
    async with EtcdGateway(no_cert) as etcd:
        with pytest.raises(EtcdUnavailable):
            await etcd.get("/tls/k")

    # Without credentials, or with a wrong password, etcd refuses (not "unavailable").
    password_file.write_text("wrong\n")
    async with EtcdGateway(settings) as etcd:
        with pytest.raises(EtcdError, match="authentication failed"):
            await etcd.get("/tls/k")
    anonymous = replace(settings, username=None, password_file=None)
    async with EtcdGateway(anonymous) as etcd:
        with pytest.raises(EtcdError):
            await etcd.get("/tls/k")


def test_settings_refuse_incomplete_tls_and_auth(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="endpoints"):
        GatewaySettings([])
    with pytest.raises(ValueError, match="etcd_timeout"):
        GatewaySettings(["http://127.0.0.1:2379"], timeout=0)
    with pytest.raises(ValueError, match="cert_file and key_file"):
        GatewaySettings(["http://127.0.0.1:2379"], cert_file=tmp_path / "c.pem")
    with pytest.raises(ValueError, match="username and password_file"):
        GatewaySettings(["http://127.0.0.1:2379"], username="root")
