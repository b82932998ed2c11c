"""Leases found at start that nothing has touched yet, kept in a few flat arrays.

A daemon restarted with a million leases in its database used to make the
engine's objects for every one of them (~650 B and ~8 us each: a lease, a
key state, a heap entry, index entries) before it could answer. Most of
those keys are not touched again before their lease ends. So the store
hands over only each lease's key and deadline; a key's full rows are read
the first time the engine needs the key: a request names it, a ``list``
page shows it, or its first deadline comes. Until then a lease costs ~75
bytes here instead of ~650 in the engine.

Per lease, in (key, slot) order, so a key's leases are neighbours:

* its key, UTF-8, back to back with the others in one ``bytes``, and where
  it starts: membership and ``list`` pages by bisection;
* its deadline, with its number in one int (``deadline << 32 | number``),
  in a heap: the timer takes them earliest first, ties in key order. A
  heap is made in linear time; sorting a million deadlines that come in
  key order, not time order, took ~0.9 s (measured), ~5x the heap;
* a ``taken`` byte, set for all of a key's leases once the engine has
  loaded the key (from then on the engine's own state is the truth for it).

Everything here is pure data: no I/O, no clock. Reading the rows of a
taken key is the engine's injected loader (the store, in the daemon).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

#: keys between two entries of the first-level index (see ColdLeases._posts).
POST_EVERY = 16
#: low bits of a deadline entry that hold the lease's number (see ColdLeases._heap).
NUMBER_BITS = 32
_NUMBER = (1 << NUMBER_BITS) - 1


class _KeyView:
    """Lease i's key as bytes, for :mod:`bisect` (which only needs a sequence)."""

    __slots__ = ("_blob", "_offsets")

    def __init__(self, blob: bytearray, offsets: array[int]) -> None:
        self._blob, self._offsets = blob, offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> bytearray:
        offsets = self._offsets
        return self._blob[offsets[i] : offsets[i + 1]]


class ColdLeases:
    """The keys and deadlines of the leases loaded at start and not taken yet."""

    def __init__(self) -> None:
        """No cold leases (see :meth:`build`)."""
        self._blob = bytearray()
        #: lease i's key is _blob[_offsets[i]:_offsets[i + 1]].
        self._offsets = array("Q", [0])
        self._keys = _KeyView(self._blob, self._offsets)
        #: ``deadline << NUMBER_BITS | lease number`` of every lease, a heap.
        self._heap: list[int] = []
        #: entries the timer took off the heap, earliest first, not known taken.
        self._ahead: deque[int] = deque()
        self._taken = bytearray()
        #: every POST_EVERY-th key: bisecting this list is C all the way, and
        #: leaves a few steps through _KeyView (Python calls) to go.
        self._posts: list[bytes] = []
        #: keys and leases not taken yet.
        self.key_count = 0
        self.lease_count = 0

    @classmethod
    def build(cls, batches: Iterable[Sequence[tuple[Any, ...]]]) -> ColdLeases:
        """From batches of (UTF-8 key, deadline) rows, in (key, slot) order.

        Each batch is taken apart by C loops (``map``, ``join``), not a
        Python step per row: at a million rows that is most of the start.
        """
        cold = cls()
        first, second = operator.itemgetter(0), operator.itemgetter(1)
        for rows in batches:
            if rows:
                cold._append(list(map(first, rows)), map(second, rows))
        heapq.heapify(cold._heap)
        cold._taken = bytearray(cold.lease_count)
        return cold

    def extend(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Add (UTF-8 key, deadline) rows after the last key here, before :meth:`finish`.

        A restore in chunks (:meth:`LockEngine.restore_lazily
        <lockd.daemon.engine.LockEngine.restore_lazily>`): keys and
        membership work at once, deadlines only once finished.
        """
        if rows:
            self._append(list(map(operator.itemgetter(0), rows)), map(operator.itemgetter(1), rows))
            self._taken += bytes(len(self._offsets) - 1 - len(self._taken))

    def finish(self) -> None:
        """The last chunk is in: order the deadlines (a heap, made in linear time)."""
        heapq.heapify(self._heap)

    @classmethod
    def of(cls, leases: Iterable[tuple[bytes, int]]) -> ColdLeases:
        """From (UTF-8 key, deadline) pairs in key order, all at once."""
        return cls.build([list(leases)])

    def _append(self, keys: list[bytes], deadlines: Iterable[int]) -> None:
        # Leases so far, taken ones too (lease_count leaves those out: extend()).
        stored = len(self._offsets) - 1
        # The batch with the last key of the one before: a key's leases may straddle.
        ordered = [bytes(self._keys[stored - 1]), *keys] if stored else keys
        # One pass when no key has several leases (the common case), two otherwise.
        pairs = len(ordered) - 1
        rising = sum(map(operator.lt, ordered, itertools.islice(ordered, 1, None)))
        repeats = 0 if rising == pairs else sum(map(operator.eq, ordered, ordered[1:]))
        if rising + repeats != pairs:
            raise ValueError("cold leases must come in key order")
        self._posts.extend(keys[-stored % POST_EVERY :: POST_EVERY])
        start = len(self._blob)
        self._blob += b"".join(keys)
        ends = itertools.accumulate(map(len, keys), initial=start)
        self._offsets.extend(itertools.islice(ends, 1, None))  # ``start`` is there already
        numbers = range(stored, stored + len(keys))
        shifted = map(operator.lshift, deadlines, itertools.repeat(NUMBER_BITS))
        self._heap.extend(map(operator.or_, shifted, numbers))
        self.lease_count += len(keys)
        self.key_count += len(keys) - repeats

    # ------------------------------------------------------------ keys

    def _find(self, key: str) -> int:
        """The number of the key's first lease if it is cold, else -1."""
        if not self.key_count:
            return -1
        raw = key.encode()
        i = self._bisect(raw, bisect.bisect_left)
        if i < len(self._taken) and not self._taken[i] and self._keys[i] == raw:
            return i
        return -1

    def _bisect(self, raw: bytes, find: Callable[..., int]) -> int:
        """``find`` (bisect_left or _right) of ``raw`` among the keys, posts first.

        The posts narrow it to POST_EVERY + 1 keys (a key's leases may
        straddle a post): ~1.5 us for a million keys instead of ~6 (measured).
        """
        j = find(self._posts, raw)
        lo = max(0, (j - 1) * POST_EVERY)
        hi = min(len(self._keys), j * POST_EVERY + 1)
        return find(self._keys, raw, lo, hi)

    def __contains__(self, key: str) -> bool:
        return self._find(key) >= 0

    def take(self, key: str) -> bool:
        """Hand ``key`` over to the engine (it loads its rows); False if it is not cold."""
        i = self._find(key)
        if i < 0:
            return False
        self._take(i)
        return True

    def _take(self, first: int) -> None:
        """Mark the leases of the key whose first lease is ``first`` as taken."""
        raw = self._keys[first]
        end = first + 1
        while end < len(self._taken) and self._keys[end] == raw:
            end += 1
        self._taken[first:end] = b"\x01" * (end - first)
        self.key_count -= 1
        self.lease_count -= end - first

    def keys_from(self, start: str, inclusive: bool) -> Iterator[str]:
        """Cold keys >= ``start`` (> when not ``inclusive``) in key order."""
        if not self.key_count:
            return
        raw = start.encode()
        find = bisect.bisect_left if inclusive else bisect.bisect_right
        taken, keys = self._taken, self._keys
        prev = None
        for i in range(self._bisect(raw, find), len(taken)):
            if not taken[i]:
                key = keys[i]
                if key != prev:
                    yield key.decode()
                    prev = key

    # ------------------------------------------------------------ deadlines

    def next_deadline(self) -> int | None:
        """The earliest deadline of a lease not taken yet."""
        ahead, heap, taken = self._ahead, self._heap, self._taken
        while ahead and taken[ahead[0] & _NUMBER]:
            ahead.popleft()
        if ahead:
            return ahead[0] >> NUMBER_BITS
        while heap and taken[heap[0] & _NUMBER]:
            heapq.heappop(heap)
        return heap[0] >> NUMBER_BITS if heap else None

    def due(self, now: int, limit: int) -> list[str]:
        """Up to ``limit`` keys with a deadline <= ``now``, earliest first (not taken).

        Looking takes nothing: entries taken off the heap wait in
        ``_ahead`` (a failed read leaves their keys cold, still due).
        """
        keys: list[str] = []
        seen: set[int] = set()
        if self.next_deadline() is None:
            return keys
        ahead, heap, taken, view = self._ahead, self._heap, self._taken, self._keys
        at = 0
        while len(keys) < limit:
            if at == len(ahead):
                if not heap:
                    break
                ahead.append(heapq.heappop(heap))
            entry = ahead[at]
            at += 1
            if entry >> NUMBER_BITS > now:
                break
            i = entry & _NUMBER
            if taken[i]:
                continue
            while i > 0 and view[i - 1] == view[i]:  # the key's first lease
                i -= 1
            if i not in seen:
                seen.add(i)
                keys.append(view[i].decode())
        return keys
