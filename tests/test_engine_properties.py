"""Property tests of :class:`lockd.daemon.engine.LockEngine` with a fake clock.

A hypothesis state machine drives random acquires, tries, re-takes, renews,
releases, breaks, waiter cancellations, connection closes and the passing of
time over three keys, three principals and four connections, and keeps a
small model of what must be true:

* at most one holder per key, and the engine's holder is the one the model
  predicts (a freed key goes to the head of its queue, or becomes free);
* only the latest handle of a key releases or renews it;
* fences strictly increase over all grants;
* FIFO: waiters are granted in the order they parked, per key, skipping
  the cancelled and timed-out ones;
* a waiter is granted only while its deadline has not passed, and times out
  only once it has;
* no key reports a holder at or after the lease's deadline;
* ``check_invariants()`` holds after every step.

Time moves like the daemon's timer moves it: to each pending deadline in
turn (see ``tick``). What happens when the engine is advanced late, across
several deadlines at once, is pinned separately below.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from lockd.daemon.engine import Busy, Changes, Lease, LockEngine, Parked, TimedOut, Waiter

KEYS = ("a", "b", "c")
PRINCIPALS = ("user:alice", "user:bob", "service:cron.service")
OWNERS = (None, "run-1", "run-2")
CONNS = (1, 2, 3, 4)

keys = st.sampled_from(KEYS)
principals = st.sampled_from(PRINCIPALS)
owners = st.sampled_from(OWNERS)
conns = st.sampled_from(CONNS)
ttls = st.integers(min_value=1, max_value=400)
waits = st.integers(min_value=1, max_value=600)


@dataclass
class Model:
    now: int = 0
    holder: dict[str, Lease | None] = field(default_factory=lambda: dict.fromkeys(KEYS))
    queue: dict[str, list[Waiter]] = field(default_factory=lambda: {k: [] for k in KEYS})
    handles: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KEYS})
    last_fence: int = 0


class EngineMachine(RuleBasedStateMachine):
    """Random operations against the engine, checked against :class:`Model`."""

    def __init__(self) -> None:
        super().__init__()
        counter = itertools.count(1)
        self.engine = LockEngine(handle_factory=lambda: f"handle-{next(counter):04d}")
        self.m = Model()

    @initialize(start=st.integers(min_value=0, max_value=10**12))
    def set_clock(self, start: int) -> None:
        """The boot clock may start anywhere."""
        self.m.now = start

    # ---------------------------------------------------------- checking

    def _granted(self, lease: Lease, key: str, conn: int | None) -> None:
        """Common checks for every new lease, direct or handed to a waiter."""
        assert lease.key == key
        assert lease.fence > self.m.last_fence, "fences must strictly increase"
        self.m.last_fence = lease.fence
        assert lease.expires_at == self.m.now + lease.ttl_ms
        assert lease.conn == conn
        assert lease.handle not in self.m.handles[key]
        self.m.handles[key].append(lease.handle)
        self.m.holder[key] = lease

    def _settle(self, freed: list[str]) -> Changes:
        """Drain the engine's effects and check them against the model.

        ``freed`` lists keys the step itself freed (release, break, close);
        expiries come from the drained changes.
        """
        changes = self.engine.drain()
        now = self.m.now
        for lease in changes.expired:
            assert lease.expires_at <= now, "expired before its deadline"
            assert self.m.holder[lease.key] is lease
            freed.append(lease.key)
        for key in freed:
            self.m.holder[key] = None
        # Waiters cancelled by this step never show up as resolved.
        for key in KEYS:
            self.m.queue[key] = [w for w in self.m.queue[key] if not w.cancelled]
        for waiter in changes.resolved:
            queue = self.m.queue[waiter.key]
            assert waiter in queue, "resolved a waiter that was not parked"
            if waiter.timed_out:
                assert waiter.lease is None
                assert waiter.deadline <= now, "timed out before its deadline"
                queue.remove(waiter)
                continue
            assert waiter.lease is not None
            assert queue[0] is waiter, "FIFO: the head of the queue must be granted first"
            assert now <= waiter.deadline, "granted after its deadline had passed"
            assert waiter.key in freed, "granted a key that was not freed"
            queue.pop(0)
            bound = waiter.conn if waiter.release_on_close else None
            self._granted(waiter.lease, waiter.key, bound)
        for key in KEYS:
            if self.m.holder[key] is None:
                assert not self.m.queue[key], f"{key} is free but has waiters"
        return changes

    @invariant()
    def engine_agrees_with_model(self) -> None:
        engine, now = self.engine, self.m.now
        engine.check_invariants()
        for key in KEYS:
            st_ = engine.status(now, key)
            assert st_.holder is self.m.holder[key]
            assert st_.waiters == len(self.m.queue[key])
            if st_.holder is not None:
                assert st_.holder.expires_at > now, "status shows a lease past its deadline"
        assert engine.waiter_count == sum(len(q) for q in self.m.queue.values())
        assert engine.held_count == sum(h is not None for h in self.m.holder.values())
        assert engine.fence == self.m.last_fence
        held = engine.list_held(now).locks
        assert [s.key for s in held] == [k for k in KEYS if self.m.holder[k] is not None]
        walked, after = [], None
        while True:  # pages of 2, following next, give the same keys
            page = engine.list_held(now, "", 2, after)
            walked += [s.key for s in page.locks]
            if page.next is None:
                break
            after = page.next
        assert walked == [s.key for s in held]
        assert not engine.drain(), "status/list must not change anything"

    # ------------------------------------------------------------- rules

    def _acquire(
        self,
        key: str,
        principal: str,
        owner: str | None,
        conn: int,
        roc: bool,
        wait_ms: int | None,
        ttl: int,
    ) -> None:
        before = self.m.holder[key]
        result = self.engine.acquire(
            self.m.now,
            key,
            ttl_ms=ttl,
            principal=principal,
            owner=owner,
            conn=conn,
            release_on_close=roc,
            wait_ms=wait_ms,
        )
        retake = (
            before is not None
            and owner is not None
            and before.owner == owner
            and before.principal == principal
        )
        if before is None or retake:
            assert isinstance(result, Lease), result
            self._settle([])
            self._granted(result, key, conn if roc else None)
            if retake:
                assert before is not None and result.fence > before.fence
            return
        if wait_ms is None:
            assert isinstance(result, Busy) and result.holder is before
        else:
            assert isinstance(result, Parked)
            assert result.waiter.deadline == self.m.now + wait_ms
            self.m.queue[key].append(result.waiter)
        self._settle([])

    @rule(key=keys, principal=principals, owner=owners, conn=conns, roc=st.booleans(), ttl=ttls)
    def try_acquire(
        self, key: str, principal: str, owner: str | None, conn: int, roc: bool, ttl: int
    ) -> None:
        self._acquire(key, principal, owner, conn, roc, None, ttl)

    @rule(
        key=keys,
        principal=principals,
        owner=owners,
        conn=conns,
        roc=st.booleans(),
        ttl=ttls,
        wait=waits,
    )
    def acquire(
        self,
        key: str,
        principal: str,
        owner: str | None,
        conn: int,
        roc: bool,
        ttl: int,
        wait: int,
    ) -> None:
        self._acquire(key, principal, owner, conn, roc, wait, ttl)

    @precondition(lambda self: any(h is not None and h.owner for h in self.m.holder.values()))
    @rule(data=st.data(), conn=conns, roc=st.booleans(), ttl=ttls, wait=st.none() | waits)
    def retake(self, data: st.DataObject, conn: int, roc: bool, ttl: int, wait: int | None) -> None:
        """The same principal and owner take the hold back, ahead of any waiters."""
        held = [k for k in KEYS if (h := self.m.holder[k]) is not None and h.owner]
        key = data.draw(st.sampled_from(held))
        before = self.m.holder[key]
        assert before is not None
        queued = list(self.m.queue[key])
        self._acquire(key, before.principal, before.owner, conn, roc, wait, ttl)
        assert self.m.queue[key] == queued, "a re-take must not disturb the queue"

    @rule(key=keys, which=st.integers(min_value=0, max_value=50), ttl=ttls)
    def renew(self, key: str, which: int, ttl: int) -> None:
        handles = self.m.handles[key] or ["never-granted"]
        handle = handles[which % len(handles)]
        holder = self.m.holder[key]
        result = self.engine.renew(self.m.now, key, handle, ttl)
        self._settle([])
        if holder is not None and holder.handle == handle:
            assert result is holder and holder.expires_at == self.m.now + ttl
        else:
            assert result is None, "only the latest handle may renew"

    @rule(key=keys, which=st.integers(min_value=0, max_value=50))
    def release(self, key: str, which: int) -> None:
        handles = self.m.handles[key] or ["never-granted"]
        handle = handles[which % len(handles)]
        holder = self.m.holder[key]
        ok = self.engine.release(self.m.now, key, handle)
        expected = holder is not None and holder.handle == handle
        assert ok == expected, "only the latest handle may release"
        self._settle([key] if ok else [])

    @rule(key=keys)
    def break_lock(self, key: str) -> None:
        holder = self.m.holder[key]
        broken = self.engine.break_lock(self.m.now, key)
        assert broken == ([holder] if holder is not None else [])
        self._settle([key] if broken else [])

    @precondition(lambda self: any(self.m.queue.values()))
    @rule(data=st.data())
    def cancel_waiter(self, data: st.DataObject) -> None:
        parked = [w for k in KEYS for w in self.m.queue[k]]
        waiter = data.draw(st.sampled_from(parked))
        self.engine.cancel_waiter(self.m.now, waiter)
        assert waiter.cancelled
        self._settle([])
        assert waiter not in self.m.queue[waiter.key]

    @rule(conn=conns)
    def close_connection(self, conn: int) -> None:
        bound = [k for k in KEYS if (h := self.m.holder[k]) is not None and h.conn == conn]
        mine = [w for k in KEYS for w in self.m.queue[k] if w.conn == conn]
        released = self.engine.connection_closed(self.m.now, conn)
        assert sorted(lease.key for lease in released) == sorted(bound)
        assert all(w.cancelled for w in mine)
        self._settle(bound)
        assert not any(w.conn == conn for k in KEYS for w in self.m.queue[k])

    @rule(dt=st.integers(min_value=0, max_value=700))
    def tick(self, dt: int) -> None:
        """Let ``dt`` ms pass, stopping at every deadline like a punctual timer."""
        target = self.m.now + dt
        while (deadline := self.engine.next_deadline()) is not None and deadline <= target:
            assert deadline >= self.m.now, "a deadline was left behind"
            self.m.now = deadline
            self.engine.advance(deadline)
            self._settle([])
        self.m.now = target
        self.engine.advance(target)
        self._settle([])


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ------------------------------------------------- time arriving late


def test_late_advance_does_not_grant_a_waiter_past_its_deadline() -> None:
    engine = LockEngine()
    holder = engine.acquire(0, "k", ttl_ms=1000, principal="user:a")
    assert isinstance(holder, Lease)
    parked = engine.acquire(0, "k", ttl_ms=1000, principal="user:b", wait_ms=900)
    assert isinstance(parked, Parked)
    engine.drain()
    # The waiter gave up at 900; the lease ran out at 1000; the timer fires at 1005.
    engine.advance(1005)
    assert parked.waiter.timed_out
    assert parked.waiter.lease is None


def test_late_advance_still_frees_every_expired_lease_in_one_step() -> None:
    """However late the timer, one advance catches up with all deadlines."""
    engine = LockEngine()
    for i, key in enumerate(KEYS):
        assert isinstance(engine.acquire(0, key, ttl_ms=100 + i, principal="user:a"), Lease)
    engine.drain()
    engine.advance(10_000)
    changes = engine.drain()
    assert sorted(lease.key for lease in changes.expired) == sorted(KEYS)
    assert set(changes.rows) == {(k, 0) for k in KEYS} and not any(changes.rows.values())
    assert engine.held_count == 0 and engine.next_deadline() is None


def test_zero_wait_never_parks() -> None:
    engine = LockEngine()
    assert isinstance(engine.acquire(0, "k", ttl_ms=10, principal="user:a"), Lease)
    assert isinstance(engine.acquire(1, "k", ttl_ms=10, principal="user:b", wait_ms=0), TimedOut)
    assert engine.waiter_count == 0
