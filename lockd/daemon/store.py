"""SQLite persistence for the engine's effects.

One table of current leases, one row per holder addressed by (key, slot):
an exclusive hold is slot 0, shared holders and semaphore holders take the
lowest free slots, so a hand-off or a re-take rewrites one row. A ``meta``
table holds the fence high-water mark, kept by a trigger on every lease
insert.
:meth:`Store.apply` writes one :class:`~lockd.daemon.engine.Changes` batch in one
transaction; the server calls it
before sending the replies that depend on it, so an acknowledged grant,
renew, release or break survives a crash of the daemon.

WAL with ``synchronous=NORMAL``: a commit is an append to the WAL without an
fsync (measured ~10-20 us here, see bench/), so it runs on the event loop
thread; handing it to a worker thread would cost more than the write. Power loss may lose the
last commits, but it also ends every process that held those leases.

Each lease row carries the boot id; rows from an earlier boot are dropped
at start because every process that held them is gone. The fence survives
in ``meta`` so it never goes backwards, across restarts and reboots alike.

A broken disk must not quietly lose what was acknowledged:

- At start the files are checked before use: an empty or non-SQLite
  database file, a WAL with a damaged header, or a failed ``PRAGMA
  quick_check`` is a :class:`StoreError` (the daemon does not start), never a
  fresh empty database. The daemon runs the check in a thread
  (``background_check``, see :class:`_IntegrityCheck`) and answers
  meanwhile: nothing is written before it passed (every write waits for
  it), no row is used that was not checked (:meth:`Store.leases_of` checks
  the rows it reads; :meth:`Store.deadlines_after` hands over keys and
  deadlines only, whose keys are read that way when used), and a failure
  stops the daemon as a refused start would (:class:`DatabaseDamaged`).
- The database and WAL files we opened must still be the ones at their
  paths: deleted (``st_nlink == 0`` for the open file) or replaced, every
  later commit would vanish at the next restart. :meth:`Store.check_files`
  compares them; the daemon calls it four times a second and
  :meth:`Store.apply` every :data:`CHECK_EVERY` writes (a ``stat`` costs
  ~20 us on the VMs measured, more than a commit, so not every write). From
  the first failed check on, every write fails as
  :class:`StorageUnavailable` until a restart.
- The fence high-water mark is kept outside the database as well
  (:mod:`lockd.daemon.fencemark`); :meth:`Store.apply` moves it in blocks.
- Nothing acknowledged may be missing (issue 21). Each row carries a
  checksum, checked at start (:mod:`lockd.daemon.verify`); ``meta`` counts
  the lease rows written, and the run record outside the state folder
  (:mod:`lockd.daemon.runrecord`) counts the same after each commit: a
  start in the same boot on a database that counts fewer is refused. A
  database left with a WAL is checked on a read-only connection first, so
  a refusal leaves the files as they were; ``accept_loss`` starts anyway
  and holds every grant until the lost leases have run out.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from lockd.daemon.engine import Changes, Lease, RowId
from lockd.daemon.fencemark import BLOCK, FenceMark
from lockd.daemon.losscheck import LossCheck, StartRefused
from lockd.daemon.runrecord import LastRun, RunRecord
from lockd.daemon.verify import ROW_TEXT_SQL, Findings, inspect, row_checksum
from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.store")

SCHEMA_VERSION = 4


def _migrate_0_to_1(db: sqlite3.Connection) -> None:
    # WITHOUT ROWID: rows live in the key's own b-tree, so a commit writes one
    # page per table instead of a table page plus a primary-key index page.
    db.execute(
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL) STRICT, WITHOUT ROWID"
    )
    db.execute(
        """
        CREATE TABLE leases (
            key        TEXT PRIMARY KEY,
            handle     TEXT NOT NULL,
            fence      INTEGER NOT NULL,
            owner      TEXT,
            principal  TEXT NOT NULL,
            ttl_ms     INTEGER NOT NULL,
            expires_at INTEGER NOT NULL,  -- CLOCK_BOOTTIME milliseconds
            boot_id    TEXT NOT NULL
        ) STRICT, WITHOUT ROWID
        """
    )
    db.execute("INSERT INTO meta (name, value) VALUES ('fence', 0)")
    # The fence high-water mark follows every inserted lease inside the same
    # statement, so a grant is one statement (one implicit transaction) and
    # the mark can never fall behind a lease that was written.
    db.execute(
        """
        CREATE TRIGGER leases_fence AFTER INSERT ON leases BEGIN
            UPDATE meta SET value = max(value, NEW.fence) WHERE name = 'fence';
        END
        """
    )


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    """Several holders per key (docs/contract.md §10): rows keyed by (key, slot).

    Every version-1 lease becomes the exclusive holder (slot 0, limit 1) of
    its key, with its handle, fence, owner and deadline unchanged; pid and
    process were not recorded then and stay unknown.
    """
    db.execute(
        """
        CREATE TABLE leases_v2 (
            key        TEXT NOT NULL,
            slot       INTEGER NOT NULL,
            handle     TEXT NOT NULL,
            fence      INTEGER NOT NULL,
            owner      TEXT,
            principal  TEXT NOT NULL,
            ttl_ms     INTEGER NOT NULL,
            expires_at INTEGER NOT NULL,  -- CLOCK_BOOTTIME milliseconds
            boot_id    TEXT NOT NULL,
            mode       TEXT NOT NULL CHECK (mode IN ('exclusive', 'shared')),
            hold_limit INTEGER NOT NULL,
            pid        INTEGER,
            process    TEXT,
            PRIMARY KEY (key, slot)
        ) STRICT, WITHOUT ROWID
        """
    )
    db.execute(
        "INSERT INTO leases_v2 (key, slot, handle, fence, owner, principal, ttl_ms, expires_at, "
        "boot_id, mode, hold_limit) SELECT key, 0, handle, fence, owner, principal, ttl_ms, "
        "expires_at, boot_id, 'exclusive', 1 FROM leases"
    )
    db.execute("DROP TABLE leases")  # drops its trigger too
    db.execute("ALTER TABLE leases_v2 RENAME TO leases")
    db.execute(
        """
        CREATE TRIGGER leases_fence AFTER INSERT ON leases BEGIN
            UPDATE meta SET value = max(value, NEW.fence) WHERE name = 'fence';
        END
        """
    )


def _migrate_2_to_3(db: sqlite3.Connection) -> None:
    """Rows checked and writes counted (issue 21, :mod:`lockd.daemon.verify`).

    Every row gets ``chk``, the CRC-32 of its columns; ``meta`` gets
    ``seq`` (a column of its ``fence`` row), the number of lease rows inserted
    or deleted so far, kept by
    triggers inside each write's own transaction (the run record outside
    the state folder counts the same: see :mod:`lockd.daemon.runrecord`).
    An insert (a grant or a renew) already rewrote ``meta`` for the fence,
    so counting it costs no page more; a delete now writes ``meta`` too.
    """
    db.execute("ALTER TABLE leases ADD COLUMN chk INTEGER")
    db.create_function("lockd_chk", 1, lambda text: zlib.crc32(text.encode()), deterministic=True)
    db.execute(f"UPDATE leases SET chk = lockd_chk({ROW_TEXT_SQL})")
    # The count rides in the fence's own meta row: the trigger that raised the
    # fence on every insert still updates one row (a second row cost ~2 us).
    db.execute("ALTER TABLE meta ADD COLUMN seq INTEGER NOT NULL DEFAULT 0")
    db.execute("DROP TRIGGER leases_fence")
    db.execute(
        """
        CREATE TRIGGER leases_insert AFTER INSERT ON leases BEGIN
            UPDATE meta SET value = max(value, NEW.fence), seq = seq + 1 WHERE name = 'fence';
        END
        """
    )
    # An INSERT OR REPLACE does not fire it for the row it replaces
    # (recursive_triggers is off): one write, one count.
    db.execute(
        """
        CREATE TRIGGER leases_delete AFTER DELETE ON leases BEGIN
            UPDATE meta SET seq = seq + 1 WHERE name = 'fence';
        END
        """
    )


def _migrate_3_to_4(db: sqlite3.Connection) -> None:
    """The holder's start time (docs/contract.md §12.2), so ``alive`` survives a restart.

    Rows written before have none (NULL: ``alive`` stays unknown for them).
    Not part of ``chk``: a damaged start time can only make ``alive`` wrong,
    never a lease, and leaving ``chk`` as it is keeps every row valid.
    """
    db.execute("ALTER TABLE leases ADD COLUMN pid_start INTEGER")


#: MIGRATIONS[n] takes a database at user_version n to n + 1.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _migrate_0_to_1,
    _migrate_1_to_2,
    _migrate_2_to_3,
    _migrate_3_to_4,
]


class StoreError(Exception):
    """The database cannot be used (newer schema, unreadable file, ...)."""


class StorageUnavailable(StoreError):
    """A write failed (disk full, I/O error, files gone); nothing of it was kept."""


class DatabaseDamaged(StorageUnavailable):
    """The integrity check, or a row read, found the database damaged: do not use it.

    A :class:`StorageUnavailable` so that a request it stops fails as any
    storage failure does (nothing of it kept); the daemon then stops as a
    start refused on the same damage would (``lockd.daemon.serve``).
    """


class GrantsOnHold(StorageUnavailable):
    """No key is granted yet: leases were lost and accepted at start (issue 21)."""


def _boot_ms() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


#: sqlite3 errors that mean "the storage failed", not "lockd has a bug".
_BUG_ERRORS = (sqlite3.ProgrammingError, sqlite3.InterfaceError, sqlite3.IntegrityError)


def read_boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        return f.read().strip()


class Store:
    def __init__(
        self,
        path: Path | str,
        boot_id: str,
        *,
        synchronous: str = "NORMAL",
        background_check: bool = False,
        record: RunRecord | None = None,
        accept_loss: bool = False,
        boot_ms: Callable[[], int] | None = None,
    ) -> None:
        """Open (or create) the database; raises :class:`StoreError` if it cannot be used.

        With ``background_check`` the integrity check of a database on disk
        runs in a thread and the constructor returns at once: reads may go
        on meanwhile (:meth:`leases_of` checks the rows it reads);
        :meth:`wait_checked` (and every write) waits for it and raises its
        failure; :meth:`close` stops it.

        ``record``: the run record outside the state folder
        (:mod:`lockd.daemon.runrecord`): a database that lost writes it
        acknowledged in this boot is refused, unless ``accept_loss``; then
        :attr:`grants_held_until` says until when no key may be granted.
        Call :meth:`begin_run` once the start succeeded.
        """
        self.path = Path(path)
        self.boot_id = boot_id
        on_disk = str(path) != ":memory:"
        #: the fence mark beside the database (None for an in-memory one).
        self.mark: FenceMark | None = FenceMark.beside(self.path) if on_disk else None
        #: the highest fence the database holds (after load and each commit).
        self.committed_fence = 0
        #: lease rows inserted or deleted so far (``meta.seq``; the run record follows it).
        self.seq = 0
        self.record = record if on_disk else None
        #: the start's judgement of the database against the run record.
        self.loss = LossCheck(self.path, boot_id, self.record, accept_loss)
        #: what was found lost or damaged and accepted (``accept_loss``), for the log.
        self.accepted_loss = self.loss.accepted
        #: after an accepted loss: no grant before this boot-clock ms (0: none held).
        self.grants_held_until = 0
        #: path -> (st_dev, st_ino) of the files we write, to notice them vanish.
        self._identities: dict[Path, tuple[int, int]] = {}
        #: why the files are no longer ours, once a check found it (then no writes).
        self.lost: str | None = None
        self._writes_unchecked = 0
        #: rows of earlier boots seen by deadlines_after(), deleted after its last chunk.
        self._earlier_rows = 0
        self._wal = self.path.with_name(self.path.name + "-wal")
        self._wal_known = False
        #: the integrity check still running in its thread (background_check).
        self._check: _IntegrityCheck | None = None
        #: begin_run()'s fence while the check runs: the record begins once it passed.
        self._run_fence: int | None = None
        #: the latest deadline of this boot's rows, when the check found it.
        self._latest: int | None = None
        #: what a row read found damaged (then no more writes, as after a failed check).
        self.damaged: str | None = None
        #: called with the number of rows each read of leases hands over (tests count them).
        self.read_hook: Callable[[int], None] | None = None
        found: Findings | None = None
        if on_disk:
            _prepare_directory(self.path.parent)
            _check_files_before_open(self.path)
            try:
                self.loss.read_last_run()
                found = self.loss.inspect_first()
            except StartRefused as exc:
                raise StoreError(str(exc)) from None
            except sqlite3.Error as exc:
                raise _open_failed(self.path, exc) from exc
        # The -wal and -shm files SQLite creates later copy the database
        # file's mode, so a private umask at creation covers all three.
        old_umask = os.umask(0o077)
        try:
            # timeout=0: the database is ours alone (exclusive locking); if it
            # is locked, another daemon has it, and waiting will not help.
            self._db = sqlite3.connect(
                str(path), isolation_level=None, check_same_thread=False, timeout=0
            )
            if str(path) != ":memory:":
                os.chmod(self.path, 0o600)
            # Exclusive locking: the daemon is the database's only user, so
            # WAL needs no shared-memory index and a commit skips its fcntl
            # locks (measured ~23 -> ~9 us per commit with 1 KiB pages). It
            # also stops a second daemon from opening the same database.
            self._db.execute("PRAGMA page_size=1024")  # only takes effect on a new file
            self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            # A checkpoint (with its fsync) runs inside whichever commit
            # crosses the threshold, on the event loop: 1-3 ms. Our commits
            # rewrite the same few pages, so a longer WAL costs little to
            # checkpoint and makes that stall ten times rarer.
            self._db.execute("PRAGMA wal_autocheckpoint=10000")
            self._db.execute("PRAGMA journal_size_limit=4194304")
            self._db.execute("PRAGMA foreign_keys=ON")
            # The write count (meta.seq) relies on a REPLACE not firing the
            # delete trigger; some builds default this on (compile options).
            self._db.execute("PRAGMA recursive_triggers=OFF")
            if on_disk and found is None:
                self.loss.judge_seq(self._read_seq())  # before anything is written
            self._migrate()
            if found is not None:
                self.loss.repair(self._db, found)  # checked already, on the files as found
            elif on_disk and background_check and self._wal_folded_in():
                self._check = _IntegrityCheck(self.path, boot_id)
            else:
                self.loss.judge_found(inspect(self._db))
            self.grants_held_until = self.loss.grants_held_until((boot_ms or _boot_ms)())
            self.seq = self._read_seq() or 0
            if on_disk:
                self._remember_identity(self.path)
        except StartRefused as exc:
            raise StoreError(str(exc)) from None
        except sqlite3.Error as exc:
            raise _open_failed(Path(path), exc) from exc
        finally:
            os.umask(old_umask)

    @property
    def last_run(self) -> LastRun | None:
        """The run record of this database's last run, when it was in this boot."""
        return self.loss.last_run

    @property
    def recorded_fence(self) -> int:
        """The fence the run record reserved, whatever boot wrote it (0: none)."""
        return self.loss.recorded_fence

    def _read_seq(self) -> int | None:
        """``meta.seq`` (None before schema 3 or in a new file)."""
        db = self._db
        if db.execute("PRAGMA user_version").fetchone()[0] < 3:
            return None
        row = db.execute("SELECT seq FROM meta WHERE name = 'fence'").fetchone()
        return None if row is None else int(row[0])

    def check_grants(self, now: int) -> None:
        """Raise :class:`GrantsOnHold` while no key may be granted (after an accepted loss)."""
        if self.grants_held_until:
            if now < self.grants_held_until:
                raise GrantsOnHold(
                    "lockd started accepting lost leases; no key is granted until every lease "
                    f"that may have been lost has run out ({self.grants_held_until - now} ms)"
                )
            self.grants_held_until = 0
            log.info(kv(event="grants_resumed"))

    def begin_run(self, fence_reserved: int) -> None:
        """Write this run's record once the start is complete (its checks passed).

        Not earlier: a start refused by a check must leave the last run's
        record as it was, or the next attempt would start on the damage.
        While the check runs in its thread this only notes the fence: the
        record begins when :meth:`wait_checked` sees the check pass, which
        every write does first.
        """
        if self._check is not None:
            self._run_fence = fence_reserved
            return
        record = self.record
        if record is None:
            return
        deadline = self._latest
        if deadline is None:
            deadline = self._db.execute(
                "SELECT max(expires_at) FROM leases WHERE boot_id = ?", (self.boot_id,)
            ).fetchone()[0]
        last = self.last_run
        latest = max(deadline or 0, last.deadline if last is not None else 0)
        try:
            record.begin(
                self.boot_id, self.path, seq=self.seq, fence=fence_reserved, deadline=latest
            )
        except OSError as exc:
            # Serve anyway: without the record the next start cannot tell lost
            # writes of this run, which the log says loudly (operations.md).
            log.error(
                kv(
                    event="run_record_unavailable",
                    path=record.path,
                    error=exc.strerror or exc,
                    effect="a later start cannot tell whether acknowledged leases were lost",
                )
            )
            self.record = None

    def _migrate(self) -> None:
        db = self._db
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: schema version {version} is newer than this lockd "
                f"understands ({SCHEMA_VERSION}); upgrade lockd"
            )
        while version < SCHEMA_VERSION:
            db.execute("BEGIN IMMEDIATE")
            try:
                MIGRATIONS[version](db)
                version += 1
                db.execute(f"PRAGMA user_version={version}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            log.info(kv(event="migrated", db=self.path, version=version))

    def _wal_folded_in(self) -> bool:
        """Make the database file hold every commit (the check's connection reads only it).

        After a crash the WAL still holds the last commits: a checkpoint
        copies them into the file (only then; a clean stop leaves no WAL).
        False if some could not be copied: the check then runs here, on
        this connection, which sees the WAL.
        """
        try:
            if os.stat(self._wal).st_size == 0:
                return True
        except FileNotFoundError:
            return True
        busy, frames, copied = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return not busy and frames == copied

    def _read_failed(self, exc: sqlite3.DatabaseError) -> NoReturn:
        """A read at start failed: a damaged file is the integrity check's to tell."""
        self.wait_checked()
        raise StoreError(f"{self.path}: {exc}") from exc

    def wait_checked(self) -> None:
        """Wait for the integrity check started in the background; raise its failure.

        Raises :class:`DatabaseDamaged` when it failed (every call, not only
        the first). Once it passed, the run record begins (:meth:`begin_run`).
        """
        check = self._check
        if check is not None:
            check.result()  # raises DatabaseDamaged when the check failed
            self._latest = check.latest
            self._check = None
            if self._run_fence is not None:
                fence, self._run_fence = self._run_fence, None
                self.begin_run(fence)

    @property
    def check_done(self) -> threading.Event | None:
        """Set once the background check has finished (None: none is running)."""
        return None if self._check is None else self._check.done

    def _remember_identity(self, path: Path) -> None:
        st = os.stat(path)
        self._identities[path] = (st.st_dev, st.st_ino)

    def check_files(self) -> None:
        """Raise :class:`StorageUnavailable` if a file we write was deleted or replaced."""
        if self.lost is not None:
            raise StorageUnavailable(self.lost)
        if self.mark is None:
            return
        if self._wal not in self._identities and self._wal.exists():
            self._remember_identity(self._wal)
        for path, identity in self._identities.items():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if st is None or (st.st_dev, st.st_ino) != identity:
                self.lost = (
                    f"{path} was deleted or replaced while lockd had it open: "
                    "nothing written now would survive a restart"
                )
                raise StorageUnavailable(self.lost)

    def load(self) -> tuple[list[Lease], int]:
        """Drop leases of earlier boots; return this boot's leases and the fence."""
        leases = list(self.leases())
        return leases, max([self.stored_fence(), *(lease.fence for lease in leases)])

    def stored_fence(self) -> int:
        """The fence high-water mark kept in ``meta``."""
        try:
            row = self._db.execute("SELECT value FROM meta WHERE name = 'fence'").fetchone()
        except sqlite3.DatabaseError as exc:
            self._read_failed(exc)
        value: int = row[0]
        self.committed_fence = max(self.committed_fence, value)
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
            db.execute(f"PRAGMA mmap_size={_START_MMAP_BYTES}")
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
        except _BUG_ERRORS:
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

    def _drop_earlier_boots(self, count: int) -> None:
        self.wait_checked()
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
        if self.damaged is not None:
            raise DatabaseDamaged(self.damaged)
        if self._check is not None:
            self.wait_checked()  # never write into a database that failed its check
        if self.lost is not None:
            raise StorageUnavailable(self.lost)
        self._writes_unchecked += 1
        if self._writes_unchecked >= CHECK_EVERY:
            self._writes_unchecked = 0
            self.check_files()
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
        except _BUG_ERRORS:
            raise
        except sqlite3.Error as exc:
            raise StorageUnavailable(f"{self.path}: {exc}") from exc
        self.seq += written
        if record is not None:
            record.set_seq(self.seq)
        if changes.fence is not None:
            self.committed_fence = max(self.committed_fence, changes.fence)
        if not self._wal_known and self.mark is not None:
            self._remember_identity(self._wal)  # once: the first write made it
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

    def close(self) -> None:
        if self._check is not None:
            # Closing checkpoints into the file the check is reading: stop
            # it first (a stop must not wait for a scan of every row; the
            # next start checks again).
            self._check.cancel()
            self._check.done.wait()
        self._db.close()
        if self.record is not None:
            self.record.close()
        mark = self.mark
        if mark is not None and mark.reserved:
            # Record what the database holds now: a database lost or rolled
            # back while we are stopped is then noticed at the next start.
            try:
                mark.write(mark.reserved, max(mark.floor, self.committed_fence))
            except OSError as exc:
                log.warning(kv(event="fence_mark_not_written", error=exc.strerror or exc))


#: The columns of a lease row, in the order :func:`_lease_of` reads them.
_LEASE_COLUMNS = (
    "key, handle, fence, owner, principal, ttl_ms, expires_at, mode, hold_limit, slot, pid, "
    "process, pid_start, boot_id"
)
#: Rows per fetch of :meth:`Store.deadlines`.
_ROWS_PER_BATCH = 8192
#: How much of the file the reads at start map: the first 64 MiB (pages
#: past it are read as usual). Mapped pages count in the daemon's RSS while
#: mapped: this bounds what the start's peak RSS grows by.
_START_MMAP_BYTES = 64 << 20
#: SQLite VM steps between two looks of the integrity check at its cancel flag
#: (~20 ms of quick_check; each look takes the GIL, so not much more often).
_CANCEL_EVERY = 1_000_000
#: Keys in one ``IN (...)`` of :meth:`Store.leases_of` (SQLite allows 32,766 parameters).
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


class _IntegrityCheck:
    """``PRAGMA quick_check`` and the row checks (:func:`~lockd.daemon.verify.inspect`) in a thread.

    SQLite lets go of the GIL for ``quick_check`` (one ``sqlite3_step``) and
    while it builds each row's text, so it runs beside the daemon, which
    answers meanwhile (issue 26: at 1 M leases the check costs ~1.5-5 s of
    CPU, measured, and was most of a restart). It needs a connection of
    its own, and the daemon's holds an exclusive lock: this one is
    ``immutable`` (no locks, does not look at the WAL). That sees every
    commit because :meth:`Store._wal_folded_in` copied the WAL into the file
    first, and nothing changes the file until :meth:`result` is in: writes
    wait for it, and reads do not touch the file.
    """

    def __init__(self, path: Path, boot_id: str) -> None:
        self.path = path
        self.boot_id = boot_id
        self._problems: list[str] = []
        self._found: Findings | None = None
        #: the latest deadline of ``boot_id``'s rows (for the run record), once passed.
        self.latest: int | None = None
        self._cancelled = False
        self.done = threading.Event()
        threading.Thread(target=self._run, name="lockd-quick-check", daemon=True).start()

    def _run(self) -> None:
        uri = f"{self.path.absolute().as_uri()}?mode=ro&immutable=1"
        if self._cancelled:  # stopped before it began
            self._problems = ["interrupted"]
            self.done.set()
            return
        try:
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
            try:
                # Mapped: no system call per page (~40 % less CPU, measured);
                # unmapped when the connection closes.
                conn.execute(f"PRAGMA mmap_size={_START_MMAP_BYTES}")
                # cancel() interrupts whichever statement runs.
                conn.set_progress_handler(lambda: self._cancelled, _CANCEL_EVERY)
                self._found = inspect(conn)
                if self._found.sound and self._found.version:
                    # Here, not on the start's path: a scan of every row.
                    self.latest = conn.execute(
                        "SELECT max(expires_at) FROM leases WHERE boot_id = ?", (self.boot_id,)
                    ).fetchone()[0]
            finally:
                conn.close()
        except sqlite3.Error as exc:
            self._problems = [f"{exc}"]
        except BaseException as exc:  # a bug: the start must still fail, not pass
            self._problems = [f"{type(exc).__name__}: {exc}"]
            raise
        finally:
            self.done.set()

    def cancel(self) -> None:
        """Stop the check soon (the daemon stops); :meth:`result` then fails."""
        self._cancelled = True

    def result(self) -> None:
        """Wait for the check; raise :class:`DatabaseDamaged` if the file is damaged."""
        self.done.wait()
        if self._problems:
            _raise_problems(self.path, [(p,) for p in self._problems])
        if self._found is not None and not self._found.sound:
            raise DatabaseDamaged(
                f"{self.path} {self._found.describe()}; nothing was changed "
                "(lockd serve --accept-data-loss starts on what is left)"
            )


def _raise_problems(path: Path, rows: list[tuple[Any, ...]]) -> None:
    """Raise :class:`StoreError` unless ``quick_check`` answered ``ok``."""
    problems = [row[0] for row in rows]
    if problems != ["ok"]:
        shown = "; ".join(str(p) for p in problems[:3])
        raise DatabaseDamaged(f"{path} failed its integrity check: {shown}")


#: Writes between two checks of the files inside :meth:`Store.apply`.
CHECK_EVERY = 64
#: The first 16 bytes of every SQLite database file.
_SQLITE_HEADER = b"SQLite format 3\x00"
#: The first 4 bytes of a WAL file (big-endian magic, either checksum order).
_WAL_MAGICS = (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")


def _check_files_before_open(db: Path) -> None:
    """Refuse a database or WAL that SQLite would quietly treat as empty.

    SQLite opens a zero-length file as a new database and ignores a WAL
    whose header is damaged: either way the leases and the fence would be
    gone without a word. A missing file is fine (a new database).
    """
    for path, magics, what in (
        (db, (_SQLITE_HEADER,), "not a SQLite database"),
        (db.with_name(db.name + "-wal"), _WAL_MAGICS, "not a SQLite WAL"),
    ):
        try:
            with path.open("rb") as f:
                head = f.read(len(magics[0]))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        if path == db and not head:
            raise StoreError(f"{path} is empty (0 bytes): it was truncated or damaged")
        if head and head not in magics:
            raise StoreError(f"{path} is damaged: {what} (its first bytes are wrong)")


def _open_failed(path: Path, exc: sqlite3.Error) -> StoreError:
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return StoreError(f"{path} is in use by another process (another lockd on this database?)")
    return StoreError(f"{path}: {exc}")


def _prepare_directory(directory: Path) -> None:
    """Create the state directory private to the daemon's user."""
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    mode = directory.stat().st_mode & 0o777
    if mode & 0o077 and directory.stat().st_uid == os.getuid():
        log.warning(kv(event="state_dir_open", dir=directory, mode=oct(mode), hint="chmod 700 it"))
