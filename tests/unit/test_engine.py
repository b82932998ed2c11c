"""The lock engine, driven with an explicit clock: no test sleeps."""

from __future__ import annotations

import itertools

import pytest

from lockd.daemon.engine import SHARED, Busy, Lease, ListPage, LockEngine, Parked, TimedOut, Waiter


def make_engine(fence: int = 0) -> LockEngine:
    counter = itertools.count(1)
    return LockEngine(fence=fence, handle_factory=lambda: f"h{next(counter)}")


def grant(result: object) -> Lease:
    assert isinstance(result, Lease), result
    return result


def park(result: object) -> Waiter:
    assert isinstance(result, Parked), result
    return result.waiter


def test_grant_then_busy_then_release_frees() -> None:
    e = make_engine()
    lease = grant(e.acquire(0, "k", ttl_ms=1000, principal="user:a"))
    assert lease.fence == 1 and lease.expires_at == 1000
    busy = e.acquire(10, "k", ttl_ms=1000, principal="user:b")
    assert isinstance(busy, Busy) and busy.holder is lease
    assert e.release(20, "k", lease.handle)
    assert e.status(20, "k").holder is None
    changes = e.drain()
    assert changes.rows == {("k", 0): None}
    assert changes.fence == 1 and changes.grants == 1
    e.check_invariants()


def test_release_with_wrong_handle_is_refused() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=1000, principal="user:a"))
    assert not e.release(1, "k", "nope")
    assert not e.release(1, "other", "h1")
    assert e.status(1, "k").holder is not None


def test_lease_expires_at_deadline_exactly() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=1000, principal="user:a"))
    assert e.status(999, "k").holder is not None
    assert e.status(1000, "k").holder is None
    changes = e.drain()
    assert [lease.key for lease in changes.expired] == ["k"]
    assert changes.rows[("k", 0)] is None


def test_fifo_handoff_on_release() -> None:
    e = make_engine()
    first = grant(e.acquire(0, "k", ttl_ms=1000, principal="user:a"))
    waiters = [
        park(e.acquire(i, "k", ttl_ms=500, principal=f"user:w{i}", wait_ms=10_000, conn=i))
        for i in range(1, 5)
    ]
    assert e.status(5, "k").waiters == 4
    e.drain()
    assert e.release(6, "k", first.handle)
    changes = e.drain()
    assert changes.resolved == [waiters[0]]
    got = waiters[0].lease
    assert got is not None and got.principal == "user:w1" and got.fence == 2
    assert got.expires_at == 6 + 500
    # The rest follow strictly in order, each hand-off in the same step.
    for i, w in enumerate(waiters[1:], start=1):
        previous = waiters[i - 1].lease
        assert previous is not None
        assert e.release(10 + i, "k", previous.handle)
        assert w.lease is not None and w.lease.fence == 2 + i
    e.check_invariants()


def test_handoff_on_expiry_and_on_break() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=100, principal="user:a"))
    w1 = park(e.acquire(1, "k", ttl_ms=100, principal="user:b", wait_ms=1000))
    w2 = park(e.acquire(2, "k", ttl_ms=100, principal="user:c", wait_ms=1000))
    assert e.next_deadline() == 100
    e.advance(100)
    assert w1.lease is not None and w1.lease.expires_at == 200
    broken = e.break_lock(150, "k")
    assert broken == [w1.lease]
    assert w2.lease is not None and w2.lease.fence == 3
    # The broken holder's handle is fenced.
    assert not e.release(151, "k", w1.lease.handle)
    assert e.renew(151, "k", w1.lease.handle, 100) is None


def test_waiter_times_out_by_its_deadline() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=10_000, principal="user:a"))
    w = park(e.acquire(0, "k", ttl_ms=100, principal="user:b", wait_ms=300))
    assert e.next_deadline() == 300
    e.advance(299)
    assert not w.resolved
    e.advance(300)
    assert w.timed_out and w.lease is None
    assert e.drain().resolved == [w]
    assert e.status(301, "k").waiters == 0
    e.check_invariants()


def test_expiry_at_same_instant_as_waiter_deadline_grants() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=300, principal="user:a"))
    w = park(e.acquire(0, "k", ttl_ms=100, principal="user:b", wait_ms=300))
    e.advance(300)
    assert w.lease is not None and not w.timed_out


def test_zero_timeout_on_held_key_times_out_immediately() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=300, principal="user:a"))
    assert isinstance(e.acquire(1, "k", ttl_ms=1, principal="user:b", wait_ms=0), TimedOut)
    # ...but a zero timeout on a free key still wins it.
    assert isinstance(e.acquire(1, "free", ttl_ms=1, principal="user:b", wait_ms=0), Lease)


def test_renew_extends_and_moves_the_deadline() -> None:
    e = make_engine()
    lease = grant(e.acquire(0, "k", ttl_ms=100, principal="user:a"))
    renewed = e.renew(50, "k", lease.handle, 1000)
    assert renewed is lease and lease.expires_at == 1050 and lease.ttl_ms == 1000
    assert e.next_deadline() == 1050
    e.advance(200)
    assert e.status(200, "k").holder is lease
    assert e.renew(2000, "k", lease.handle, 100) is None  # expired meanwhile


def test_owner_retake_fences_earlier_handles_and_jumps_the_queue() -> None:
    e = make_engine()
    first = grant(e.acquire(0, "k", ttl_ms=100, principal="user:a", owner="run-1"))
    waiter = park(e.acquire(1, "k", ttl_ms=100, principal="user:b", wait_ms=1000))
    second = grant(e.acquire(2, "k", ttl_ms=100, principal="user:a", owner="run-1"))
    assert second.handle != first.handle and second.fence > first.fence
    assert not e.release(3, "k", first.handle)
    assert e.renew(3, "k", first.handle, 100) is None
    assert not waiter.resolved
    assert e.drain().retakes == 1
    assert e.release(4, "k", second.handle)
    assert waiter.lease is not None


def test_retake_needs_same_principal_and_owner() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=100, principal="service:x.service", owner="run-1"))
    assert isinstance(e.acquire(1, "k", ttl_ms=100, principal="user:x", owner="run-1"), Busy)
    assert isinstance(
        e.acquire(1, "k", ttl_ms=100, principal="service:x.service", owner="run-2"), Busy
    )


def test_hold_without_owner_is_never_reentered() -> None:
    e = make_engine()
    grant(e.acquire(0, "k", ttl_ms=100, principal="user:a"))
    assert isinstance(e.acquire(1, "k", ttl_ms=100, principal="user:a"), Busy)
    assert isinstance(e.acquire(1, "k", ttl_ms=100, principal="user:a", owner="x"), Busy)


def test_release_on_close_frees_only_bound_leases() -> None:
    e = make_engine()
    bound = grant(
        e.acquire(0, "a", ttl_ms=10_000, principal="user:a", conn=7, release_on_close=True)
    )
    grant(e.acquire(0, "b", ttl_ms=10_000, principal="user:a", conn=7))
    w = park(e.acquire(1, "a", ttl_ms=100, principal="user:b", conn=8, wait_ms=1000))
    released = e.connection_closed(2, 7)
    assert released == [bound]
    assert w.lease is not None
    assert e.status(2, "b").holder is not None


def test_stopping_daemon_keeps_bound_leases_as_ttl_leases() -> None:
    e = make_engine()
    bound = grant(e.acquire(0, "a", ttl_ms=1000, principal="user:a", conn=7, release_on_close=True))
    grant(e.acquire(1, "b", ttl_ms=1000, principal="user:c", conn=8))
    w = park(e.acquire(1, "b", ttl_ms=100, principal="user:b", conn=7, wait_ms=10_000))
    assert e.connection_closed(2, 7, release_bound=False) == []
    assert e.status(2, "a").holder is bound and bound.conn is None
    assert w.cancelled
    # ...and a later close of a reused connection id does not free it.
    assert e.connection_closed(3, 7) == []
    assert e.status(3, "a").holder is bound


def test_connection_close_drops_its_waiters() -> None:
    e = make_engine()
    holder = grant(e.acquire(0, "k", ttl_ms=100, principal="user:a", conn=1))
    w_gone = park(e.acquire(1, "k", ttl_ms=100, principal="user:b", conn=2, wait_ms=1000))
    w_next = park(e.acquire(2, "k", ttl_ms=100, principal="user:c", conn=3, wait_ms=1000))
    e.connection_closed(3, 2)
    assert w_gone.cancelled
    assert e.release(4, "k", holder.handle)
    assert w_next.lease is not None
    e.check_invariants()


def test_retake_from_another_connection_binds_by_its_own_request() -> None:
    e = make_engine()
    grant(
        e.acquire(0, "k", ttl_ms=1000, principal="user:a", owner="o", conn=1, release_on_close=True)
    )
    grant(e.acquire(1, "k", ttl_ms=1000, principal="user:a", owner="o", conn=2))
    assert e.connection_closed(2, 1) == []
    assert e.status(2, "k").holder is not None


def test_cancel_waiter_after_grant_keeps_the_lease() -> None:
    e = make_engine()
    holder = grant(e.acquire(0, "k", ttl_ms=100, principal="user:a"))
    w = park(e.acquire(1, "k", ttl_ms=100, principal="user:b", wait_ms=1000))
    e.release(2, "k", holder.handle)
    e.cancel_waiter(3, w)
    assert w.lease is not None and not w.cancelled


def test_fences_never_go_backwards_from_restored_counter() -> None:
    e = make_engine(fence=41)
    assert grant(e.acquire(0, "k", ttl_ms=1, principal="user:a")).fence == 42


def test_restore_keeps_live_leases_and_frees_expired_ones() -> None:
    e = make_engine()
    live = Lease("live", "h-live", 7, None, "user:a", 1000, 5000)
    dead = Lease("dead", "h-dead", 9, "o", "user:a", 1000, 1500, conn=3)
    e.restore([live, dead], now=2000)
    assert e.fence == 9
    assert e.status(2000, "live").holder is live
    assert e.status(2000, "dead").holder is None
    assert e.drain().rows == {("dead", 0): None}
    assert e.release(2001, "live", "h-live")
    assert grant(e.acquire(2002, "x", ttl_ms=1, principal="user:a")).fence == 10


def test_list_is_sorted_filtered_and_limited() -> None:
    e = make_engine()
    for key in ["b:2", "a:1", "b:1", "c"]:
        grant(e.acquire(0, key, ttl_ms=100, principal="user:a"))
    assert [s.key for s in e.list_held(1).locks] == ["a:1", "b:1", "b:2", "c"]
    assert [s.key for s in e.list_held(1, "b:").locks] == ["b:1", "b:2"]
    assert [s.key for s in e.list_held(1, "", 2).locks] == ["a:1", "b:1"]
    assert e.list_held(100) == ListPage([], None)


def test_list_pages_follow_next_to_the_end() -> None:
    e = make_engine()
    for key in ["b:2", "a:1", "b:1", "c", "b:3"]:
        grant(e.acquire(0, key, ttl_ms=100, principal="user:a"))
    first = e.list_held(1, "", 2)
    assert ([s.key for s in first.locks], first.next) == (["a:1", "b:1"], "b:1")
    second = e.list_held(1, "", 2, first.next)
    assert ([s.key for s in second.locks], second.next) == (["b:2", "b:3"], "b:3")
    last = e.list_held(1, "", 2, second.next)
    assert ([s.key for s in last.locks], last.next) == (["c"], None)
    # A page that ends exactly at the last key has no next.
    assert e.list_held(1, "b:", 3).next is None
    assert e.list_held(1, "b:", 2).next == "b:2"
    # ``after`` need not be a held key; before the prefix it starts at the prefix.
    assert [s.key for s in e.list_held(1, "b:", 10, "b:15").locks] == ["b:2", "b:3"]
    assert [s.key for s in e.list_held(1, "b:", 10, "a:9").locks] == ["b:1", "b:2", "b:3"]
    assert e.list_held(1, "b:", 10, "b:3") == ListPage([], None)
    assert e.list_held(1, "b:", 10, "zzz") == ListPage([], None)


def test_list_index_follows_grants_frees_and_hand_offs() -> None:
    e = make_engine()
    a = grant(e.acquire(0, "a", ttl_ms=100, principal="user:a"))
    grant(e.acquire(0, "b", ttl_ms=50, principal="user:a"))
    e.acquire(0, "a", ttl_ms=100, principal="user:b", wait_ms=1000)
    assert e.release(1, "a", a.handle)  # handed to the waiter: still held
    assert [s.key for s in e.list_held(2).locks] == ["a", "b"]
    assert [s.key for s in e.list_held(60).locks] == ["a"]  # b expired
    e.check_invariants()


def test_heaps_stay_bounded_under_many_renewals() -> None:
    e = make_engine()
    lease = grant(e.acquire(0, "k", ttl_ms=100, principal="user:a"))
    for t in range(1, 10_000):
        assert e.renew(t, "k", lease.handle, 100) is not None
    assert len(e._lease_heap) <= 64 * 4 + 8


def test_lease_repr_hides_handle() -> None:
    lease = Lease("k", "secret-handle-id", 1, None, "user:a", 1, 1)
    assert "secret-handle-id" not in repr(lease)


def test_default_handles_are_long_and_random() -> None:
    e = LockEngine()
    a = grant(e.acquire(0, "a", ttl_ms=1, principal="user:a"))
    b = grant(e.acquire(0, "b", ttl_ms=1, principal="user:a"))
    assert len(a.handle) >= 22 and a.handle != b.handle


@pytest.mark.parametrize("n", [1, 3])
def test_many_keys_expire_in_deadline_order(n: int) -> None:
    e = make_engine()
    for i in range(100):
        grant(e.acquire(0, f"k{i}", ttl_ms=(i * 37) % 100 + n, principal="user:a"))
    seen: list[int] = []
    t = 0
    while (deadline := e.next_deadline()) is not None:
        t = deadline
        e.advance(t)
        seen.extend(lease.expires_at for lease in e.drain().expired)
    assert seen == sorted(seen) and len(seen) == 100


def test_list_index_follows_a_rollback() -> None:
    e = make_engine()
    kept = grant(e.acquire(0, "kept", ttl_ms=100, principal="user:a"))
    e.drain()
    grant(e.acquire(1, "undone", ttl_ms=100, principal="user:a"))
    e.rollback()  # its commit failed: the grant never happened
    assert [s.key for s in e.list_held(2).locks] == ["kept"]
    assert e.release(3, "kept", kept.handle)
    e.rollback()  # so did this release
    assert [s.key for s in e.list_held(4).locks] == ["kept"]


@pytest.mark.parametrize("others", [0, 1])
def test_a_hold_a_rollback_brings_back_still_runs_out(others: int) -> None:
    """A release undone by a failed commit: the hold runs out at its deadline all the same.

    The release left its heap entry dead, and the next request pruned it;
    the rollback put the hold back without one, so it never ran out and the
    key stayed held for good (found by tests/unit/test_fastpath.py). With
    ``others`` a shared hold stays, so the key's state is changed, not dropped.
    """
    e = make_engine()
    mode = {"mode": SHARED} if others else {}
    if others:
        grant(e.acquire(0, "k", ttl_ms=10_000, principal="user:b", **mode))
    held = grant(e.acquire(0, "k", ttl_ms=50, principal="user:a", **mode))
    e.drain()  # committed
    assert e.release(1, "k", held.handle)
    e.status(2, "k")  # a later request of the batch prunes the dead entry
    e.rollback()  # the batch's commit failed: the release never happened
    assert e.status(3, "k").holder is not None
    assert e.next_deadline() == 50
    e.advance(60)
    assert held in e.drain().expired
    e.check_invariants()


@pytest.mark.parametrize("how", ["release", "break"])
def test_a_hand_off_a_rollback_undoes_leaves_the_hold_running_out(how: str) -> None:
    """A sole exclusive holder (no owner) handed to a waiter, then the commit failed.

    Only the key's state changed (restored whole by the undo log): the
    hold must still get its heap entry back, or it never runs out and the
    waiter waits behind it for good.
    """
    e = make_engine()
    held = grant(e.acquire(0, "k", ttl_ms=50, principal="user:a"))
    park(e.acquire(0, "k", ttl_ms=10_000, principal="user:b", wait_ms=100_000))
    e.drain()
    assert e.release(1, "k", held.handle) if how == "release" else e.break_lock(1, "k")
    e.status(2, "k")  # a later request of the batch prunes the dead entry
    e.rollback()  # the group commit failed
    assert e.status(3, "k").holder is held
    e.advance(60)
    assert held in e.drain().expired
    assert e.status(61, "k").holder is not held  # the waiter has it now
    e.check_invariants()


# ------------------------------------------------------- bounded expiry (issue 10)


def fill(e: LockEngine, count: int, ttl_ms: int, prefix: str = "mass") -> list[Lease]:
    return [
        grant(e.acquire(0, f"{prefix}:{i}", ttl_ms=ttl_ms, principal="user:a"))
        for i in range(count)
    ]


def test_mass_expiry_goes_in_bounded_passes() -> None:
    e = make_engine()
    fill(e, 2500, 100)
    e.drain()
    assert e.advance(100, 1000) is False and e.behind
    assert len(e.drain().expired) == 1000
    assert e.advance(100, 1000) is False
    assert len(e.drain().expired) == 1000
    assert e.advance(100, 1000) is True and not e.behind
    changes = e.drain()
    assert len(changes.expired) == 500 and len(changes.rows) == 500
    assert e.held_count == 0
    e.check_invariants()


def test_a_request_sees_its_own_key_expired_while_the_timer_is_behind() -> None:
    e = make_engine()
    leases = fill(e, 500, 100)
    e.drain()
    assert e.advance(100, 10) is False
    last = leases[-1]  # expires last among equals: still unapplied
    assert e.status(100, last.key).holder is None
    assert not e.release(100, last.key, last.handle)
    assert e.renew(100, leases[-2].key, leases[-2].handle, 1000) is None
    taken = grant(e.acquire(100, leases[-3].key, ttl_ms=50, principal="user:b"))
    assert taken.fence == 501
    e.check_invariants()
    while not e.advance(100, 100):
        pass
    assert [s.key for s in e.list_held(100).locks] == [leases[-3].key]
    e.check_invariants()


def test_a_waiter_whose_deadline_came_before_the_late_expiry_is_not_granted() -> None:
    e = make_engine()
    fill(e, 200, 10, prefix="early")  # a backlog ahead of everything below
    held = grant(e.acquire(0, "k", ttl_ms=100, principal="user:a"))
    gone = park(e.acquire(0, "k", ttl_ms=100, principal="user:b", wait_ms=50))
    late = park(e.acquire(0, "k", ttl_ms=100, principal="user:c", wait_ms=200))
    e.drain()
    # At 150 the backlog keeps the timer from reaching k; status settles k.
    status = e.status(150, "k")
    assert gone.timed_out and gone.lease is None
    assert late.lease is not None and status.holder is late.lease
    assert held.fence < late.lease.fence
    resolved = e.drain().resolved
    assert gone in resolved and late in resolved
    e.check_invariants()


def test_a_key_whose_waiters_all_timed_out_meanwhile_is_freed() -> None:
    e = make_engine()
    fill(e, 200, 10, prefix="early")
    grant(e.acquire(0, "k", ttl_ms=100, principal="user:a"))
    gone = park(e.acquire(0, "k", ttl_ms=100, principal="user:b", wait_ms=50))
    e.drain()
    status = e.status(150, "k")
    assert status.holder is None and status.waiters == 0 and gone.timed_out
    assert grant(e.acquire(150, "k", ttl_ms=100, principal="user:c")).key == "k"
    e.check_invariants()


def test_list_skips_keys_that_ran_out_while_the_timer_is_behind() -> None:
    e = make_engine()
    fill(e, 300, 100)
    for key in ("mass:0005x", "mass:0100x", "mass:9x"):
        grant(e.acquire(0, key, ttl_ms=1000, principal="user:a"))
    e.drain()
    assert e.advance(100, 10) is False
    first = e.list_held(100, "mass:", 2)
    assert [s.key for s in first.locks] == ["mass:0005x", "mass:0100x"]
    assert first.next == "mass:0100x"
    last = e.list_held(100, "mass:", 2, first.next)
    assert ([s.key for s in last.locks], last.next) == (["mass:9x"], None)
    e.check_invariants()


def test_equal_deadlines_and_repeated_renewals_order_by_fence() -> None:
    e = make_engine()
    a = grant(e.acquire(0, "a", ttl_ms=100, principal="user:a"))
    b = grant(e.acquire(0, "b", ttl_ms=100, principal="user:a"))
    for _ in range(3):  # the same deadline pushed again: entries equal up to the lease
        assert e.renew(0, "a", a.handle, 100) is a
    assert e.advance(100) is True
    assert [lease.key for lease in e.drain().expired] == ["a", "b"] and b.fence > a.fence
    e.check_invariants()


def test_retake_goes_ahead_of_waiters_and_fences_earlier_handle() -> None:
    engine = LockEngine()
    first = engine.acquire(0, "k", ttl_ms=1000, principal="user:a", owner="run", conn=1)
    parked = engine.acquire(0, "k", ttl_ms=1000, principal="user:b", conn=2, wait_ms=5000)
    other = engine.acquire(0, "k", ttl_ms=1000, principal="user:b", owner="run", conn=3)
    again = engine.acquire(1, "k", ttl_ms=1000, principal="user:a", owner="run", conn=4)
    assert isinstance(first, Lease) and isinstance(again, Lease)
    assert isinstance(parked, Parked) and not parked.waiter.resolved
    assert isinstance(other, Busy)  # same owner, other principal: no re-take
    assert again.fence > first.fence
    assert not engine.release(1, "k", first.handle)
    assert engine.renew(1, "k", first.handle, 1000) is None
    engine.check_invariants()


def test_retake_from_another_connection_is_bound_by_its_own_request() -> None:
    engine = LockEngine()
    engine.acquire(0, "k", ttl_ms=1000, principal="p", owner="o", conn=1, release_on_close=True)
    engine.acquire(0, "k", ttl_ms=1000, principal="p", owner="o", conn=2)
    assert engine.connection_closed(1, 1) == []  # the re-take is not bound to conn 1
    assert engine.status(1, "k").holder is not None
    engine.acquire(1, "k", ttl_ms=1000, principal="p", owner="o", conn=3, release_on_close=True)
    assert [lease.key for lease in engine.connection_closed(2, 3)] == ["k"]


def test_many_renewals_keep_expiry_exact_and_heap_small() -> None:
    engine = LockEngine()
    lease = engine.acquire(0, "k", ttl_ms=100, principal="p")
    assert isinstance(lease, Lease)
    for now in range(1, 5000):
        assert engine.renew(now, "k", lease.handle, 100) is not None
        engine.renew(now, "k", lease.handle, 100)  # twice to the same deadline
    assert engine.next_deadline() == 4999 + 100
    assert len(engine._lease_heap) < 1000
    engine.advance(5098)
    assert engine.status(5098, "k").holder is not None
    engine.advance(5099)
    assert engine.status(5099, "k").holder is None
    assert engine.next_deadline() is None
