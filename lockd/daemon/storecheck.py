"""The integrity check of a database found at start, run in a thread while the daemon answers.

``PRAGMA quick_check`` and the row checks of :mod:`lockd.daemon.verify`; the
store (:mod:`lockd.daemon.store`) waits for :meth:`IntegrityCheck.result`
before its first write.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

from lockd.daemon.storeerrors import DatabaseDamaged, StorageUnavailable
from lockd.daemon.verify import Findings, inspect

#: How much of the file :meth:`~lockd.daemon.storereads.LeaseReads.deadlines`
#: (the restore at once, not the daemon's restore in chunks) maps: the first
#: 64 MiB (pages past it are read as usual). Mapped pages count in the
#: process's RSS while mapped. The integrity check maps nothing (below).
START_MMAP_BYTES = 64 << 20
#: SQLite VM steps between two looks of the integrity check at its cancel flag
#: (~20 ms of quick_check; each look takes the GIL, so not much more often).
CANCEL_EVERY = 1_000_000
#: Primary SQLite result codes that say the check could not run, nothing
#: about the file: a resource it lacked (a descriptor, memory, room) or a
#: lock. Any other error is a finding (a damaged schema answers
#: SQLITE_ERROR, and it comes back at every start).
_COULD_NOT_RUN = frozenset(
    {
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_PERM,
        sqlite3.SQLITE_PROTOCOL,  # a WAL lock race
        sqlite3.SQLITE_READONLY,  # e.g. the -shm could not be written
    }
)


class IntegrityCheck:
    """``PRAGMA quick_check`` and the row checks (:func:`~lockd.daemon.verify.inspect`) in a thread.

    SQLite lets go of the GIL for ``quick_check`` (one ``sqlite3_step``) and
    while it builds each row's text, so it runs beside the daemon, which
    answers meanwhile (issue 26: at 1 M leases the check costs ~1.5-5 s of
    CPU, measured, and was most of a restart). It needs a connection of
    its own, and the daemon's holds an exclusive lock: this one is
    ``immutable`` (no locks, does not look at the WAL). That sees every
    commit because :meth:`~lockd.daemon.store.Store._wal_folded_in` copied the WAL into the file
    first, and nothing changes the file until :meth:`result` is in: writes
    wait for it, and reads do not touch the file.
    """

    def __init__(
        self, path: Path, boot_id: str, *, start: bool = True, sees_wal: bool = False
    ) -> None:
        """Check ``path``; ``start=False``: the thread begins at :meth:`start` (or :meth:`result`).

        The daemon starts it once it answers (``serve``), so that neither its
        CPU nor its reads of the file are on the way to the first ``hello``.
        ``sees_wal``: after a crash, the database with its WAL, read as the
        store's read-only connection reads it (``Store._read_crash_first``);
        otherwise the file alone, which holds every commit then.
        """
        self.path = path
        self.sees_wal = sees_wal
        self.boot_id = boot_id
        self._problems: list[str] = []
        #: why the check never ran (no thread): nothing was found damaged.
        self._not_run: str | None = None
        #: the I/O error a read of the file met (the disk, not the content).
        self._io_error: str | None = None
        self._found: Findings | None = None
        #: the latest deadline of ``boot_id``'s rows (for the run record), once passed.
        self.latest: int | None = None
        self._cancelled = False
        self.done = threading.Event()
        self._started = False
        self._starting = threading.Lock()
        #: opened here, on the start's path, not in the thread: the daemon
        #: answers before the thread runs, and a descriptor limit reached
        #: meanwhile (clients hold every free one) must not stop the check,
        #: nor read as damage (issue 23's CI: EMFILE after ``hello``).
        self._conn: sqlite3.Connection | None = None
        try:
            self._conn = self._connect()
        except sqlite3.Error as exc:
            self._judge_error(exc, opening=True)
            self._started = True
            self.done.set()
        if start:
            self.start()

    def _connect(self) -> sqlite3.Connection:
        uri = f"{self.path.absolute().as_uri()}?mode=ro"
        if not self.sees_wal:
            uri += "&immutable=1"
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        try:
            # Not mapped (SQLite's default, said here as the choice it is):
            # every mapped page the check touches counts in the daemon's
            # RSS until the connection closes, +77 MB at 1 M leases with
            # 64 MiB mapped, which took a restarted daemon's peak to
            # 172-178 MB (issue 26 wants <= 150). Read, the check costs
            # ~13 % more CPU at 1 M (system calls; 4.75 against 4.20 s,
            # medians of 3) and adds ~10 MB; a 16 MiB map cost as much
            # CPU as none (docs/operations.md, "Restart time").
            conn.execute("PRAGMA mmap_size=0")
            # cancel() interrupts whichever statement runs.
            conn.set_progress_handler(lambda: self._cancelled, CANCEL_EVERY)
            if self.sees_wal:
                # SQLite opens the -wal file and maps the -shm index at the
                # first read, not at connect: read now, so the check needs
                # no descriptor after READY either (see __init__).
                conn.execute("PRAGMA schema_version").fetchone()
        except BaseException:
            conn.close()
            raise
        return conn

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    @property
    def started(self) -> bool:
        """Whether the check's thread was started (or the check cancelled before it was)."""
        return self._started

    def start(self) -> None:
        """Begin the check in its thread (once; later calls do nothing)."""
        with self._starting:
            if self._started:
                return
            self._started = True
        try:
            threading.Thread(target=self._run, name="lockd-quick-check", daemon=True).start()
        except Exception as exc:
            # No thread, no check: it fails (every write is refused, the daemon
            # stops) rather than leave result() and close() waiting forever.
            self._not_run = f"its thread could not start: {exc}"
            self._close()
            self.done.set()

    def _run(self) -> None:
        conn = self._conn
        if self._cancelled or conn is None:  # stopped before it began
            self._problems = ["interrupted"]
            self._close()
            self.done.set()
            return
        try:
            try:
                self._found = inspect(conn)
                if self._found.sound and self._found.version:
                    # Here, not on the start's path: a scan of every row.
                    self.latest = conn.execute(
                        "SELECT max(expires_at) FROM leases WHERE boot_id = ?", (self.boot_id,)
                    ).fetchone()[0]
            finally:
                self._close()
        except sqlite3.Error as exc:
            self._judge_error(exc)
        except BaseException as exc:  # a bug: the start must still fail, not pass
            self._problems = [f"{type(exc).__name__}: {exc}"]
            raise
        finally:
            self.done.set()

    def _judge_error(self, exc: sqlite3.Error, *, opening: bool = False) -> None:
        """What an SQLite error met by the check says: it could not run, the disk, or damage."""
        code = getattr(exc, "sqlite_errorcode", None)
        name = getattr(exc, "sqlite_errorname", code)
        primary = None if code is None else code & 0xFF
        if primary in _COULD_NOT_RUN or (opening and code is None):
            what = "cannot open the database to check it: " if opening else ""
            self._not_run = f"{what}{exc} ({name})"
        elif primary == sqlite3.SQLITE_IOERR:
            # Not called damage (the file may be sound), nor "start again":
            # a disk that fails a read tends to fail it again.
            self._io_error = f"{exc} ({name})"
        else:
            self._problems = [f"{exc}"]

    def cancel(self) -> None:
        """Stop the check soon (the daemon stops); :meth:`result` then fails."""
        self._cancelled = True
        with self._starting:
            if self._started:
                return
            self._started = True  # never to run: done at once, as an interrupted check
        self._problems = ["interrupted"]
        self._close()
        self.done.set()

    def result(self) -> None:
        """Wait for the check (starting it if it was not); raise :class:`DatabaseDamaged`."""
        self.start()
        self.done.wait()
        if self._not_run is not None:
            # Not DatabaseDamaged: an operator told "damaged" might restore a
            # backup or accept data loss over a passing resource limit.
            raise StorageUnavailable(
                f"{self.path}: the integrity check could not run ({self._not_run}); "
                "nothing was found damaged, and nothing is written until it has run: "
                "start lockd again"
            )
        if self._io_error is not None:
            raise StorageUnavailable(
                f"{self.path}: the integrity check met an I/O error reading it "
                f"({self._io_error}); nothing was found damaged, and nothing is written "
                "until it has run: check the disk (dmesg, SMART), then start lockd again"
            )
        if self._problems:
            raise_problems(self.path, [(p,) for p in self._problems])
        if self._found is not None and not self._found.sound:
            raise DatabaseDamaged(
                f"{self.path} {self._found.describe()}; nothing was changed "
                "(lockd serve --accept-data-loss starts on what is left)"
            )


def raise_problems(path: Path, rows: list[tuple[Any, ...]]) -> None:
    """Raise :class:`StoreError` unless ``quick_check`` answered ``ok``."""
    problems = [row[0] for row in rows]
    if problems != ["ok"]:
        shown = "; ".join(str(p) for p in problems[:3])
        raise DatabaseDamaged(f"{path} failed its integrity check: {shown}")
