"""Every held key's holders, the indexes that find them, and the fence counter.

This is the engine's state of *who holds what* (:mod:`lockd.daemon.engine`):
one :class:`KeyState` per key with a holder, its holders an intrusive doubly
linked list in grant order, and the indexes a request needs in O(1) -- by
handle, by (key, principal, owner) for a re-take, by connection for a close
-- plus a sorted index of the keys for ``list`` pages. It knows how to add a
hold, take one out and forget a key, each step written to the undo log so a
failed commit puts it back. It decides nothing: which request may hold is
:mod:`lockd.core`'s, when a hold ends is the engine's and the queue's
(:mod:`lockd.daemon.waitqueue`). It is separate so that the rules of the
lists and indexes, which every other part relies on, are in one place.

A key's queue hangs off its :class:`KeyState` too (a key with waiters has a
holder), but only :mod:`lockd.daemon.waitqueue` changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from sortedcontainers import SortedList

from lockd import core
from lockd.core import EXCLUSIVE
from lockd.daemon.deadlines import Deadlines
from lockd.daemon.demoted import ColdKeys
from lockd.daemon.journal import Journal
from lockd.daemon.leases import Lease, Waiter

#: keys whose place in the sorted index may lag behind (see ``KeyTable._unsorted``).
MAX_UNSORTED = 4096


class KeyState:
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


def holders(state: KeyState) -> Iterator[Lease]:
    """The key's holders, oldest grant first."""
    lease = state.first
    while lease is not None:
        yield lease
        lease = lease.next


def queued(state: KeyState) -> Iterator[Waiter]:
    """The key's waiters, in arrival order."""
    waiter = state.q_first
    while waiter is not None:
        yield waiter
        waiter = waiter.next


class KeyTable:
    """The held keys, their holders and indexes, the lease count and the fence counter."""

    def __init__(
        self, journal: Journal, deadlines: Deadlines, fence: int, new_handle: Callable[[], str]
    ) -> None:
        self._journal = journal
        self._undo = journal.undo
        self._deadlines = deadlines
        self.keys: dict[str, KeyState] = {}
        #: the keys of ``keys`` in order, so a ``list`` page costs
        #: O(page + log n) instead of sorting every key (docs/contract.md §3);
        #: read through :attr:`sorted_keys`, which brings it up to date.
        self._sorted = SortedList()
        #: keys added to or dropped from ``keys`` since ``_sorted`` was brought
        #: up to date. A SortedList insert or removal is ~5,000 instructions of
        #: Python: a key taken and let go between two ``list`` pages (the
        #: common case) costs two set insertions here instead.
        self._unsorted: set[str] = set()
        #: (key, principal, owner) -> the hold a re-take would take back.
        self.owned: dict[tuple[str, str, str], Lease] = {}
        self.conn_leases: dict[int, set[Lease]] = {}
        self.lease_count = 0
        self.fence = fence
        self._new_handle = new_handle

    # ---------------------------------------------------------------- lookups

    @property
    def sorted_keys(self) -> SortedList:
        """The keys of ``keys`` in order, up to date."""
        if self._unsorted:
            self._sort_changed()
        return self._sorted

    def _keys_changed(self, key: str) -> None:
        """``key`` came into ``keys`` or left it: the sorted index catches up when read."""
        unsorted = self._unsorted
        unsorted.add(key)
        if len(unsorted) > MAX_UNSORTED:
            self._sort_changed()  # bounded memory when nobody reads it

    def _sort_changed(self) -> None:
        ordered, keys = self._sorted, self.keys
        for key in self._unsorted:
            if key in keys:
                if key not in ordered:
                    ordered.add(key)
            else:
                ordered.discard(key)
        self._unsorted.clear()

    def find(self, key: str, handle: str) -> Lease | None:
        state = self.keys.get(key)
        if state is None:
            return None
        if state.by_handle is not None:
            return state.by_handle.get(handle)
        first = state.first
        return first if first is not None and first.handle == handle else None

    def holds(self, lease: Lease) -> bool:
        """Is ``lease`` a current hold (not released, expired, broken or re-taken)?"""
        return self.find(lease.key, lease.handle) is lease

    # ----------------------------------------------------------------- grants

    def _new_lease(self, now: int, claim: Waiter, slot: int) -> Lease:
        return self.new_lease(
            now,
            claim.key,
            claim.principal,
            claim.owner,
            claim.ttl_ms,
            claim.conn,
            claim.release_on_close,
            claim.mode,
            claim.limit,
            claim.pid,
            claim.process,
            claim.pid_start,
            slot,
        )

    def new_lease(
        self,
        now: int,
        key: str,
        principal: str,
        owner: str | None,
        ttl_ms: int,
        conn: int,
        release_on_close: bool,
        mode: str,
        limit: int,
        pid: int | None,
        process: str | None,
        pid_start: int | None,
        slot: int = 0,
    ) -> Lease:
        """A new hold with the next fence and a new handle (not yet anyone's)."""
        self.fence += 1
        lease = Lease(
            key,
            self._new_handle(),
            self.fence,
            owner,
            principal,
            ttl_ms,
            now + ttl_ms,
            conn if release_on_close else None,
            mode,
            limit,
            slot,
            pid,
            process,
            pid_start,
        )
        lease.taken_by = conn
        return lease

    def grant_fresh(self, now: int, claim: Waiter) -> Lease:
        """The common case, a key nobody holds: one new state, one undo entry."""
        return self.grant_free(self._new_lease(now, claim, 0))

    def grant_free(self, lease: Lease) -> Lease:
        """Make a new ``lease`` (slot 0) the only holder of its key, which nobody holds.

        The engine's fast path makes the lease without a waiter
        (:meth:`new_lease`, then this: :meth:`lockd.daemon.lonekeys.LoneKeys.grant`).
        """
        key = lease.key
        state = KeyState(lease.mode, lease.limit)
        state.count, state.first, state.last, state.next_slot = 1, lease, lease, 1
        self._undo.put(self.keys, key, state)
        self._keys_changed(key)
        self.lease_count += 1
        self._granted(lease)
        return lease

    def grant(self, now: int, state: KeyState, claim: Waiter) -> Lease:
        """A new hold on a tracked key; a hold of the same principal and owner is taken back."""
        owner = claim.owner
        replaced = self.owned.get((claim.key, claim.principal, owner)) if owner else None
        if replaced is not None:
            self.detach(state, replaced)
            slot = replaced.slot
        else:
            slot = self._take_slot(state)
        lease = self._new_lease(now, claim, slot)
        self.link(state, lease)
        self._granted(lease)
        return lease

    def _granted(self, lease: Lease) -> None:
        self.index(lease)
        self._deadlines.push_lease(lease)
        changes = self._journal.changes
        self._undo.put(changes.rows, (lease.key, lease.slot), lease)
        changes.fence = self.fence
        changes.grants += 1

    # ------------------------------------------------------- lists and indexes

    def link(self, state: KeyState, lease: Lease) -> None:
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
        self.lease_count += 1

    def index(self, lease: Lease) -> None:
        """Make the lease findable by its owner and its connection."""
        if lease.owner is not None:
            self._undo.put(self.owned, (lease.key, lease.principal, lease.owner), lease)
        if lease.conn is not None:
            leases = self.conn_leases.get(lease.conn)
            if leases is None:
                leases = set()
                self._undo.put(self.conn_leases, lease.conn, leases)
            self._undo.add_to(leases, lease)

    def detach(self, state: KeyState, lease: Lease) -> None:
        """Take ``lease`` out of the key's holders and indexes (its slot stays taken)."""
        self.unlink(state, lease, "first", "last")
        state.count -= 1
        if state.by_handle is not None:
            self._undo.delete(state.by_handle, lease.handle)
        self.lease_count -= 1
        self._unindex(lease)

    def unlink(self, state: KeyState, node: Lease | Waiter, first: str, last: str) -> None:
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
            if self.owned.get(owned) is lease:
                self._undo.delete(self.owned, owned)
        if lease.conn is not None:
            leases = self.conn_leases.get(lease.conn)
            if leases is not None:
                self._undo.discard_from(leases, lease)

    def _take_slot(self, state: KeyState) -> int:
        if state.free_slots:
            return int(self._undo.pop_from(state.free_slots))
        state.next_slot += 1
        return state.next_slot - 1

    def free(self, state: KeyState, lease: Lease) -> None:
        """``lease`` leaves a key that keeps other holders or waiters: its slot is free again."""
        self.detach(state, lease)
        slot = lease.slot
        if slot == state.next_slot - 1:
            state.next_slot = slot
        else:
            if state.free_slots is None:
                state.free_slots = []
            self._undo.append_to(state.free_slots, slot)
        self._undo.put(self._journal.changes.rows, (lease.key, slot), None)

    def drop_key(self, key: str, state: KeyState) -> None:
        """The key's last holders leave and nobody waits: forget the key.

        The state object itself is left as it was, so undoing is putting it back.
        """
        self._undo.delete(self.keys, key)
        self._keys_changed(key)
        rows = self._journal.changes.rows
        for lease in holders(state):
            self.lease_count -= 1
            self._unindex(lease)
            self._undo.put(rows, (key, lease.slot), None)

    def index_key(self, key: str) -> None:
        """Make the sorted index agree with ``keys`` about ``key`` (after an undo, a load)."""
        self._keys_changed(key)

    def undone(
        self,
        restored: list[object],
        lease_count: int,
        keys: set[str],
        waiters: dict[int, Waiter],
    ) -> None:
        """The undo log put back a batch of requests: make what it does not keep agree.

        ``restored`` are the objects whose fields came back, ``lease_count``
        the count before the batch, ``keys`` the keys it changed (their
        place in the sorted index), ``waiters`` the engine's by id. Heap
        entries are deleted lazily and may be gone for what came back.
        """
        self.lease_count = lease_count
        for key in keys:
            self.index_key(key)
        deadlines = self._deadlines
        pushed: set[int] = set()
        for obj in restored:
            if isinstance(obj, Lease):
                leases = [obj]
            elif isinstance(obj, KeyState):
                # A key the batch dropped or handed on (its hold released or
                # broken) is back with its holds; their heap entries may have
                # been pruned as dead meanwhile, and without one a hold never
                # runs out (a key wedged after a failed commit:
                # tests/unit/test_fastpath.py found it).
                leases = list(holders(obj))
            else:
                if isinstance(obj, Waiter) and waiters.get(obj.id) is obj:
                    deadlines.push_waiter(obj)
                continue
            for lease in leases:
                if id(lease) not in pushed and self.holds(lease):
                    pushed.add(id(lease))
                    deadlines.push_lease(lease)

    # -------------------------------------------------- restored and demoted

    def restore_key(self, group: list[Lease]) -> None:
        """Make the state of one key from all its stored holders (no heap entries)."""
        key = group[0].key
        if key in self.keys:
            raise ValueError(f"the leases of {key!r} must come together")
        for lease in group:
            lease.conn = None  # a restart ends every connection binding
            if lease.fence > self.fence:
                self.fence = lease.fence
        if len(group) == 1:  # the common case, without the general bookkeeping
            lease = group[0]
            state = KeyState(lease.mode, lease.limit)
            state.count, state.first, state.last = 1, lease, lease
            state.next_slot = lease.slot + 1
            state.free_slots = list(range(lease.slot)) or None
            self.keys[key] = state
            self.lease_count += 1
            if lease.owner is not None:
                self.owned[(key, lease.principal, lease.owner)] = lease
            return
        group.sort(key=lambda lease: lease.fence)  # oldest grant first
        state = self.keys[key] = KeyState(group[-1].mode, group[-1].limit)
        used = {lease.slot for lease in group}
        state.next_slot = max(used) + 1
        free = [slot for slot in range(state.next_slot) if slot not in used]
        state.free_slots = free or None
        for lease in group:
            self.link(state, lease)
            self.index(lease)

    def forget(self, key: str, held: list[Lease]) -> None:
        """Drop a demoted key's state; its rows stay in the store (no change to persist)."""
        del self.keys[key]
        self._keys_changed(key)
        self.lease_count -= len(held)
        for lease in held:
            if lease.owner is not None:
                owned = (key, lease.principal, lease.owner)
                if self.owned.get(owned) is lease:
                    del self.owned[owned]
        # Its heap entries are dead now (Deadlines.lease_live) and go lazily.


def check_invariants(table: KeyTable, waiters: dict[int, Waiter], cold: ColdKeys) -> None:
    """Assert the invariants :mod:`lockd.daemon.engine` keeps (for tests).

    ``waiters`` are the engine's by id, ``cold`` the keys not loaded.
    """
    leases = 0
    for key, state in table.keys.items():
        held = list(holders(state))
        assert held, f"{key}: tracked without a holder"
        assert len(held) == state.count and state.last is held[-1]
        leases += len(held)
        assert all(lease.key == key for lease in held)
        for lease in held:
            if lease.owner is not None:
                assert table.owned[(key, lease.principal, lease.owner)] is lease
        assert all(lease.mode == state.mode and lease.limit == state.limit for lease in held)
        if state.mode == EXCLUSIVE:
            assert len(held) <= state.limit, f"{key}: {len(held)} > limit {state.limit}"
        else:
            assert state.limit == 1
        fences = [lease.fence for lease in held]
        assert fences == sorted(fences) and fences[-1] <= table.fence
        slots = [lease.slot for lease in held]
        assert len(set(slots)) == len(slots)
        free = set(state.free_slots or ())
        assert set(slots) | free == set(range(state.next_slot)) and not set(slots) & free
        if state.by_handle is not None:
            assert state.by_handle == {lease.handle: lease for lease in held}
        else:
            assert len(held) == 1
        queue = list(queued(state))
        for waiter in queue:
            assert waiters.get(waiter.id) is waiter and waiter.key == key
            assert not waiter.resolved
        assert len(queue) == state.q_len
        if queue:
            head = queue[0]
            assert not core.fits(head.mode, state.mode, state.count, state.limit), (
                f"{key}: the queue head fits but was not granted"
            )
    assert leases == table.lease_count
    assert list(table.sorted_keys) == sorted(table.keys)
    assert not any(key in cold for key in table.keys), "a key both cold and loaded"
    assert sum(s.q_len for s in table.keys.values()) == len(waiters)
    for owned, lease in table.owned.items():
        assert table.holds(lease) and owned == (lease.key, lease.principal, lease.owner)
