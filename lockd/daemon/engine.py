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

Requests are all or nothing: a request's own changes are recorded in an undo
log, and :meth:`LockEngine.rollback` puts the engine back exactly as it was
before the request when its commit fails (disk full). Time passing and
clients leaving are facts, not requests: they are not undone, their effects
stay pending and go out with the next commit that succeeds.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from sortedcontainers import SortedList

from lockd import core
from lockd.core import EXCLUSIVE, SHARED, Refused
from lockd.core.deadlock import Budget, blockers, find_cycle
from lockd.daemon.cold import ColdLeases
from lockd.daemon.demoted import ColdKeys
from lockd.daemon.leases import (
    MAX_LISTED_HOLDERS,
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
from lockd.daemon.undo import UndoLog
from lockd.daemon.waiterview import MAX_LISTED_WAITERS

__all__ = [
    "EXCLUSIVE",
    "SHARED",
    "AcquireResult",
    "Busy",
    "Changes",
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
#: due deadlines a request applies on its way in, before settling its own key.
REQUEST_CHUNK = 64
#: cold keys (see :mod:`lockd.daemon.cold`) loaded by one call of the loader.
LOAD_BATCH = 256
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


#: One chunk of a restore (:meth:`LockEngine.restore_lazily`): the (UTF-8 key,
#: deadline) rows of whole keys after a key (None: from the first), in
#: (key, slot) order, and the last key looked at, or None after the last chunk.
ChunkReader = Callable[[str | None], tuple[list[tuple[bytes, int]], str | None]]


def _no_chunks(after: str | None) -> tuple[list[tuple[bytes, int]], str | None]:
    return [], None


#: Reads the stored leases of cold keys (:meth:`LockEngine.restore_cold`):
#: every lease of each key asked for, a key's leases together, keys in any
#: order. The daemon's is :meth:`lockd.daemon.store.Store.leases_of`.
LeaseLoader = Callable[[list[str]], Iterable[Lease]]


def _no_loader(keys: list[str]) -> Iterable[Lease]:
    raise AssertionError(f"no cold keys to load, asked for {keys[:3]}")


def _cold_status(group: list[Lease]) -> KeyStatus:
    """What status shows of a cold key, from its stored leases (as restore makes it)."""
    group.sort(key=lambda lease: lease.fence)  # oldest grant first
    newest = group[-1]
    return KeyStatus(
        newest.key, newest.mode, newest.limit, len(group), group[:MAX_LISTED_HOLDERS], 0
    )


def _by_key(leases: Iterable[Lease]) -> Iterator[list[Lease]]:
    """The leases of each key together, from a stream that keeps them together."""
    group: list[Lease] = []
    for lease in leases:
        if group and lease.key != group[0].key:
            yield group
            group = []
        group.append(lease)
    if group:
        yield group


class _KeyState:
    """Holders and waiters of one key (only keys with a holder are tracked)."""

    __slots__ = (
        "by_handle",
        "count",
        "first",
        "free_slots",
        "last",
        "limit",
        "mode",
        "next_slot",
        "q_first",
        "q_last",
        "q_len",
    )

    def __init__(self, mode: str, limit: int) -> None:
        self.mode = mode
        self.limit = limit
        #: holders, linked oldest (``first``) to newest (``last``).
        self.count = 0
        self.first: Lease | None = None
        self.last: Lease | None = None
        #: handle -> lease, made once the key has had two holders at once (a
        #: key with one holder finds it at ``first``, and saves the dict).
        self.by_handle: dict[str, Lease] | None = None
        #: slots 0..next_slot-1 are in use except those in free_slots.
        self.next_slot = 0
        self.free_slots: list[int] | None = None
        #: waiters, linked in arrival order.
        self.q_first: Waiter | None = None
        self.q_last: Waiter | None = None
        self.q_len = 0


class LockEngine:
    """All keys, leases, waiters and the fence counter of one daemon."""

    def __init__(
        self,
        *,
        fence: int = 0,
        handle_factory: Callable[[], str] = new_handle_id,
    ) -> None:
        self._keys: dict[str, _KeyState] = {}
        #: the keys of ``_keys`` in order, so a ``list`` page costs
        #: O(page + log n) instead of sorting every key (docs/contract.md §3).
        self._sorted_keys = SortedList()
        self._fence = fence
        self._new_handle = handle_factory
        self._lease_count = 0
        #: (expires_at, fence, lease): the fence orders equal deadlines. Fences
        #: are unique per grant and a renewal re-pushes the same lease, so two
        #: entries never tie up to a lease that Python would have to compare.
        self._lease_heap: list[tuple[int, int, Lease]] = []
        self._waiter_heap: list[tuple[int, int]] = []
        self._waiters: dict[int, Waiter] = {}
        self._conn_waiters: dict[int, set[int]] = {}
        self._conn_leases: dict[int, set[Lease]] = {}
        #: (key, principal, owner) -> the hold a re-take would take back.
        self._owned: dict[tuple[str, str, str], Lease] = {}
        self._waiter_ids = itertools.count(1)
        self._changes = Changes()
        #: what the running request changed (see rollback()).
        self._undo = UndoLog()
        self._undo_mark: tuple[int, int, int, int, int | None, int] = (0, 0, 0, 0, None, 0)
        #: the keys the requests since the last drain() changed (one each).
        self._request_keys: set[str] = set()
        #: set when a bounded :meth:`advance` left due deadlines unapplied;
        #: requests then settle their own key first (:meth:`_settle`).
        self._behind = False
        #: keys restored but not loaded yet (restore_cold) or demoted since,
        #: and how to load them.
        self._cold = ColdKeys()
        self._load: LeaseLoader = _no_loader
        self._read_chunk: ChunkReader = _no_chunks
        #: tracked keys, least recently touched first, with when (see demote()).
        #: Keys dropped meanwhile leave lazily, when demote() meets them.
        self._touched: OrderedDict[str, int] = OrderedDict()
        #: the latest ``now`` the engine was given (the touch time of keys loaded).
        self._last_now = 0
        #: demote() does nothing before this (it found nothing to demote).
        self._demote_after = 0

    # ------------------------------------------------------------------ state

    @property
    def fence(self) -> int:
        """The last fence handed out (0 before the first grant ever)."""
        return self._fence

    @property
    def held_count(self) -> int:
        """Keys with at least one holder (a key without holders is not tracked)."""
        return len(self._keys) + self._cold.key_count

    @property
    def lease_count(self) -> int:
        """Holders over all keys."""
        return self._lease_count + self._cold.lease_count

    @property
    def waiter_count(self) -> int:
        return len(self._waiters)

    def restore(self, leases: Iterable[Lease], now: int) -> None:
        """Load leases kept by the store; those already run out are freed.

        The store streams them in key order, so a key's holders come
        together: each key is built as its rows go by, and a million leases
        load without a second copy of them in memory. The deadline heap is
        built once at the end (heapify is O(n), a push per lease is not).
        """
        for group in _by_key(leases):
            self._restore_key(group)
            self._lease_heap.extend((lease.expires_at, lease.fence, lease) for lease in group)
        heapq.heapify(self._lease_heap)
        self._sorted_keys.update(self._keys)
        # Leases that ran out while the daemon was down go in timer passes too.
        self._advance(now, EXPIRY_CHUNK)

    def restore_cold(self, cold: ColdLeases, load: LeaseLoader, now: int) -> None:
        """Take up the stored leases as cold keys, loading each when first needed.

        ``cold`` has each lease's key and deadline; ``load`` reads the full
        leases of the keys asked for (see :mod:`lockd.daemon.cold`). A key is
        loaded, as :meth:`restore` would have made it, before a request on
        it, a ``status``/``list`` that shows it, or its first deadline; to
        every caller the engine is the same as after :meth:`restore`.
        """
        if self._keys or self._cold.key_count:
            raise ValueError("restore_cold() is for a new engine")
        self._cold, self._load = ColdKeys(cold), load
        self._advance(now, EXPIRY_CHUNK)

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
        if self._keys or self._cold.key_count:
            raise ValueError("restore_lazily() is for a new engine")
        self._cold, self._load, self._read_chunk = ColdKeys(), load, read
        self._cold.loading = True

    @property
    def restoring(self) -> bool:
        """A restore in chunks is not complete yet (see :meth:`restore_lazily`)."""
        return self._cold.loading

    def restore_step(self, now: int) -> bool:
        """Take up the next chunk; True once the restore is complete.

        Only between commits: a row the engine has let go of but not yet
        deleted in the store would otherwise come back as a cold lease.
        Keys the engine took up meanwhile (loaded, granted, demoted) are
        its own already; their rows in the chunk are skipped.
        """
        cold = self._cold
        if not cold.loading:
            return True
        if self._undo.recording or self._changes.rows:
            raise RuntimeError("restore_step() runs between commits only")
        after = cold.frontier.decode() if cold.frontier else None
        rows, upto = self._read_chunk(after)
        if rows:
            first, last = rows[0][0].decode(), rows[-1][0].decode()
            mine = {
                key.encode()
                for keys in (
                    self._sorted_keys.irange(first, last),
                    cold.demoted.keys_from(first, inclusive=True),
                )
                for key in itertools.takewhile(lambda key: key <= last, keys)
            }
            cold.restored.extend([row for row in rows if row[0] not in mine] if mine else rows)
        if upto is not None:
            cold.frontier = upto.encode()
            return False
        cold.restored.finish()
        cold.loading = False
        self._advance(now, EXPIRY_CHUNK)  # leases that ran out while down, in passes
        return True

    def finish_restore(self, now: int) -> None:
        """Take up every chunk left (a ``list`` needs all keys); between commits only."""
        while not self.restore_step(now):
            pass

    def _warm(self, keys: list[str], now: int | None = None) -> None:
        """Load cold keys into the engine's state (they are cold no more).

        Not part of any request: loading changes nothing anyone can see,
        so a rollback of the requests around it keeps the keys loaded
        (:meth:`_loading`). With ``now`` (the timer's), a key whose every
        lease has run out by then expires on its way in, without state made
        for it and undone: a mass expiry after a restart costs a read per
        key, no more. That is a fact of time, never rolled back.
        """
        if now is not None:
            self._undo.stop()
        # Read first: a read that fails leaves the keys cold, none of them lost.
        leases = list(self._load(keys))
        with self._loading():
            for key in keys:
                self._cold.take(key)
            for group in _by_key(leases):
                if now is None or any(lease.expires_at > now for lease in group):
                    self._adopt(group)
                    continue
                group.sort(key=lambda lease: (lease.expires_at, lease.fence))
                for lease in group:
                    self._fence = max(self._fence, lease.fence)
                    self._changes.expired.append(lease)
                    self._changes.rows[(lease.key, lease.slot)] = None

    @contextlib.contextmanager
    def _loading(self) -> Iterator[None]:
        """Cold keys come in during a batch of requests: no part of the batch.

        A failed group commit rolls back every request of the batch (see
        :meth:`_begin`); a key loaded meanwhile stays loaded, with its
        leases counted, as if it had been loaded before the batch began.
        """
        count = self._lease_count
        with self._undo.paused():
            yield
        if self._undo.recording:
            resolved, expired, grants, retakes, fence, counted = self._undo_mark
            added = self._lease_count - count
            self._undo_mark = (resolved, expired, grants, retakes, fence, counted + added)

    def _adopt(self, group: list[Lease]) -> None:
        """Make a loaded cold key's state (all its leases) in the engine."""
        self._restore_key(group)
        self._sorted_keys.add(group[0].key)
        for lease in group:
            heapq.heappush(self._lease_heap, (lease.expires_at, lease.fence, lease))

    def _warm_key(self, key: str) -> None:
        """Load ``key`` if it is still cold, or maybe stored (before anything looks at it)."""
        cold = self._cold
        if (
            (cold.key_count or cold.loading)
            and key not in self._keys
            and (key in cold or cold.unknown(key))
        ):
            self._warm([key])

    def _restore_key(self, group: list[Lease]) -> None:
        """Make the state of one key from all its stored holders."""
        key = group[0].key
        if key in self._keys:
            raise ValueError(f"the leases of {key!r} must come together")
        self._touch(key)
        for lease in group:
            lease.conn = None  # a restart ends every connection binding
            if lease.fence > self._fence:
                self._fence = lease.fence
        if len(group) == 1:  # the common case, without the general bookkeeping
            lease = group[0]
            state = _KeyState(lease.mode, lease.limit)
            state.count, state.first, state.last = 1, lease, lease
            state.next_slot = lease.slot + 1
            state.free_slots = list(range(lease.slot)) or None
            self._keys[key] = state
            self._lease_count += 1
            if lease.owner is not None:
                self._owned[(key, lease.principal, lease.owner)] = lease
            return
        group.sort(key=lambda lease: lease.fence)  # oldest grant first
        state = self._keys[key] = _KeyState(group[-1].mode, group[-1].limit)
        used = {lease.slot for lease in group}
        state.next_slot = max(used) + 1
        free = [slot for slot in range(state.next_slot) if slot not in used]
        state.free_slots = free or None
        for lease in group:
            self._link(state, lease)
            self._index(lease)

    def drain(self) -> Changes:
        """Hand over the effects gathered so far (they were committed)."""
        changes, self._changes = self._changes, Changes()
        self._undo.stop()
        return changes

    @property
    def requests_pending(self) -> bool:
        """Requests changed state since the last drain: a rollback would undo them."""
        return self._undo.recording

    def pending(self) -> Changes:
        """The effects gathered so far, left in place until :meth:`drain`."""
        return self._changes

    def rollback(self) -> None:
        """Undo the requests since the last drain: their commit failed, so none of it happened.

        That is one request, or the batch of a group commit. Everything they
        changed goes back, their pending rows and woken waiters included;
        effects of time and of departed clients gathered before the first of
        them stay pending. Handed-out fences are not taken back (a
        skipped fence is harmless, a reused one is not).
        """
        if not self._undo.recording:
            return
        restored = self._undo.rollback()
        resolved, expired, grants, retakes, fence, lease_count = self._undo_mark
        changes = self._changes
        del changes.resolved[resolved:]
        del changes.expired[expired:]
        changes.grants, changes.retakes, changes.fence = grants, retakes, fence
        self._lease_count = lease_count
        for key in self._request_keys:
            self._index_key(key)
        # Heap entries are deleted lazily and may be gone for what came back.
        for obj in restored:
            if isinstance(obj, Lease) and self._holds(obj):
                self._push_lease(obj)
            elif isinstance(obj, Waiter) and self._waiters.get(obj.id) is obj:
                heapq.heappush(self._waiter_heap, (obj.deadline, obj.id))

    def due(self, now: int) -> bool:
        """A deadline has come: the next request or tick applies it first."""
        deadline = self.next_deadline()
        return deadline is not None and deadline <= now

    def next_deadline(self) -> int | None:
        """The earliest lease expiry or waiter deadline still pending."""
        self._prune_heaps()
        candidates = []
        if self._lease_heap:
            candidates.append(self._lease_heap[0][0])
        if self._waiter_heap:
            candidates.append(self._waiter_heap[0][0])
        if self._cold.key_count and (cold_at := self._cold.next_deadline()) is not None:
            candidates.append(cold_at)
        return min(candidates) if candidates else None

    def advance(self, now: int, budget: int | None = None) -> bool:
        """Let time pass: apply deadlines <= now, at most ``budget`` of them.

        True when none is left due; False when the budget ran out first (the
        timer comes back at once, see :data:`EXPIRY_CHUNK`).
        """
        return self._advance(now, budget)

    @property
    def behind(self) -> bool:
        """Deadlines already passed are still waiting for a timer pass."""
        return self._behind

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
        self._catch_up(now, key)
        self._begin(key)
        state = self._keys.get(key)
        held = self._owned.get((key, principal, owner)) if owner is not None else None
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
            return self._grant_fresh(now, claim)  # GRANT: a free key
        # A request changes only its own key: keep the key's state whole once.
        self._undo.keep(state)
        if verdict == core.RETAKE:
            self._changes.retakes += 1
        elif verdict == core.BUSY:
            assert state.first is not None
            return Busy(state.first)
        elif verdict == core.PARK:
            assert wait_ms is not None
            if wait_ms <= 0:
                return TimedOut()
            cycle = self._cycle_closed_by(state, claim)
            if cycle is not None:
                return Deadlock(cycle)
            claim.id, claim.deadline = next(self._waiter_ids), now + wait_ms
            claim.since = now
            self._enqueue(state, claim)
            return Parked(claim)
        return self._grant(now, state, claim)

    def _cycle_closed_by(self, state: _KeyState, claim: Waiter) -> list[str] | None:
        """The keys of the cycle of waits ``claim`` would close by parking, or None.

        Runs only when a blocking acquire is about to park; the graph and
        its bounds are :mod:`lockd.core.deadlock`'s.
        """
        if len(self._conn_waiters) == (claim.conn in self._conn_waiters):
            return None  # no other connection waits: nobody can wait for this one
        budget = Budget()
        first = self._blockers(state, claim, state.q_last, budget)
        if not first:
            return None

        def waits_of(conn: int) -> Iterator[tuple[str, set[int]]]:
            for waiter_id in self._conn_waiters.get(conn, ()):
                waiter = self._waiters[waiter_id]
                waited = self._keys.get(waiter.key)
                if waited is not None:
                    yield waiter.key, self._blockers(waited, waiter, waiter.prev, budget)

        return find_cycle(claim.conn, claim.key, first, waits_of, budget=budget)

    def _blockers(
        self, state: _KeyState, claim: Waiter, last_ahead: Waiter | None, budget: Budget
    ) -> set[int]:
        """The connections ``claim`` waits for: its key's holders, the queue to ``last_ahead``."""
        holders = ((lease.mode, lease.taken_by) for lease in self._holders(state))
        return blockers(
            claim.mode,
            claim.limit,
            holders,
            self._queue_back(last_ahead),
            conn=claim.conn,
            budget=budget,
        )

    @staticmethod
    def _queue_back(waiter: Waiter | None) -> Iterator[tuple[str, int | None]]:
        """Mode and connection of ``waiter`` and every waiter before it, nearest first."""
        while waiter is not None:
            yield waiter.mode, waiter.conn
            waiter = waiter.prev

    def renew(self, now: int, key: str, handle: str, ttl_ms: int) -> Lease | None:
        """Extend the lease if ``handle`` still holds ``key``; None means lost."""
        self._catch_up(now, key)
        self._begin(key)
        lease = self._find(key, handle)
        if lease is None:
            return None
        self._undo.set_attr(lease, "ttl_ms", ttl_ms)
        self._undo.set_attr(lease, "expires_at", now + ttl_ms)
        self._push_lease(lease)
        self._undo.put(self._changes.rows, (key, lease.slot), lease)
        return lease

    def release(self, now: int, key: str, handle: str) -> bool:
        """End the hold of ``handle`` on ``key``; the queue is served from its head."""
        self._catch_up(now, key)
        self._begin(key)
        lease = self._find(key, handle)
        if lease is None:
            return False
        state = self._keys[key]
        self._undo.keep(state)
        self._end_hold(now, state, lease)
        return True

    def break_lock(self, now: int, key: str) -> list[Lease]:
        """End every hold of ``key``; returns them, oldest first (empty: was free)."""
        self._catch_up(now, key)
        self._begin(key)
        state = self._keys.get(key)
        if state is None:
            return []
        broken = list(self._holders(state))
        if state.q_len == 0:
            self._drop_key(key, state)
            return broken
        self._undo.keep(state)
        for lease in broken:
            self._detach(state, lease)
            self._undo.put(self._changes.rows, (key, lease.slot), None)
        state.next_slot, state.free_slots = 0, None
        self._serve_queue(now, state)
        return broken

    def cancel_waiter(self, now: int, waiter: Waiter) -> None:
        """The waiter gave up (connection closed, request cancelled).

        A waiter that was already granted keeps its lease: the caller must
        release it if the reply cannot be delivered. The waiter leaves the
        queue *before* time moves on, so a lease that ran out meanwhile goes
        to the next waiter, not to this one that is no longer listening.
        """
        self._undo.stop()  # a fact, not a request: never rolled back
        if not waiter.resolved:
            waiter.cancelled = True
            self._leave_queue(now, waiter)
        self._catch_up(now, None)

    def connection_closed(self, now: int, conn: int, *, release_bound: bool = True) -> list[Lease]:
        """Drop the connection's waiters and release its bound leases.

        With ``release_bound=False`` (the daemon is stopping, not the client
        leaving) the bound leases stay as ordinary TTL leases instead, as they
        would across a crash. Waiters leave first, for the reason given in
        :meth:`cancel_waiter`.
        """
        self._undo.stop()  # a fact, not a request: never rolled back
        # Every waiter of the connection leaves before any queue is served,
        # so none of them is granted on the way out.
        heads_left: dict[str, _KeyState] = {}
        for waiter_id in sorted(self._conn_waiters.get(conn, ())):
            waiter = self._waiters[waiter_id]
            waiter.cancelled = True
            state = self._keys[waiter.key]
            if state.q_first is waiter:
                heads_left[waiter.key] = state
            self._dequeue(state, waiter)
        for state in heads_left.values():
            self._serve_queue(now, state)
        self._catch_up(now, None)
        released = []
        for lease in sorted(self._conn_leases.pop(conn, ()), key=lambda held: held.fence):
            if self._behind:
                self._settle(now, lease.key)
            if lease.conn != conn or not self._holds(lease):
                continue
            if release_bound:
                released.append(lease)
                self._end_hold(now, self._keys[lease.key], lease)
            else:
                lease.conn = None
        return released

    def find(self, key: str, handle: str) -> Lease | None:
        """The hold of ``handle`` on ``key`` as the engine has it (no time passes)."""
        self._warm_key(key)
        return self._find(key, handle)

    def status(self, now: int, key: str) -> KeyStatus:
        self._catch_up(now, key)
        return self._status(key, self._keys.get(key))

    def list_held(
        self, now: int, prefix: str = "", limit: int = 1000, after: str | None = None
    ) -> ListPage:
        """Held keys under ``prefix`` in key order, at most ``limit``, after ``after``.

        Keys under a prefix are contiguous in key order, so the page is a
        slice of the sorted index (merged with the cold keys', which are
        shown from their rows, read in one call, without loading them for
        good): O(limit + log n). While the timer is behind, each key is
        settled first and skipped if that freed it.
        """
        if self._cold.loading:
            self.finish_restore(now)  # a page shows every key: all of them first
        self._catch_up(now, None)
        if after is not None and after >= prefix:
            cursor, inclusive = after, False
        else:
            cursor, inclusive = prefix, True
        keys: list[str] = []
        #: cold keys of the page -> their stored leases.
        cold_rows: dict[str, list[Lease]] = {}
        exhausted = False
        while not exhausted and len(keys) <= limit:
            # A batch first: settling a key may take it out of the index.
            want = limit + 1 - len(keys)
            hot = self._sorted_keys.irange(minimum=cursor, inclusive=(inclusive, True))
            cold = list(itertools.islice(self._cold.keys_from(cursor, inclusive), want))
            batch = list(itertools.islice(heapq.merge(hot, cold), want))
            in_cold = set(cold)
            exhausted = len(batch) < want
            if batch:
                cursor, inclusive = batch[-1], False
            for at, key in enumerate(batch):
                if not key.startswith(prefix):
                    exhausted = True
                    del batch[at:]
                    break
            loaded = self._load([k for k in batch if k in in_cold]) if in_cold else ()
            for group in _by_key(loaded):
                key = group[0].key
                if self._behind and any(lease.expires_at <= now for lease in group):
                    with self._loading():  # ran out: to the engine, to be settled below
                        self._cold.take(key)
                        self._adopt(group)
                else:
                    cold_rows[key] = group
            for key in batch:
                if key in cold_rows:
                    keys.append(key)
                    continue
                if self._behind:
                    self._settle(now, key)
                if key in self._keys:
                    keys.append(key)
        more = len(keys) > limit
        del keys[limit:]
        return ListPage(
            [
                self._status(k, self._keys[k]) if k in self._keys else _cold_status(cold_rows[k])
                for k in keys
            ],
            keys[-1] if more else None,
        )

    # ----------------------------------------------------------------- memory

    def _touch(self, key: str) -> None:
        """``key`` is in use now: the last candidate for :meth:`demote`."""
        touched = self._touched
        touched[key] = self._last_now
        touched.move_to_end(key)

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
        touched = self._touched
        if (
            self._load is _no_loader
            or now < self._demote_after
            or self._undo.recording
            or self._changes.rows
            or not touched
        ):
            return 0
        idle_before = now - IDLE_MS
        demoted = kept = 0
        for _ in range(DEMOTE_BATCH):
            if not touched:
                break
            key, touched_at = next(iter(touched.items()))
            crowded = len(touched) > HOT_KEYS
            if not crowded and touched_at > idle_before:
                break
            del touched[key]
            state = self._keys.get(key)
            if state is None:
                continue  # dropped since it was touched
            if self._demote_key(key, state, now, soon=None if crowded else now + IDLE_MS):
                demoted += 1
            else:
                touched[key] = now  # looked at again after the others
                kept += 1
        if kept and not demoted:
            self._demote_after = now + DEMOTE_RETRY_MS  # all pinned: no rescan per commit
        return demoted

    def _demote_key(self, key: str, state: _KeyState, now: int, soon: int | None) -> bool:
        """Forget ``key``'s state, keeping its key and first deadline cold.

        Not when a lease of it ends by ``soon`` (it runs out hot, without a
        read), or when it must stay in memory (waiters, connection-bound,
        free slots: a reload must make exactly the state it had).
        """
        if state.q_len or state.free_slots:
            # Free slots below the last: which one the next holder gets
            # follows the order they were freed in, which the rows do not
            # keep. Such a key waits until its holders are contiguous again.
            return False
        if state.count == 1:  # the common case, without the loops
            assert state.first is not None
            held = [state.first]
            if state.first.conn is not None:
                return False
            first_end = state.first.expires_at
        else:
            held = list(self._holders(state))
            if any(lease.conn is not None for lease in held):
                return False
            first_end = min(lease.expires_at for lease in held)
        if first_end <= now or (soon is not None and first_end <= soon):
            return False
        if not self._cold.demoted.add(key, first_end, len(held)):
            return False
        del self._keys[key]
        self._sorted_keys.discard(key)
        self._lease_count -= len(held)
        for lease in held:
            if lease.owner is not None:
                owned = (key, lease.principal, lease.owner)
                if self._owned.get(owned) is lease:
                    del self._owned[owned]
        # Its heap entries are dead now (_lease_entry_live) and go lazily.
        return True

    # ---------------------------------------------------------------- holders

    def _status(self, key: str, state: _KeyState | None) -> KeyStatus:
        if state is None:
            return KeyStatus(key, None, None, 0, [], 0)
        listed = list(itertools.islice(self._holders(state), MAX_LISTED_HOLDERS))
        queue = list(itertools.islice(self._queued(state), MAX_LISTED_WAITERS))
        return KeyStatus(key, state.mode, state.limit, state.count, listed, state.q_len, queue)

    @staticmethod
    def _queued(state: _KeyState) -> Iterator[Waiter]:
        waiter = state.q_first
        while waiter is not None:
            yield waiter
            waiter = waiter.next

    @staticmethod
    def _holders(state: _KeyState) -> Iterator[Lease]:
        lease = state.first
        while lease is not None:
            yield lease
            lease = lease.next

    def _find(self, key: str, handle: str) -> Lease | None:
        state = self._keys.get(key)
        if state is None:
            return None
        if state.by_handle is not None:
            return state.by_handle.get(handle)
        first = state.first
        return first if first is not None and first.handle == handle else None

    def _holds(self, lease: Lease) -> bool:
        """Is ``lease`` a current hold (not released, expired, broken or re-taken)?"""
        return self._find(lease.key, lease.handle) is lease

    def _new_lease(self, now: int, claim: Waiter, slot: int) -> Lease:
        self._fence += 1
        lease = Lease(
            claim.key,
            self._new_handle(),
            self._fence,
            claim.owner,
            claim.principal,
            claim.ttl_ms,
            now + claim.ttl_ms,
            claim.conn if claim.release_on_close else None,
            claim.mode,
            claim.limit,
            slot,
            claim.pid,
            claim.process,
            claim.pid_start,
        )
        lease.taken_by = claim.conn
        return lease

    def _grant_fresh(self, now: int, claim: Waiter) -> Lease:
        """The common case, a key nobody holds: one new state, one undo entry."""
        lease = self._new_lease(now, claim, 0)
        state = _KeyState(claim.mode, claim.limit)
        state.count, state.first, state.last, state.next_slot = 1, lease, lease, 1
        self._undo.put(self._keys, claim.key, state)
        self._sorted_keys.add(claim.key)
        self._lease_count += 1
        self._granted(lease)
        return lease

    def _grant(self, now: int, state: _KeyState, claim: Waiter) -> Lease:
        """A new hold on a tracked key; a hold of the same principal and owner is taken back."""
        owner = claim.owner
        replaced = self._owned.get((claim.key, claim.principal, owner)) if owner else None
        if replaced is not None:
            self._detach(state, replaced)
            slot = replaced.slot
        else:
            slot = self._take_slot(state)
        lease = self._new_lease(now, claim, slot)
        self._link(state, lease)
        self._granted(lease)
        return lease

    def _granted(self, lease: Lease) -> None:
        self._index(lease)
        self._push_lease(lease)
        self._undo.put(self._changes.rows, (lease.key, lease.slot), lease)
        self._changes.fence = self._fence
        self._changes.grants += 1

    def _link(self, state: _KeyState, lease: Lease) -> None:
        """Append a new ``lease`` to the key's holders (it is the newest grant)."""
        last = state.last
        if last is None:
            state.first, state.mode, state.limit = lease, lease.mode, lease.limit
        else:
            self._undo.set_attr(last, "next", lease)
            if state.by_handle is None:
                state.by_handle = {last.handle: last}
        lease.prev, lease.next = last, None  # a new lease: nothing to undo on it
        state.last = lease
        state.count += 1
        if state.by_handle is not None:
            self._undo.put(state.by_handle, lease.handle, lease)
        self._lease_count += 1

    def _index(self, lease: Lease) -> None:
        """Make the lease findable by its owner and its connection."""
        if lease.owner is not None:
            self._undo.put(self._owned, (lease.key, lease.principal, lease.owner), lease)
        if lease.conn is not None:
            leases = self._conn_leases.get(lease.conn)
            if leases is None:
                leases = set()
                self._undo.put(self._conn_leases, lease.conn, leases)
            self._undo.add_to(leases, lease)

    def _detach(self, state: _KeyState, lease: Lease) -> None:
        """Take ``lease`` out of the key's holders and indexes (its slot stays taken)."""
        self._unlink(state, lease, "first", "last")
        state.count -= 1
        if state.by_handle is not None:
            self._undo.delete(state.by_handle, lease.handle)
        self._lease_count -= 1
        self._unindex(lease)

    def _unlink(self, state: _KeyState, node: Lease | Waiter, first: str, last: str) -> None:
        """Take ``node`` out of one of the key's lists (holders or queue) in O(1).

        The node keeps its own links, so undoing relinks it where it was.
        """
        prev, nxt = node.prev, node.next
        if prev is None:
            setattr(state, first, nxt)
        else:
            self._undo.set_attr(prev, "next", nxt)
        if nxt is None:
            setattr(state, last, prev)
        else:
            self._undo.set_attr(nxt, "prev", prev)

    def _unindex(self, lease: Lease) -> None:
        if lease.owner is not None:
            owned = (lease.key, lease.principal, lease.owner)
            if self._owned.get(owned) is lease:
                self._undo.delete(self._owned, owned)
        if lease.conn is not None:
            leases = self._conn_leases.get(lease.conn)
            if leases is not None:
                self._undo.discard_from(leases, lease)

    def _take_slot(self, state: _KeyState) -> int:
        if state.free_slots:
            return int(self._undo.pop_from(state.free_slots))
        state.next_slot += 1
        return state.next_slot - 1

    def _give_slot(self, state: _KeyState, slot: int) -> None:
        if slot == state.next_slot - 1:
            state.next_slot = slot
            return
        if state.free_slots is None:
            state.free_slots = []
        self._undo.append_to(state.free_slots, slot)

    def _end_hold(self, now: int, state: _KeyState, lease: Lease, at: int | None = None) -> None:
        """A holder is gone (release, expiry, close): serve the queue, or drop the key.

        ``at`` is when it happened if that was before ``now`` (an expiry
        applied late): see :meth:`_serve_queue`.
        """
        if state.count == 1 and state.q_len == 0:
            self._drop_key(lease.key, state)
            return
        self._detach(state, lease)
        self._give_slot(state, lease.slot)
        self._undo.put(self._changes.rows, (lease.key, lease.slot), None)
        self._serve_queue(now, state, at)

    def _drop_key(self, key: str, state: _KeyState) -> None:
        """The key's last holders leave and nobody waits: forget the key.

        The state object itself is left as it was, so undoing is putting it back.
        """
        self._undo.delete(self._keys, key)
        self._sorted_keys.discard(key)
        for lease in self._holders(state):
            self._lease_count -= 1
            self._unindex(lease)
            self._undo.put(self._changes.rows, (key, lease.slot), None)

    # ---------------------------------------------------------------- waiters

    def _serve_queue(self, now: int, state: _KeyState, at: int | None = None) -> None:
        """Grant the head of the queue while it fits (docs/contract.md §10: no overtaking).

        The key freed ``at`` (default: now). A waiter whose own deadline
        came before that has timed out and is not granted: in time order
        its timeout comes first. Only a late expiry or a request settling
        its key while the timer is behind meets such a waiter here.
        """
        dead_before = now + 1 if at is None else at
        timed_out: list[Waiter] = []
        owned = self._owned
        key = state.q_first.key if state.q_first is not None else None

        def holds_owned(principal: str, owner: str) -> bool:
            return (key, principal, owner) in owned

        for waiter in core.woken(
            state.mode,
            state.count,
            state.limit,
            self._live_heads(state, dead_before, timed_out),
            holds_owned=holds_owned,
        ):
            self._dequeue(state, waiter)
            self._undo.set_attr(waiter, "lease", self._grant(now, state, waiter))
            self._changes.resolved.append(waiter)
        if timed_out and state.count == 0 and state.q_len == 0:
            self._drop_key(timed_out[0].key, state)  # nobody left to hand the key to

    def _live_heads(
        self, state: _KeyState, dead_before: int, timed_out: list[Waiter]
    ) -> Iterator[Waiter]:
        """The head of the key's queue, read afresh each time (the caller grants it).

        A head whose deadline came before ``dead_before`` has timed out: it
        leaves the queue (noted in ``timed_out``) and is never offered.
        """
        while (waiter := state.q_first) is not None:
            if waiter.deadline < dead_before:
                self._undo.set_attr(waiter, "timed_out", True)
                self._changes.resolved.append(waiter)
                self._dequeue(state, waiter)
                timed_out.append(waiter)
                continue
            yield waiter

    def _enqueue(self, state: _KeyState, waiter: Waiter) -> None:
        last = state.q_last
        waiter.prev = last
        if last is None:
            state.q_first = waiter
        else:
            self._undo.set_attr(last, "next", waiter)
        state.q_last = waiter
        state.q_len += 1
        self._undo.put(self._waiters, waiter.id, waiter)
        ids = self._conn_waiters.get(waiter.conn)
        if ids is None:
            ids = set()
            self._undo.put(self._conn_waiters, waiter.conn, ids)
        self._undo.add_to(ids, waiter.id)
        heapq.heappush(self._waiter_heap, (waiter.deadline, waiter.id))

    def _dequeue(self, state: _KeyState, waiter: Waiter) -> None:
        """Unlink ``waiter`` from its key's queue and forget it: O(1) anywhere in the queue."""
        self._unlink(state, waiter, "q_first", "q_last")
        state.q_len -= 1
        self._undo.delete(self._waiters, waiter.id)
        ids = self._conn_waiters.get(waiter.conn)
        if ids is not None:
            self._undo.discard_from(ids, waiter.id)
            if not ids:
                self._undo.delete(self._conn_waiters, waiter.conn)

    def _leave_queue(self, now: int, waiter: Waiter, at: int | None = None) -> None:
        """A waiter left (timeout, cancel); if it was the head, the next may fit now."""
        if self._waiters.get(waiter.id) is not waiter:
            return
        state = self._keys[waiter.key]
        was_head = state.q_first is waiter
        self._dequeue(state, waiter)
        if was_head:
            self._serve_queue(now, state, at)

    # ------------------------------------------------------------------ time

    def _push_lease(self, lease: Lease) -> None:
        heapq.heappush(self._lease_heap, (lease.expires_at, lease.fence, lease))

    def _lease_entry_live(self, entry: tuple[int, int, Lease]) -> bool:
        expires_at, _, lease = entry
        return lease.expires_at == expires_at and self._holds(lease)

    def _prune_heaps(self) -> None:
        heap = self._lease_heap
        while heap and not self._lease_entry_live(heap[0]):
            heapq.heappop(heap)
        wheap = self._waiter_heap
        while wheap and wheap[0][1] not in self._waiters:
            heapq.heappop(wheap)

    def _advance(self, now: int, budget: int | None = None) -> bool:
        """Apply deadlines <= now in time order, at most ``budget``; True when none is left.

        Order matters when the timer runs late (a loaded box, a resume from
        suspend, a backlog of expiries): a waiter whose deadline came before
        a lease's expiry has timed out and must not be handed that key. At
        equal times the lease goes first, so a waiter whose deadline is the
        expiry still wins. Each event is applied as of its own time (``at``).
        Time passing is a fact: nothing here is recorded for a rollback, and
        a deadline applied ends the record of the requests before it (a group
        commit's batch must be committed before: see :meth:`due`).
        """
        if not self._undo.recording or self.due(now):
            self._undo.stop()
        self._last_now = max(self._last_now, now)
        heap, wheap = self._lease_heap, self._waiter_heap
        applied = 0
        caught_up = False
        cold = self._cold
        while budget is None or applied < budget:
            self._prune_heaps()
            lease_at = heap[0][0] if heap else None
            waiter_at = wheap[0][0] if wheap else None
            cold_at = cold.next_deadline() if cold.key_count else None
            if (
                cold_at is not None
                and cold_at <= now
                and (lease_at is None or cold_at < lease_at)
                and (waiter_at is None or cold_at <= waiter_at)
            ):
                # Cold keys come due: expire them, or load them and let the
                # heap order what follows. Each counts against the budget.
                # Keys are independent of each other, so which of two keys
                # goes first is nobody's business: a tie with a loaded lease
                # goes to the loaded one.
                room = LOAD_BATCH if budget is None else min(LOAD_BATCH, budget - applied)
                due = cold.due(now, room)
                self._warm(due, now)
                applied += len(due)
                continue
            if (
                lease_at is not None
                and lease_at <= now
                and (waiter_at is None or lease_at <= waiter_at)
            ):
                lease = heapq.heappop(heap)[2]
                self._changes.expired.append(lease)
                self._end_hold(now, self._keys[lease.key], lease, lease_at)
            elif waiter_at is not None and waiter_at <= now:
                waiter = self._waiters[heapq.heappop(wheap)[1]]
                waiter.timed_out = True
                self._changes.resolved.append(waiter)
                self._leave_queue(now, waiter, waiter_at)
            else:
                caught_up = True
                break
            applied += 1
        else:
            caught_up = (next_due := self.next_deadline()) is None or next_due > now
        self._behind = not caught_up
        self._compact_if_bloated()
        return caught_up

    def _catch_up(self, now: int, key: str | None) -> None:
        """Time passes before a request: a few due deadlines, then all of ``key``'s."""
        if key is not None:
            self._warm_key(key)
            self._last_now = now
            self._touch(key)
        if not self._advance(now, REQUEST_CHUNK) and key is not None:
            self._settle(now, key)

    def _settle(self, now: int, key: str) -> None:
        """Expire ``key``'s holders that ran out, ahead of the timer that is behind.

        Keys are independent, so applying one key's deadlines ahead of the
        others' changes nothing another key shows; within the key they go in
        time order, and its waiters whose deadline passed are timed out when
        they reach the head (:meth:`_serve_queue`). O(holders of the key),
        and only while :attr:`behind`.
        """
        state = self._keys.get(key)
        if state is None:
            return
        due = [lease for lease in self._holders(state) if lease.expires_at <= now]
        due.sort(key=lambda lease: (lease.expires_at, lease.fence))
        for lease in due:
            state = self._keys.get(key)
            if state is None:
                return  # the key was dropped: nothing of it is left to expire
            if not self._holds(lease):
                continue
            self._changes.expired.append(lease)
            self._end_hold(now, state, lease, lease.expires_at)

    def _compact_if_bloated(self) -> None:
        """Renewals leave dead heap entries; rebuild when they dominate."""
        if len(self._lease_heap) > 64 and len(self._lease_heap) > 4 * self._lease_count:
            self._lease_heap = [e for e in self._lease_heap if self._lease_entry_live(e)]
            heapq.heapify(self._lease_heap)
        if len(self._waiter_heap) > 64 and len(self._waiter_heap) > 4 * len(self._waiters):
            self._waiter_heap = [e for e in self._waiter_heap if e[1] in self._waiters]
            heapq.heapify(self._waiter_heap)

    def _index_key(self, key: str) -> None:
        """Make the sorted index agree with ``_keys`` about ``key`` (after an undo)."""
        if key in self._keys:
            if key not in self._sorted_keys:
                self._sorted_keys.add(key)
        else:
            self._sorted_keys.discard(key)

    def _begin(self, key: str) -> None:
        """A request on ``key`` starts: record what it changes until drain() or rollback().

        Requests of one group commit (several before a drain) share one
        record, and what time did between them joins it: a failed commit
        undoes every request of the batch, back to its first one's start.
        """
        if self._undo.recording:
            self._request_keys.add(key)
            return
        c = self._changes
        self._request_keys = {key}
        self._undo.begin()
        self._undo_mark = (
            len(c.resolved),
            len(c.expired),
            c.grants,
            c.retakes,
            c.fence,
            self._lease_count,
        )

    # ------------------------------------------------------------- checking

    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (for tests)."""
        leases = 0
        for key, state in self._keys.items():
            held = list(self._holders(state))
            assert held, f"{key}: tracked without a holder"
            assert len(held) == state.count and state.last is held[-1]
            leases += len(held)
            assert all(lease.key == key for lease in held)
            for lease in held:
                if lease.owner is not None:
                    assert self._owned[(key, lease.principal, lease.owner)] is lease
            assert all(lease.mode == state.mode and lease.limit == state.limit for lease in held)
            if state.mode == EXCLUSIVE:
                assert len(held) <= state.limit, f"{key}: {len(held)} > limit {state.limit}"
            else:
                assert state.limit == 1
            fences = [lease.fence for lease in held]
            assert fences == sorted(fences) and fences[-1] <= self._fence
            slots = [lease.slot for lease in held]
            assert len(set(slots)) == len(slots)
            free = set(state.free_slots or ())
            assert set(slots) | free == set(range(state.next_slot)) and not set(slots) & free
            if state.by_handle is not None:
                assert state.by_handle == {lease.handle: lease for lease in held}
            else:
                assert len(held) == 1
            queued = []
            waiter = state.q_first
            while waiter is not None:
                assert self._waiters.get(waiter.id) is waiter and waiter.key == key
                assert not waiter.resolved
                queued.append(waiter)
                waiter = waiter.next
            assert len(queued) == state.q_len
            if queued:
                head = queued[0]
                assert not core.fits(head.mode, state.mode, state.count, state.limit), (
                    f"{key}: the queue head fits but was not granted"
                )
        assert leases == self._lease_count
        assert list(self._sorted_keys) == sorted(self._keys)
        assert not any(key in self._cold for key in self._keys), "a key both cold and loaded"
        assert sum(s.q_len for s in self._keys.values()) == len(self._waiters)
        for owned, lease in self._owned.items():
            assert self._holds(lease) and owned == (lease.key, lease.principal, lease.owner)
