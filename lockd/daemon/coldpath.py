"""Keys the engine keeps out of memory: taken up at start, loaded when needed, sent back.

A daemon that restarts with a million leases must answer at once, and one
that has served many keys must not keep them all in full. So the engine
(:mod:`lockd.daemon.engine`) holds some keys *cold*: only the key and its
first deadline (:mod:`lockd.daemon.cold` for those found at start,
:mod:`lockd.daemon.demoted` for those sent back), and the store's rows. A
cold key is loaded (:meth:`ColdPath.warm`) before a request on it, a
``status``/``list`` that shows it, or its first deadline; to every caller
it is the same as a loaded key. A restore in chunks
(:meth:`ColdPath.read_chunk`) answers meanwhile: a key past the chunks
read is read like a cold key.

This module owns that traffic between memory and the store -- the cold
keys, the loader, the least-recently-touched order of the loaded keys and
:meth:`ColdPath.demote` -- and is separate because none of it is a lock
rule: loading and demoting change nothing anyone can see.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from lockd.daemon.cold import ColdLeases
from lockd.daemon.deadlines import Deadlines
from lockd.daemon.demoted import ColdKeys
from lockd.daemon.journal import Journal
from lockd.daemon.keytable import KeyState, KeyTable, holders
from lockd.daemon.leases import Lease

#: One chunk of a restore (:meth:`LockEngine.restore_lazily`): the (UTF-8 key,
#: deadline) rows of whole keys after a key (None: from the first), in
#: (key, slot) order, and the last key looked at, or None after the last chunk.
ChunkReader = Callable[[str | None], tuple[list[tuple[bytes, int]], str | None]]

#: Reads the stored leases of cold keys (:meth:`LockEngine.restore_cold`):
#: every lease of each key asked for, a key's leases together, keys in any
#: order. The daemon's is :meth:`lockd.daemon.store.Store.leases_of`.
LeaseLoader = Callable[[list[str]], Iterable[Lease]]


def _no_chunks(after: str | None) -> tuple[list[tuple[bytes, int]], str | None]:
    return [], None


def _no_loader(keys: list[str]) -> Iterable[Lease]:
    raise AssertionError(f"no cold keys to load, asked for {keys[:3]}")


def by_key(leases: Iterable[Lease]) -> Iterator[list[Lease]]:
    """The leases of each key together, from a stream that keeps them together."""
    group: list[Lease] = []
    for lease in leases:
        if group and lease.key != group[0].key:
            yield group
            group = []
        group.append(lease)
    if group:
        yield group


class ColdPath:
    """The cold keys, how to load them, and which loaded keys go back first."""

    def __init__(self, table: KeyTable, deadlines: Deadlines, journal: Journal) -> None:
        self._table = table
        self._deadlines = deadlines
        self._journal = journal
        #: keys restored but not loaded yet (restore_cold) or demoted since.
        self.cold = ColdKeys()
        self.load: LeaseLoader = _no_loader
        self._read_chunk: ChunkReader = _no_chunks
        #: tracked keys, least recently touched first, with when (see demote()).
        #: Keys dropped meanwhile leave lazily, when demote() meets them.
        self._touched: OrderedDict[str, int] = OrderedDict()
        #: the latest ``now`` the engine was given (the touch time of keys loaded).
        self.last_now = 0
        #: demote() does nothing before this (it found nothing to demote).
        self._demote_after = 0

    # --------------------------------------------------------------- restore

    def restore(self, leases: Iterable[Lease]) -> None:
        """Load every stored lease in full (see :meth:`LockEngine.restore`)."""
        table = self._table
        for group in by_key(leases):
            table.restore_key(group)
            self.touch(group[0].key)
            self._deadlines.extend_leases(group)
        self._deadlines.heapify()
        table.sorted_keys.update(table.keys)

    def restore_cold(self, cold: ColdLeases, load: LeaseLoader) -> None:
        if self._table.keys or self.cold.key_count:
            raise ValueError("restore_cold() is for a new engine")
        self.cold, self.load = ColdKeys(cold), load

    def restore_lazily(self, read: ChunkReader, load: LeaseLoader) -> None:
        if self._table.keys or self.cold.key_count:
            raise ValueError("restore_lazily() is for a new engine")
        self.cold, self.load, self._read_chunk = ColdKeys(), load, read
        self.cold.loading = True

    def read_chunk(self) -> bool:
        """Take up the next chunk of a restore in chunks; True when it was the last.

        Keys the engine took up meanwhile (loaded, granted, demoted) are
        its own already; their rows in the chunk are skipped.
        """
        cold = self.cold
        after = cold.frontier.decode() if cold.frontier else None
        rows, upto = self._read_chunk(after)
        if rows:
            first, last = rows[0][0].decode(), rows[-1][0].decode()
            mine = {
                key.encode()
                for keys in (
                    self._table.sorted_keys.irange(first, last),
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
        return True

    # --------------------------------------------------------------- loading

    def warm(self, keys: list[str], now: int | None = None) -> None:
        """Load cold keys into the engine's state (they are cold no more).

        Not part of any request: loading changes nothing anyone can see,
        so a rollback of the requests around it keeps the keys loaded
        (:meth:`Journal.outside_requests`). With ``now`` (the timer's), a
        key whose every lease has run out by then expires on its way in,
        without state made for it and undone: a mass expiry after a restart
        costs a read per key, no more. That is a fact of time, never rolled
        back.
        """
        journal = self._journal
        if now is not None:
            journal.undo.stop()
        # Read first: a read that fails leaves the keys cold, none of them lost.
        leases = list(self.load(keys))
        table = self._table
        with journal.outside_requests(lambda: table.lease_count):
            for key in keys:
                self.cold.take(key)
            changes = journal.changes
            for group in by_key(leases):
                if now is None or any(lease.expires_at > now for lease in group):
                    self.adopt(group)
                    continue
                group.sort(key=lambda lease: (lease.expires_at, lease.fence))
                for lease in group:
                    table.fence = max(table.fence, lease.fence)
                    changes.expired.append(lease)
                    changes.rows[(lease.key, lease.slot)] = None

    def adopt(self, group: list[Lease]) -> None:
        """Make a loaded cold key's state (all its leases) in the engine."""
        key = group[0].key
        self._table.restore_key(group)
        self.touch(key)
        self._table.index_key(key)
        for lease in group:
            self._deadlines.push_lease(lease)

    def adopt_outside_requests(self, group: list[Lease]) -> None:
        """:meth:`adopt` a cold key read for a view, as a load: no part of any request."""
        table = self._table
        with self._journal.outside_requests(lambda: table.lease_count):
            self.cold.take(group[0].key)
            self.adopt(group)

    def warm_key(self, key: str) -> None:
        """Load ``key`` if it is still cold, or maybe stored (before anything looks at it)."""
        if self.needs_load(key):
            self.warm([key])

    def needs_load(self, key: str) -> bool:
        """Is ``key`` cold, or maybe stored (so :meth:`warm_key` would read the store)?"""
        cold = self.cold
        return bool(
            (cold.key_count or cold.loading)
            and key not in self._table.keys
            and (key in cold or cold.unknown(key))
        )

    # -------------------------------------------------------------- demotion

    def touch(self, key: str) -> None:
        """``key`` is in use now: the last candidate for :meth:`demote`."""
        touched = self._touched
        touched[key] = self.last_now
        touched.move_to_end(key)

    def demote(self, now: int, *, hot_keys: int, idle_ms: int, batch: int, retry_ms: int) -> int:
        """Send settled keys back to the store; how many went (:meth:`LockEngine.demote`).

        The least recently touched keys go first, while more than
        ``hot_keys`` keys are tracked, or when untouched for ``idle_ms``;
        ``batch`` keys are examined at most. When all it examined had to
        stay, it looks again ``retry_ms`` later.
        """
        touched = self._touched
        journal = self._journal
        if (
            self.load is _no_loader
            or now < self._demote_after
            or journal.recording
            or journal.changes.rows
            or not touched
        ):
            return 0
        idle_before = now - idle_ms
        demoted = kept = 0
        keys = self._table.keys
        for _ in range(batch):
            if not touched:
                break
            key, touched_at = next(iter(touched.items()))
            crowded = len(touched) > hot_keys
            if not crowded and touched_at > idle_before:
                break
            del touched[key]
            state = keys.get(key)
            if state is None:
                continue  # dropped since it was touched
            if self._demote_key(key, state, now, soon=None if crowded else now + idle_ms):
                demoted += 1
            else:
                touched[key] = now  # looked at again after the others
                kept += 1
        if kept and not demoted:
            self._demote_after = now + retry_ms  # all pinned: no rescan per commit
        return demoted

    def _demote_key(self, key: str, state: KeyState, now: int, soon: int | None) -> bool:
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
            held = list(holders(state))
            if any(lease.conn is not None for lease in held):
                return False
            first_end = min(lease.expires_at for lease in held)
        if first_end <= now or (soon is not None and first_end <= soon):
            return False
        if not self.cold.demoted.add(key, first_end, len(held)):
            return False
        self._table.forget(key, held)
        return True
