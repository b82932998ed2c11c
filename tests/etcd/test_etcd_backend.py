"""The etcd backend (lockd/daemon/backends/etcd/backend.py) on a real 3-member cluster.

In process: two ``EtcdBackend`` objects with different node names stand for
two hosts sharing one prefix. Daemon-level and failure tests live in the
cross-host test files; these pin the backend's own decisions.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import trio

from lockd.config import BackendSettings
from lockd.daemon.backends.etcd import backend as backend_module
from lockd.daemon.backends.etcd.backend import EtcdBackend, lease_seconds
from lockd.daemon.backends.etcd.gateway import EtcdGateway, EtcdUnavailable, GatewaySettings
from lockd.daemon.backends.etcd.leases import HEADROOM_S, KeptLease
from lockd.daemon.backends.etcd.records import Directory, Hold, Layout, Waiter
from lockd.daemon.backends.etcd.session import Session
from lockd.daemon.backends.etcd.wire import RangeOp
from lockd.daemon.clock import Clock, SystemClock
from lockd.daemon.holds import Refused
from lockd.daemon.protocol import Acquire
from lockd.identity import Caller
from lockd.testing.clock import SkippedClock
from lockd.testing.etcd_cluster import EtcdCluster
from lockd.testing.polling import AsyncPredicate, wait_for_trio

_ids = itertools.count()

ALICE = Caller("user", "alice", "member", 1000, 1000, 4242, frozenset(), "job")
BOB = Caller("user", "bob", "member", 1001, 1001, 4343, frozenset(), "other")

Backends = Callable[..., Awaitable[EtcdBackend]]


def request(
    key: str,
    *,
    ttl_ms: int = 30_000,
    timeout_ms: int | None = None,
    owner: str | None = None,
    bound: bool = False,
    mode: str = "exclusive",
    limit: int = 1,
) -> Acquire:
    op = "tryAcquire" if timeout_ms is None else "acquire"
    return Acquire(next(_ids), op, key, ttl_ms, timeout_ms, owner, bound, mode, limit)


@pytest.fixture
async def backends(etcd_cluster: EtcdCluster) -> AsyncIterator[Backends]:
    """``await backends(node)``: a running backend on this test's own prefix."""
    prefix = f"/test-backend/{time.monotonic_ns()}/"
    async with trio.open_nursery() as nursery:

        async def start(
            node: str = "n1",
            timeout: float = 5.0,
            endpoints: list[str] | None = None,
            session_ttl: int = 2,
            clock: Clock | None = None,
        ) -> EtcdBackend:
            settings = BackendSettings(
                kind="etcd",
                endpoints=tuple(endpoints or etcd_cluster.endpoints),
                prefix=prefix,
                node=node,
                etcd_timeout=timeout,
                session_ttl=session_ttl,
            )
            gateway = EtcdGateway(GatewaySettings(settings.endpoints, timeout=timeout))
            backend = EtcdBackend(gateway, settings, clock or SystemClock())
            await nursery.start(backend.run)
            return backend

        yield start
        nursery.cancel_scope.cancel()


async def acquired(
    backend: EtcdBackend, req: Acquire, caller: Caller = ALICE, conn: int = 1
) -> Hold:
    timeout = req.timeout_ms / 1000 if req.timeout_ms is not None else None
    outcome = await backend.acquire(req, caller, conn, timeout)
    assert isinstance(outcome, Hold), outcome
    return outcome


async def records(backend: EtcdBackend, key: str) -> list[bytes]:
    result = await backend.etcd.range(RangeOp(backend.layout.directory(key), prefix=True))
    return [kv.key for kv in result.kvs]


@asynccontextmanager
async def parked(
    backend: EtcdBackend, req: Acquire, caller: Caller, results: list[object]
) -> AsyncIterator[trio.CancelScope]:
    """A blocking acquire running in the background; its outcome lands in ``results``."""
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                assert req.timeout_ms is not None
                results.append(await backend.acquire(req, caller, 1, req.timeout_ms / 1000))

        before = len(await records(backend, req.key))
        nursery.start_soon(run)

        async def written() -> bool:
            return len(await records(backend, req.key)) > before

        await wait_for_trio(written, 10, "its waiter key written")
        yield scope


async def until(predicate: AsyncPredicate, timeout: float = 10.0) -> None:
    await wait_for_trio(predicate, timeout)


# ---------------------------------------------------------------- grants


@pytest.mark.parametrize(
    ("ttl_ms", "seconds"), [(1, 2), (1500, 2), (2000, 2), (2001, 3), (60_000, 60)]
)
def test_ttls_are_whole_seconds_at_least_etcds_minimum(ttl_ms: int, seconds: int) -> None:
    assert lease_seconds(ttl_ms) == seconds


async def test_try_acquire_grants_a_free_key_and_reports_the_effective_ttl(
    backends: Backends,
) -> None:
    backend = await backends("web-1")
    before = int(time.time() * 1000)
    hold = await acquired(backend, request("k", ttl_ms=1500))
    assert hold.ttl_ms == 2000 and hold.node == "web-1" and hold.pid == ALICE.pid
    # At least the TTL reported; its etcd lease has HEADROOM_S more.
    assert before + 2000 <= hold.expires_at <= int(time.time() * 1000) + 2000 + HEADROOM_S * 1000
    lease = await backend.etcd.lease_time_to_live(hold.lease)
    assert lease.granted_ttl == 2 + HEADROOM_S
    # The fence is the hold key's create revision.
    kv = (await backend.etcd.get(backend.layout.hold("k", hold.handle))).kvs[0]
    assert hold.fence == kv.create_revision
    assert await backend.acquire(request("k"), BOB, 2, None) is None  # busy
    status = await backend.status("k")
    assert [h.handle for h in status.holds] == [hold.handle] and status.waiters == 0
    assert await backend.release("k", hold.handle)
    assert not await backend.release("k", hold.handle)
    assert (await backend.status("k")).holds == []


async def test_fences_increase_across_hosts(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    fences = []
    for backend in (one, two, one, two):
        hold = await acquired(backend, request("f"))
        fences.append(hold.fence)
        assert await backend.release("f", hold.handle)
    assert fences == sorted(set(fences))


async def test_a_retake_from_another_host_fences_the_old_handle(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    old = await acquired(one, request("r", owner="run-1"))
    new = await acquired(two, request("r", owner="run-1"))
    assert new.fence > old.fence and new.handle != old.handle and new.node == "n2"
    assert await one.find("r", old.handle) is None  # renew answers lease_lost
    assert not await one.release("r", old.handle)
    assert await two.acquire(request("r", owner="run-2"), ALICE, 1, None) is None
    assert await two.acquire(request("r", owner="run-1"), BOB, 1, None) is None  # not the principal


async def test_refusals_name_the_field(backends: Backends) -> None:
    backend = await backends()
    await acquired(backend, request("s", limit=3))
    refused = await backend.acquire(request("s", limit=2), BOB, 1, None)
    assert isinstance(refused, Refused) and refused.field == "limit"
    assert refused.details == {"limit": 3}
    await acquired(backend, request("m", owner="o"))
    refused = await backend.acquire(request("m", owner="o", mode="shared"), ALICE, 1, None)
    assert isinstance(refused, Refused) and refused.field == "mode"


async def test_shared_holds_and_semaphores(backends: Backends) -> None:
    backend = await backends()
    a = await acquired(backend, request("sh", mode="shared"))
    b = await acquired(backend, request("sh", mode="shared"), BOB)
    assert a.fence < b.fence
    assert await backend.acquire(request("sh"), BOB, 1, None) is None
    assert len((await backend.status("sh")).holds) == 2
    await acquired(backend, request("sem", limit=2))
    await acquired(backend, request("sem", limit=2), BOB)
    assert await backend.acquire(request("sem", limit=2), BOB, 1, None) is None


# ---------------------------------------------------------------- renew


async def test_renew_keeps_the_fence_and_moves_the_expiry(backends: Backends) -> None:
    clock = SkippedClock()
    backend = await backends(clock=clock)
    hold = await acquired(backend, request("n", ttl_ms=2000))
    clock.skip(300)  # the renewal comes 0.3 s after the grant, as far as the backend knows
    found = await backend.find("n", hold.handle)
    assert found is not None
    same = await backend.renew(found, 2000)
    assert same is not None and same.fence == hold.fence and same.expires_at > hold.expires_at
    found = await backend.find("n", hold.handle)
    assert found is not None and found.expires_at == same.expires_at
    longer = await backend.renew(found, 10_000)
    assert longer is not None and longer.ttl_ms == 10_000 and longer.fence == hold.fence
    # The record now lives on the new lease: the first one's end cannot take it.
    assert longer.lease != hold.lease
    record = await backend.etcd.range(RangeOp(backend.layout.hold("n", hold.handle)))
    assert [kv.lease for kv in record.kvs] == [longer.lease]
    found = await backend.find("n", hold.handle)
    assert found is not None and found.lease == longer.lease


async def test_a_hold_ends_with_its_ttl(backends: Backends) -> None:
    backend = await backends()
    hold = await acquired(backend, request("e", ttl_ms=1))

    # The hold's lease has etcd's shortest TTL (2 s); etcd ends an expired lease a
    # moment later (its lessor looks every 500 ms and the revoke is a raft write):
    # over 3 s on a loaded box. Nothing else deletes the hold.
    async def gone() -> bool:
        return await backend.find("e", hold.handle) is None

    await wait_for_trio(gone, 15, "the hold's end", interval=0.1)
    assert (await backend.status("e")).holds == []


# ---------------------------------------------------------------- waiting


async def test_waiters_are_granted_in_order_across_hosts(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    holder = await acquired(one, request("q"))
    results: list[object] = []
    async with (
        parked(two, request("q", timeout_ms=20_000), BOB, results),
        parked(one, request("q", timeout_ms=20_000), ALICE, results),
    ):
        assert (await one.status("q")).waiters == 2
        assert await one.release("q", holder.handle)
        await until(lambda: len(results) == 1)
        first = results[0]
        assert isinstance(first, Hold) and first.principal == "user:bob" and first.node == "n2"
        assert await two.release("q", first.handle)
        await until(lambda: len(results) == 2)
    second = results[1]
    assert isinstance(second, Hold) and second.principal == "user:alice"
    assert second.fence > first.fence


async def test_a_deletion_wakes_only_the_waiters_it_concerns(backends: Backends) -> None:
    """A waiter waits for the holds blocking the head, or the waiter just before it.

    Other deletions in the key's directory (the holder's release while a
    waiter of another host is ahead, a waiter behind leaving) only update
    what the queue knows: no decision.
    """
    one, two = await backends("n1"), await backends("n2")
    holder = await acquired(one, request("wk"))
    results: list[object] = []
    async with (
        parked(two, request("wk", timeout_ms=20_000), BOB, results),
        parked(one, request("wk", timeout_ms=20_000), ALICE, results),
        parked(two, request("wk", timeout_ms=20_000), BOB, results) as last,
    ):
        mine = one._queues["wk"]

        def known() -> int:
            return len(mine.records) if mine.records is not None else -1

        await until(lambda: known() == 4 and mine.wake_keys is not None)
        decided = mine.decisions
        last.cancel()  # a waiter behind ours leaves
        await until(lambda: known() == 3)
        assert await one.release("wk", holder.handle)  # n2's waiter is the head
        await until(lambda: len(results) == 1)
        # n1's hand-off granted n2's waiter, deleting the waiter just before
        # ours: that woke it, once (n2 untying the delivered hold does not).
        await until(lambda: mine.decisions == decided + 1)
        first = results[0]
        assert isinstance(first, Hold) and first.node == "n2"
        # Once our view shows n2's untie (a rewrite of the hold's record), still one.
        hold_key = one.layout.hold("wk", first.handle)

        def untie_seen() -> bool:
            record = (mine.records or {}).get(hold_key)
            return record is not None and record.mod_revision > record.create_revision

        await until(untie_seen)
        assert mine.decisions == decided + 1
        assert await two.release("wk", first.handle)
        await until(lambda: len(results) == 2)
    assert isinstance(results[1], Hold) and results[1].node == "n1"


async def test_consecutive_shared_waiters_are_granted_together(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    writer = await acquired(one, request("rw"))
    results: list[object] = []
    async with (
        parked(one, request("rw", timeout_ms=20_000, mode="shared"), ALICE, results),
        parked(two, request("rw", timeout_ms=20_000, mode="shared"), BOB, results),
        parked(two, request("rw", timeout_ms=20_000), BOB, results),
    ):
        assert await one.release("rw", writer.handle)
        await until(lambda: len(results) == 2)
        assert all(isinstance(r, Hold) and r.mode == "shared" for r in results)
        assert (await one.status("rw")).waiters == 1  # the writer behind them waits
        for r in list(results):
            assert isinstance(r, Hold)
            assert await one.release("rw", r.handle)
        await until(lambda: len(results) == 3)
    assert isinstance(results[2], Hold) and results[2].mode == "exclusive"


async def test_a_waiter_that_times_out_leaves_the_queue(backends: Backends) -> None:
    backend = await backends()
    holder = await acquired(backend, request("t"))
    started = trio.current_time()
    assert await backend.acquire(request("t", timeout_ms=700), BOB, 1, 0.7) is None
    assert trio.current_time() - started >= 0.7
    await until_records(backend, "t", 1)
    assert await backend.release("t", holder.handle)


async def test_a_cancelled_waiter_leaves_the_queue_and_takes_nothing(backends: Backends) -> None:
    backend = await backends()
    holder = await acquired(backend, request("c"))
    results: list[object] = []
    async with parked(backend, request("c", timeout_ms=20_000), BOB, results) as scope:
        scope.cancel()
    assert results == []
    await until_records(backend, "c", 1)  # the holder's key alone
    assert await backend.release("c", holder.handle)
    assert (await backend.status("c")).holds == []


def queued(backend: EtcdBackend, key: str) -> bool:
    """``backend`` has a waiter of its own queued on ``key``."""
    key_queue = backend._queues.get(key)
    return bool(key_queue and key_queue.waiters)


async def waiters(backend: EtcdBackend, key: str, count: int) -> bool:
    return (await backend.status(key)).waiters == count


async def until_records(backend: EtcdBackend, key: str, count: int) -> None:
    async def counted() -> bool:
        return len(await records(backend, key)) == count

    await wait_for_trio(counted, 10, f"{count} records of {key}", interval=0.02)


# ------------------------------------------------------ ends of holds


async def test_release_on_close_ends_with_the_connection(backends: Backends) -> None:
    backend = await backends()
    bound = await acquired(backend, request("b", bound=True), conn=7)
    kept = await acquired(backend, request("b2"), conn=7)
    assert len(await records(backend, "b")) == 2  # hold + binding
    backend.connection_closed(7)
    await until_records(backend, "b", 0)
    assert await backend.find("b", bound.handle) is None
    assert await backend.find("b2", kept.handle) is not None


async def test_a_bound_hold_dies_with_its_daemons_session(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    bound = await acquired(one, request("d", bound=True))
    lease = one.session_lease
    assert lease is not None
    await one.etcd.lease_revoke(lease)  # as if its host died: the session lease ends
    assert await two.find("d", bound.handle) is None
    assert await acquired(two, request("d"), BOB)


async def test_an_undelivered_grant_is_released(backends: Backends) -> None:
    backend = await backends()
    hold = await acquired(backend, request("u"))
    backend.release_undelivered(hold)
    await until_records(backend, "u", 0)


async def test_break_ends_every_hold(backends: Backends) -> None:
    backend = await backends()
    assert await backend.break_lock("x") == []
    a = await acquired(backend, request("x", mode="shared"))
    await acquired(backend, request("x", mode="shared"), BOB)
    broken = await backend.break_lock("x")
    assert len(broken) == 2 and broken[0].fence == a.fence
    assert (await backend.status("x")).holds == []


# ---------------------------------------------------------------- list


async def test_list_pages_in_key_order(backends: Backends) -> None:
    backend = await backends()
    keys = ["a/1", "a/2", "a/3", "b", "a/2x"]
    for key in keys:
        await acquired(backend, request(key))
    page, after = await backend.list_held("", 2, None)
    assert [st.key for st in page] == ["a/1", "a/2"] and after == "a/2"
    page, after = await backend.list_held("", 2, after)
    assert [st.key for st in page] == ["a/2x", "a/3"] and after == "a/3"
    page, after = await backend.list_held("", 2, after)
    assert [st.key for st in page] == ["b"] and after is None
    page, after = await backend.list_held("a/2", 10, None)
    assert [st.key for st in page] == ["a/2", "a/2x"] and after is None


# ---------------------------------------------------------------- outages


async def test_an_unreachable_cluster_fails_within_the_timeout(backends: Backends) -> None:
    backend = await backends(timeout=1.0, endpoints=["http://127.0.0.1:9"])
    started = trio.current_time()
    with pytest.raises(EtcdUnavailable):
        await backend.acquire(request("down"), ALICE, 1, None)
    assert trio.current_time() - started < 10
    # A blocking acquire keeps trying until its own timeout instead.
    assert await backend.acquire(request("down", timeout_ms=1500), ALICE, 1, 1.5) is None


# ---------------------------------------------------------------- leases


async def test_released_leases_are_reused_with_a_fresh_ttl(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SkippedClock()
    backend = await backends(clock=clock)
    keepalive = backend.etcd.lease_keepalive
    answered: list[tuple[int, int]] = []

    async def counted(lease_id: int) -> int:
        ttl = await keepalive(lease_id)
        answered.append((lease_id, ttl))
        return ttl

    monkeypatch.setattr(backend.etcd, "lease_keepalive", counted)
    first = await acquired(backend, request("p", ttl_ms=3000))
    assert await backend.release("p", first.handle)
    assert len(backend.leases) == 1
    clock.skip(1200)  # the kept lease has ~1.8 s left: its reuse renews it first
    again = await acquired(backend, request("p", ttl_ms=3000))
    assert again.lease == first.lease and len(backend.leases) == 0
    assert again.expires_at >= first.expires_at + 1000
    # etcd renewed the lease to its whole TTL (at least the grant's 3 s): it outlives
    # the first grant's end.
    assert [lease for lease, _ in answered] == [first.lease] and answered[0][1] >= 3
    assert await backend.find("p", again.handle) is not None
    # A busy try gives its lease back too.
    assert await backend.acquire(request("p", ttl_ms=3000), BOB, 1, None) is None
    assert len(backend.leases) == 1


def count_keepalives(backend: EtcdBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lease ids ``backend`` sends keepalives for from now on, in order."""
    keepalive = backend.etcd.lease_keepalive
    sent: list[int] = []

    async def counted(lease_id: int) -> int:
        sent.append(lease_id)
        return await keepalive(lease_id)

    monkeypatch.setattr(backend.etcd, "lease_keepalive", counted)
    return sent


async def test_a_lease_reused_right_after_its_keepalive_needs_no_other(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SkippedClock()
    backend = await backends(clock=clock)
    sent = count_keepalives(backend, monkeypatch)
    # Headroom stretched to 5 s, so a loaded machine cannot make the lease stale.
    monkeypatch.setattr(backend_module, "HEADROOM_S", 5)
    first = await acquired(backend, request("f", ttl_ms=600_000))
    assert await backend.release("f", first.handle)
    asked_at = int(time.time() * 1000)
    again = await acquired(backend, request("f", ttl_ms=600_000))
    assert again.lease == first.lease and sent == []
    # A full TTL from this grant, which the lease (granted HEADROOM_S longer) outlives.
    lease_end = first.expires_at + 5000
    assert asked_at + 600_000 <= again.expires_at <= lease_end
    assert again.ttl_ms == 600_000
    assert await backend.release("f", again.handle)

    def never_fresh(lease: KeptLease, now_ms: int) -> bool:
        return False

    original_fresh = KeptLease.fresh
    monkeypatch.setattr(KeptLease, "fresh", never_fresh)
    clock.skip(50)
    third = await acquired(backend, request("f", ttl_ms=600_000))
    assert third.lease == first.lease and sent == [first.lease]
    assert third.expires_at >= first.expires_at + 50
    # The keepalive answered after the record was written; the pool still
    # knows the lease was just refreshed.
    assert await backend.release("f", third.handle)
    monkeypatch.setattr(KeptLease, "fresh", original_fresh)
    fourth = await acquired(backend, request("f", ttl_ms=600_000))
    assert sent == [first.lease] and fourth.expires_at >= third.expires_at


def test_a_kept_lease_is_fresh_while_a_full_ttl_is_ahead_of_it() -> None:
    now = 1_000_000
    for ttl in (2, 30, 300):
        assert KeptLease(1, ttl, now + (ttl + HEADROOM_S) * 1000).fresh(now)  # just granted
        assert KeptLease(1, ttl, now + ttl * 1000).fresh(now)
        assert not KeptLease(1, ttl, now + ttl * 1000 - 1).fresh(now)


async def test_a_kept_lease_that_ended_is_replaced(backends: Backends) -> None:
    backend = await backends()
    first = await acquired(backend, request("z", ttl_ms=2000))
    assert await backend.release("z", first.handle)
    await backend.etcd.lease_revoke(first.lease)  # ended under the pool
    again = await acquired(backend, request("z", ttl_ms=2000))
    assert again.lease != first.lease
    assert await backend.find("z", again.handle) is not None


# ---------------------------------------------------------------- sessions


async def test_a_clean_stop_keeps_bound_holds_as_ttl_holds(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    bound = await acquired(one, request("stop", bound=True), conn=3)
    await one.close()
    kept = await two.find("stop", bound.handle)
    assert kept is not None and not kept.bound and kept.fence == bound.fence
    assert len(await records(two, "stop")) == 1  # the binding went, the hold stayed


async def test_waiters_survive_the_loss_of_their_session(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    holder = await acquired(two, request("lost"))
    bound = await acquired(one, request("lost-bound", bound=True))
    results: list[object] = []
    async with parked(one, request("lost", timeout_ms=30_000), BOB, results):
        session = one.session_lease
        assert session is not None
        await one.etcd.lease_revoke(session)  # as after an outage past its TTL
        # The bound hold died with the session; the waiter is queued again.
        assert await two.find("lost-bound", bound.handle) is None
        await until(lambda: one.session_lease not in (None, session))
        await until(lambda: waiters(two, "lost", 1))
        assert await two.release("lost", holder.handle)
        await until(lambda: len(results) == 1)
    assert isinstance(results[0], Hold) and results[0].principal == "user:bob"


async def test_a_request_that_finds_the_session_gone_starts_a_new_one(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session ended while its keeper was not looking (a stopped daemon,
    a partition): the next request that puts a key on it learns first. It
    must get a new session and succeed, not fail with "lease not found"."""
    two = await backends("n2")

    async def keeper_looking_away(self: Session) -> None:
        await trio.sleep_forever()

    # n1's keepers never ask: only the requests can find their sessions gone
    # (a 10 s session outlives the test).
    monkeypatch.setattr(Session, "_keep_alive", keeper_looking_away)
    one = await backends("n1", session_ttl=10)
    old = one.session_lease
    assert old is not None
    await one.etcd.lease_revoke(old)
    bound = await acquired(one, request("gone-bound", bound=True), conn=7)
    new = one.session_lease
    assert new not in (None, old)
    # The hold's binding is on the new session: it ends with it, not before.
    binding = await one.etcd.range(RangeOp(one.layout.binding("gone-bound", bound.handle)))
    assert [kv.lease for kv in binding.kvs] == [new]
    # A waiter key goes on the session too.
    holder = await acquired(two, request("gone-queue"))
    assert new is not None
    await one.etcd.lease_revoke(new)
    results: list[object] = []
    async with parked(one, request("gone-queue", timeout_ms=30_000), BOB, results):
        assert one.session_lease not in (None, old, new)
        assert await two.release("gone-queue", holder.handle)
        await until(lambda: len(results) == 1)
    assert isinstance(results[0], Hold) and results[0].principal == "user:bob"


async def test_a_blocking_acquire_tries_once_whatever_its_timeout(backends: Backends) -> None:
    backend = await backends()
    hold = await acquired(backend, request("zero", timeout_ms=0))
    assert await backend.acquire(request("zero", timeout_ms=0), BOB, 1, 0.0) is None
    assert (await backend.status("zero")).waiters == 0
    assert await backend.release("zero", hold.handle)


def test_a_waiter_is_lost_only_when_written_before_the_read() -> None:
    layout = Layout("/p/")
    key = layout.waiter("k", 1, 1)
    waiter = Waiter(key, 0, "user:a", None, "exclusive", 1, "n1")
    empty = Directory("k", revision=10)
    assert not empty.lost(waiter)  # its write is under way
    assert not empty.lost(replace(waiter, create_revision=11))  # written after the read
    assert empty.lost(replace(waiter, create_revision=9))  # gone (its session ended)
    assert not Directory("k", revision=10, present={key}).lost(replace(waiter, create_revision=9))


async def test_hand_offs_across_hosts_never_overlap_or_stall(backends: Backends) -> None:
    """Four workers on two nodes take one key in turns: every acquire is granted
    (a lost wake-up would leave one waiting out its timeout) and no two hold it at once."""
    nodes = [await backends("n1"), await backends("n2")]
    holding: list[str] = []
    overlaps = 0
    grants = 0

    async def worker(name: str, backend: EtcdBackend) -> None:
        nonlocal overlaps, grants
        caller = Caller("user", name, "member", 1000, 1000, 1, frozenset(), None)
        for _ in range(6):
            hold = await backend.acquire(request("turns", timeout_ms=20_000), caller, 1, 20.0)
            assert isinstance(hold, Hold), f"{name} waited out its timeout"
            overlaps += len(holding)
            holding.append(name)
            grants += 1
            await trio.sleep(0.005)  # the work done holding: a window an overlap would show in
            holding.remove(name)
            assert await backend.release("turns", hold.handle)

    async with trio.open_nursery() as nursery:
        for n in range(4):
            nursery.start_soon(worker, f"w{n}", nodes[n % 2])
    assert grants == 24 and overlaps == 0


async def test_a_grant_cancelled_after_its_commit_is_released(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while its reused lease's keepalive is out (the commit is done): released."""
    backend = await backends()
    first = await acquired(backend, request("late", ttl_ms=30_000))
    assert await backend.release("late", first.handle)  # its lease is kept for reuse

    def never_fresh(lease: KeptLease, now_ms: int) -> bool:
        return False

    monkeypatch.setattr(KeptLease, "fresh", never_fresh)  # its reuse sends a keepalive
    keepalive_out = trio.Event()

    async def unanswered_keepalive(lease_id: int) -> int:
        keepalive_out.set()
        await trio.sleep_forever()  # etcd has not answered when the caller is cancelled

    monkeypatch.setattr(backend.etcd, "lease_keepalive", unanswered_keepalive)
    scope = trio.CancelScope()

    async def take() -> None:
        with scope:
            await backend.acquire(request("late", ttl_ms=30_000), ALICE, 1, None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take)
        await keepalive_out.wait()
        await until_records(backend, "late", 1)  # the grant is committed
        scope.cancel()
    assert scope.cancelled_caught
    await until_records(backend, "late", 0)
