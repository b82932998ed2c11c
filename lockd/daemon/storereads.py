"""The store's reads: what a start restores, and a cold key's rows when it is used.

:class:`LeaseReads` reads lease rows and the fence of the store's connection
(:mod:`lockd.daemon.store` opens it and hands it over). At start, before the
integrity check of the whole file may have passed, only keys and deadlines
are handed over (:meth:`LeaseReads.deadlines_after`); a key's full rows are
read, each checked against its checksum, when the engine needs the key
(:meth:`LeaseReads.leases_of`). Rows of an earlier boot are counted on the
way; deleting them is a write, handed back to the store.
"""

from __future__ import annotations

import itertools
import logging
import operator
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from lockd.daemon.engine import Lease
from lockd.daemon.storecheck import START_MMAP_BYTES
from lockd.daemon.storeerrors import BUG_ERRORS, DatabaseDamaged, StorageUnavailable, StoreError
from lockd.daemon.verify import row_checksum
from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.store")

#: The columns of a lease row, in the order :func:`_lease_of` reads them.
_LEASE_COLUMNS = (
    "key, handle, fence, owner, principal, ttl_ms, expires_at, mode, hold_limit, slot, pid, "
    "process, pid_start, boot_id"
)
#: Rows per fetch of :meth:`LeaseReads.deadlines`.
_ROWS_PER_BATCH = 8192
#: Keys in one ``IN (...)`` of :meth:`LeaseReads.leases_of` (SQLite allows 32,766 parameters).
_KEYS_PER_QUERY = 500


def _checksum_of(row: tuple[Any, ...]) -> int:
    """The ``chk`` a row in :data:`_LEASE_COLUMNS` order should carry."""
    key, handle, fence, owner, principal, ttl, expires, mode, limit, slot, pid, proc = row[:12]
    boot = row[13]  # (row[12] is pid_start: not part of chk)
    return row_checksum(
        key, slot, handle, fence, owner, principal, ttl, expires, boot, mode, limit, pid, proc
    )


def _lease_of(row: tuple[Any, ...], share: Callable[[Any, Any], Any]) -> Lease:
    """A lease from its row; ``share`` (a dict's setdefault) keeps one copy of repeated values."""
    key, handle, fence, owner, principal, ttl, expires, mode, limit, slot, pid, proc, start = row[
        :13
    ]
    return Lease(
        key,
        handle,
        fence,
        None if owner is None else share(owner, owner),
        share(principal, principal),
        share(ttl, ttl),
        expires,
        None,
        share(mode, mode),
        limit,
        slot,
        pid,
        None if proc is None else share(proc, proc),
        start,
    )


class LeaseReads:
    """The lease rows and the fence of one boot (``boot_id``), read from ``db``.

    ``wait_checked`` waits for the integrity check of the file (a read that
    failed is the check's to explain); ``drop_earlier_boots(count)`` deletes
    the rows of earlier boots once a stream of them has ended.
    """

    def __init__(
        self,
        db: sqlite3.Connection,
        path: Path,
        boot_id: str,
        *,
        wait_checked: Callable[[], None],
        drop_earlier_boots: Callable[[int], None],
    ) -> None:
        self._db = db
        self.path = path
        self.boot_id = boot_id
        self._wait_checked = wait_checked
        self._drop_earlier_boots = drop_earlier_boots
        #: what a row read found damaged (then no more writes, as after a failed check).
        self.damaged: str | None = None
        #: called with the number of rows each read of leases hands over (tests count them).
        self.read_hook: Callable[[int], None] | None = None
        #: rows of earlier boots seen by deadlines_after(), deleted after its last chunk.
        self._earlier_rows = 0

    def rebind(self, db: sqlite3.Connection) -> None:
        """Read through ``db`` from now on (``Store._become_writer`` opened it to write)."""
        self._db = db

    def _read_failed(self, exc: sqlite3.DatabaseError) -> NoReturn:
        """A read at start failed: a damaged file is the integrity check's to tell."""
        self._wait_checked()
        raise StoreError(f"{self.path}: {exc}") from exc

    def stored_fence(self) -> int:
        """The fence high-water mark kept in ``meta`` (the store notes it as committed)."""
        try:
            row = self._db.execute("SELECT value FROM meta WHERE name = 'fence'").fetchone()
        except sqlite3.DatabaseError as exc:
            self._read_failed(exc)
        value: int = row[0]
        return value

    def deadlines(self) -> Iterator[list[tuple[bytes, int]]]:
        """This boot's (UTF-8 key, deadline) rows in (key, slot) order, in batches.

        What :class:`~lockd.daemon.cold.ColdLeases` keeps of a lease at
        start; the rest of its row is read by :meth:`leases_of` when the
        engine needs the key. Batches let the caller take them apart in C
        loops. Two columns, SQLite leaving out other boots' rows: a third
        column cost ~20 % more (measured). Rows of an earlier boot are
        counted and deleted once the stream has ended.
        """
        db = self._db
        read = 0
        try:
            # Mapped, the file is read without a system call and a copy per
            # page (~25 % less CPU for this scan, measured); unmapped after,
            # so the daemon's RSS does not keep the file.
            db.execute(f"PRAGMA mmap_size={START_MMAP_BYTES}")
            rows = db.execute(
                "SELECT CAST(key AS BLOB), expires_at FROM leases WHERE boot_id = ? "
                "ORDER BY key, slot",
                (self.boot_id,),
            )
            try:
                while batch := rows.fetchmany(_ROWS_PER_BATCH):
                    read += len(batch)
                    if self.read_hook is not None:
                        self.read_hook(len(batch))
                    yield batch
            finally:
                rows.close()
                db.execute("PRAGMA mmap_size=0")
            # SQLite counts a table's rows without decoding them (~5 ms at 300,000).
            dropped = db.execute("SELECT count(*) FROM leases").fetchone()[0] - read
        except sqlite3.DatabaseError as exc:
            self._read_failed(exc)
        if dropped:
            self._drop_earlier_boots(dropped)

    def deadlines_after(self, after: str | None) -> tuple[list[tuple[bytes, int]], str | None]:
        """This boot's (UTF-8 key, deadline) rows of the keys after ``after``: one chunk.

        Whole keys in (key, slot) order, at most :data:`_ROWS_PER_BATCH`
        rows, and the last key it looked at (where the next chunk starts),
        or None when there are no more: the restore in chunks that
        :meth:`deadlines` is at once (the engine interleaves it with
        requests, see ``LockEngine.restore_lazily``). Rows of an earlier
        boot are counted on the way and deleted after the last chunk.
        """
        try:
            rows = self._db.execute(
                "SELECT CAST(key AS BLOB), CASE WHEN boot_id = ? THEN expires_at END "
                "FROM leases WHERE key > ? ORDER BY key, slot LIMIT ?",
                (self.boot_id, "" if after is None else after, _ROWS_PER_BATCH),
            ).fetchall()
        except sqlite3.DatabaseError as exc:
            self._read_failed(exc)
        if self.read_hook is not None:
            self.read_hook(len(rows))
        # Read before the integrity check may have come to them: only keys
        # and deadlines, each key's rows read and checked when it is used
        # (leases_of). Their order is what the cold index relies on.
        keys = [row[0] for row in rows]
        if keys and (
            (after is not None and keys[0] <= after.encode())
            or not all(map(operator.le, keys, itertools.islice(keys, 1, None)))
        ):
            self.damaged = f"{self.path}: lease rows out of key order (a damaged key)"
            raise DatabaseDamaged(self.damaged)
        done = len(rows) < _ROWS_PER_BATCH
        upto = None
        if not done:  # the last key's rows may go on in the next chunk: all there
            last = rows[-1][0]
            while rows[-1][0] == last:  # a key has far fewer rows than a chunk
                rows.pop()
            upto = rows[-1][0].decode()
        if any(deadline is None for _, deadline in rows):
            earlier = sum(deadline is None for _, deadline in rows)
            self._earlier_rows += earlier
            rows = [row for row in rows if row[1] is not None]
        if done and self._earlier_rows:
            self._drop_earlier_boots(self._earlier_rows)
            self._earlier_rows = 0
        return rows, upto

    def leases_of(self, keys: list[str]) -> list[Lease]:
        """This boot's leases of ``keys``, in (key, slot) order (a cold key's load).

        Raises :class:`StorageUnavailable` when the rows cannot be read (an
        I/O error): the request that needed them fails as any storage
        failure does, and the keys stay cold, none of their leases lost.
        Each row's checksum is checked here (~1 us a row), whether or not the
        integrity check of the whole file has run yet: a row that fails it
        raises :class:`DatabaseDamaged` and no lease of it is used.
        """
        share: Callable[[Any, Any], Any] = {}.setdefault
        leases: list[Lease] = []
        try:
            for start in range(0, len(keys), _KEYS_PER_QUERY):
                chunk = keys[start : start + _KEYS_PER_QUERY]
                rows = self._db.execute(
                    f"SELECT {_LEASE_COLUMNS}, chk FROM leases WHERE key IN "
                    f"({', '.join('?' * len(chunk))}) AND boot_id = ? ORDER BY key, slot",
                    (*chunk, self.boot_id),
                )
                for row in rows:
                    if _checksum_of(row) != row[-1]:
                        self._damaged_row(row[0], row[9])
                    leases.append(_lease_of(row, share))
        except BUG_ERRORS:
            raise
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"{self.path}: cannot read leases: {exc}") from exc
        if self.read_hook is not None:
            self.read_hook(len(leases))
        return leases

    def _damaged_row(self, key: str, slot: int) -> NoReturn:
        """A row read failed its checksum: no more writes; raise DatabaseDamaged."""
        self.damaged = (
            f"{self.path} lease row ({key!r}, slot {slot}) fails its checksum; nothing was "
            "changed (lockd serve --accept-data-loss starts on what is left)"
        )
        log.error(kv(event="damaged_row", db=self.path, key=key, slot=slot))
        raise DatabaseDamaged(self.damaged)

    def leases(self) -> Iterator[Lease]:
        """Stream this boot's leases in (key, slot) order; drop those of earlier boots.

        Rows are read one at a time (never ``fetchall``: a million rows as
        tuples cost more than the leases made of them), and the strings many
        leases share (principal, owner, mode, process) and the TTLs are
        interned, so each exists once however many leases hold it. Rows of
        an earlier boot are skipped and deleted once the stream has ended.
        """
        share: Callable[[Any, Any], Any] = {}.setdefault
        dropped = 0
        for row in self._db.execute(f"SELECT {_LEASE_COLUMNS} FROM leases ORDER BY key, slot"):
            if row[-1] != self.boot_id:
                dropped += 1
                continue
            yield _lease_of(row, share)
        if dropped:
            self._drop_earlier_boots(dropped)
