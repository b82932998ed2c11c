"""Time passing in the engine: leases run out, waits end, cold keys come due, in time order.

The engine (:mod:`lockd.daemon.engine`) has no clock: it is told ``now``.
:meth:`Expiry.advance` applies every deadline that has come -- a lease's
expiry (the hold ends, its queue is served), a waiter's timeout (it
leaves its queue), a cold key's first deadline (it is loaded or expired on
its way in) -- in time order and at most a budget of them per call, so a
mass expiry is spread over many timer passes. While the timer is behind,
a request settles its own key first (:meth:`Expiry.settle`): keys are
independent, so that changes nothing another key shows.

This is the one place that orders events in time. It is separate from the
heaps it reads (:mod:`lockd.daemon.deadlines`), from the queue service it
hands each ended hold or wait to (:mod:`lockd.daemon.waitqueue`), and from
the loading of cold keys (:mod:`lockd.daemon.coldpath`).
"""

from __future__ import annotations

from lockd.daemon.coldpath import ColdPath
from lockd.daemon.deadlines import Deadlines
from lockd.daemon.journal import Journal
from lockd.daemon.keytable import KeyTable, holders
from lockd.daemon.waitqueue import WaitQueues

#: cold keys (see :mod:`lockd.daemon.cold`) loaded by one call of the loader.
LOAD_BATCH = 256
#: due deadlines a request applies on its way in, before settling its own key.
REQUEST_CHUNK = 64


class Expiry:
    """Applies due deadlines; knows whether the timer is behind."""

    def __init__(
        self,
        table: KeyTable,
        deadlines: Deadlines,
        queues: WaitQueues,
        coldpath: ColdPath,
        journal: Journal,
    ) -> None:
        self._table = table
        self._deadlines = deadlines
        self._queues = queues
        self._coldpath = coldpath
        self._journal = journal
        #: set when a bounded :meth:`advance` left due deadlines unapplied;
        #: requests then settle their own key first (:meth:`settle`).
        self.behind = False
        #: while set (boot ms), no lease runs out after this time: see
        #: :meth:`hold_leases`. Waiters' deadlines are not held.
        self.leases_held_at: int | None = None

    def hold_leases(self, at: int) -> None:
        """Let no lease (nor cold key) run out after ``at`` until :meth:`release_leases`.

        The daemon holds them while the requests that came during a
        restart's integrity check wait for it (``LockServer.gate_for_check``):
        a holder that sent its renew before its deadline must find its lease
        when the renew is judged, after the check, however long the check
        took. Nobody else loses by it: no key can be granted before the
        check passed either. Leases whose deadline was at or before ``at``
        run out as usual.
        """
        self.leases_held_at = at

    def release_leases(self) -> None:
        """Let leases run out again; those whose deadline passed meanwhile go at the next pass."""
        self.leases_held_at = None

    def _lease_now(self, now: int) -> int:
        """The time leases are judged at: ``now``, or the hold's time while leases are held."""
        held = self.leases_held_at
        return now if held is None or now < held else held

    def next_deadline(self) -> int | None:
        """The earliest lease expiry or waiter deadline still pending.

        While leases are held (:meth:`hold_leases`), a lease deadline after
        the hold's time is not pending: the timer is not to wake for it.
        """
        deadlines = self._deadlines
        deadlines.prune(self._table)
        held = self.leases_held_at
        candidates = []
        if deadlines.lease_heap and (held is None or deadlines.lease_heap[0][0] <= held):
            candidates.append(deadlines.lease_heap[0][0])
        if deadlines.waiter_heap:
            candidates.append(deadlines.waiter_heap[0][0])
        cold = self._coldpath.cold
        if (
            cold.key_count
            and (cold_at := cold.next_deadline()) is not None
            and (held is None or cold_at <= held)
        ):
            candidates.append(cold_at)
        return min(candidates) if candidates else None

    def due(self, now: int) -> bool:
        """A deadline has come: the next request or tick applies it first."""
        deadline = self.next_deadline()
        return deadline is not None and deadline <= now

    def advance(self, now: int, budget: int | None = None) -> bool:
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
        journal = self._journal
        if not journal.undo.recording or self.due(now):
            journal.undo.stop()
        coldpath = self._coldpath
        coldpath.last_now = max(coldpath.last_now, now)
        deadlines, table, queues = self._deadlines, self._table, self._queues
        lease_now = self._lease_now(now)
        applied = 0
        caught_up = False
        cold = coldpath.cold
        while budget is None or applied < budget:
            deadlines.prune(table)
            heap, wheap = deadlines.lease_heap, deadlines.waiter_heap
            lease_at = heap[0][0] if heap else None
            waiter_at = wheap[0][0] if wheap else None
            cold_at = cold.next_deadline() if cold.key_count else None
            if (
                cold_at is not None
                and cold_at <= lease_now
                and (lease_at is None or cold_at < lease_at)
                and (waiter_at is None or cold_at <= waiter_at)
            ):
                # Cold keys come due: expire them, or load them and let the
                # heap order what follows. Each counts against the budget.
                # Keys are independent of each other, so which of two keys
                # goes first is nobody's business: a tie with a loaded lease
                # goes to the loaded one.
                room = LOAD_BATCH if budget is None else min(LOAD_BATCH, budget - applied)
                due = cold.due(lease_now, room)
                coldpath.warm(due, lease_now)
                applied += len(due)
                continue
            if (
                lease_at is not None
                and lease_at <= lease_now
                and (waiter_at is None or lease_at <= waiter_at)
            ):
                lease = deadlines.pop_lease()
                journal.changes.expired.append(lease)
                queues.end_hold(now, table.keys[lease.key], lease, lease_at)
            elif waiter_at is not None and waiter_at <= now:
                waiter = deadlines.pop_waiter()
                waiter.timed_out = True
                journal.changes.resolved.append(waiter)
                queues.leave(now, waiter, waiter_at)
            else:
                caught_up = True
                break
            applied += 1
        else:
            caught_up = (next_due := self.next_deadline()) is None or next_due > now
        self.behind = not caught_up
        deadlines.compact_if_bloated(table)
        return caught_up

    def quiet(self, now: int) -> bool:
        """No deadline has come by ``now`` and the timer is not behind (the fast path's check).

        Reads the heaps' tops as they are: a dead entry on top can only make
        it answer False, so it never answers True when :meth:`due` would be
        true. Then :meth:`catch_up` would apply nothing, and
        :meth:`pass_quietly` does what is left of it.
        """
        if self.behind:
            return False
        deadlines = self._deadlines
        lease_now = now if self.leases_held_at is None else self._lease_now(now)
        heap = deadlines.lease_heap
        if heap and heap[0][0] <= lease_now:
            return False
        wheap = deadlines.waiter_heap
        if wheap and wheap[0][0] <= now:
            return False
        cold = self._coldpath.cold
        if cold.key_count:
            cold_at = cold.next_deadline()
            if cold_at is not None and cold_at <= lease_now:
                return False
        return True

    def pass_quietly(self, now: int, key: str) -> None:
        """:meth:`catch_up` for a loaded ``key`` when :meth:`quiet` said nothing is due.

        Nothing is applied; what stays is its bookkeeping: the key is the
        most recently used (demotion), and dead heap entries do not pile up.
        """
        coldpath = self._coldpath
        coldpath.last_now = now
        coldpath.touch(key)
        self._deadlines.compact_if_bloated(self._table)

    def catch_up(self, now: int, key: str | None) -> None:
        """Time passes before a request: a few due deadlines, then all of ``key``'s."""
        if key is not None:
            coldpath = self._coldpath
            coldpath.warm_key(key)
            coldpath.last_now = now
            coldpath.touch(key)
        if not self.advance(now, REQUEST_CHUNK) and key is not None:
            self.settle(now, key)

    def settle(self, now: int, key: str) -> None:
        """Expire ``key``'s holders that ran out, ahead of the timer that is behind.

        Keys are independent, so applying one key's deadlines ahead of the
        others' changes nothing another key shows; within the key they go in
        time order, and its waiters whose deadline passed are timed out when
        they reach the head (:meth:`WaitQueues.serve`). O(holders of the
        key), and only while :attr:`behind`.
        """
        keys = self._table.keys
        state = keys.get(key)
        if state is None:
            return
        lease_now = self._lease_now(now)
        due = [lease for lease in holders(state) if lease.expires_at <= lease_now]
        due.sort(key=lambda lease: (lease.expires_at, lease.fence))
        for lease in due:
            state = keys.get(key)
            if state is None:
                return  # the key was dropped: nothing of it is left to expire
            if not self._table.holds(lease):
                continue
            self._journal.changes.expired.append(lease)
            self._queues.end_hold(now, state, lease, lease.expires_at)
