"""The store's writes: one batch of the engine's effects, one transaction.

:class:`LeaseWrites` writes the lease rows of each
:class:`~lockd.daemon.engine.Changes` batch to the store's connection, and
keeps the counts that follow each commit: ``meta.seq`` mirrored in the run
record (:mod:`lockd.daemon.runrecord`), the fence mark moved in blocks
(:mod:`lockd.daemon.fencemark`), and the files checked every
:data:`CHECK_EVERY` writes (:class:`~lockd.daemon.storefiles.FileWatch`).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

from lockd.daemon.engine import Changes, Lease, RowId
from lockd.daemon.fencemark import BLOCK, FenceMark
from lockd.daemon.runrecord import RunRecord
from lockd.daemon.storeerrors import BUG_ERRORS, StorageUnavailable
from lockd.daemon.storefiles import FileWatch
from lockd.daemon.verify import row_checksum
from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.store")

#: Writes between two checks of the files inside :meth:`LeaseWrites.apply`.
CHECK_EVERY = 64


class LeaseWrites:
    """Every write of one boot's (``boot_id``) lease rows to ``db``, and what follows a commit.

    ``may_write`` raises when no write may go in now (a damaged row read,
    a failed integrity check, files lost), waiting for a check still
    running; ``wait_checked`` waits for that check. ``mark`` and ``record``
    are None for an in-memory database.
    """

    def __init__(
        self,
        db: sqlite3.Connection,
        path: Path,
        boot_id: str,
        *,
        mark: FenceMark | None,
        record: RunRecord | None,
        files: FileWatch,
        may_write: Callable[[], None],
        wait_checked: Callable[[], None],
    ) -> None:
        self._db = db
        self.path = path
        self.boot_id = boot_id
        self.mark = mark
        self.record = record
        self._files = files
        self._may_write = may_write
        self._wait_checked = wait_checked
        #: the highest fence the database holds (after load and each commit).
        self.committed_fence = 0
        #: lease rows inserted or deleted so far (``meta.seq``; the run record follows it).
        self.seq = 0
        self._writes_unchecked = 0
        self._wal_known = False

    def rebind(self, db: sqlite3.Connection) -> None:
        """Write through ``db`` from now on (``Store._become_writer`` opened it)."""
        self._db = db

    def drop_earlier_boots(self, count: int) -> None:
        """Delete the rows of earlier boots (``count`` of them were seen)."""
        self._wait_checked()
        deleted = self._db.execute("DELETE FROM leases WHERE boot_id != ?", (self.boot_id,))
        self._count_writes(deleted.rowcount)
        log.info(kv(event="dropped_earlier_boot", leases=count))

    def _count_writes(self, count: int) -> None:
        """``count`` more lease rows written and committed: the run record follows."""
        self.seq += count
        if self.record is not None:
            self.record.set_seq(self.seq)

    def apply(self, changes: Changes) -> None:
        """Persist one batch of engine effects atomically.

        The common batch is one row (a grant, a renew, a release, a
        hand-off): that is a single statement in autocommit mode, its own
        transaction, which costs a third of BEGIN + statement + COMMIT. The
        fence follows by trigger, so ``changes.fence`` needs a statement of
        its own only when no written row carries it.

        Raises :class:`StorageUnavailable` when the database cannot be
        written; the transaction is rolled back, so nothing of the batch is
        kept.
        """
        rows = changes.rows
        # The trigger raises the stored fence with every lease written; a
        # grant whose row is gone again in the same batch (granted, then
        # broken or released) needs the mark written by hand.
        fence = changes.fence
        latest = 0
        for lease in rows.values():
            if lease is not None:
                if fence is not None and lease.fence >= fence:
                    fence = None
                if lease.expires_at > latest:
                    latest = lease.expires_at
        if not rows and fence is None:
            return
        self._may_write()
        self._writes_unchecked += 1
        if self._writes_unchecked >= CHECK_EVERY:
            self._writes_unchecked = 0
            self._files.check_files()
        if (
            changes.fence is not None
            and self.mark is not None
            and changes.fence > self.mark.reserved
        ):
            self._move_mark(changes.fence)
        record = self.record
        if record is not None and latest > record.deadline:
            # Before the commit: a lease lost with it may have run until then.
            record.set_deadline(latest)
        try:
            written = self._apply(rows, fence)
        except BUG_ERRORS:
            raise
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"{self.path}: {exc}") from exc
        self.seq += written
        if record is not None:
            record.set_seq(self.seq)
        if changes.fence is not None:
            self.committed_fence = max(self.committed_fence, changes.fence)
        if not self._wal_known and self.mark is not None:
            self._files.remember_identity(self._files.wal)  # once: the first write made it
            self._wal_known = True

    def _move_mark(self, fence: int) -> None:
        """Make what the database holds durable, then reserve the next block of fences.

        A checkpoint fsyncs the WAL and the database file through SQLite.
        (Opening and closing a file descriptor of our own on them would drop
        SQLite's POSIX locks, and with them the exclusive lock that keeps a
        second daemon out.)
        """
        assert self.mark is not None
        try:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self.mark.write(fence + BLOCK, max(self.mark.floor, self.committed_fence))
            if self.record is not None:
                # Also outside the state folder: the mark goes if the folder goes.
                self.record.set_fence(fence + BLOCK)
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"{self.path}: {exc}") from exc
        except OSError as exc:
            raise StorageUnavailable(
                f"{self.mark.path}: cannot move the fence mark: {exc.strerror or exc}"
            ) from exc

    def _apply(self, rows: dict[RowId, Lease | None], fence: int | None) -> int:
        """Write the batch; how many rows were written (what ``meta.seq`` counted)."""
        db = self._db
        if len(rows) == 1 and fence is None:
            return self._write_row(*next(iter(rows.items())))
        written = 0
        db.execute("BEGIN")
        try:
            for row_id, lease in rows.items():
                written += self._write_row(row_id, lease)
            if fence is not None:
                db.execute("UPDATE meta SET value = max(value, ?) WHERE name = 'fence'", (fence,))
            db.execute("COMMIT")
            return written
        except BaseException:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    # SQLite rolls back by itself after some I/O errors.
                    log.debug(kv(event="rollback_failed", db=self.path))
            raise

    def _write_row(self, row_id: RowId, lease: Lease | None) -> int:
        """Write one row; 1, or 0 for a delete that found no row (the triggers count the same)."""
        if lease is None:
            deleted = self._db.execute("DELETE FROM leases WHERE key = ? AND slot = ?", row_id)
            return deleted.rowcount
        values = (
            lease.key,
            lease.slot,
            lease.handle,
            lease.fence,
            lease.owner,
            lease.principal,
            lease.ttl_ms,
            lease.expires_at,
            self.boot_id,
            lease.mode,
            lease.limit,
            lease.pid,
            lease.process,
        )
        self._db.execute(
            "INSERT OR REPLACE INTO leases "
            "(key, slot, handle, fence, owner, principal, ttl_ms, expires_at, boot_id, "
            "mode, hold_limit, pid, process, chk, pid_start) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*values, row_checksum(*values), lease.pid_start),
        )
        return 1
