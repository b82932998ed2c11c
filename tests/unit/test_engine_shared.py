"""Shared holds, semaphores and failed commits in the engine (docs/contract.md §10, fake clock)."""

from __future__ import annotations

from lockd.daemon.engine import EXCLUSIVE, SHARED, Busy, Lease, LockEngine, Refused

from .test_engine import grant, make_engine, park


def shared(e: LockEngine, now: int, who: str, **kw: object) -> object:
    return e.acquire(now, "k", ttl_ms=1000, principal=who, mode=SHARED, **kw)  # type: ignore[arg-type]


def test_readers_share_and_a_writer_waits_for_all_of_them() -> None:
    e = make_engine()
    r1, r2 = grant(shared(e, 0, "user:r1")), grant(shared(e, 1, "user:r2"))
    assert (r1.slot, r2.slot) == (0, 1) and r2.fence == r1.fence + 1
    writer = park(e.acquire(2, "k", ttl_ms=1000, principal="user:w", wait_ms=5000))
    st = e.status(3, "k")
    assert (st.mode, st.limit, st.holder_count, st.waiters) == (SHARED, 1, 2, 1)
    assert st.holders == [r1, r2] and st.holder is r1
    assert e.release(4, "k", r1.handle) and not writer.resolved
    assert e.release(5, "k", r2.handle)
    assert writer.lease is not None and writer.lease.mode == EXCLUSIVE
    assert writer.lease.slot == 0
    e.check_invariants()


def test_a_reader_behind_a_waiting_writer_waits_too() -> None:
    """No overtaking: writers never starve behind a stream of readers."""
    e = make_engine()
    r1 = grant(shared(e, 0, "user:r1"))
    writer = park(e.acquire(1, "k", ttl_ms=1000, principal="user:w", wait_ms=5000))
    late = park(shared(e, 2, "user:r2", wait_ms=5000))
    assert isinstance(shared(e, 3, "user:r3"), Busy)  # tryAcquire: others queued
    assert e.release(4, "k", r1.handle)
    assert writer.lease is not None and not late.resolved
    assert e.release(5, "k", writer.lease.handle)
    assert late.lease is not None
    e.check_invariants()


def test_consecutive_readers_at_the_head_are_granted_together() -> None:
    e = make_engine()
    w = grant(e.acquire(0, "k", ttl_ms=1000, principal="user:w"))
    readers = [park(shared(e, i, f"user:r{i}", wait_ms=5000)) for i in range(1, 4)]
    writer2 = park(e.acquire(5, "k", ttl_ms=1000, principal="user:w2", wait_ms=5000))
    reader_after = park(shared(e, 6, "user:r9", wait_ms=5000))
    e.drain()
    assert e.release(10, "k", w.handle)
    changes = e.drain()
    assert changes.resolved == readers  # all three, in order, in one step
    fences = [r.lease.fence for r in readers if r.lease is not None]
    assert fences == sorted(fences) and len(set(fences)) == 3
    assert sorted(row for row in changes.rows) == [("k", 0), ("k", 1), ("k", 2)]
    assert not writer2.resolved and not reader_after.resolved
    e.check_invariants()


def test_semaphore_grants_up_to_its_limit_and_hands_freed_slots_on() -> None:
    e = make_engine()
    backups = [
        grant(e.acquire(i, "backup", ttl_ms=1000, principal=f"user:b{i}", limit=3))
        for i in range(3)
    ]
    assert [b.slot for b in backups] == [0, 1, 2]
    fourth = park(e.acquire(3, "backup", ttl_ms=1000, principal="user:b3", limit=3, wait_ms=9))
    assert isinstance(e.acquire(4, "backup", ttl_ms=1000, principal="user:x", limit=3), Busy)
    e.drain()
    assert e.release(5, "backup", backups[1].handle)
    assert fourth.lease is not None and fourth.lease.slot == 1
    assert e.drain().rows == {("backup", 1): fourth.lease}  # the hand-off is one row
    assert e.status(6, "backup").holder_count == 3
    e.check_invariants()


def test_a_limit_that_contradicts_the_key_is_refused_at_once_and_changes_nothing() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=1000, principal="user:a", limit=3))
    e.drain()
    refused = e.acquire(1, "k", ttl_ms=1000, principal="user:b", limit=2, wait_ms=5000)
    assert isinstance(refused, Refused)
    assert refused.field == "limit" and refused.details == {"limit": 3}
    assert e.waiter_count == 0 and not e.drain()
    plain = e.acquire(1, "k", ttl_ms=1000, principal="user:b")  # limit 1 on a semaphore
    assert isinstance(plain, Refused) and plain.details == {"limit": 3}


def test_shared_with_a_limit_is_refused_even_on_a_free_key() -> None:
    e = make_engine()
    refused = shared(e, 0, "user:a", limit=2)
    assert isinstance(refused, Refused) and refused.field == "limit"
    assert e.held_count == 0 and not e.drain()


def test_retake_of_a_shared_hold_replaces_only_that_hold_even_with_waiters() -> None:
    e = make_engine()
    mine = grant(shared(e, 0, "user:a", owner="run-1"))
    other = grant(shared(e, 1, "user:b", owner="run-1"))
    writer = park(e.acquire(2, "k", ttl_ms=1000, principal="user:w", wait_ms=5000))
    again = grant(shared(e, 3, "user:a", owner="run-1"))  # re-take, ahead of the writer
    assert again.slot == mine.slot and again.fence > other.fence
    assert e.status(4, "k").holders == [other, again]
    assert not e.release(5, "k", mine.handle)  # the old handle is fenced
    assert not writer.resolved
    e.check_invariants()


def test_retake_in_another_mode_is_refused_with_the_holds_mode_and_limit() -> None:
    e = make_engine()
    grant(shared(e, 0, "user:a", owner="run-1"))
    refused = e.acquire(1, "k", ttl_ms=1000, principal="user:a", owner="run-1")
    assert isinstance(refused, Refused)
    assert refused.field == "mode" and refused.details == {"mode": SHARED, "limit": 1}


def test_break_ends_every_hold_and_serves_the_queue() -> None:
    e = make_engine()
    r1, r2 = grant(shared(e, 0, "user:r1")), grant(shared(e, 1, "user:r2"))
    writer = park(e.acquire(2, "k", ttl_ms=1000, principal="user:w", wait_ms=5000))
    assert e.break_lock(3, "k") == [r1, r2]
    assert writer.lease is not None and writer.lease.slot == 0
    assert not e.release(4, "k", r1.handle) and e.renew(4, "k", r2.handle, 10) is None
    e.check_invariants()


def test_when_a_blocked_head_leaves_the_readers_behind_it_go_in() -> None:
    e = make_engine()
    grant(shared(e, 0, "user:r1"))
    writer = park(e.acquire(1, "k", ttl_ms=1000, principal="user:w", wait_ms=100))
    reader = park(shared(e, 2, "user:r2", wait_ms=5000))
    e.advance(101)  # the writer gives up; the reader fits now
    assert writer.timed_out and reader.lease is not None
    writer2 = park(e.acquire(200, "k", ttl_ms=1000, principal="user:w2", wait_ms=5000))
    reader3 = park(shared(e, 201, "user:r3", wait_ms=5000))
    e.cancel_waiter(202, writer2)
    assert reader3.lease is not None
    e.check_invariants()


def test_expiry_of_one_shared_holder_leaves_the_others() -> None:
    e = make_engine()
    short = grant(e.acquire(0, "k", ttl_ms=10, principal="user:a", mode=SHARED))
    long = grant(e.acquire(0, "k", ttl_ms=1000, principal="user:b", mode=SHARED))
    e.advance(10)
    assert e.drain().expired == [short]
    assert e.status(11, "k").holders == [long]


def test_restore_rebuilds_holders_slots_and_owners() -> None:
    e = make_engine()
    leases = [
        Lease("k", "hb", 5, None, "user:b", 100, 9000, mode=SHARED, slot=2),
        Lease("k", "ha", 3, "run", "user:a", 100, 9000, mode=SHARED, slot=0),
    ]
    e.restore(leases, now=0)
    assert e.status(0, "k").holders == [leases[1], leases[0]]  # oldest grant first
    third = grant(e.acquire(1, "k", ttl_ms=100, principal="user:c", mode=SHARED))
    assert third.slot == 1  # the free slot between them
    again = grant(e.acquire(2, "k", ttl_ms=100, principal="user:a", owner="run", mode=SHARED))
    assert again.slot == 0 and e.status(2, "k").holder_count == 3
    e.check_invariants()


# ------------------------------------------------------------- failed commits


def test_rollback_of_a_grant_leaves_no_ghost_hold() -> None:
    e = make_engine()
    e.acquire(0, "k", ttl_ms=1000, principal="user:a")
    e.rollback()
    assert e.status(1, "k").holder is None and e.held_count == 0
    assert not e.drain() and e.next_deadline() is None
    assert grant(e.acquire(2, "k", ttl_ms=1000, principal="user:b")).fence == 2  # 1 is skipped


def test_rollback_of_a_release_keeps_the_holder_and_its_queue() -> None:
    e = make_engine()
    holder = grant(e.acquire(0, "k", ttl_ms=1000, principal="user:a"))
    waiter = park(e.acquire(1, "k", ttl_ms=1000, principal="user:b", wait_ms=5000))
    e.drain()
    assert e.release(2, "k", holder.handle) and waiter.lease is not None
    e.rollback()
    assert waiter.lease is None and not waiter.resolved
    st = e.status(3, "k")
    assert st.holder is holder and st.waiters == 1
    assert e.next_deadline() == 1000  # the lease's expiry is scheduled again
    e.advance(1000)
    assert waiter.lease is not None  # ...and hands the key on as before
    e.check_invariants()


def test_rollback_keeps_what_time_did_before_the_request() -> None:
    """An expiry is a fact: it stays pending when the request after it is undone."""
    e = make_engine()
    old = grant(e.acquire(0, "old", ttl_ms=10, principal="user:a"))
    e.drain()
    e.acquire(20, "new", ttl_ms=10, principal="user:b")  # expires "old" first
    e.rollback()
    pending = e.pending()
    assert pending.expired == [old] and pending.rows == {("old", 0): None}
    assert e.status(21, "new").holder is None and e.status(21, "old").holder is None


def test_rollback_of_a_renew_restores_the_deadline() -> None:
    e = make_engine()
    lease = grant(e.acquire(0, "k", ttl_ms=100, principal="user:a"))
    e.drain()
    e.renew(50, "k", lease.handle, 10_000)
    e.rollback()
    assert (lease.expires_at, lease.ttl_ms) == (100, 100)
    assert e.next_deadline() == 100
    e.advance(100)
    assert e.status(100, "k").holder is None


def test_a_closing_connection_is_never_granted_its_own_queued_requests() -> None:
    e = make_engine()
    grant(shared(e, 0, "user:r"))
    writer = park(e.acquire(1, "k", ttl_ms=1000, principal="user:w", conn=5, wait_ms=5000))
    reader = park(shared(e, 2, "user:r2", conn=5, wait_ms=5000))
    other = park(shared(e, 3, "user:r3", conn=6, wait_ms=5000))
    e.connection_closed(4, 5)
    assert writer.cancelled and reader.cancelled and reader.lease is None
    assert other.lease is not None  # the next head fits once the writer is gone
    e.check_invariants()


def test_rollback_of_a_batch_undoes_every_request_of_it() -> None:
    """Group commit: requests before one drain share one undo record."""
    e = make_engine()
    held = grant(e.acquire(0, "held", ttl_ms=1000, principal="user:a"))
    e.drain()
    e.acquire(1, "new", ttl_ms=1000, principal="user:b")
    assert e.release(2, "held", held.handle)
    e.renew(3, "other", "nobody", 10)
    assert e.requests_pending
    e.rollback()
    assert not e.requests_pending and not e.drain()
    assert e.status(4, "held").holder is held and e.status(4, "new").holder is None
    assert list(e.list_held(4, "", 10, None).locks) == [e.status(4, "held")]
    e.check_invariants()


def test_a_deadline_that_comes_ends_the_record_of_a_batch() -> None:
    """Time is a fact: before applying it, the record of the batch so far ends
    (the service commits the batch first when :meth:`due` says so)."""
    e = make_engine()
    short = grant(e.acquire(0, "short", ttl_ms=10, principal="user:a"))
    e.drain()
    e.acquire(1, "k1", ttl_ms=1000, principal="user:b")
    assert not e.due(9) and e.due(10)
    e.status(9, "k1")  # nothing due: the batch goes on
    assert e.requests_pending
    e.acquire(20, "k2", ttl_ms=1000, principal="user:b")  # "short" runs out first
    e.rollback()  # undoes k2 only
    assert e.pending().expired == [short]
    assert e.status(21, "k1").holder is not None and e.status(21, "k2").holder is None
    e.check_invariants()
