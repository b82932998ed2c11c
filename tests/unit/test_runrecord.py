"""The run record and the row checksums, without a daemon (issue 21).

The store refuses a database that counts fewer lease writes than the run
record outside the state folder says were acknowledged in this boot, and
after an accepted loss it holds every grant until the latest deadline the
record saw: driven here with explicit boot-clock values, no sleeping.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockd.daemon.runrecord import RunRecord, RunRecordError, record_path
from lockd.daemon.store import GrantsOnHold, Store, StoreError
from lockd.daemon.verify import ROW_TEXT_SQL, row_checksum
from tests.depth import examples

from .test_store import BOOT, OTHER_BOOT, changes, lease

# Text as SQLite stores it from Python: no lone surrogates (they cannot be encoded).
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=examples(200), deadline=None)
@given(
    key=text.filter(bool),
    owner=st.none() | text,
    process=st.none() | text,
    pid=st.none() | st.integers(0, 2**31),
    numbers=st.tuples(*[st.integers(0, 2**62)] * 5),
)
def test_row_checksum_is_what_sqlite_rebuilds_at_start(
    key: str, owner: str | None, process: str | None, pid: int | None, numbers: tuple[int, ...]
) -> None:
    slot, fence, ttl, expires, limit = numbers
    values = (key, slot, "h" * 22, fence, owner, "user:x", ttl, expires, BOOT, "shared", limit)
    row = (*values, pid, process)
    conn = sqlite3.connect(":memory:")
    conn.text_factory = bytes
    conn.execute(
        "CREATE TABLE leases (key TEXT, slot INTEGER, handle TEXT, fence INTEGER, owner TEXT, "
        "principal TEXT, ttl_ms INTEGER, expires_at INTEGER, boot_id TEXT, mode TEXT, "
        "hold_limit INTEGER, pid INTEGER, process TEXT) STRICT"
    )
    conn.execute("INSERT INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
    (rebuilt,) = conn.execute(f"SELECT {ROW_TEXT_SQL} FROM leases").fetchone()
    conn.close()
    assert zlib.crc32(rebuilt) == row_checksum(*row)


def test_record_round_trip_and_bounds(tmp_path: Path) -> None:
    path = record_path(tmp_path / "run", tmp_path / "state" / "lockd.db")
    assert path.parent == tmp_path / "run"
    record = RunRecord(path)
    assert record.read() is None
    record.begin(BOOT, tmp_path / "state" / "lockd.db", seq=3, fence=10_007, deadline=500)
    record.set_seq(9)
    record.set_fence(20_000)
    record.set_fence(15_000)  # a reservation never goes back
    record.set_deadline(400)  # nor the latest deadline
    last = RunRecord(path).read()  # another reader sees the mapped stores at once
    assert last is not None
    assert (last.boot_id, last.seq, last.fence, last.deadline) == (BOOT, 9, 20_000, 500)
    assert last.db == str(tmp_path / "state" / "lockd.db")
    assert path.stat().st_mode & 0o777 == 0o600
    record.close()
    if os.geteuid() == 0:  # CI runs as root: a record planted by another user
        os.chown(path, 65534, 65534)
        with pytest.raises(RunRecordError, match="not a regular file of ours"):
            RunRecord(path).read()
    path.unlink()
    path.write_bytes(b"garbage")
    with pytest.raises(RunRecordError, match="not a lockd run record"):
        RunRecord(path).read()


def _crash_copy(db: Path, to: Path) -> None:
    """Copy the open database's files as a crash would leave them."""
    to.parent.mkdir(mode=0o700, exist_ok=True)
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{db}{suffix}", f"{to}{suffix}")


def test_lost_writes_refused_then_accepted_with_grants_held(tmp_path: Path) -> None:
    db = tmp_path / "state" / "lockd.db"
    record_file = record_path(tmp_path, db)
    store = Store(db, BOOT, record=RunRecord(record_file))
    store.begin_run(0)
    store.apply(changes({"a": lease("a", 1, expires_at=7_000)}, fence=1))
    saved = tmp_path / "saved" / "lockd.db"
    _crash_copy(db, saved)  # the files before the next two writes
    store.apply(changes({"b": lease("b", 2, expires_at=9_000)}, fence=2))
    store.apply(changes({"a": None}))
    _crash_copy(db, tmp_path / "crashed" / "lockd.db")
    store.close()
    # The WAL "lost" its last two commits: the record still counts them.
    shutil.rmtree(db.parent)
    shutil.copytree(saved.parent, db.parent)
    with pytest.raises(StoreError, match="acknowledged writes are gone"):
        Store(db, BOOT, record=RunRecord(record_file))
    # Another boot's record does not count (its leases are dropped anyway).
    Store(db, OTHER_BOOT, record=RunRecord(record_file)).close()
    shutil.rmtree(db.parent)
    shutil.copytree(saved.parent, db.parent)

    accepted = Store(db, BOOT, record=RunRecord(record_file), accept_loss=True, boot_ms=lambda: 50)
    assert accepted.accepted_loss and "2 acknowledged writes are gone" in accepted.accepted_loss[0]
    assert accepted.grants_held_until == 9_000  # "b" may have been held until then
    with pytest.raises(GrantsOnHold):
        accepted.check_grants(8_999)
    accepted.check_grants(9_000)
    assert accepted.grants_held_until == 0
    accepted.close()


def test_unchanged_files_after_a_refusal(tmp_path: Path) -> None:
    """The check runs on a read-only connection: the WAL is not folded in or deleted."""
    db = tmp_path / "state" / "lockd.db"
    record_file = record_path(tmp_path, db)
    store = Store(db, BOOT, record=RunRecord(record_file))
    store.begin_run(0)
    for i in range(20):
        store.apply(changes({f"k{i}": lease(f"k{i}", i + 1)}, fence=i + 1))
    _crash_copy(db, tmp_path / "crashed" / "lockd.db")
    store.close()  # (a clean stop, but the crash's files are put back)
    shutil.rmtree(db.parent)
    shutil.copytree(tmp_path / "crashed", db.parent)
    crashed = db
    wal = crashed.with_name("lockd.db-wal")
    data = bytearray(wal.read_bytes())
    data[32 + 24 + 300] ^= 1  # the first frame's page
    wal.write_bytes(bytes(data))
    before = (crashed.read_bytes(), wal.read_bytes())
    with pytest.raises(StoreError, match="acknowledged writes are gone"):
        Store(crashed, BOOT, record=RunRecord(record_file), background_check=True)
    assert (crashed.read_bytes(), wal.read_bytes()) == before
    assert not crashed.with_name("lockd.db-shm").exists()


def test_the_record_counts_what_the_database_counts(tmp_path: Path) -> None:
    """Inserts, replaces (renew), deletes and deletes of nothing: both counts agree."""
    db = tmp_path / "state" / "lockd.db"
    record = RunRecord(record_path(tmp_path, db))
    store = Store(db, BOOT, record=record)
    store.begin_run(0)
    store.apply(changes({"a": lease("a", 1), "b": lease("b", 2)}, fence=2))
    store.apply(changes({"a": lease("a", 1, expires_at=9_000)}))  # a renew: a REPLACE
    store.apply(changes({"b": None}))
    store.apply(changes({"gone": None, "c": lease("c", 3)}, fence=3))  # deletes no row
    store.apply(changes({"a": None}))
    # (the store's connection is exclusive: the count is read through it)
    counted = store._db.execute("SELECT seq FROM meta WHERE name = 'fence'").fetchone()[0]
    assert counted == store.seq == record.seq == 6
    last = RunRecord(record.path).read()
    assert last is not None and last.seq == 6 and last.deadline == 9_000
    store.close()
