"""A blocking acquire parks in one etcd write (docs/etcd-design.md §3).

On a key where this daemon's acquires parked lately, the take-if-free
transaction writes the waiter record in its failure branch: when the rules
say wait, the acquire is queued by that one transaction. When they say
otherwise (the key fits, a re-take, a refusal) the record is taken back
first, and a grant of it that another daemon's hand-off made in between is
the acquire's outcome.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from lockd.daemon.backends.etcd.backend import EtcdBackend
from lockd.daemon.backends.etcd.records import Hold
from lockd.daemon.holds import Refused
from lockd.identity import Caller
from tests.etcd.test_etcd_backend import (
    ALICE,
    BOB,
    Backends,
    acquired,
    backends,
    queued,
    records,
    request,
    until,
)
from tests.etcd.test_etcd_faults import Start, start

__all__ = ["backends", "start"]  # the fixtures these tests use

CAROL = Caller("user", "carol", "member", 1002, 1002, 4444, frozenset(), "third")


def count_txns(backend: EtcdBackend) -> list[bytes]:
    """Every transaction ``backend`` sends from now on (its arguments, as text)."""
    sent: list[bytes] = []
    real = backend.etcd.txn

    async def txn(*args: Any, **kwargs: Any) -> Any:
        sent.append(repr(args).encode())
        return await real(*args, **kwargs)

    backend.etcd.txn = txn  # type: ignore[method-assign]
    return sent


def waiter_keys(backend: EtcdBackend, keys: list[bytes]) -> list[bytes]:
    return [key for key in keys if backend.layout.is_waiter(key)]


async def background(
    nursery: trio.Nursery, results: list[object], acquire: Callable[[], Awaitable[object]]
) -> None:
    async def run() -> None:
        results.append(await acquire())

    nursery.start_soon(run)


async def test_a_second_wait_on_a_key_is_queued_by_its_first_transaction(
    backends: Backends,
) -> None:
    a = await backends("a")
    b = await backends("b")
    holder = await acquired(a, request("p"), ALICE)
    results: list[object] = []
    async with trio.open_nursery() as nursery:
        first = request("p", timeout_ms=20_000)
        await background(nursery, results, lambda: b.acquire(first, BOB, 1, 20))
        await until(lambda: queued(b, "p"))  # the first wait here: two writes
        sent = count_txns(b)
        second = request("p", timeout_ms=20_000)
        await background(nursery, results, lambda: b.acquire(second, CAROL, 2, 20))

        async def two_waiting() -> bool:
            return len(waiter_keys(b, await records(b, "p"))) == 2

        await until(two_waiting)
        # The record is in etcd once the txn commits; the daemon files its
        # waiter when the txn's reply has been read, a scheduling step later.
        await until(lambda: len(b._queues["p"].waiters) == 2)
        assert len(sent) == 1  # taken-or-queued in one transaction
        # In order: the waiter queued first is granted first.
        assert await a.release("p", holder.handle)
        await until(lambda: len(results) == 1)
        granted = results[0]
        assert isinstance(granted, Hold) and granted.principal == "user:bob"
        assert await b.release("p", granted.handle)
        await until(lambda: len(results) == 2)
    last = results[1]
    assert isinstance(last, Hold) and last.principal == "user:carol" and last.fence > granted.fence
    assert await b.release("p", last.handle)
    assert await records(b, "p") == []


async def test_a_waiter_written_when_the_key_fits_is_taken_back(backends: Backends) -> None:
    a = await backends("a")
    b = await backends("b")
    shared = await acquired(a, request("s", mode="shared"), ALICE)
    b.acquirer._note_parked("s")  # as after a wait on it
    joined = await acquired(b, request("s", timeout_ms=5_000, mode="shared"), BOB)
    assert joined.mode == "shared" and joined.fence > shared.fence
    assert waiter_keys(b, await records(b, "s")) == []
    assert "s" not in b.acquirer._parked_keys  # the next one tries as on a free key
    assert await b.release("s", joined.handle) and await a.release("s", shared.handle)


async def test_a_retake_is_not_queued_behind_its_own_hold(backends: Backends) -> None:
    b = await backends("b")
    old = await acquired(b, request("r", owner="job-1"), BOB)
    b.acquirer._note_parked("r")
    new = await acquired(b, request("r", timeout_ms=5_000, owner="job-1"), BOB)
    assert new.fence > old.fence and new.handle != old.handle
    assert await records(b, "r") == [b.layout.hold("r", new.handle)]
    assert not await b.release("r", old.handle)
    assert await b.release("r", new.handle)


async def test_a_refusal_leaves_no_waiter_behind(backends: Backends) -> None:
    b = await backends("b")
    holder = await acquired(b, request("q"), ALICE)
    b.acquirer._note_parked("q")
    outcome = await b.acquire(request("q", timeout_ms=5_000, limit=2), BOB, 2, 5)
    assert isinstance(outcome, Refused)
    assert await records(b, "q") == [b.layout.hold("q", holder.handle)]
    assert await b.release("q", holder.handle)


def _unqueue_of(target: str, body: bytes) -> bool:
    """The taking back of a waiter record: a delete and a read, no compare, no put."""
    return (
        target == "/v3/kv/txn"
        and body.startswith(b'{"compare":[],')
        and b"request_delete_range" in body
        and b"request_range" in body
        and b"request_put" not in body
    )


async def test_a_grant_that_crossed_the_taking_back_is_the_acquires(start: Start) -> None:
    """The key fits, so the record is taken back; meanwhile another daemon's hand-off
    granted it (tied to this daemon's session): the acquire answers with that hold,
    untied, and leaves nothing behind."""
    a, faults = await start("a")
    b, _ = await start("b")
    exclusive = await acquired(b, request("x"), BOB, conn=1)
    results: list[object] = []
    theirs: list[object] = []
    unqueue_held = trio.Event()
    go_on = trio.Event()

    async def hold_back(target: str, body: bytes) -> None:
        if _unqueue_of(target, body):
            unqueue_held.set()
            await go_on.wait()

    async with trio.open_nursery() as nursery:
        # b's own shared waiter, granted by b's hand-off: b keeps a view of "x".
        shared = request("x", timeout_ms=20_000, mode="shared")
        await background(nursery, theirs, lambda: b.acquire(shared, CAROL, 2, 20))
        await until(lambda: queued(b, "x"))
        assert await b.release("x", exclusive.handle)
        await until(lambda: len(theirs) == 1)
        held = theirs[0]
        assert isinstance(held, Hold) and held.mode == "shared"

        a.acquirer._note_parked("x")
        faults.gate = hold_back
        mine = request("x", timeout_ms=20_000, mode="shared")
        await background(nursery, results, lambda: a.acquire(mine, ALICE, 3, 20))
        await unqueue_held.wait()  # it fits beside the shared hold: taking back

        def b_sees_a_waiter() -> bool:
            view = b._queues["x"].records or {}
            return any(b.layout.is_waiter(key) for key in view)

        await until(b_sees_a_waiter)
        assert await b.release("x", held.handle)  # hands off to a's record: tied
        go_on.set()
        await until(lambda: len(results) == 1)
    outcome = results[0]
    assert isinstance(outcome, Hold) and not outcome.tied and outcome.mode == "shared"
    left = await records(a, "x")
    assert left == [a.layout.hold("x", outcome.handle)]  # no waiter, no binding
    assert await a.release("x", outcome.handle)
