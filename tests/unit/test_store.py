"""The SQLite store on a temporary file: schema, durability settings, round trips."""

from __future__ import annotations

import gc
import shutil
import sqlite3
import stat
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockd.daemon import storeschema
from lockd.daemon.cold import ColdLeases
from lockd.daemon.engine import Changes, Lease, LockEngine
from lockd.daemon.store import SCHEMA_VERSION, Store, StoreError
from lockd.daemon.verify import ROW_TEXT_SQL

FIXTURES = Path(__file__).parents[1] / "fixtures"
BOOT = "11111111-2222-3333-4444-555555555555"
OTHER_BOOT = "99999999-8888-7777-6666-555555555555"


def lease(key: str, fence: int, owner: str | None = None, expires_at: int = 5000) -> Lease:
    return Lease(
        key=key,
        handle=f"handle-of-{key}-{fence:04d}-xxxxxx",
        fence=fence,
        owner=owner,
        principal="user:alice",
        ttl_ms=1000,
        expires_at=expires_at,
    )


def changes(rows: dict[str, Lease | None], fence: int | None = None) -> Changes:
    """A batch of exclusive holds: each key's row is its slot 0."""
    return Changes(rows={(key, 0): lease for key, lease in rows.items()}, fence=fence)


def persisted(lease: Lease) -> tuple[object, ...]:
    """What the store keeps of a lease (the connection binding is not kept)."""
    return (
        lease.key,
        lease.slot,
        lease.handle,
        lease.fence,
        lease.owner,
        lease.principal,
        lease.ttl_ms,
        lease.expires_at,
        lease.mode,
        lease.limit,
        lease.pid,
        lease.process,
    )


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "lockd.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    s = Store(db_path, BOOT)
    try:
        yield s
    finally:
        s.close()


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_migration_sets_user_version_and_creates_the_schema(db_path: Path) -> None:
    Store(db_path, BOOT).close()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"meta", "leases"} <= tables
        assert conn.execute("SELECT value FROM meta WHERE name='fence'").fetchone() == (0,)
    conn.close()
    assert len(storeschema.MIGRATIONS) == SCHEMA_VERSION


def test_reopening_does_not_migrate_again(db_path: Path) -> None:
    Store(db_path, BOOT).close()
    s = Store(db_path, BOOT)
    s.apply(changes({"k": lease("k", 4)}, fence=4))
    s.close()
    s = Store(db_path, BOOT)
    leases, fence = s.load()
    s.close()
    assert fence == 4 and [x.key for x in leases] == ["k"]


def test_newer_schema_is_refused(db_path: Path) -> None:
    Store(db_path, BOOT).close()
    with sqlite3.connect(db_path) as conn:
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        Store(db_path, BOOT)


def test_failed_migration_leaves_the_database_untouched(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(db: sqlite3.Connection) -> None:
        db.execute("CREATE TABLE half_done (x INTEGER)")
        raise sqlite3.OperationalError("disk on fire")

    monkeypatch.setattr(storeschema, "MIGRATIONS", [broken])
    with pytest.raises(StoreError, match="disk on fire") as info:
        Store(db_path, BOOT)
    # The failed Store's connection (still holding its exclusive lock) is only
    # reachable through the traceback; let it go before looking at the file.
    del info
    gc.collect()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (0,)
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        assert "half_done" not in names
    conn.close()


def test_wal_mode_and_synchronous_setting(db_path: Path) -> None:
    normal = Store(db_path, BOOT)
    assert normal._db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert normal._db.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
    normal.close()
    full = Store(db_path, BOOT, synchronous="FULL")
    assert full._db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    full.close()
    with sqlite3.connect(db_path) as conn:  # WAL is a property of the file
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    conn.close()


def test_apply_load_round_trip(store: Store, db_path: Path) -> None:
    a, b = lease("a", 1), lease("b", 2, owner="run-1", expires_at=9000)
    store.apply(changes({"a": a, "b": b}, fence=2))
    b2 = lease("b", 3, owner="run-1", expires_at=12_000)
    store.apply(changes({"b": b2, "a": None}, fence=3))
    store.apply(changes({"c": lease("c", 4)}, fence=4))
    store.apply(changes({"c": None}))
    store.close()
    again = Store(db_path, BOOT)
    leases, fence = again.load()
    again.close()
    assert fence == 4
    assert [persisted(x) for x in leases] == [persisted(b2)]
    (got,) = leases
    assert (got.handle, got.owner, got.principal, got.ttl_ms, got.expires_at) == (
        b2.handle,
        "run-1",
        "user:alice",
        1000,
        12_000,
    )
    assert got.conn is None


def test_fence_mark_follows_every_written_lease_and_only_moves_up(store: Store) -> None:
    store.apply(changes({"a": lease("a", 10)}, fence=10))  # one row: autocommit
    assert store.load()[1] == 10
    store.apply(changes({"a": None}))  # the lease is gone, the mark stays
    assert store.load() == ([], 10)
    store.apply(changes({"b": lease("b", 7)}, fence=7))  # never lowers the mark
    assert store.load()[1] == 10
    store.apply(changes({"c": lease("c", 11), "d": lease("d", 12)}, fence=12))
    store.apply(changes({"c": None, "d": None}))
    assert store.load()[1] == 12


def test_empty_changes_write_nothing(store: Store) -> None:
    before = store._db.total_changes
    store.apply(Changes())
    assert store._db.total_changes == before
    assert store.load() == ([], 0)


def test_load_drops_other_boots_and_keeps_their_fence(db_path: Path) -> None:
    old = Store(db_path, OTHER_BOOT)
    old.apply(changes({"old": lease("old", 8), "older": lease("older", 9)}, fence=9))
    old.close()
    new = Store(db_path, BOOT)
    new.apply(changes({"new": lease("new", 10)}, fence=10))
    leases, fence = new.load()
    assert [x.key for x in leases] == ["new"] and fence == 10
    new.close()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT key FROM leases").fetchall() == [("new",)]
    conn.close()
    # Even with every lease gone, the counter stays.
    gone = Store(db_path, OTHER_BOOT)
    assert gone.load() == ([], 10)
    gone.close()


def test_fence_of_rows_is_never_lower_than_loaded(db_path: Path) -> None:
    """A row carrying a fence above meta's (hand-edited db) still raises the counter."""
    s = Store(db_path, BOOT)
    s.apply(changes({"k": lease("k", 3)}, fence=3))
    s.close()
    with sqlite3.connect(db_path) as conn:
        # Its row checksum edited along (lockd.daemon.verify), or the start refuses it.
        conn.create_function("lockd_chk", 1, lambda text: zlib.crc32(text.encode()))
        conn.execute("UPDATE leases SET fence = 50")
        conn.execute(f"UPDATE leases SET chk = lockd_chk({ROW_TEXT_SQL})")
    conn.close()
    s = Store(db_path, BOOT)
    assert s.load()[1] == 50
    s.close()


def test_files_and_directory_are_private(store: Store, db_path: Path) -> None:
    store.apply(changes({"k": lease("k", 1)}, fence=1))
    assert mode_of(db_path.parent) == 0o700
    assert mode_of(db_path) == 0o600
    wal = db_path.with_name(db_path.name + "-wal")
    assert wal.exists()
    for extra in (wal, db_path.with_name(db_path.name + "-shm")):
        if extra.exists():
            assert mode_of(extra) & 0o077 == 0, (extra, oct(mode_of(extra)))


def test_unusable_database_is_a_store_error(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-db"
    bad.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError):
        Store(bad, BOOT)


def test_apply_rolls_back_a_failed_batch(store: Store) -> None:
    store.apply(changes({"a": lease("a", 1)}, fence=1))
    broken = lease("b", 2)
    broken.principal = None  # type: ignore[assignment]  # NOT NULL violation
    with pytest.raises(sqlite3.IntegrityError):
        store.apply(changes({"a": None, "b": broken}, fence=2))
    leases, fence = store.load()
    assert [x.key for x in leases] == ["a"] and fence == 1


# ------------------------------------------------ schema 2: several holders per key


def test_holders_of_one_key_round_trip_with_mode_limit_slot_and_process(
    store: Store, db_path: Path
) -> None:
    readers = [
        Lease(
            "r",
            f"handle-reader-{i}-xxxxxxxxxx",
            10 + i,
            None,
            "user:alice",
            1000,
            5000,
            mode="shared",
            slot=i,
            pid=100 + i,
            process="backup.sh",
        )
        for i in range(3)
    ]
    store.apply(Changes(rows={("r", x.slot): x for x in readers}, fence=12))
    store.apply(Changes(rows={("r", 1): None}))  # the middle reader left
    sem = Lease(
        "s",
        "handle-sem-xxxxxxxxxxxxx",
        13,
        "run-1",
        "user:bob",
        1000,
        5000,
        limit=3,
        slot=2,
        pid=7,
        process="rsync",
    )
    store.apply(Changes(rows={("s", 2): sem}, fence=13))
    store.close()
    again = Store(db_path, BOOT)
    leases, fence = again.load()
    again.close()
    assert fence == 13
    got = sorted((persisted(x) for x in leases), key=lambda row: row[3])
    assert got == [persisted(readers[0]), persisted(readers[2]), persisted(sem)]


def test_a_schema_1_database_keeps_its_leases_handles_and_fence(tmp_path: Path) -> None:
    """tests/fixtures/lockd-v1.db was written by the release before schema 2.

    (tests/fixtures/make_v1_db.py says how it was made.) Each lease becomes
    the exclusive holder (slot 0) of its key; the earlier boot's lease goes.
    """
    db = tmp_path / "state" / "lockd.db"
    db.parent.mkdir(mode=0o700)
    shutil.copyfile(FIXTURES / "lockd-v1.db", db)
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (1,)
    conn.close()
    s = Store(db, BOOT)
    leases, fence = s.load()
    s.close()
    assert fence == 4  # "gone" (fence 3... 4) was released; the mark stays
    by_key = {x.key: x for x in leases}
    assert sorted(by_key) == ["alpha", "beta", "gamma"]
    assert persisted(by_key["alpha"]) == (
        "alpha",
        0,
        "handle-alpha-000000000",
        1,
        None,
        "user:alice",
        3_600_000,
        4_600_000,
        "exclusive",
        1,
        None,
        None,
    )
    assert by_key["beta"].owner == "run-7" and by_key["beta"].handle == "handle-beta-0000000000"
    assert by_key["gamma"].fence == 4
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    conn.close()
    # The migrated database goes on working: the engine takes the leases up.
    engine = LockEngine(fence=fence)
    engine.restore(leases, now=1_000_000)
    assert engine.status(1_000_000, "beta").holder is by_key["beta"]
    assert engine.release(1_000_001, "alpha", "handle-alpha-000000000")
    granted = engine.acquire(1_000_002, "new", ttl_ms=10, principal="user:a")
    assert isinstance(granted, Lease) and granted.fence == 5


def test_leases_stream_in_key_order_with_shared_strings(store: Store) -> None:
    rows = {k: lease(k, f, owner="nightly") for f, k in enumerate(["b", "c", "a"], start=1)}
    store.apply(changes(rows, fence=3))
    streamed = list(store.leases())
    assert [x.key for x in streamed] == ["a", "b", "c"]
    # One string object per distinct principal and owner, however many leases.
    assert streamed[0].principal is streamed[1].principal is streamed[2].principal
    assert streamed[0].owner is streamed[2].owner
    assert store.stored_fence() == 3


def test_restore_builds_each_key_from_its_holders_together() -> None:
    engine = LockEngine()
    engine.restore([lease("b", 2), lease("a", 1)], now=0)
    assert [s.key for s in engine.list_held(0).locks] == ["a", "b"] and engine.fence == 2
    engine.check_invariants()
    with pytest.raises(ValueError, match="must come together"):
        LockEngine().restore([lease("a", 1), lease("b", 2), lease("a", 3)], now=0)


def test_deadlines_and_leases_of_feed_a_cold_restore(db_path: Path) -> None:
    """The daemon's start: keys and deadlines first, a key's full rows when needed."""
    old = Store(db_path, OTHER_BOOT)
    old.apply(changes({"gone": lease("gone", 1)}, fence=1))
    old.close()
    s = Store(db_path, BOOT)
    rows = {f"k{i:04d}": lease(f"k{i:04d}", i + 2, expires_at=100 + i) for i in range(1200)}
    s.apply(changes({**rows, "é": lease("é", 5000, owner="run")}, fence=5000))
    batches = list(s.deadlines())
    assert len(batches) == 1 and batches[0][:2] == [(b"k0000", 100), (b"k0001", 101)]
    assert batches[0][-1] == ("é".encode(), 5000)
    # An earlier boot's lease: left out, and deleted once the stream ended.
    assert list(s.leases_of(["gone"])) == []
    assert s._db.execute("SELECT count(*) FROM leases").fetchone() == (1201,)
    wanted = [*list(rows)[::2], "é", "absent"]  # more keys than one query takes
    expected = [rows[k] for k in wanted[:-2]] + [lease("é", 5000, owner="run")]
    assert [persisted(x) for x in s.leases_of(wanted)] == [persisted(x) for x in expected]
    engine = LockEngine(fence=s.stored_fence())
    engine.restore_cold(ColdLeases.build(s.deadlines()), s.leases_of, now=0)
    assert engine.held_count == 1201
    assert engine.release(1, "k0007", rows["k0007"].handle)
    assert engine.status(1, "é").holder is not None
    s.close()


# ------------------------------------------------- the integrity check at start


def _many_keys(store: Store, count: int) -> None:
    """``count`` leases with long keys: the table spans many pages."""
    keys = [f"key-with-some-length-{i:05d}" * 4 for i in range(count)]
    store.apply(changes({key: lease(key, i + 1) for i, key in enumerate(keys)}, fence=count))


def _damage_middle(path: Path) -> None:
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 2048)


def test_background_check_refuses_a_damaged_file_before_any_write(db_path: Path) -> None:
    store = Store(db_path, BOOT)
    _many_keys(store, 300)
    store.close()
    _damage_middle(db_path)
    size = db_path.stat().st_size
    # The reads at start either pass the damaged page or hit it; either way
    # the failure is the integrity check's, and nothing was written.
    damaged = Store(db_path, BOOT, background_check=True)
    with pytest.raises(StoreError, match="integrity check"):
        for _ in damaged.deadlines():
            pass
        damaged.wait_checked()
    damaged.close()
    damaged = Store(db_path, BOOT, background_check=True)
    with pytest.raises(StoreError, match="integrity check"):
        damaged.apply(changes({"new": lease("new", 10_000)}, fence=10_000))
    damaged.close()
    wal = db_path.with_name(db_path.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    assert db_path.stat().st_size == size


def test_background_check_sees_the_commits_a_crash_left_in_the_wal(
    db_path: Path, tmp_path: Path
) -> None:
    """kill -9 leaves the last commits in the WAL only; the check reads them there.

    A database with a WAL is checked on a read-only connection before the
    daemon's own connection touches it (issue 21: a refusal leaves both files
    as found), so the WAL is still there when the check has passed.
    """
    store = Store(db_path, BOOT)
    _many_keys(store, 300)
    crashed = tmp_path / "crashed" / "lockd.db"
    crashed.parent.mkdir(mode=0o700)
    # Copies of the open files, as a crash leaves them (no checkpoint on close).
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{db_path}{suffix}", f"{crashed}{suffix}")
    store.close()
    wal = crashed.with_name(crashed.name + "-wal")
    assert wal.stat().st_size > 0
    before = wal.read_bytes()
    reopened = Store(crashed, BOOT, background_check=True)
    assert wal.read_bytes() == before  # checked as found, nothing folded in first
    rows = [row for batch in reopened.deadlines() for row in batch]
    reopened.wait_checked()
    assert len(rows) == 300
    reopened.close()


def test_a_database_in_use_is_refused_without_a_busy_wait(db_path: Path) -> None:
    """A second Store on a database another one holds is refused at once: SQLite's busy
    handler (Python's default is to retry for 5 s) would not help, since the holder
    keeps it for good (exclusive locking). Timed here, in process, rather than around a
    second daemon's whole start, where a starved CPU's Python start-up is most of it."""
    holder = Store(db_path, BOOT)
    try:
        started = time.monotonic()
        with pytest.raises(StoreError, match="in use by another process"):
            Store(db_path, BOOT)
        assert time.monotonic() - started < 1.0
    finally:
        holder.close()
