"""The one-write hand-off (docs/etcd-design.md §5): the releaser grants the queue's head.

In process, on the real 3-member cluster: two ``EtcdBackend`` objects with
different node names stand for two hosts. A release by the daemon that
has a view of the key's queue deletes the hold and grants the head
waiter(s) in one transaction, whichever daemon they belong to; the
waiter's daemon learns of the grant from its watch. These tests pin that
it is one transaction (the old hold is gone at exactly the grant's
revision), FIFO and fences across hosts, the head groups of shared holds
and semaphores, the waiter that leaves just as it is granted (no orphan
hold), and the fall back to the two-write path for a record that does not
name its hold (an older daemon's).
"""

from __future__ import annotations

import json
from dataclasses import replace

import trio.testing

from lockd.daemon.backends.etcd.backend import EtcdBackend
from lockd.daemon.backends.etcd.records import Directory, Hold, Waiter
from lockd.daemon.backends.etcd.waiting import KeyQueue, LocalWaiter
from lockd.daemon.backends.etcd.wire import Event, KeyValue, PutOp, RangeOp
from tests.etcd.test_etcd_backend import (
    ALICE,
    BOB,
    Backends,
    acquired,
    backends,
    parked,
    records,
    request,
    until,
)

__all__ = ["backends"]  # the fixture, used by name


async def one_write(backend: EtcdBackend, released: Hold, granted: Hold) -> bool:
    """True when ``released`` was deleted by the transaction that wrote ``granted``."""
    hold_key = backend.layout.hold(released.key, released.handle)
    before = await backend.etcd.range(RangeOp(hold_key, revision=granted.fence - 1))
    at = await backend.etcd.range(RangeOp(hold_key, revision=granted.fence))
    return bool(before.kvs) and not at.kvs


def settled(backend: EtcdBackend, key: str, revision: int) -> bool:
    """``backend``'s queue of ``key`` has seen ``revision`` and decided on all it saw."""
    key_queue = backend._queues.get(key)
    return (
        key_queue is not None
        and key_queue.revision >= revision
        and not key_queue.changed.is_set()
        and not key_queue.lock.locked()
    )


async def viewing(backend: EtcdBackend, key: str, waiters: int) -> None:
    """Until ``backend``'s queue of ``key`` has joined and its view shows ``waiters``.

    ``parked`` returns once a waiter key is written, a moment before its
    daemon's queue knows it: a release then would find no queue (and be
    plain, the two-write path).
    """

    def ready() -> bool:
        key_queue = backend._queues.get(key)
        return (
            key_queue is not None
            and key_queue.records is not None
            and (len(key_queue.view.directory().waiters) == waiters)
        )

    await until(ready)


async def hold_record(backend: EtcdBackend, hold: Hold) -> Hold | None:
    found = await backend.etcd.get(backend.layout.hold(hold.key, hold.handle))
    return Hold.parse(hold.key, hold.handle, found.kvs[0]) if found.kvs else None


async def test_the_releaser_grants_another_hosts_head_waiter_in_its_release(
    backends: Backends,
) -> None:
    one, two = await backends("n1"), await backends("n2")
    holder = await acquired(one, request("h"))
    results: list[object] = []
    async with (
        parked(two, request("h", timeout_ms=20_000), BOB, results),
        parked(one, request("h", timeout_ms=20_000), ALICE, results),
        parked(two, request("h", timeout_ms=20_000), BOB, results),
    ):
        await viewing(one, "h", 3)
        assert await one.release("h", holder.handle)  # n1 has a queue here: it hands off
        await until(lambda: len(results) == 1)
        first = results[0]
        assert isinstance(first, Hold) and first.node == "n2" and first.principal == "user:bob"
        assert first.fence > holder.fence and await one_write(one, holder, first)
        # n2 answered it only once the tie to n2's session was undone.
        untied = await hold_record(two, first)
        assert untied is not None and not untied.tied and untied.fence == first.fence
        assert not (await one.etcd.get(one.layout.binding("h", first.handle))).kvs

        # n2's queue stayed while its waiter's hold lives: n2 hands off to n1.
        assert await two.release("h", first.handle)
        await until(lambda: len(results) == 2)
        second = results[1]
        assert isinstance(second, Hold) and second.node == "n1" and second.fence > first.fence
        assert await one_write(two, first, second)
        assert await one.release("h", second.handle)
        await until(lambda: len(results) == 3)
    third = results[2]
    assert isinstance(third, Hold) and third.node == "n2" and third.fence > second.fence
    assert await two.release("h", third.handle)
    assert (await one.status("h")).holds == []
    await until(lambda: "h" not in one._queues and "h" not in two._queues)


async def test_a_shared_head_group_is_granted_in_the_release(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    writer = await acquired(one, request("g"))
    results: list[object] = []
    shared = request("g", timeout_ms=20_000, mode="shared")
    async with (
        parked(two, shared, BOB, results),
        parked(one, request("g", timeout_ms=20_000, mode="shared"), ALICE, results),
        parked(two, request("g", timeout_ms=20_000, mode="shared"), BOB, results),
        parked(one, request("g", timeout_ms=20_000), ALICE, results),  # exclusive: waits
    ):
        await viewing(one, "g", 4)
        assert await one.release("g", writer.handle)
        await until(lambda: len(results) == 3)
        readers = [r for r in results if isinstance(r, Hold)]
        assert len(readers) == 3 and {r.node for r in readers} == {"n1", "n2"}
        # Every grant draws a fence of its own (docs/contract.md §10): the head in the
        # release's own transaction, the others each in one of their own.
        assert len({r.fence for r in readers}) == 3
        first = min(readers, key=lambda r: r.fence)
        assert await one_write(one, writer, first)
        assert (await two.status("g")).waiters == 1
        for reader in readers:
            backend = one if reader.node == "n1" else two
            assert await backend.release("g", reader.handle)
        await until(lambda: len(results) == 4)
        last = results[3]
        assert isinstance(last, Hold) and last.mode == "exclusive"
        assert await one.release("g", last.handle)


async def test_a_semaphore_slot_goes_to_the_head_only(backends: Backends) -> None:
    one, two = await backends("n1"), await backends("n2")
    first = await acquired(one, request("s", limit=2))
    await acquired(two, request("s", limit=2), BOB)
    results: list[object] = []
    async with (
        parked(two, request("s", timeout_ms=20_000, limit=2), BOB, results),
        parked(one, request("s", timeout_ms=20_000, limit=2), ALICE, results),
    ):
        await viewing(one, "s", 2)
        assert await one.release("s", first.handle)
        await until(lambda: len(results) == 1)
        head = results[0]
        assert isinstance(head, Hold) and head.node == "n2" and await one_write(one, first, head)
        # No second grant: once n1's queue has seen the hand-off and decided on it.
        await until(lambda: settled(one, "s", head.fence))
        await trio.testing.wait_all_tasks_blocked()  # a grant it made has reached its waiter
        assert len(results) == 1 and (await one.status("s")).waiters == 1
        assert await two.release("s", head.handle)
        await until(lambda: len(results) == 2)
        assert isinstance(results[1], Hold) and results[1].node == "n1"


def deaf(key_queue: KeyQueue) -> None:
    """Make a queue blind to every transaction that touches its waiters or their holds.

    So it never sees its waiter granted (nor decides on that hand-off) and
    the grant crosses the waiter's leave.
    """
    apply = key_queue.view.apply

    def without_grants(events: list[Event]) -> None:
        mine = key_queue.expected.keys() | key_queue.waiters.keys()
        hidden = {e.kv.mod_revision for e in events if e.kv.key in mine}
        apply([e for e in events if e.kv.mod_revision not in hidden])

    key_queue.view.apply = without_grants  # type: ignore[method-assign]


async def test_a_waiter_cancelled_as_it_is_granted_leaves_no_hold(backends: Backends) -> None:
    """The grant commits, the waiter's daemon has not seen it, the waiter leaves.

    Its leave deletes the waiter key and reads the hold key in one
    transaction, finds the grant, and releases it: the key goes to the next
    waiter (here one of the releasing host).
    """
    one, two = await backends("n1"), await backends("n2")
    holder = await acquired(one, request("c"))
    results: list[object] = []
    async with (
        parked(two, request("c", timeout_ms=20_000), BOB, results) as cancelled,
        parked(one, request("c", timeout_ms=20_000), ALICE, results),
    ):
        await until(lambda: "c" in two._queues)
        deaf(two._queues["c"])
        await viewing(one, "c", 2)
        assert await one.release("c", holder.handle)
        [orphan] = [h for h in (await one.status("c")).holds]
        assert orphan.node == "n2" and orphan.tied
        cancelled.cancel()  # the client went away, or cancelled, right then
        await until(lambda: len(results) == 1)
        granted = results[0]
        assert isinstance(granted, Hold) and granted.node == "n1"
        assert [h.handle for h in (await one.status("c")).holds] == [granted.handle]
        assert not (await one.etcd.get(one.layout.binding("c", orphan.handle))).kvs
        assert await one.release("c", granted.handle)
    assert await records(one, "c") == []


async def test_a_waiter_timed_out_as_it_is_granted_gets_the_hold(backends: Backends) -> None:
    """A timeout that crosses the grant answers the grant (as on SQLite): nothing orphaned."""
    one, two = await backends("n1"), await backends("n2")
    holder = await acquired(one, request("t"))
    results: list[object] = []
    async with (
        parked(two, request("t", timeout_ms=3000), BOB, results),
        parked(one, request("t", timeout_ms=20_000), ALICE, results),
    ):
        await until(lambda: "t" in two._queues)
        deaf(two._queues["t"])
        await viewing(one, "t", 2)
        assert await one.release("t", holder.handle)
        await until(lambda: len(results) == 1)  # its timeout passed: it left
        timed_out = results[0]
        assert isinstance(timed_out, Hold) and timed_out.node == "n2"
        record = await hold_record(two, timed_out)
        assert record is not None and not record.tied
        assert await two.release("t", timed_out.handle)
        await until(lambda: len(results) == 2)
        assert isinstance(results[1], Hold) and results[1].node == "n1"
        assert await one.release("t", results[1].handle)


async def test_a_waiter_record_without_its_hold_is_granted_by_its_own_daemon(
    backends: Backends,
) -> None:
    """An older daemon's record names no hold: the release is plain, its daemon grants."""
    one, two = await backends("n1"), await backends("n2")
    holder = await acquired(one, request("o"))
    results: list[object] = []
    async with (
        parked(two, request("o", timeout_ms=20_000), BOB, results),
        parked(one, request("o", timeout_ms=20_000), ALICE, results),
    ):
        [waiter] = two._queues["o"].waiters.values()
        doc = json.loads(waiter.record.value())
        old = {k: doc[k] for k in ("principal", "owner", "mode", "limit", "node")}
        await two.etcd.txn(
            [],
            [PutOp(waiter.record.etcd_key, json.dumps(old).encode(), lease=waiter.record.lease)],
        )
        await until(lambda: not one._queues["o"].view.directory().waiters[0].grantable)
        assert await one.release("o", holder.handle)
        await until(lambda: len(results) == 1)
        granted = results[0]
        assert isinstance(granted, Hold) and granted.node == "n2" and not granted.tied
        assert not await one_write(one, holder, granted)  # two writes: release, then grant
        assert await two.release("o", granted.handle)
        await until(lambda: len(results) == 2)
        assert isinstance(results[1], Hold) and await one.release("o", results[1].handle)


async def test_a_grant_the_watch_showed_before_its_waiter_joined_is_delivered(
    backends: Backends,
) -> None:
    """Another daemon may grant a waiter before its enqueue's reply came back.

    The queue's watch then shows the hold before the waiter joins (with a
    read older than the view): joining delivers it from the view. Before,
    the grant was never delivered and the hold sat until its TTL (a 31 s
    stall in B2 under load).
    """
    backend = await backends("n1")
    layout = backend.layout
    key_queue = KeyQueue(backend, "j", revision=10)
    key_queue.view.learn(Directory(key="j", revision=10))
    waiter_key = layout.waiter("j", 1, 1)
    record = Waiter(
        waiter_key, 11, "user:bob", None, "exclusive", 1, "n1", 1, "H1", 2000, 7, "job", False
    )
    hold = record.hold("j")
    granted = replace(hold, lease=5, ttl_ms=2000, expires_at=1, tied=True)
    hold_key = layout.hold("j", "H1")
    key_queue.view.apply(
        [
            Event("PUT", KeyValue(waiter_key, record.value(), 11, 11, 1, 1), None),
            Event("DELETE", KeyValue(waiter_key, b"", 0, 12, 0, 0), None),
            Event("PUT", KeyValue(hold_key, granted.value(), 12, 12, 1, 5), None),
        ]
    )
    waiter = LocalWaiter(record, hold, 2)
    key_queue.join(waiter, Directory(key="j", revision=11))  # its enqueue's read
    assert waiter.done.is_set() and waiter.granted is not None
    assert waiter.granted.fence == 12 and waiter.granted.tied
    assert not key_queue.waiters and key_queue.holding == {hold_key}
