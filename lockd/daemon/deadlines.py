"""When each lease runs out and each wait ends: two heaps with lazy deletion.

The engine (:mod:`lockd.daemon.engine`) must find its next deadline in
O(log n), without scanning its keys, on every request and timer pass. A
renewal, a release or a cancel does not look for the old entry: it is
left in its heap and skipped when it comes up (:meth:`Deadlines.prune`),
and the heaps are rebuilt when such dead entries dominate. This module is
only that bookkeeping; applying a deadline that came (expiring a hold,
ending a wait) is :mod:`lockd.daemon.expiry`'s. It is separate because
whether an entry is still live depends on the lock state
(:class:`~lockd.daemon.keytable.KeyTable`), which is passed in, not kept.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from lockd.daemon.leases import Lease, Waiter

if TYPE_CHECKING:
    from lockd.daemon.keytable import KeyTable


class Deadlines:
    """Lease expiries and waiter deadlines, earliest first."""

    __slots__ = ("lease_heap", "waiter_heap", "waiters")

    def __init__(self, waiters: dict[int, Waiter]) -> None:
        #: (expires_at, fence, lease): the fence orders equal deadlines. Fences
        #: are unique per grant and a renewal re-pushes the same lease, so two
        #: entries never tie up to a lease that Python would have to compare.
        self.lease_heap: list[tuple[int, int, Lease]] = []
        #: (deadline, waiter id); a waiter id not in ``waiters`` is dead.
        self.waiter_heap: list[tuple[int, int]] = []
        #: the engine's waiters by id (:class:`~lockd.daemon.waitqueue.WaitQueues`').
        self.waiters = waiters

    def push_lease(self, lease: Lease) -> None:
        heapq.heappush(self.lease_heap, (lease.expires_at, lease.fence, lease))

    def push_waiter(self, waiter: Waiter) -> None:
        heapq.heappush(self.waiter_heap, (waiter.deadline, waiter.id))

    def extend_leases(self, leases: list[Lease]) -> None:
        """Add many leases' entries; :meth:`heapify` must follow before the next read."""
        self.lease_heap.extend((lease.expires_at, lease.fence, lease) for lease in leases)

    def heapify(self) -> None:
        heapq.heapify(self.lease_heap)

    @staticmethod
    def lease_live(table: KeyTable, entry: tuple[int, int, Lease]) -> bool:
        expires_at, _, lease = entry
        return lease.expires_at == expires_at and table.holds(lease)

    def prune(self, table: KeyTable) -> None:
        """Pop dead entries off both heaps' tops, so their first entries are live."""
        heap = self.lease_heap
        while heap and not self.lease_live(table, heap[0]):
            heapq.heappop(heap)
        wheap = self.waiter_heap
        while wheap and wheap[0][1] not in self.waiters:
            heapq.heappop(wheap)

    def pop_lease(self) -> Lease:
        return heapq.heappop(self.lease_heap)[2]

    def pop_waiter(self) -> Waiter:
        return self.waiters[heapq.heappop(self.waiter_heap)[1]]

    def compact_if_bloated(self, table: KeyTable) -> None:
        """Renewals leave dead heap entries; rebuild when they dominate."""
        if len(self.lease_heap) > 64 and len(self.lease_heap) > 4 * table.lease_count:
            self.lease_heap = [e for e in self.lease_heap if self.lease_live(table, e)]
            heapq.heapify(self.lease_heap)
        if len(self.waiter_heap) > 64 and len(self.waiter_heap) > 4 * len(self.waiters):
            self.waiter_heap = [e for e in self.waiter_heap if e[1] in self.waiters]
            heapq.heapify(self.waiter_heap)
