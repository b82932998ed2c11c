"""The lock semantics, with no I/O and no clock of its own.

Every public method takes ``now`` (milliseconds on a clock that wall-clock
steps cannot move; the daemon passes CLOCK_BOOTTIME) and answers at once.
What must happen outside -- rows to persist, parked waiters to wake -- piles up
in :class:`Changes` (the data types are in :mod:`lockd.daemon.leases`, and
re-exported here), which the caller takes with :meth:`LockEngine.drain`
after each call, commits, and only then replies. This is the h11 shape: the
engine is a state machine, the server moves bytes and time.

A key has any number of holders (docs/contract.md §10): one exclusive holder, several
shared ones, or up to ``limit`` exclusive holders of a semaphore, each with
its own lease, handle, fence and slot. Which request fits, who goes first
and what a re-take is are the rules of :mod:`lockd.core` (the etcd backend
applies the same functions); this module keeps the state they are applied
to, and calls them on every acquire and every departure.

Invariants the methods keep (and ``check_invariants`` asserts in tests):

* every tracked key has a holder; a key with waiters has a holder, and the
  head of its queue does not fit (else it would hold already);
* an exclusive hold never shares its key; a semaphore never has more than
  ``limit`` holders; a key's holders all have one mode and one limit;
* only a holder's own handle releases or renews it; a re-take, a break or an
  expiry fences the handle of the hold it ends;
* fences strictly increase across every grant of the engine's life.

Costs: holders and waiters of a key are intrusive doubly linked lists in
grant / arrival order, so a grant, a release, a cancel and every hand-off
are O(1) (O(number granted) for a hand-out to consecutive shared waiters).
Leases and waiter deadlines sit in two heaps with lazy deletion, so neither
the timer nor any operation scans all keys.

Leases found at start are taken up cold (:meth:`LockEngine.restore_cold`,
:mod:`lockd.daemon.cold`): only their keys and deadlines are in memory until
a request, a ``list`` page or a deadline needs a key, and then an injected
loader reads that key's leases (the store, in the daemon; a dict in tests).
Loading is not a change: nobody can tell a cold key from a loaded one.

The engine is the door; its rooms are plain classes it owns, each given
the state it works on:

* :mod:`lockd.daemon.keytable` -- every key's holders, the indexes and the
  fence counter (who holds what);
* :mod:`lockd.daemon.waitqueue` -- every key's queue: who is woken when a
  hold ends, the deadlock check before a wait;
* :mod:`lockd.daemon.deadlines` and :mod:`lockd.daemon.expiry` -- the
  heaps of deadlines, and time passing over them in order;
* :mod:`lockd.daemon.coldpath` -- restore, cold keys loaded on demand,
  demotion of settled keys;
* :mod:`lockd.daemon.journal` -- the effects to commit and the undo log;
* :mod:`lockd.daemon.lonekeys` -- the common case with less work: a free
  key granted, a key's only holder released (the service's fast path);
* :mod:`lockd.daemon.engineviews` -- what ``status`` and ``list`` show.

Requests are all or nothing: a request's own changes are recorded in an undo
log, and :meth:`LockEngine.rollback` puts the engine back exactly as it was
before the request when its commit fails (disk full). Time passing and
clients leaving are facts, not requests: they are not undone, their effects
stay pending and go out with the next commit that succeeds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lockd import core
from lockd.core import EXCLUSIVE, SHARED, Refused
from lockd.daemon.cold import ColdLeases
from lockd.daemon.coldpath import ChunkReader, ColdPath, LeaseLoader
from lockd.daemon.deadlines import Deadlines
from lockd.daemon.demoted import ColdKeys
from lockd.daemon.engineviews import key_status, list_page
from lockd.daemon.expiry import Expiry
from lockd.daemon.journal import Journal
from lockd.daemon.keytable import KeyState, KeyTable, holders
from lockd.daemon.keytable import check_invariants as check_engine
from lockd.daemon.leases import (
    AcquireResult,
    Busy,
    Changes,
    Deadlock,
    KeyStatus,
    Lease,
    ListPage,
    Parked,
    RowId,
    TimedOut,
    Waiter,
    new_handle_id,
)
from lockd.daemon.lonekeys import LoneKeys
from lockd.daemon.waitqueue import WaitQueues

__all__ = [
    "EXCLUSIVE",
    "SHARED",
    "AcquireResult",
    "Busy",
    "Changes",
    "ChunkReader",
    "Deadlock",
    "KeyStatus",
    "Lease",
    "LeaseLoader",
    "ListPage",
    "LockEngine",
    "Parked",
    "Refused",
    "RowId",
    "TimedOut",
    "Waiter",
    "new_handle_id",
]

#: deadlines a timer pass applies at most (lease expiries and waiter
#: timeouts). 200,000 leases running out together are expired over many
#: passes, each followed by its commit and replies, instead of in one step
#: that holds the loop for seconds; the rest wait for the next pass. 250
#: kept other clients' p99 during such an expiry ~45 ms on the loaded
#: development box (1,000: ~100 ms) for a drain ~20 % longer (bench/scale.py).
EXPIRY_CHUNK = 250
#: keys the engine holds in full at most, once :meth:`LockEngine.demote` runs:
#: beyond it the least recently touched settled keys go back to the store
#: (:mod:`lockd.daemon.demoted`). ~700 B each in full, ~72 B demoted.
HOT_KEYS = 10_000
#: a settled key untouched this long is demoted however few keys are hot,
#: unless its first lease ends within as long again (then it runs out hot).
IDLE_MS = 60_000
#: keys one :meth:`LockEngine.demote` call examines at most (a bounded pause).
DEMOTE_BATCH = 2_048
#: after a :meth:`LockEngine.demote` call found only keys that must stay
#: (waiters, connection-bound), the next looks again this much later.
DEMOTE_RETRY_MS = 1_000


class LockEngine:
    """All keys, leases, waiters and the fence counter of one daemon.

    It answers each call and hands its effects on; the state lives in the
    parts it owns (see the module docstring), built here and given to
    each other explicitly.
    """

    def __init__(
        self,
        *,
        fence: int = 0,
        handle_factory: Callable[[], str] = new_handle_id,
    ) -> None:
        journal = self._journal = Journal()
        waiters: dict[int, Waiter] = {}
        deadlines = self._deadlines = Deadlines(waiters)
        table = self._table = KeyTable(journal, deadlines, fence, handle_factory)
        queues = self._queues = WaitQueues(table, deadlines, journal, waiters)
        coldpath = self._coldpath = ColdPath(table, deadlines, journal)
        self._expiry = Expiry(table, deadlines, queues, coldpath, journal)
        #: the common case the service's fast path answers (lockd.daemon.lonekeys).
        self.lone = LoneKeys(table, self._expiry, coldpath, journal)
        # Tests read these by their old names; each is never replaced.
        self._keys, self._owned, self._conn_leases = table.keys, table.owned, table.conn_leases
        self._waiters, self._conn_waiters = waiters, queues.conn_waiters

    # ------------------------------------------------------------------ state

    @property
    def fence(self) -> int:
        """The last fence handed out (0 before the first grant ever)."""
        return self._table.fence

    @property
    def held_count(self) -> int:
        """Keys with at least one holder (a key without holders is not tracked)."""
        return len(self._table.keys) + self._coldpath.cold.key_count

    @property
    def lease_count(self) -> int:
        """Holders over all keys."""
        return self._table.lease_count + self._coldpath.cold.lease_count

    @property
    def waiter_count(self) -> int:
        return len(self._queues.waiters)

    # The state under the names tests read it by.
    _holders = staticmethod(holders)

    @property
    def _lease_heap(self) -> list[tuple[int, int, Lease]]:
        return self._deadlines.lease_heap

    @property
    def _cold(self) -> ColdKeys:
        return self._coldpath.cold

    @property
    def _load(self) -> LeaseLoader:
        return self._coldpath.load

    @_load.setter
    def _load(self, load: LeaseLoader) -> None:
        self._coldpath.load = load

    # ---------------------------------------------------------------- restore

    def restore(self, leases: Iterable[Lease], now: int) -> None:
        """Load leases kept by the store; those already run out are freed.

        The store streams them in key order, so a key's holders come
        together: each key is built as its rows go by, and a million leases
        load without a second copy of them in memory. The deadline heap is
        built once at the end (heapify is O(n), a push per lease is not).
        """
        self._coldpath.restore(leases)
        # Leases that ran out while the daemon was down go in timer passes too.
        self._expiry.advance(now, EXPIRY_CHUNK)

    def restore_cold(self, cold: ColdLeases, load: LeaseLoader, now: int) -> None:
        """Take up the stored leases as cold keys, loading each when first needed.

        ``cold`` has each lease's key and deadline; ``load`` reads the full
        leases of the keys asked for (see :mod:`lockd.daemon.cold`). A key is
        loaded, as :meth:`restore` would have made it, before a request on
        it, a ``status``/``list`` that shows it, or its first deadline; to
        every caller the engine is the same as after :meth:`restore`.
        """
        self._coldpath.restore_cold(cold, load)
        self._expiry.advance(now, EXPIRY_CHUNK)

    def restore_lazily(self, read: ChunkReader, load: LeaseLoader) -> None:
        """Take up the stored leases chunk by chunk (:meth:`restore_step`), answering meanwhile.

        ``read`` gives the (UTF-8 key, deadline) rows of the keys after a
        key, a chunk at a time (the store's ``deadlines_after``); ``load``
        is :meth:`restore_cold`'s. Until the last chunk is in, a key past
        the chunks read is read from the store like a cold key when a
        request needs it, and a ``list`` page reads the rest first
        (:meth:`finish_restore`): every lease counts from the first request.
        Deadlines of the keys not loaded come once the last chunk is in.
        """
        self._coldpath.restore_lazily(read, load)

    @property
    def restoring(self) -> bool:
        """A restore in chunks is not complete yet (see :meth:`restore_lazily`)."""
        return self._coldpath.cold.loading

    def restore_step(self, now: int) -> bool:
        """Take up the next chunk; True once the restore is complete.

        Only between commits: a row the engine has let go of but not yet
        deleted in the store would otherwise come back as a cold lease.
        """
        if not self._coldpath.cold.loading:
            return True
        if self._journal.recording or self._journal.changes.rows:
            raise RuntimeError("restore_step() runs between commits only")
        if not self._coldpath.read_chunk():
            return False
        self._expiry.advance(now, EXPIRY_CHUNK)  # leases that ran out while down, in passes
        return True

    def finish_restore(self, now: int) -> None:
        """Take up every chunk left (a ``list`` needs all keys); between commits only."""
        while not self.restore_step(now):
            pass

    # ------------------------------------------------------------- commits

    def drain(self) -> Changes:
        """Hand over the effects gathered so far (they were committed)."""
        return self._journal.drain()

    @property
    def requests_pending(self) -> bool:
        """Requests changed state since the last drain: a rollback would undo them."""
        return self._journal.recording

    def pending(self) -> Changes:
        """The effects gathered so far, left in place until :meth:`drain`."""
        return self._journal.changes

    def rollback(self) -> None:
        """Undo the requests since the last drain: their commit failed, so none of it happened.

        That is one request, or the batch of a group commit. Everything they
        changed goes back, their pending rows and woken waiters included;
        effects of time and of departed clients gathered before the first of
        them stay pending. Handed-out fences are not taken back (a
        skipped fence is harmless, a reused one is not).
        """
        undone = self._journal.rollback()
        if undone is not None:
            restored, lease_count = undone
            self._table.undone(restored, lease_count, self._journal.request_keys, self._waiters)

    # ------------------------------------------------------------------ time

    def due(self, now: int) -> bool:
        """A deadline has come: the next request or tick applies it first."""
        return self._expiry.due(now)

    def next_deadline(self) -> int | None:
        """The earliest lease expiry or waiter deadline still pending."""
        return self._expiry.next_deadline()

    def advance(self, now: int, budget: int | None = None) -> bool:
        """Let time pass: apply deadlines <= now, at most ``budget`` of them.

        True when none is left due; False when the budget ran out first (the
        timer comes back at once, see :data:`EXPIRY_CHUNK`).
        """
        return self._expiry.advance(now, budget)

    @property
    def behind(self) -> bool:
        """Deadlines already passed are still waiting for a timer pass."""
        return self._expiry.behind

    def hold_leases(self, at: int) -> None:
        """No lease runs out after ``at`` until :meth:`release_leases` (see Expiry.hold_leases)."""
        self._expiry.hold_leases(at)

    def release_leases(self) -> None:
        """Leases run out again; those whose deadline passed meanwhile at the next pass."""
        self._expiry.release_leases()

    # ------------------------------------------------------------- operations

    def acquire(
        self,
        now: int,
        key: str,
        *,
        ttl_ms: int,
        principal: str,
        owner: str | None = None,
        conn: int = 0,
        release_on_close: bool = False,
        wait_ms: int | None = None,
        mode: str = EXCLUSIVE,
        limit: int = 1,
        pid: int | None = None,
        process: str | None = None,
        pid_start: int | None = None,
    ) -> AcquireResult:
        """Take ``key`` now, re-take one's own hold, or (with ``wait_ms``) queue.

        ``wait_ms=None`` is a tryAcquire: a key that cannot be taken now
        answers :class:`Busy`. A request that contradicts the key answers
        :class:`Refused` and changes nothing. The decision is
        :func:`lockd.core.admit`'s.
        """
        if mode not in core.MODES:
            raise ValueError(f"unknown mode {mode!r}")
        table = self._table
        self._expiry.catch_up(now, key)
        self._journal.begin(key, table.lease_count)
        state = table.keys.get(key)
        held = table.owned.get((key, principal, owner)) if owner is not None else None
        if state is None:
            verdict = core.admit_free(key, mode, limit)
        else:
            verdict = core.admit(
                key,
                mode,
                limit,
                held_mode=state.mode,
                held_count=state.count,
                key_limit=state.limit,
                queued=state.q_len,
                own_hold=held,
                blocking=wait_ms is not None,
            )
        if isinstance(verdict, Refused):
            return verdict
        claim = Waiter(
            0, key, principal, owner, ttl_ms, conn, release_on_close, 0, mode, limit, pid, process
        )
        claim.pid_start = pid_start  # kept apart from the line above: fewer merge conflicts
        if state is None:
            return table.grant_fresh(now, claim)  # GRANT: a free key
        # A request changes only its own key: keep the key's state whole once.
        self._journal.undo.keep(state)
        if verdict == core.RETAKE:
            self._journal.changes.retakes += 1
        elif verdict == core.BUSY:
            assert state.first is not None
            return Busy(state.first)
        elif verdict == core.PARK:
            assert wait_ms is not None
            if wait_ms <= 0:
                return TimedOut()
            queues = self._queues
            cycle = queues.cycle_closed_by(state, claim)
            if cycle is not None:
                return Deadlock(cycle)
            claim.id, claim.deadline = queues.next_id(), now + wait_ms
            claim.since = now
            queues.enqueue(state, claim)
            return Parked(claim)
        return table.grant(now, state, claim)

    def renew(self, now: int, key: str, handle: str, ttl_ms: int) -> Lease | None:
        """Extend the lease if ``handle`` still holds ``key``; None means lost."""
        table, journal = self._table, self._journal
        self._expiry.catch_up(now, key)
        journal.begin(key, table.lease_count)
        lease = table.find(key, handle)
        if lease is None:
            return None
        undo = journal.undo
        undo.set_attr(lease, "ttl_ms", ttl_ms)
        undo.set_attr(lease, "expires_at", now + ttl_ms)
        self._deadlines.push_lease(lease)
        undo.put(journal.changes.rows, (key, lease.slot), lease)
        return lease

    def release(self, now: int, key: str, handle: str) -> bool:
        """End the hold of ``handle`` on ``key``; the queue is served from its head."""
        table = self._table
        self._expiry.catch_up(now, key)
        self._journal.begin(key, table.lease_count)
        lease = table.find(key, handle)
        if lease is None:
            return False
        state = table.keys[key]
        self._journal.undo.keep(state)
        self._queues.end_hold(now, state, lease)
        return True

    def break_lock(self, now: int, key: str) -> list[Lease]:
        """End every hold of ``key``; returns them, oldest first (empty: was free)."""
        table, journal = self._table, self._journal
        self._expiry.catch_up(now, key)
        journal.begin(key, table.lease_count)
        state = table.keys.get(key)
        if state is None:
            return []
        broken = list(holders(state))
        if state.q_len == 0:
            table.drop_key(key, state)
            return broken
        journal.undo.keep(state)
        for lease in broken:
            table.detach(state, lease)
            journal.undo.put(journal.changes.rows, (key, lease.slot), None)
        state.next_slot, state.free_slots = 0, None
        self._queues.serve(now, state)
        return broken

    def cancel_waiter(self, now: int, waiter: Waiter) -> None:
        """The waiter gave up (connection closed, request cancelled).

        A waiter that was already granted keeps its lease: the caller must
        release it if the reply cannot be delivered. The waiter leaves the
        queue *before* time moves on, so a lease that ran out meanwhile goes
        to the next waiter, not to this one that is no longer listening.
        """
        self._journal.undo.stop()  # a fact, not a request: never rolled back
        if not waiter.resolved:
            waiter.cancelled = True
            self._queues.leave(now, waiter)
        self._expiry.catch_up(now, None)

    def connection_closed(self, now: int, conn: int, *, release_bound: bool = True) -> list[Lease]:
        """Drop the connection's waiters and release its bound leases.

        With ``release_bound=False`` (the daemon is stopping, not the client
        leaving) the bound leases stay as ordinary TTL leases instead, as they
        would across a crash. Waiters leave first, for the reason given in
        :meth:`cancel_waiter`.
        """
        self._journal.undo.stop()  # a fact, not a request: never rolled back
        table, queues, expiry = self._table, self._queues, self._expiry
        # Every waiter of the connection leaves before any queue is served,
        # so none of them is granted on the way out.
        heads_left: dict[str, KeyState] = {}
        for waiter_id in sorted(queues.conn_waiters.get(conn, ())):
            waiter = queues.waiters[waiter_id]
            waiter.cancelled = True
            state = table.keys[waiter.key]
            if state.q_first is waiter:
                heads_left[waiter.key] = state
            queues.dequeue(state, waiter)
        for state in heads_left.values():
            queues.serve(now, state)
        expiry.catch_up(now, None)
        released = []
        for lease in sorted(table.conn_leases.pop(conn, ()), key=lambda held: held.fence):
            if expiry.behind:
                expiry.settle(now, lease.key)
            if lease.conn != conn or not table.holds(lease):
                continue
            if release_bound:
                released.append(lease)
                queues.end_hold(now, table.keys[lease.key], lease)
            else:
                lease.conn = None
        return released

    # ------------------------------------------------------------------ views

    def find(self, key: str, handle: str) -> Lease | None:
        """The hold of ``handle`` on ``key`` as the engine has it (no time passes)."""
        self._coldpath.warm_key(key)
        return self._table.find(key, handle)

    def status(self, now: int, key: str) -> KeyStatus:
        self._expiry.catch_up(now, key)
        return key_status(key, self._table.keys.get(key))

    def list_held(
        self, now: int, prefix: str = "", limit: int = 1000, after: str | None = None
    ) -> ListPage:
        """Held keys under ``prefix`` in key order, at most ``limit``, after ``after``.

        O(limit + log n): see :func:`lockd.daemon.engineviews.list_page`.
        """
        if self._coldpath.cold.loading:
            self.finish_restore(now)  # a page shows every key: all of them first
        self._expiry.catch_up(now, None)
        return list_page(self._table, self._coldpath, self._expiry, now, prefix, limit, after)

    # ----------------------------------------------------------------- memory

    def demote(self, now: int) -> int:
        """Send settled keys back to the store; how many went (see :mod:`lockd.daemon.demoted`).

        Call it right after a commit (:meth:`drain`): a demoted key's rows
        must be in the store, since they are what the engine reads when it
        needs the key again. The least recently touched keys go first, while
        more than :data:`HOT_KEYS` keys are tracked, or when untouched for
        :data:`IDLE_MS`. A key stays when it has waiters or a lease bound to
        its connection (those live in memory only); it is then looked at
        again later. Like a load, a demotion changes nothing anyone can
        see: the key answers every request as before, after one read.
        """
        return self._coldpath.demote(
            now, hot_keys=HOT_KEYS, idle_ms=IDLE_MS, batch=DEMOTE_BATCH, retry_ms=DEMOTE_RETRY_MS
        )

    # ------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (for tests)."""
        check_engine(self._table, self._queues.waiters, self._coldpath.cold)
