"""Leases found at start that nothing has touched yet, kept in a few flat arrays.

A daemon restarted with a million leases in its database used to make the
engine's objects for every one of them (~650 B and ~8 us each: a lease, a
key state, a heap entry, index entries) before it could answer. Most of
those keys are not touched again before their lease ends. So the store
hands over only each lease's key and deadline; a key's full rows are read
the first time the engine needs the key: a request names it, a ``list``
page shows it, or its first deadline comes. Until then a lease costs ~35
bytes here instead of ~650 in the engine.

Per lease, in (key, slot) order, so a key's leases are neighbours:

* its key, UTF-8, back to back with the others in one ``bytes``, and where
  it starts: membership and ``list`` pages by bisection;
* its deadline, and (once, at start) the order of all leases by deadline:
  the timer walks that order; ties stay in key order;
* a ``taken`` byte, set for all of a key's leases once the engine has
  loaded the key (from then on the engine's own state is the truth for it).

Everything here is pure data: no I/O, no clock. Reading the rows of a
taken key is the engine's injected loader (the store, in the daemon).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


class _KeyView:
    """Lease i's key as bytes, for :mod:`bisect` (which only needs a sequence)."""

    __slots__ = ("_blob", "_offsets")

    def __init__(self, blob: bytes, offsets: array[int]) -> None:
        self._blob, self._offsets = blob, offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        offsets = self._offsets
        return self._blob[offsets[i] : offsets[i + 1]]


class ColdLeases:
    """The keys and deadlines of the leases loaded at start and not taken yet."""

    def __init__(self, keys: Sequence[bytes] = (), expires: Sequence[int] = ()) -> None:
        """From each lease's UTF-8 key and deadline, in key order (see :meth:`build`)."""
        if len(keys) != len(expires):
            raise ValueError("one deadline per key")
        if not all(map(operator.le, keys, itertools.islice(keys, 1, None))):
            raise ValueError("cold leases must come in key order")
        self._blob = b"".join(keys)
        self._offsets = array("Q", itertools.accumulate(map(len, keys), initial=0))
        self._keys = _KeyView(self._blob, self._offsets)
        self._expires = expires if isinstance(expires, array) else array("q", expires)
        # Sorted once, here: by deadline, ties in key order (sorted is stable).
        self._order = array("I", sorted(range(len(keys)), key=self._expires.__getitem__))
        self._next = 0
        self._taken = bytearray(len(keys))
        #: keys and leases not taken yet.
        self.lease_count = len(keys)
        self.key_count = self.lease_count - sum(
            map(operator.eq, keys, itertools.islice(keys, 1, None))
        )

    @classmethod
    def build(cls, batches: Iterable[list[tuple[Any, ...]]]) -> ColdLeases:
        """From batches of rows (UTF-8 key, deadline, ...), in (key, slot) order."""
        keys: list[bytes] = []
        expires = array("q")
        first, second = operator.itemgetter(0), operator.itemgetter(1)
        for rows in batches:  # C loops over each batch, not a Python step per row
            keys.extend(map(first, rows))
            expires.extend(map(second, rows))
        return cls(keys, expires)

    # ------------------------------------------------------------ keys

    def _find(self, key: str) -> int:
        """The number of the key's first lease if it is cold, else -1."""
        if not self.key_count:
            return -1
        raw = key.encode()
        i = bisect.bisect_left(self._keys, raw)
        if i < len(self._taken) and not self._taken[i] and self._keys[i] == raw:
            return i
        return -1

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
        for i in range(find(keys, raw), len(taken)):
            if not taken[i]:
                key = keys[i]
                if key != prev:
                    yield key.decode()
                    prev = key

    # ------------------------------------------------------------ deadlines

    def next_deadline(self) -> int | None:
        """The earliest deadline of a lease not taken yet."""
        order, taken, at = self._order, self._taken, self._next
        while at < len(order) and taken[order[at]]:
            at += 1
        self._next = at
        return self._expires[order[at]] if at < len(order) else None

    def take_due(self, now: int, limit: int) -> list[str]:
        """Take up to ``limit`` keys with a deadline <= ``now``, earliest first."""
        keys: list[str] = []
        while len(keys) < limit:
            at = self.next_deadline()
            if at is None or at > now:
                break
            i = self._order[self._next]
            raw = self._keys[i]
            while i > 0 and self._keys[i - 1] == raw:  # the key's first lease
                i -= 1
            self._take(i)
            keys.append(raw.decode())
        return keys
