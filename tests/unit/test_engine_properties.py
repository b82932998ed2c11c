"""Property tests of :class:`lockd.daemon.engine.LockEngine` with a fake clock.

A hypothesis state machine drives random acquires (exclusive, shared and
semaphore, valid or contradicting the key), tries, re-takes, renews,
releases, breaks, waiter cancellations, connection closes, failed commits
and the passing of time over three keys, three principals and four
connections, and keeps a model of what must be true. After every step:

* an exclusive hold never coexists with any other hold of its key, a
  semaphore never has more than ``limit`` holders, and the engine's holders
  are the model's, in grant order;
* grants follow queue order with no overtaking: a queued waiter is granted
  only as the head of its queue, a new claim wins at once only when nobody
  waits (a re-take excepted), and no head that fits is left waiting;
* fences strictly increase over all grants;
* only a holder's own handle releases or renews it;
* a waiter is granted only while its deadline has not passed, and times out
  only once it has; no key reports a holder at or after its deadline;
* a refused request and a request whose commit failed (rolled back) leave
  the engine exactly as it was;
* ``check_invariants()`` holds.

Time moves like the daemon's timer moves it: to each pending deadline in
turn (see ``tick``). What happens when the engine is advanced late, across
several deadlines at once, is pinned separately below.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from lockd.core.deadlock import MAX_STEPS
from lockd.daemon.engine import (
    EXCLUSIVE,
    SHARED,
    Busy,
    Changes,
    Deadlock,
    Lease,
    LockEngine,
    Parked,
    Refused,
    TimedOut,
    Waiter,
)
from lockd.daemon.leases import MAX_LISTED_HOLDERS
from tests.depth import examples

from .test_store import persisted

KEYS = ("a", "b", "c")
PRINCIPALS = ("user:alice", "user:bob", "service:cron.service")
OWNERS = (None, "run-1", "run-2")
CONNS = (1, 2, 3, 4)

keys = st.sampled_from(KEYS)
principals = st.sampled_from(PRINCIPALS)
owners = st.sampled_from(OWNERS)
conns = st.sampled_from(CONNS)
ttls = st.integers(min_value=1, max_value=400)
waits = st.integers(min_value=1, max_value=1500)
# Mostly the plain mutex; shared and small semaphores often enough to mix
# on one key; now and then a request that contradicts the key.
modes = st.sampled_from((EXCLUSIVE, EXCLUSIVE, SHARED, SHARED))
limits = st.sampled_from((1, 1, 1, 2, 3))


@dataclass
class Model:
    now: int = 0
    holders: dict[str, list[Lease]] = field(default_factory=lambda: {k: [] for k in KEYS})
    queue: dict[str, list[Waiter]] = field(default_factory=lambda: {k: [] for k in KEYS})
    handles: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in KEYS})
    last_fence: int = 0

    def own_hold(self, key: str, principal: str, owner: str | None) -> Lease | None:
        if owner is None:
            return None
        for lease in self.holders[key]:
            if lease.principal == principal and lease.owner == owner:
                return lease
        return None

    def fits(self, key: str, mode: str) -> bool:
        """Written out here, not imported: shared joins shared, a semaphore has a free slot."""
        held = self.holders[key]
        if not held:
            return True
        if mode != held[0].mode:
            return False
        return mode == SHARED or len(held) < held[0].limit

    def key_limit(self, key: str) -> int | None:
        return self.holders[key][0].limit if self.holders[key] else None

    def waits_for(
        self, key: str, mode: str, limit: int, conn: int, ahead: list[Waiter]
    ) -> set[int]:
        """The connections a waiter waits for (docs/contract.md §12), written out again here."""
        holders = [(h.mode, h.taken_by) for h in self.holders[key]]
        parties = holders + [(w.mode, w.conn) for w in ahead]
        if limit > 1:
            conns = {c for _, c in parties}
            return conns if len(conns) == 1 and None not in conns and conn not in conns else set()
        return {
            c for other, c in parties if c is not None and c != conn and EXCLUSIVE in (mode, other)
        }

    def search_may_stop(self, key: str) -> bool:
        """Could the engine's deadlock check reach its bound before it is done?

        docs/contract.md §12: the check reads at most ``MAX_STEPS`` holders
        and waiters, and past that reports no cycle (the wait then ends by
        its timeout). This is an upper bound of what any check reads: the
        new waiter's key in full, then every parked waiter's holders and the
        waiters ahead of it.
        """
        reads = len(self.holders[key]) + len(self.queue[key])
        for k in KEYS:
            reads += sum(len(self.holders[k]) + i for i in range(len(self.queue[k])))
        return reads > MAX_STEPS

    def closes_cycle(self, key: str, mode: str, limit: int, conn: int) -> bool:
        """Would a new waiter of ``conn`` on ``key`` reach ``conn`` again? A plain closure."""
        edges: dict[int, set[int]] = {}
        for k in KEYS:
            for i, w in enumerate(self.queue[k]):
                found = self.waits_for(k, w.mode, w.limit, w.conn, self.queue[k][:i])
                edges.setdefault(w.conn, set()).update(found)
        reached = self.waits_for(key, mode, limit, conn, self.queue[key])
        while True:
            more = set().union(*(edges.get(c, set()) for c in reached)) - reached
            if not more:
                return conn in reached
            reached |= more


def snapshot(engine: LockEngine) -> Any:
    """Everything observable of the engine's state, by value (for rollback checks)."""

    def lease_state(lease: Lease) -> tuple[Any, ...]:
        return (*persisted(lease), lease.conn)

    keys_state = {}
    for key, state in engine._keys.items():
        queued = []
        waiter = state.q_first
        while waiter is not None:
            queued.append(waiter.id)
            waiter = waiter.next
        keys_state[key] = (
            state.mode,
            state.limit,
            state.count,
            [lease_state(lease) for lease in engine._holders(state)],
            queued,
            state.next_slot,
            list(state.free_slots or ()),
            sorted(state.by_handle) if state.by_handle is not None else None,
        )
    waiters = {
        wid: (w.key, w.deadline, w.lease is not None, w.timed_out, w.cancelled)
        for wid, w in engine._waiters.items()
    }
    changes = engine.pending()
    return (
        keys_state,
        waiters,
        {conn: sorted(ids) for conn, ids in engine._conn_waiters.items()},
        {conn: sorted(lease.fence for lease in held) for conn, held in engine._conn_leases.items()},
        {owned: lease.fence for owned, lease in engine._owned.items()},
        engine.lease_count,
        {row: (lease.fence if lease else None) for row, lease in changes.rows.items()},
        [w.id for w in changes.resolved],
        [lease.fence for lease in changes.expired],
        (changes.grants, changes.retakes, changes.fence),
        engine.next_deadline(),
    )


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
        holders = self.m.holders[key]
        replaced = self.m.own_hold(key, lease.principal, lease.owner)
        if replaced is not None:
            holders.remove(replaced)  # the same work continuing: a re-take
        assert self.m.fits(key, lease.mode) or replaced is not None, (
            "granted a hold that does not fit"
        )
        holders.append(lease)

    def _settle(self, freed: list[Lease]) -> Changes:
        """Drain the engine's effects and check them against the model.

        ``freed`` lists holds the step itself ended (release, break, close);
        expiries come from the drained changes.
        """
        changes = self.engine.drain()
        now = self.m.now
        for lease in changes.expired:
            assert lease.expires_at <= now, "expired before its deadline"
            assert lease in self.m.holders[lease.key]
            freed.append(lease)
        for lease in freed:
            self.m.holders[lease.key].remove(lease)
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
            assert queue[0] is waiter, "no overtaking: only the head of the queue is granted"
            assert now <= waiter.deadline, "granted after its deadline had passed"
            queue.pop(0)
            bound = waiter.conn if waiter.release_on_close else None
            self._granted(waiter.lease, waiter.key, bound)
            assert waiter.lease.taken_by == waiter.conn
        for key in KEYS:
            if not self.m.holders[key]:
                assert not self.m.queue[key], f"{key} is free but has waiters"
            elif self.m.queue[key]:
                head = self.m.queue[key][0]
                assert not self.m.fits(key, head.mode), f"{key}: the head fits but waits"
        return changes

    @invariant()
    def engine_agrees_with_model(self) -> None:
        engine, now = self.engine, self.m.now
        engine.check_invariants()
        for key in KEYS:
            st_ = engine.status(now, key)
            held = self.m.holders[key]
            # status lists the oldest MAX_LISTED_HOLDERS (docs/contract.md §10);
            # holder_count below counts them all.
            shown = held[:MAX_LISTED_HOLDERS]
            assert st_.holders == shown, "the holders, oldest grant first"
            assert st_.holder_count == len(held) and st_.waiters == len(self.m.queue[key])
            if held:
                modes_ = {lease.mode for lease in held}
                assert len(modes_) == 1 and st_.mode in modes_ and st_.limit == held[0].limit
                if held[0].mode == EXCLUSIVE:
                    assert len(held) <= held[0].limit, "a semaphore over its limit"
                    if held[0].limit == 1:
                        assert len(held) == 1, "an exclusive hold shares its key"
            else:
                assert st_.mode is None and st_.limit is None
            assert all(lease.expires_at > now for lease in held), "status shows an ended lease"
        assert engine.waiter_count == sum(len(q) for q in self.m.queue.values())
        assert engine.held_count == sum(bool(h) for h in self.m.holders.values())
        assert engine.lease_count == sum(len(h) for h in self.m.holders.values())
        assert engine.fence == self.m.last_fence
        listed = engine.list_held(now).locks
        assert [s.key for s in listed] == [k for k in KEYS if self.m.holders[k]]
        walked, after = [], None
        while True:  # pages of 2, following next, give the same keys
            page = engine.list_held(now, "", 2, after)
            walked += [s.key for s in page.locks]
            if page.next is None:
                break
            after = page.next
        assert walked == [s.key for s in listed]
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
        mode: str = EXCLUSIVE,
        limit: int = 1,
    ) -> None:
        m = self.m
        own = m.own_hold(key, principal, owner)
        key_limit = m.key_limit(key)
        before = snapshot(self.engine)
        result = self.engine.acquire(
            m.now,
            key,
            ttl_ms=ttl,
            principal=principal,
            owner=owner,
            conn=conn,
            release_on_close=roc,
            wait_ms=wait_ms,
            mode=mode,
            limit=limit,
        )
        if mode == SHARED and limit > 1:
            assert isinstance(result, Refused) and result.field == "limit"
        elif key_limit is not None and limit != key_limit:
            assert isinstance(result, Refused) and result.field == "limit"
            assert result.details == {"limit": key_limit}
        elif own is not None and own.mode != mode:
            assert isinstance(result, Refused) and result.field == "mode"
            assert result.details == {"mode": own.mode, "limit": own.limit}
        if isinstance(result, Refused):
            assert snapshot(self.engine) == before, "a refused request changed something"
            assert not self.engine.drain()
            return
        queued = list(m.queue[key])
        if own is not None or (m.fits(key, mode) and not m.queue[key]):
            assert isinstance(result, Lease), result
            assert (result.mode, result.limit) == (mode, limit)
            self._settle([])
            self._granted(result, key, conn if roc else None)
            assert result.taken_by == conn
            if own is not None:
                assert result.fence > own.fence
                assert m.queue[key] == queued, "a re-take must not disturb the queue"
            return
        if wait_ms is None:
            assert isinstance(result, Busy) and result.holder is m.holders[key][0]
        elif wait_ms <= 0:
            assert isinstance(result, TimedOut)
        elif m.closes_cycle(key, mode, limit, conn) and not (
            isinstance(result, Parked) and m.search_may_stop(key)
        ):
            assert isinstance(result, Deadlock) and result.cycle[0] == key, result
            assert snapshot(self.engine) == before, "a refused request changed something"
        else:
            assert isinstance(result, Parked), result
            assert result.waiter.deadline == m.now + wait_ms
            m.queue[key].append(result.waiter)
        self._settle([])

    @rule(
        key=keys,
        principal=principals,
        owner=owners,
        conn=conns,
        roc=st.booleans(),
        ttl=ttls,
        mode=modes,
        limit=limits,
    )
    def try_acquire(
        self,
        key: str,
        principal: str,
        owner: str | None,
        conn: int,
        roc: bool,
        ttl: int,
        mode: str,
        limit: int,
    ) -> None:
        self._acquire(key, principal, owner, conn, roc, None, ttl, mode, limit)

    @rule(
        key=keys,
        principal=principals,
        owner=owners,
        conn=conns,
        roc=st.booleans(),
        ttl=ttls,
        wait=waits,
        mode=modes,
        limit=limits,
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
        mode: str,
        limit: int,
    ) -> None:
        self._acquire(key, principal, owner, conn, roc, wait, ttl, mode, limit)

    @rule(key=keys, principal=principals, owner=owners, conn=conns, ttl=ttls, wait=waits)
    def acquire_like_the_key(
        self, key: str, principal: str, owner: str | None, conn: int, ttl: int, wait: int
    ) -> None:
        """A request that agrees with the key's limit, so semaphores fill up and queue."""
        held = self.m.holders[key]
        mode, limit = (held[0].mode, held[0].limit) if held else (EXCLUSIVE, 3)
        self._acquire(key, principal, owner, conn, False, wait, ttl, mode, limit)

    @rule(
        key=keys,
        principals_=st.lists(principals, min_size=2, max_size=4),
        ttl=ttls,
        wait=st.integers(min_value=300, max_value=2000),
    )
    def readers_arrive(self, key: str, principals_: list[str], ttl: int, wait: int) -> None:
        """Several shared requests in a row: behind a writer they queue and go in together."""
        for principal in principals_:
            self._acquire(key, principal, None, 2, False, wait, ttl, SHARED, 1)

    @precondition(lambda self: any(h.owner for k in KEYS for h in self.m.holders[k]))
    @rule(data=st.data(), conn=conns, roc=st.booleans(), ttl=ttls, wait=st.none() | waits)
    def retake(self, data: st.DataObject, conn: int, roc: bool, ttl: int, wait: int | None) -> None:
        """The same principal and owner take the hold back, ahead of any waiters."""
        owned = [h for k in KEYS for h in self.m.holders[k] if h.owner]
        before = data.draw(st.sampled_from(owned))
        self._acquire(
            before.key,
            before.principal,
            before.owner,
            conn,
            roc,
            wait,
            ttl,
            before.mode,
            before.limit,
        )

    def _pick_handle(self, key: str, which: int) -> str:
        handles = self.m.handles[key] or ["never-granted"]
        return handles[which % len(handles)]

    @rule(key=keys, which=st.integers(min_value=0, max_value=50), ttl=ttls)
    def renew(self, key: str, which: int, ttl: int) -> None:
        handle = self._pick_handle(key, which)
        holder = next((h for h in self.m.holders[key] if h.handle == handle), None)
        result = self.engine.renew(self.m.now, key, handle, ttl)
        self._settle([])
        if holder is not None:
            assert result is holder and holder.expires_at == self.m.now + ttl
        else:
            assert result is None, "only a holder's own handle may renew"

    @rule(key=keys, which=st.integers(min_value=0, max_value=50))
    def release(self, key: str, which: int) -> None:
        handle = self._pick_handle(key, which)
        holder = next((h for h in self.m.holders[key] if h.handle == handle), None)
        ok = self.engine.release(self.m.now, key, handle)
        assert ok == (holder is not None), "only a holder's own handle may release"
        self._settle([holder] if holder is not None else [])

    @rule(key=keys)
    def break_lock(self, key: str) -> None:
        held = list(self.m.holders[key])
        broken = self.engine.break_lock(self.m.now, key)
        assert broken == held, "break ends every hold, oldest first"
        self._settle(list(broken))

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
        bound = [h for k in KEYS for h in self.m.holders[k] if h.conn == conn]
        mine = [w for k in KEYS for w in self.m.queue[k] if w.conn == conn]
        released = self.engine.connection_closed(self.m.now, conn)
        assert sorted(lease.fence for lease in released) == sorted(h.fence for h in bound)
        assert all(w.cancelled for w in mine)
        self._settle(list(released))
        assert not any(w.conn == conn for k in KEYS for w in self.m.queue[k])

    @rule(
        data=st.data(),
        op=st.sampled_from(("acquire", "try", "release", "renew", "break")),
        key=keys,
        principal=principals,
        owner=owners,
        mode=modes,
        limit=limits,
    )
    def failed_commit(
        self,
        data: st.DataObject,
        op: str,
        key: str,
        principal: str,
        owner: str | None,
        mode: str,
        limit: int,
    ) -> None:
        """A request whose commit fails is undone: the engine is exactly as before."""
        engine, now = self.engine, self.m.now
        before = snapshot(engine)
        if op in ("acquire", "try"):
            wait = 100 if op == "acquire" else None
            engine.acquire(
                now,
                key,
                ttl_ms=50,
                principal=principal,
                owner=owner,
                conn=1,
                release_on_close=data.draw(st.booleans()),
                wait_ms=wait,
                mode=mode,
                limit=limit,
            )
        elif op == "break":
            engine.break_lock(now, key)
        else:
            handle = self._pick_handle(key, data.draw(st.integers(0, 50)))
            if op == "release":
                engine.release(now, key, handle)
            else:
                engine.renew(now, key, handle, 77)
        engine.rollback()
        assert snapshot(engine) == before, f"rollback of {op} left a trace"
        assert not engine.drain()
        # Fences drawn by the undone request are skipped, never handed out again.
        assert engine.fence >= self.m.last_fence
        self.m.last_fence = engine.fence

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
    max_examples=examples(200),
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
