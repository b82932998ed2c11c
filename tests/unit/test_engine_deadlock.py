"""Deadlock detection in the engine: the acquire that closes a cycle of waits (fake clock)."""

from __future__ import annotations

from typing import Any

from lockd.daemon.engine import SHARED, Deadlock, Lease, LockEngine

from .test_engine import grant, make_engine, park


def take(e: LockEngine, now: int, key: str, conn: int, **kw: Any) -> Any:
    """An acquire of ``key`` from connection ``conn`` (unbound: releaseOnClose off)."""
    return e.acquire(now, key, ttl_ms=60_000, principal=f"user:c{conn}", conn=conn, **kw)


def wait(e: LockEngine, now: int, key: str, conn: int, **kw: Any) -> Any:
    return take(e, now, key, conn, wait_ms=30_000, **kw)


def refused(result: object) -> list[str]:
    assert isinstance(result, Deadlock), result
    return result.cycle


def test_two_connections_crossing_their_keys() -> None:
    e = make_engine()
    a1 = grant(take(e, 0, "k1", 1))
    grant(take(e, 1, "k2", 2))
    b_waits = park(wait(e, 2, "k1", 2))
    e.drain()
    assert refused(wait(e, 3, "k2", 1)) == ["k2", "k1"]
    # refused at once, and nothing changed: not queued, nothing to commit.
    changes = e.drain()
    assert not changes.rows and not changes.resolved
    assert e.status(4, "k2").waiters == 0 and e.waiter_count == 1
    # the other side keeps waiting, and gets k1 once the refused side lets go.
    assert not b_waits.resolved
    assert e.release(5, "k1", a1.handle)
    assert b_waits.lease is not None and b_waits.lease.key == "k1"
    e.check_invariants()


def test_three_connections_in_a_ring_only_the_closing_request_is_refused() -> None:
    e = make_engine()
    holds = [grant(take(e, i, f"k{i}", i)) for i in (1, 2, 3)]
    w1 = park(wait(e, 4, "k2", 1))  # 1 waits for 2
    w2 = park(wait(e, 5, "k3", 2))  # 2 waits for 3
    assert refused(wait(e, 6, "k1", 3)) == ["k1", "k2", "k3"]
    assert not w1.resolved and not w2.resolved
    assert e.release(7, "k3", holds[2].handle)  # the refused side lets go
    assert w2.lease is not None
    assert e.release(8, "k2", holds[1].handle)
    assert w1.lease is not None
    e.check_invariants()


def test_an_unbound_hold_belongs_to_the_connection_that_took_it() -> None:
    """Bound or not (releaseOnClose), the hold is the taking connection's."""
    e = make_engine()
    bound = grant(take(e, 0, "k1", 1, release_on_close=True))
    loose = grant(take(e, 0, "k2", 2))
    assert bound.conn == 1 and bound.taken_by == 1
    assert loose.conn is None and loose.taken_by == 2
    park(wait(e, 1, "k1", 2))
    assert refused(wait(e, 2, "k2", 1)) == ["k2", "k1"]


def test_a_plain_queue_is_no_deadlock() -> None:
    e = make_engine()
    holder = grant(take(e, 0, "k", 1))
    waiters = [park(wait(e, i, "k", i)) for i in range(2, 12)]
    assert e.release(20, "k", holder.handle)
    for now, waiter in enumerate(waiters, start=21):
        assert waiter.lease is not None
        assert e.release(now, "k", waiter.lease.handle)
    e.check_invariants()


def test_same_connection_waiting_behind_its_own_hold_is_contention_not_deadlock() -> None:
    """Threads of one program share a connection: a wait behind its own hold is ordinary."""
    e = make_engine()
    grant(take(e, 0, "k", 1, owner="thread-1"))
    park(wait(e, 1, "k", 1, owner="thread-2"))


def test_a_long_chain_without_a_way_back_parks() -> None:
    e = make_engine()
    for c in range(1, 201):
        grant(take(e, c, f"k{c}", c))
    for c in range(1, 200):
        park(wait(e, 300 + c, f"k{c + 1}", c))  # c waits for c+1
    # 201 waits for 1, at the tail of the chain's head: 1 -> 2 -> ... -> 200, no way back to 201.
    park(wait(e, 600, "k1", 201))
    # but 200 asking for k1 closes the whole ring
    cycle = refused(wait(e, 601, "k1", 200))
    assert cycle == ["k1", *(f"k{c + 1}" for c in range(1, 200))]
    e.check_invariants()


def test_exclusive_waiter_behind_shared_holders_closes_a_cycle_through_any_of_them() -> None:
    e = make_engine()
    grant(take(e, 0, "rw", 1, mode=SHARED))
    grant(take(e, 0, "rw", 2, mode=SHARED))
    grant(take(e, 0, "other", 3))
    park(wait(e, 1, "other", 2))  # reader 2 waits for 3
    assert refused(wait(e, 2, "rw", 3)) == ["rw", "other"]


def test_reader_behind_a_queued_writer_waits_for_the_writer() -> None:
    """No overtaking: a waiter ahead that conflicts is a party the reader waits for."""
    e = make_engine()
    grant(take(e, 0, "rw", 1, mode=SHARED))  # R holds shared
    grant(take(e, 0, "k4", 3))  # S (3) holds k4
    park(wait(e, 1, "rw", 2))  # W (2) queued exclusive behind R
    park(wait(e, 2, "k4", 1))  # R waits for S
    # S asks rw shared: it would fit beside R, but waits behind W, who waits for R.
    assert refused(wait(e, 3, "rw", 3, mode=SHARED)) == ["rw", "rw", "k4"]


def test_readers_queued_together_do_not_wait_for_each_other() -> None:
    e = make_engine()
    grant(take(e, 0, "rw", 1))  # a writer holds
    grant(take(e, 0, "x", 3))
    park(wait(e, 1, "rw", 2, mode=SHARED))  # reader 2 queued
    park(wait(e, 2, "x", 2))  # ... and (pipelined) waits for 3 on x
    # reader 3 behind reader 2: both go when the writer leaves; no edge to 2.
    park(wait(e, 3, "rw", 3, mode=SHARED))


def test_semaphore_held_by_one_connection_is_waited_for() -> None:
    e = make_engine()
    grant(take(e, 0, "pool", 1, limit=2, owner="a"))
    grant(take(e, 0, "pool", 1, limit=2, owner="b"))
    grant(take(e, 0, "k", 2))
    park(wait(e, 1, "k", 1))
    assert refused(wait(e, 2, "pool", 2, limit=2)) == ["pool", "k"]


def test_semaphore_slots_on_two_connections_draw_no_edge() -> None:
    """Either holder may free a slot: no cycle is certain, the request parks."""
    e = make_engine()
    grant(take(e, 0, "pool", 1, limit=2))
    grant(take(e, 0, "pool", 4, limit=2))
    grant(take(e, 0, "k", 2))
    park(wait(e, 1, "k", 1))
    park(wait(e, 2, "pool", 2, limit=2))


def test_restored_holds_have_no_connection_and_draw_no_edge() -> None:
    e = make_engine()
    e.restore([Lease("k1", "h", 1, None, "user:x", 60_000, 60_000)], 0)
    grant(take(e, 0, "k2", 2))
    park(wait(e, 1, "k2", 1))
    park(wait(e, 2, "k1", 2))
