"""SQLite persistence for the engine's effects.

:class:`Store` is the door; its rooms: the schema and its migrations
(:mod:`lockd.daemon.storeschema`), the files checked and watched
(:mod:`lockd.daemon.storefiles`), the integrity check at start
(:mod:`lockd.daemon.storecheck`), the reads (:mod:`lockd.daemon.storereads`)
and the writes (:mod:`lockd.daemon.storewrites`); the errors they raise are
in :mod:`lockd.daemon.storeerrors`.

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
  (``background_check``, see :class:`~lockd.daemon.storecheck.IntegrityCheck`) and answers
  meanwhile: nothing is written before it passed (every write waits for
  it), no row is used that was not checked (:meth:`Store.leases_of` checks
  the rows it reads; :meth:`Store.deadlines_after` hands over keys and
  deadlines only, whose keys are read that way when used), and a failure
  stops the daemon as a refused start would (:class:`DatabaseDamaged`).
- The database and WAL files we opened must still be the ones at their
  paths: deleted (``st_nlink == 0`` for the open file) or replaced, every
  later commit would vanish at the next restart. :meth:`Store.check_files`
  compares them; the daemon calls it four times a second and
  :meth:`Store.apply` every :data:`~lockd.daemon.storewrites.CHECK_EVERY` writes (a ``stat`` costs
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

import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lockd.daemon.engine import Changes, Lease
from lockd.daemon.fencemark import FenceMark
from lockd.daemon.losscheck import LossCheck, StartRefused
from lockd.daemon.runrecord import LastRun, RunRecord
from lockd.daemon.storecheck import IntegrityCheck
from lockd.daemon.storeerrors import DatabaseDamaged, GrantsOnHold, StorageUnavailable, StoreError
from lockd.daemon.storefiles import (
    FileWatch,
    check_files_before_open,
    open_failed,
    prepare_directory,
)
from lockd.daemon.storereads import LeaseReads
from lockd.daemon.storeschema import SCHEMA_VERSION, migrate
from lockd.daemon.storewrites import LeaseWrites
from lockd.daemon.verify import Findings, inspect
from lockd.logfmt import kv

__all__ = [
    "SCHEMA_VERSION",
    "DatabaseDamaged",
    "GrantsOnHold",
    "StorageUnavailable",
    "Store",
    "StoreError",
    "read_boot_id",
]

log = logging.getLogger("lockd.daemon.store")


def _boot_ms() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


def read_boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        return f.read().strip()


class Store:
    """The daemon's SQLite database: a door to the parts that read and write it.

    It opens the database (the checks of :mod:`lockd.daemon.storefiles`, the
    schema of :mod:`lockd.daemon.storeschema`, the integrity check of
    :mod:`lockd.daemon.storecheck`) and runs the start against the run
    record; then the reads (:class:`~lockd.daemon.storereads.LeaseReads`)
    and the writes (:class:`~lockd.daemon.storewrites.LeaseWrites`) share
    its connection, each handed the state it works on.
    """

    def __init__(
        self,
        path: Path | str,
        boot_id: str,
        *,
        synchronous: str = "NORMAL",
        background_check: bool = False,
        defer_check: bool = False,
        record: RunRecord | None = None,
        accept_loss: bool = False,
        boot_ms: Callable[[], int] | None = None,
    ) -> None:
        """Open (or create) the database; raises :class:`StoreError` if it cannot be used.

        With ``background_check`` the integrity check of a database on disk
        runs in a thread and the constructor returns at once: reads may go
        on meanwhile (:meth:`leases_of` checks the rows it reads);
        :meth:`wait_checked` (and every write) waits for it and raises its
        failure; :meth:`close` stops it. ``defer_check``: its thread begins
        at :meth:`start_check` (the daemon calls it once it answers), or
        when :meth:`wait_checked` (a write) needs it first.

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
        record = record if on_disk else None
        #: the start's judgement of the database against the run record.
        self.loss = LossCheck(self.path, boot_id, record, accept_loss)
        #: what was found lost or damaged and accepted (``accept_loss``), for the log.
        self.accepted_loss = self.loss.accepted
        #: after an accepted loss: no grant before this boot-clock ms (0: none held).
        self.grants_held_until = 0
        #: the database and WAL files, watched for vanishing (not for an in-memory one).
        self.files = FileWatch(self.path, watching=self.mark is not None)
        #: the integrity check still running in its thread (background_check).
        self._check: IntegrityCheck | None = None
        #: begin_run()'s fence while the check runs: the record begins once it passed.
        self._run_fence: int | None = None
        #: the latest deadline of this boot's rows, when the check found it.
        self._latest: int | None = None
        self._synchronous = synchronous
        #: the crash's database is read, not yet written, while its check runs
        #: (see :meth:`_read_crash_first`); :meth:`wait_checked` opens it to write.
        self._reader_only = False
        #: the ``-shm`` index the read-only connections made (removed once they close).
        self._made_shm: Path | None = None
        #: a descriptor of the crash's database file, flock()ed from the start
        #: to close() (see :meth:`_claim_crash_files`).
        self._claim: int | None = None
        #: set when the crash's database could not be opened to write after its
        #: check passed: every later write and wait raises it (:meth:`_become_writer`).
        self._unusable: StorageUnavailable | None = None
        try:
            found: Findings | None = None
            if on_disk:
                prepare_directory(self.path.parent)
                check_files_before_open(self.path)
                try:
                    self.loss.read_last_run()
                    if background_check and not accept_loss and self._crash_wal():
                        self._claim_crash_files()
                        self._reader_only = self.loss.judge_crash_quickly(SCHEMA_VERSION)
                    if not self._reader_only:
                        found = self.loss.inspect_first()
                except StartRefused as exc:
                    raise StoreError(str(exc)) from None
                except sqlite3.Error as exc:
                    raise open_failed(self.path, exc) from exc
            # The -wal and -shm files SQLite creates later copy the database
            # file's mode, so a private umask at creation covers all three.
            old_umask = os.umask(0o077)
            try:
                if self._reader_only:
                    self._db = self._read_crash_first()
                else:
                    self._db = self._open_writer(str(path), on_disk)
                self.writes = LeaseWrites(
                    self._db,
                    self.path,
                    boot_id,
                    mark=self.mark,
                    record=record,
                    files=self.files,
                    may_write=self._may_write,
                    wait_checked=self.wait_checked,
                )
                self.reads = LeaseReads(
                    self._db,
                    self.path,
                    boot_id,
                    wait_checked=self.wait_checked,
                    drop_earlier_boots=self.writes.drop_earlier_boots,
                )
                if self._reader_only:
                    # Judged already on the seq (judge_crash_quickly); the rest
                    # of the checks read the WAL too, beside the daemon.
                    self._check = IntegrityCheck(
                        self.path, boot_id, start=not defer_check, sees_wal=True
                    )
                else:
                    if on_disk and found is None:
                        self.loss.judge_seq(self._read_seq())  # before anything is written
                    migrate(self._db, self.path)
                    if found is not None:
                        self.loss.repair(self._db, found)  # checked already, on the files as found
                    elif on_disk and background_check and self._wal_folded_in():
                        self._check = IntegrityCheck(self.path, boot_id, start=not defer_check)
                    else:
                        self.loss.judge_found(inspect(self._db))
                self.grants_held_until = self.loss.grants_held_until((boot_ms or _boot_ms)())
                self.writes.seq = self._read_seq() or 0
                if on_disk:
                    self.files.remember_identity(self.path)
            except StartRefused as exc:
                raise StoreError(str(exc)) from None
            except sqlite3.Error as exc:
                raise open_failed(Path(path), exc) from exc
            finally:
                os.umask(old_umask)
        except BaseException:
            if self._claim is not None:
                self._abandon_crash_open()
            raise

    def _abandon_crash_open(self) -> None:
        """A start on a crash's database failed after it opened connections: close them all.

        In this order: the check, the connections (read-only ones fold
        nothing in), the ``-shm`` they made, and the flock last, since
        closing any descriptor of the file drops this process's fcntl()
        locks on it, SQLite's among them (see :meth:`_claim_crash_files`).
        """
        check, self._check = self._check, None
        if check is not None:
            check.cancel()
            check.done.wait()
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
        self._forget_shm()
        self._release_claim()

    def _open_writer(self, target: str, on_disk: bool) -> sqlite3.Connection:
        """The daemon's own connection, the one that writes (its settings say why)."""
        # timeout=0: the database is ours alone (exclusive locking); if it
        # is locked, another daemon has it, and waiting will not help.
        db = sqlite3.connect(target, isolation_level=None, check_same_thread=False, timeout=0)
        try:
            if on_disk:
                os.chmod(self.path, 0o600)
            # Exclusive locking: the daemon is the database's only user, so
            # WAL needs no shared-memory index and a commit skips its fcntl
            # locks (measured ~23 -> ~9 us per commit with 1 KiB pages). It
            # also stops a second daemon from opening the same database.
            db.execute("PRAGMA page_size=1024")  # only takes effect on a new file
            db.execute("PRAGMA locking_mode=EXCLUSIVE")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self._synchronous}")
            # A checkpoint (with its fsync) runs inside whichever commit
            # crosses the threshold, on the event loop: 1-3 ms. Our commits
            # rewrite the same few pages, so a longer WAL costs little to
            # checkpoint and makes that stall ten times rarer.
            db.execute("PRAGMA wal_autocheckpoint=10000")
            db.execute("PRAGMA journal_size_limit=4194304")
            db.execute("PRAGMA foreign_keys=ON")
            # The write count (meta.seq) relies on a REPLACE not firing the
            # delete trigger; some builds default this on (compile options).
            db.execute("PRAGMA recursive_triggers=OFF")
        except BaseException:
            db.close()
            raise
        return db

    def _crash_wal(self) -> bool:
        """A WAL with commits in it is there: the last run did not stop cleanly."""
        try:
            return os.stat(self.loss.wal).st_size > 0 and self.path.exists()
        except FileNotFoundError:
            return False

    def _claim_crash_files(self) -> None:
        """Keep a second lockd off a crash's database while it is only read.

        The writer's exclusive lock is what keeps another daemon out, and
        after a crash it is taken only once the check passed: until then a
        second ``lockd serve`` on the same database would answer from the
        same files, and its own writer could fold the WAL in. An flock() on
        the database file (independent of SQLite's fcntl() locks; this
        descriptor is closed only after every connection, in :meth:`close`)
        refuses it at once, as the exclusive lock would.
        """
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(
                f"{self.path} is in use by another process (another lockd on this database?)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._claim = fd

    def _release_claim(self) -> None:
        """Let go of :meth:`_claim_crash_files`' lock (after every connection closed)."""
        fd, self._claim = self._claim, None
        if fd is not None:
            os.close(fd)

    def _read_crash_first(self) -> sqlite3.Connection:
        """A read-only connection to a crash's database, for the daemon while the check runs.

        After a crash the WAL holds the last commits. Opened to write, the
        database would have the WAL folded into its file at the first
        checkpoint or close, and a refusal after that would leave the files
        changed, the evidence an operator needs gone (docs/operations.md,
        "Lost or damaged database"). So the daemon reads it read-only (a
        read-only connection cannot checkpoint), the check reads it the
        same way beside it, and :meth:`wait_checked` opens it to write
        only once the check has passed. Nothing is written before: every
        write waits for the check anyway. The count of acknowledged writes
        was judged before (:meth:`LossCheck.judge_crash_quickly`), so a WAL
        cut short is still refused before the daemon answers.
        """
        shm = self.path.with_name(self.path.name + "-shm")
        if not shm.exists():
            self._made_shm = shm
        db = sqlite3.connect(
            f"{self.path.absolute().as_uri()}?mode=ro", uri=True, check_same_thread=False, timeout=0
        )
        db.execute("PRAGMA query_only=1")
        return db

    def _become_writer(self) -> None:
        """The check passed: the daemon's connection becomes the one that writes.

        All or nothing: if the database cannot be opened to write, the store
        stays unusable for good (:attr:`_unusable`, raised by every later
        write and wait), never half switched to a closed connection. Under a
        descriptor limit the switch still fits: the two read-only
        connections closed first (the check's, closed by its thread, and
        this one) held more descriptors than the writer opens.
        """
        self._db.close()  # read-only: folds nothing in
        self._forget_shm()
        old_umask = os.umask(0o077)
        try:
            db = self._open_writer(str(self.path), True)
            try:
                migrate(db, self.path)  # the same version (judge_crash_quickly): nothing to do
            except BaseException:
                db.close()
                raise
        except (sqlite3.Error, OSError, StoreError) as exc:
            self._unusable = StorageUnavailable(
                f"{self.path}: its integrity check passed, but it cannot be opened to write: {exc}"
            )
            raise self._unusable from exc
        finally:
            os.umask(old_umask)
        self._db = db
        self.writes.rebind(db)
        self.reads.rebind(db)
        self._reader_only = False
        self.files.remember_identity(self.path)

    def _forget_shm(self) -> None:
        shm, self._made_shm = self._made_shm, None
        if shm is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm)

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
            if self.writes.record is not None:
                self.writes.record.reserve()
            return
        record = self.writes.record
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
                self.boot_id, self.path, seq=self.writes.seq, fence=fence_reserved, deadline=latest
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
            self.writes.record = None

    def _wal_folded_in(self) -> bool:
        """Make the database file hold every commit (the check's connection reads only it).

        After a crash the WAL still holds the last commits: a checkpoint
        copies them into the file (only then; a clean stop leaves no WAL).
        False if some could not be copied: the check then runs here, on
        this connection, which sees the WAL.
        """
        try:
            if os.stat(self.files.wal).st_size == 0:
                return True
        except FileNotFoundError:
            return True
        busy, frames, copied = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return not busy and frames == copied

    def wait_checked(self) -> None:
        """Wait for the integrity check started in the background; raise its failure.

        Raises :class:`DatabaseDamaged` when it failed (every call, not only
        the first). Once it passed, the run record begins (:meth:`begin_run`).
        """
        if self._unusable is not None:
            raise self._unusable
        check = self._check
        if check is not None:
            check.result()  # raises DatabaseDamaged when the check failed
            if self._reader_only:
                self._become_writer()  # raises (for good) if it cannot
            self._latest = check.latest
            self._check = None
            if self._run_fence is not None:
                fence, self._run_fence = self._run_fence, None
                self.begin_run(fence)

    def start_check(self) -> None:
        """Begin the deferred integrity check (``defer_check``); nothing if none waits."""
        if self._check is not None:
            self._check.start()

    @property
    def check_pending(self) -> bool:
        """The integrity check has not been waited for yet: a write now waits for it.

        The event loop must not make that wait (it would stop every
        connection for the whole scan): facts stay pending until the check
        is in (:meth:`lockd.daemon.commits.Commits.commit_fact`), requests
        wait in their connection's task (``LockServer.integrity_checked``).
        """
        return self._check is not None

    @property
    def check_done(self) -> threading.Event | None:
        """Set once the background check has finished (None: none is running)."""
        return None if self._check is None else self._check.done

    def load(self) -> tuple[list[Lease], int]:
        """Drop leases of earlier boots; return this boot's leases and the fence."""
        leases = list(self.leases())
        return leases, max([self.stored_fence(), *(lease.fence for lease in leases)])

    # -- the parts' state, read (and, for tests, set) here -------------------

    @property
    def seq(self) -> int:
        """Lease rows inserted or deleted so far (``meta.seq``; the run record follows it)."""
        return self.writes.seq

    @property
    def committed_fence(self) -> int:
        """The highest fence the database holds (after load and each commit)."""
        return self.writes.committed_fence

    @property
    def record(self) -> RunRecord | None:
        """The run record outside the state folder (None: none, or it could not be written)."""
        return self.writes.record

    @property
    def damaged(self) -> str | None:
        """What a row read found damaged (then no more writes, as after a failed check)."""
        return self.reads.damaged

    @property
    def lost(self) -> str | None:
        """Why the files are no longer ours, once a check found it (then no writes)."""
        return self.files.lost

    @property
    def read_hook(self) -> Callable[[int], None] | None:
        """Called with the number of rows each read of leases hands over (tests count them)."""
        return self.reads.read_hook

    @read_hook.setter
    def read_hook(self, hook: Callable[[int], None] | None) -> None:
        self.reads.read_hook = hook

    def _may_write(self) -> None:
        """Raise unless a write may go in now; wait for a check still running."""
        if self.reads.damaged is not None:
            raise DatabaseDamaged(self.reads.damaged)
        if self._check is not None or self._unusable is not None:
            self.wait_checked()  # never write into a database that failed its check
        if self.files.lost is not None:
            raise StorageUnavailable(self.files.lost)

    # -- reads (storereads.py) -----------------------------------------------

    def stored_fence(self) -> int:
        """The fence high-water mark kept in ``meta``."""
        value = self.reads.stored_fence()
        self.writes.committed_fence = max(self.writes.committed_fence, value)
        return value

    def deadlines(self) -> Iterator[list[tuple[bytes, int]]]:
        """This boot's (UTF-8 key, deadline) rows in batches: ``LeaseReads.deadlines``."""
        return self.reads.deadlines()

    def deadlines_after(self, after: str | None) -> tuple[list[tuple[bytes, int]], str | None]:
        """One chunk of this boot's (UTF-8 key, deadline) rows: ``LeaseReads.deadlines_after``."""
        return self.reads.deadlines_after(after)

    def leases_of(self, keys: list[str]) -> list[Lease]:
        """This boot's leases of ``keys``, each row checked: ``LeaseReads.leases_of``."""
        return self.reads.leases_of(keys)

    def leases(self) -> Iterator[Lease]:
        """Stream this boot's leases; drop those of earlier boots: ``LeaseReads.leases``."""
        return self.reads.leases()

    # -- writes (storewrites.py) ---------------------------------------------

    def apply(self, changes: Changes) -> None:
        """Persist one batch of engine effects atomically: ``LeaseWrites.apply``."""
        self.writes.apply(changes)

    def check_files(self) -> None:
        """Raise :class:`StorageUnavailable` if a file we write was deleted or replaced."""
        self.files.check_files()

    def close(self) -> None:
        if self._check is not None:
            # Closing checkpoints into the file the check is reading: stop
            # it first (a stop must not wait for a scan of every row; the
            # next start checks again).
            self._check.cancel()
            self._check.done.wait()
        self._db.close()
        self._forget_shm()
        self._release_claim()
        if self.writes.record is not None:
            self.writes.record.close()
        mark = self.mark
        if mark is not None and mark.reserved:
            # Record what the database holds now: a database lost or rolled
            # back while we are stopped is then noticed at the next start.
            try:
                mark.write(mark.reserved, max(mark.floor, self.writes.committed_fence))
            except OSError as exc:
                log.warning(kv(event="fence_mark_not_written", error=exc.strerror or exc))
