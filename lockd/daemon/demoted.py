"""Settled keys sent back to the database: a key and a deadline in ~72 bytes.

A lease the engine holds in full costs ~700 bytes (its object, handle, key
state, heap entry, index entries, the strings of the request that made it).
Most leases are taken and then left alone until they are released or run
out, and every one of them is already a committed row in the store. So the
engine keeps a bounded set of keys "hot" (recently touched) and *demotes*
the others here (:meth:`LockEngine.demote <lockd.daemon.engine.LockEngine.demote>`):
only the key and its earliest deadline stay in memory, and the engine reads
the key's rows again, as it does for the keys found at start
(:mod:`lockd.daemon.cold`), the first time a request, a ``list`` page or
that deadline needs it.

Per key (~72 bytes for a 9-character key):

* its UTF-8 bytes in a sorted list (membership, ``list`` pages);
* a slot number, and ``_slot_keys[slot]`` pointing at those same bytes;
* one 64-bit entry ``deadline << SLOT_BITS | slot`` in a binary heap kept
  in an ``array`` (8 bytes, not a 40-byte int object in a list).

A key taken back by the engine leaves the sorted list at once; its heap
entry goes when it reaches the top (lazy deletion), and only then is its
slot reused. A key demoted, taken and demoted again before the first entry
left may therefore come due early once: the engine loads it, finds its
leases still running, and keeps it -- loading is invisible, so that costs
a read and nothing else.

:class:`ColdKeys` joins these with the keys restored at start
(:class:`~lockd.daemon.cold.ColdLeases`): the engine asks one object.
Everything here is pure data: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Iterator

from sortedcontainers import SortedList

from lockd.daemon.cold import ColdLeases

#: low bits of a heap entry that hold the slot: up to 16 M demoted keys.
SLOT_BITS = 24
_SLOT = (1 << SLOT_BITS) - 1
#: deadlines must fit the 40 bits above the slot (boot-clock ms: 34 years).
MAX_DEADLINE = (1 << (64 - SLOT_BITS)) - 1


def _push(heap: array[int], entry: int) -> None:
    """Add ``entry`` to the min-heap ``heap`` (sift it up from the end)."""
    heap.append(entry)
    at = len(heap) - 1
    while at:
        parent = (at - 1) >> 1
        above = heap[parent]
        if above <= entry:
            break
        heap[at] = above
        at = parent
    heap[at] = entry


def _pop(heap: array[int]) -> int:
    """Remove and return the smallest entry of the non-empty min-heap ``heap``."""
    last = heap.pop()
    if not heap:
        return last
    top = heap[0]
    size = len(heap)
    at = 0
    while (child := 2 * at + 1) < size:
        if child + 1 < size and heap[child + 1] < heap[child]:
            child += 1
        if heap[child] >= last:
            break
        heap[at] = heap[child]
        at = child
    heap[at] = last
    return top


class DemotedKeys:
    """Keys the engine sent back to the store, each with its earliest deadline."""

    def __init__(self) -> None:
        self._keys: SortedList = SortedList()
        #: the key bytes of each slot with an entry in the heap (or ahead).
        self._slot_keys: list[bytes | None] = []
        self._free_slots = array("I")
        #: ``deadline << SLOT_BITS | slot``, a min-heap.
        self._heap = array("Q")
        #: entries due() took off the heap, earliest first, not known taken.
        self._ahead: deque[int] = deque()
        #: lease counts of the keys with more than one lease (the rest have one).
        self._several: dict[bytes, int] = {}
        #: the front entry last found live, until a take (asked after every request).
        self._front_live = -1
        self.key_count = 0
        self.lease_count = 0

    def add(self, key: str, deadline: int, leases: int) -> bool:
        """Keep ``key`` (held by ``leases`` leases, the first to end at ``deadline``).

        False when it does not fit (a deadline past :data:`MAX_DEADLINE`, or
        every slot in use): the engine then keeps the key itself.
        """
        if not 0 <= deadline <= MAX_DEADLINE:
            return False
        if self._free_slots:
            slot = self._free_slots.pop()
        elif len(self._slot_keys) <= _SLOT:
            slot = len(self._slot_keys)
            self._slot_keys.append(None)
        else:
            return False
        raw = key.encode()
        self._slot_keys[slot] = raw
        self._keys.add(raw)
        if leases > 1:
            self._several[raw] = leases
        entry = deadline << SLOT_BITS | slot
        ahead = self._ahead
        if ahead and entry < ahead[-1]:
            # due() took entries off the heap that end after this one: back
            # into the heap with them, or this deadline would wait behind them.
            for taken in ahead:
                _push(self._heap, taken)
            ahead.clear()
            self._front_live = -1
        _push(self._heap, entry)
        self.key_count += 1
        self.lease_count += leases
        return True

    def __contains__(self, key: str) -> bool:
        return key.encode() in self._keys

    def take(self, key: str) -> bool:
        """Hand ``key`` back to the engine (it loads its rows); False if it is not here."""
        raw = key.encode()
        if raw not in self._keys:
            return False
        self._keys.remove(raw)
        self._front_live = -1
        self.key_count -= 1
        self.lease_count -= self._several.pop(raw, 1)
        return True

    def keys_from(self, start: str, inclusive: bool) -> Iterator[str]:
        """Demoted keys >= ``start`` (> when not ``inclusive``) in key order."""
        for raw in self._keys.irange(minimum=start.encode(), inclusive=(inclusive, True)):
            yield raw.decode()

    # ------------------------------------------------------------ deadlines

    def _live(self, entry: int) -> bool:
        raw = self._slot_keys[entry & _SLOT]
        return raw is not None and raw in self._keys

    def _forget(self, entry: int) -> None:
        slot = entry & _SLOT
        self._slot_keys[slot] = None
        self._free_slots.append(slot)

    def next_deadline(self) -> int | None:
        """The earliest deadline of a key still here."""
        ahead, heap = self._ahead, self._heap
        front = ahead[0] if ahead else heap[0] if heap else -1
        if front == self._front_live >= 0:
            return front >> SLOT_BITS
        while ahead:
            if self._live(ahead[0]):
                self._front_live = ahead[0]
                return ahead[0] >> SLOT_BITS
            self._forget(ahead.popleft())
        while heap:
            if self._live(heap[0]):
                self._front_live = heap[0]
                return heap[0] >> SLOT_BITS
            self._forget(_pop(heap))
        return None

    def due(self, now: int, limit: int) -> list[str]:
        """Up to ``limit`` keys with a deadline <= ``now``, earliest first.

        Looking takes nothing: a failed read leaves the keys here, still due.
        """
        keys: list[str] = []
        seen: set[bytes] = set()
        if self.next_deadline() is None:
            return keys
        ahead, heap = self._ahead, self._heap
        at = 0
        while len(keys) < limit:
            if at == len(ahead):
                if not heap:
                    break
                ahead.append(_pop(heap))
            entry = ahead[at]
            at += 1
            if entry >> SLOT_BITS > now:
                break
            raw = self._slot_keys[entry & _SLOT]
            if raw is not None and raw not in seen and raw in self._keys:
                seen.add(raw)
                keys.append(raw.decode())
        return keys


class ColdKeys:
    """Every key the engine does not hold in full: restored at start, or demoted since."""

    def __init__(self, restored: ColdLeases | None = None) -> None:
        self.restored = restored if restored is not None else ColdLeases()
        self.demoted = DemotedKeys()
        #: a restore in chunks is under way: ``restored`` has the keys up to
        #: ``frontier`` (UTF-8) and no deadlines yet; a key past it is unknown.
        self.loading = False
        self.frontier = b""

    def unknown(self, key: str) -> bool:
        """Might the store hold leases of ``key`` that are not here yet (see ``loading``)?"""
        return self.loading and key.encode() > self.frontier

    @property
    def key_count(self) -> int:
        return self.restored.key_count + self.demoted.key_count

    @property
    def lease_count(self) -> int:
        return self.restored.lease_count + self.demoted.lease_count

    def __contains__(self, key: str) -> bool:
        return (self.restored.key_count > 0 and key in self.restored) or (
            self.demoted.key_count > 0 and key in self.demoted
        )

    def take(self, key: str) -> bool:
        """Hand ``key`` over to the engine; False if it is not cold."""
        return self.restored.take(key) or (self.demoted.key_count > 0 and self.demoted.take(key))

    def keys_from(self, start: str, inclusive: bool) -> Iterator[str]:
        """Cold keys >= ``start`` (> when not ``inclusive``), in key order (never in both)."""
        if not self.demoted.key_count:
            return self.restored.keys_from(start, inclusive)
        if not self.restored.key_count:
            return self.demoted.keys_from(start, inclusive)
        return heapq.merge(
            self.restored.keys_from(start, inclusive), self.demoted.keys_from(start, inclusive)
        )

    def next_deadline(self) -> int | None:
        has_restored = self.restored.key_count and not self.loading
        restored = self.restored.next_deadline() if has_restored else None
        demoted = self.demoted.next_deadline() if self.demoted.key_count else None
        if restored is None or demoted is None:
            return restored if demoted is None else demoted
        return min(restored, demoted)

    def due(self, now: int, limit: int) -> list[str]:
        """Up to ``limit`` cold keys with a deadline <= ``now`` (keys are independent)."""
        has_restored = self.restored.key_count and not self.loading
        keys = self.restored.due(now, limit) if has_restored else []
        if len(keys) < limit and self.demoted.key_count:
            keys += self.demoted.due(now, limit - len(keys))
        return keys
