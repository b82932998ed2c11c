"""At start: did the database lose what the daemon acknowledged? (issue 21)

The store asks this before it writes anything: the run record
(:mod:`lockd.daemon.runrecord`) says how many lease writes the last run of
this boot acknowledged, the database says how many it holds, and
:mod:`lockd.daemon.verify` says whether its rows are intact. A loss or a
damage is refused with one line naming the file and what was found, or,
when the operator accepts the loss (``lockd serve --accept-data-loss``),
noted for the log, and every grant is held until the lost leases have run
out.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

from lockd.contract import MAX_TTL_MS
from lockd.daemon.runrecord import LastRun, RunRecord, RunRecordError
from lockd.daemon.verify import Findings, inspect_readonly


class StartRefused(Exception):
    """The database lost acknowledged writes or is damaged: do not start on it."""


class LossCheck:
    """What one start found, judged against the run record."""

    def __init__(self, path: Path, boot_id: str, record: RunRecord | None, accept: bool) -> None:
        self.path = path
        self.wal = path.with_name(path.name + "-wal")
        self.boot_id = boot_id
        self.record = record
        self.accept = accept
        #: the record of this database's last run, when it was in this boot.
        self.last_run: LastRun | None = None
        #: the fence the run record reserved, whatever boot wrote it (0: none).
        self.recorded_fence = 0
        #: what was found lost or damaged and accepted, for the log.
        self.accepted: list[str] = []

    def read_last_run(self) -> None:
        """Read the run record's account of this database (kept if it is from this boot)."""
        if self.record is None:
            return
        try:
            last = self.record.read()
        except RunRecordError as exc:
            if not self.accept:
                raise StartRefused(
                    f"{exc}: cannot tell whether acknowledged leases were lost"
                ) from None
            self.accepted.append(str(exc))
            return
        if last is None:
            return
        self.recorded_fence = last.fence
        if last.boot_id == self.boot_id and last.db == os.path.abspath(self.path):
            self.last_run = last
        # Another boot's leases are dropped anyway; its fence still counts.

    def inspect_first(self) -> Findings | None:
        """Check a database left by a crash (a WAL is there) before SQLite opens it to write.

        Opening it for writing and closing it again would checkpoint the WAL
        into the file and delete it: a refusal must leave both as found. A
        read-only connection sees the WAL and writes neither. A database
        stopped cleanly (no WAL) is checked by the daemon's own connection,
        in the background, as before (nothing is written first). None when
        there is nothing to inspect this way. Raises sqlite3.Error.
        """
        try:
            wal_size = os.stat(self.wal).st_size
        except FileNotFoundError:
            wal_size = 0
        if not self.path.exists():
            self.judge_seq(0)  # a deleted database after acknowledged writes
            return None
        if not wal_size and not self.accept:
            return None
        found = inspect_readonly(self.path)
        self.judge_seq(found.seq, found)
        return found

    def judge_crash_quickly(self, schema_version: int) -> bool:
        """Judge a crash's count of writes before the daemon answers; True: check the rest later.

        Only the counts are read here (a read-only connection that sees the
        WAL, ``meta.seq``): a WAL cut short, damaged or deleted is refused at
        once, files untouched, as :meth:`inspect_first` refuses it. The
        row-by-row checks then run beside the daemon (``Store._read_crash_first``).
        False, with nothing judged, when the database needs a schema
        migration first (an upgrade right after a crash): then
        :meth:`inspect_first` checks everything before the start goes on.
        """
        shm = self.path.with_name(self.path.name + "-shm")
        had_shm = shm.exists()
        conn = sqlite3.connect(f"{self.path.absolute().as_uri()}?mode=ro", uri=True, timeout=0)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version != schema_version:
                return False
            row = conn.execute("SELECT seq FROM meta WHERE name = 'fence'").fetchone()
        finally:
            conn.close()
            if not had_shm:  # as inspect_readonly: the files are left as found
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(shm)
        self.judge_seq(None if row is None else int(row[0]))
        return True

    def judge_seq(self, seq: int | None, found: Findings | None = None) -> None:
        """Refuse a database that lost writes acknowledged in this boot (and ``found`` damage)."""
        problems: list[str] = []
        last = self.last_run
        if last is not None and (seq or 0) < last.seq:
            assert self.record is not None
            missing = last.seq - (seq or 0)
            what = (
                "is missing"
                if not self.path.exists()
                else f"holds {seq or 0} lease writes (inserts and deletes)"
            )
            problems.append(
                f"{what}, but lockd acknowledged {last.seq} in this boot (per the run record "
                f"{self.record.path}): {missing} acknowledged writes are gone (its WAL "
                f"{self.wal.name} cut short, damaged or deleted, or the folder deleted)"
            )
        if found is not None and not found.sound:
            problems.append(found.describe())
        self._refuse_or_accept(problems, structural=found is not None and bool(found.structure))

    def judge_found(self, found: Findings) -> None:
        """Refuse a damaged database (or note it, accepted)."""
        if not found.sound:
            self._refuse_or_accept([found.describe()], structural=bool(found.structure))

    def _refuse_or_accept(self, problems: list[str], *, structural: bool) -> None:
        if not problems:
            return
        if structural:
            raise StartRefused(
                f"{self.path} {'; '.join(problems)}; SQLite cannot read it as it is: move it "
                "aside (lockd serve --accept-data-loss then starts on a new one)"
            )
        if not self.accept:
            raise StartRefused(
                f"{self.path} {'; '.join(problems)}; nothing was changed "
                "(lockd serve --accept-data-loss starts on what is left)"
            )
        self.accepted.extend(problems)

    def repair(self, db: sqlite3.Connection, found: Findings) -> None:
        """Accepted: drop rows that failed their check, rebuild a tree that hides rows."""
        if not self.accepted:
            return
        if found.damaged:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "DELETE FROM leases WHERE CAST(key AS BLOB) = ? AND slot = ?", found.damaged
            )
            db.execute("COMMIT")
        if found.unreachable:
            db.execute("VACUUM")  # copies every row into a new tree by a scan

    def grants_held_until(self, now: int) -> int:
        """After an accepted loss, the boot-clock ms before which no key is granted (0: none).

        Every lease that may be lost ends by the latest deadline the record
        saw committed in this boot; without such a record, by the longest
        TTL from now.
        """
        if not self.accepted:
            return 0
        last = self.last_run
        until = last.deadline if last is not None else now + MAX_TTL_MS
        return until if until > now else 0
