"""The integrity check begun after READY (issue 26: restart to ``hello``).

The daemon opens its database with the whole-file check deferred
(``Store(defer_check=True)``): no thread reads the file until the daemon
answers (``serve._settle_after_ready``) or a write needs the check first.
These tests hold that the deferral weakens nothing: a write before the
check has begun begins it and waits for it (so a damaged file still
refuses it), a row read before it is checked on its own, a stop before it
does not hang, and until the check is in, facts wait instead of blocking
the event loop on it (``Store.check_pending``).
"""

from __future__ import annotations

import gc
import os
import sqlite3
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

from lockd.daemon import serve, storecheck
from lockd.daemon.engine import Changes, Lease, LockEngine
from lockd.daemon.runrecord import RunRecord, record_path
from lockd.daemon.store import DatabaseDamaged, StorageUnavailable, Store, StoreError
from tests.unit.test_lazy_start import BOOT, KEYS, _damage_handle, _lease
from tests.unit.test_lazy_start import _write as _write_boot


def _write(db: Path) -> None:
    """test_lazy_start's KEYS held under BOOT, then a clean stop (the check runs in its thread)."""
    _write_boot(db, BOOT)


def _check_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lockd-quick-check"]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "lockd.db"


def test_a_deferred_check_begins_only_when_asked(db_path: Path) -> None:
    _write(db_path)
    before = len(_check_threads())
    store = Store(db_path, BOOT, background_check=True, defer_check=True)
    try:
        check = store._check
        assert check is not None and not check.started
        assert len(_check_threads()) == before  # no thread reads the file yet
        done = store.check_done
        assert done is not None and not done.is_set()
        # A key's rows answer meanwhile, checked one by one.
        assert [lease.fence for lease in store.leases_of([KEYS[9]])] == [10]
        store.start_check()
        store.start_check()  # once only
        assert check.started
        store.wait_checked()
        assert done.is_set()
    finally:
        store.close()


def test_a_write_before_the_deferred_check_begins_it_and_waits(db_path: Path) -> None:
    _write(db_path)
    store = Store(db_path, BOOT, background_check=True, defer_check=True)
    try:
        engine = LockEngine(fence=store.stored_fence())
        engine.restore_lazily(store.deadlines_after, store.leases_of)
        granted = engine.acquire(0, "new", ttl_ms=1000, principal="user:bob")
        assert isinstance(granted, Lease) and granted.fence == len(KEYS) + 1
        store.apply(engine.drain())  # begins the check, waits for it, then writes
        check_done = store.check_done
        assert check_done is None  # passed and let go
        assert store.leases_of(["new"])[0].fence == len(KEYS) + 1
    finally:
        store.close()


def test_a_damaged_file_still_refuses_a_write_before_the_deferred_check(
    db_path: Path,
) -> None:
    """The row is not read by anyone first: only the check can find it, and the write waits."""
    _write(db_path)
    _damage_handle(db_path, KEYS[77])
    size = db_path.stat().st_size
    store = Store(db_path, BOOT, background_check=True, defer_check=True)
    try:
        with pytest.raises(
            DatabaseDamaged, match=f"1 of {len(KEYS)} lease rows fail their checksum"
        ):
            store.apply(Changes(rows={("other", 0): _lease("other", 999)}, fence=999))
        with pytest.raises(DatabaseDamaged):  # every later write too
            store.apply(Changes(rows={("other", 0): _lease("other", 999)}, fence=999))
    finally:
        store.close()
    assert db_path.stat().st_size == size  # nothing was written


def test_a_stop_before_the_deferred_check_began_does_not_wait(db_path: Path) -> None:
    _write(db_path)
    store = Store(db_path, BOOT, background_check=True, defer_check=True)
    check = store._check
    assert check is not None
    store.close()  # would hang if it waited for a check nobody began
    assert check.done.is_set()
    with pytest.raises(DatabaseDamaged, match="interrupted"):
        check.result()  # never passes: the next start checks again


def _mapped(path: Path) -> list[str]:
    """This process's mappings of ``path`` (Linux: /proc/self/maps names the file)."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        return [line for line in maps if line.rstrip("\n").endswith(str(path.resolve()))]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_the_check_maps_none_of_the_file(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapped pages would count in the daemon's RSS while the check runs (issue 26's peak)."""
    _write(db_path)
    seen: list[tuple[int, list[str]]] = []
    inspect = storecheck.inspect

    def spying(conn: sqlite3.Connection, **kwargs: bool) -> storecheck.Findings:
        found = inspect(conn, **kwargs)  # every page read, the connection still open
        seen.append((conn.execute("PRAGMA mmap_size").fetchone()[0], _mapped(db_path)))
        return found

    monkeypatch.setattr(storecheck, "inspect", spying)
    store = Store(db_path, BOOT, background_check=True, defer_check=True)
    try:
        store.wait_checked()
    finally:
        store.close()
    assert seen == [(0, [])]


class _Recorder:
    """The store as _settle_after_ready sees it: when the check was begun."""

    def __init__(self) -> None:
        self.begun_at: float | None = None

    def start_check(self) -> None:
        self.begun_at = trio.current_time()


def test_settle_after_ready_begins_the_check_and_freezes_the_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frozen: list[bool] = []
    monkeypatch.setattr(serve.gc, "freeze", lambda: frozen.append(True))
    store = _Recorder()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve._settle_after_ready, store)
            await trio.sleep(serve.SETTLE_AFTER / 2)
            assert store.begun_at is None and not frozen  # the first answers go first
        assert store.begun_at == pytest.approx(serve.SETTLE_AFTER)
        assert frozen == [True]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert gc.isenabled()


def test_a_check_whose_thread_cannot_start_fails_instead_of_hanging(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread (e.g. "can't start new thread"): every write is refused, close() returns,
    and it is not called damage (an operator might restore a backup over a resource limit)."""
    _write(db_path)
    store = Store(db_path, BOOT, background_check=True, defer_check=True)

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    try:
        store.start_check()
        with pytest.raises(StorageUnavailable, match="could not run") as refused:
            store.wait_checked()
        assert not isinstance(refused.value, DatabaseDamaged)
        assert "nothing was found damaged" in str(refused.value)
    finally:
        store.close()


def _no_descriptors(*args: object, **kwargs: object) -> object:
    raise OSError(24, "Too many open files")


def test_a_check_begun_when_descriptors_ran_out_still_runs(
    db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check's connection and the run record's file are opened on the start's path.

    The daemon answers before the check begins; clients may then take every
    free descriptor (CI saw it: EMFILE after ``hello``, and the check that
    opened its connection only in its thread failed, was called damage,
    and stopped the daemon).
    """
    _write(db_path)
    record_file = record_path(tmp_path, db_path)
    store = Store(
        db_path, BOOT, background_check=True, defer_check=True, record=RunRecord(record_file)
    )
    try:
        store.begin_run(5)
        # From here no file can be opened, by SQLite or by the record.
        monkeypatch.setattr(storecheck.sqlite3, "connect", _no_descriptors)
        monkeypatch.setattr(os, "open", _no_descriptors)
        store.start_check()
        store.wait_checked()  # passes: nothing was damaged
        monkeypatch.undo()
        assert RunRecord(record_file).read() is not None  # the record began
        assert not record_file.with_name(f".{record_file.name}.tmp").exists()
    finally:
        store.close()


def test_a_record_reserved_but_never_begun_leaves_the_last_one(
    db_path: Path, tmp_path: Path
) -> None:
    """A stop before the check passed: the reserved file goes, the last run's record stays."""
    _write(db_path)
    record_file = record_path(tmp_path, db_path)
    first = Store(db_path, BOOT, record=RunRecord(record_file))
    first.begin_run(3)
    first.close()
    last = RunRecord(record_file).read()
    store = Store(
        db_path, BOOT, background_check=True, defer_check=True, record=RunRecord(record_file)
    )
    store.begin_run(7)
    assert record_file.with_name(f".{record_file.name}.tmp").exists()
    store.close()
    assert RunRecord(record_file).read() == last
    assert not record_file.with_name(f".{record_file.name}.tmp").exists()


def test_a_database_that_cannot_be_opened_for_the_check_is_not_called_damaged(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(db_path)

    def cannot_open(self: storecheck.IntegrityCheck) -> sqlite3.Connection:
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(storecheck.IntegrityCheck, "_connect", cannot_open)
    store = Store(db_path, BOOT, background_check=True, defer_check=True)
    monkeypatch.undo()
    try:
        with pytest.raises(StorageUnavailable, match="could not run") as refused:
            store.wait_checked()
        assert not isinstance(refused.value, DatabaseDamaged)
        assert "cannot open the database to check it" in str(refused.value)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("code", "name", "damaged"),
    [
        (10, "SQLITE_IOERR", False),  # "check the disk", not "damaged"
        (7, "SQLITE_NOMEM", False),
        (14, "SQLITE_CANTOPEN", False),
        (13, "SQLITE_FULL", False),
        (15, "SQLITE_PROTOCOL", False),
        (8 | (1 << 8), "SQLITE_READONLY_RECOVERY", False),
        (1, "SQLITE_ERROR", True),  # e.g. no such table: a damaged schema, at every start
        (11, "SQLITE_CORRUPT", True),
        (26, "SQLITE_NOTADB", True),
        (11 | (1 << 8), "SQLITE_CORRUPT_VTAB", True),  # extended codes by their primary
    ],
)
def test_only_sqlite_errors_about_the_file_are_called_damage(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, name: str, damaged: bool
) -> None:
    _write(db_path)

    def failing(conn: sqlite3.Connection) -> None:
        exc = sqlite3.DatabaseError(f"{name} from the test")
        exc.sqlite_errorcode = code  # type: ignore[attr-defined]
        exc.sqlite_errorname = name  # type: ignore[attr-defined]
        raise exc

    monkeypatch.setattr(storecheck, "inspect", failing)
    store = Store(db_path, BOOT, background_check=True, defer_check=True)
    try:
        with pytest.raises(StorageUnavailable) as refused:
            store.wait_checked()
        assert isinstance(refused.value, DatabaseDamaged) is damaged
        assert name in str(refused.value)
        if name == "SQLITE_IOERR":
            assert "check the disk" in str(refused.value)
        elif not damaged:
            assert "start lockd again" in str(refused.value)
    finally:
        store.close()


# ------------------------------------------------ after a crash: a WAL is there


def _crashed(db_path: Path, tmp_path: Path) -> Path:
    """test_lazy_start's KEYS, then one more commit ("late") left in the WAL by a crash."""
    _write(db_path)
    store = Store(db_path, BOOT)
    try:
        store.apply(Changes(rows={("late", 0): _lease("late", 999)}, fence=999))
        crashed = tmp_path / "crashed" / "lockd.db"
        crashed.parent.mkdir(mode=0o700)
        for suffix in ("", "-wal"):  # the files as a kill -9 leaves them
            crashed.with_name(crashed.name + suffix).write_bytes(
                db_path.with_name(db_path.name + suffix).read_bytes()
            )
    finally:
        store.close()
    return crashed


def _files(db: Path) -> tuple[bytes, bytes]:
    return db.read_bytes(), db.with_name(db.name + "-wal").read_bytes()


def test_after_a_crash_the_check_runs_beside_the_daemon_on_the_files_as_found(
    db_path: Path, tmp_path: Path
) -> None:
    """Restart to ``hello`` after a ``kill -9`` does not wait for a scan of every row.

    The store reads the crash's database read-only (it sees the WAL's last
    commit) until the check, which reads it the same way, has passed; only
    then is it opened to write, so nothing changed the files before.
    """
    crashed = _crashed(db_path, tmp_path)
    before = _files(crashed)
    store = Store(crashed, BOOT, background_check=True, defer_check=True)
    try:
        assert store.check_pending and store._reader_only
        assert store.stored_fence() == 999  # the WAL's commit, read before the check
        assert [lease.fence for lease in store.leases_of(["late"])] == [999]
        assert _files(crashed) == before
        store.start_check()
        store.apply(Changes(rows={("new", 0): _lease("new", 1000)}, fence=1000))
        assert not store.check_pending and not store._reader_only
        assert [lease.fence for lease in store.leases_of(["new", "late"])] == [999, 1000]
    finally:
        store.close()
    assert not crashed.with_name(crashed.name + "-shm").exists()
    reopened = Store(crashed, BOOT)
    try:
        assert reopened.stored_fence() == 1000
    finally:
        reopened.close()


def test_damage_found_after_a_crash_leaves_the_files_as_found(
    db_path: Path, tmp_path: Path
) -> None:
    crashed = _crashed(db_path, tmp_path)
    _damage_handle(crashed, KEYS[77])
    before = _files(crashed)
    store = Store(crashed, BOOT, background_check=True, defer_check=True)
    try:
        with pytest.raises(DatabaseDamaged, match="fail their checksum"):
            store.wait_checked()
        with pytest.raises(DatabaseDamaged):  # every write too
            store.apply(Changes(rows={("other", 0): _lease("other", 1000)}, fence=1000))
    finally:
        store.close()
    assert _files(crashed) == before  # the WAL not folded in, nothing deleted
    assert not crashed.with_name(crashed.name + "-shm").exists()


def test_a_crash_that_lost_acknowledged_writes_is_refused_before_the_daemon_answers(
    db_path: Path, tmp_path: Path
) -> None:
    """The count of writes is read first, cheaply: a WAL cut short never gets as far as READY."""
    _write(db_path)
    record_file = record_path(tmp_path, db_path)
    store = Store(db_path, BOOT, record=RunRecord(record_file))
    try:
        store.begin_run(0)
        store.apply(Changes(rows={("late", 0): _lease("late", 999)}, fence=999))
        wal = db_path.with_name(db_path.name + "-wal")
        files = (db_path.read_bytes(), wal.read_bytes()[: 32 + (1024 + 24)])  # one frame left
    finally:
        store.close()
    crashed = db_path  # the crash's files put back, the WAL cut short
    crashed.write_bytes(files[0])
    crashed.with_name(crashed.name + "-wal").write_bytes(files[1])
    before = _files(crashed)
    with pytest.raises(StoreError, match="acknowledged writes are gone"):
        Store(crashed, BOOT, background_check=True, defer_check=True, record=RunRecord(record_file))
    assert _files(crashed) == before
    assert not crashed.with_name(crashed.name + "-shm").exists()


def test_a_crash_database_that_cannot_be_opened_to_write_stays_refused(
    db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The switch to the writer is all or nothing: a failure is not forgotten by the next wait."""
    crashed = _crashed(db_path, tmp_path)
    store = Store(crashed, BOOT, background_check=True, defer_check=True)

    def cannot_open(target: str, on_disk: bool) -> sqlite3.Connection:
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(store, "_open_writer", cannot_open)
    try:
        for _ in range(2):
            with pytest.raises(StorageUnavailable, match="cannot be opened to write"):
                store.wait_checked()
        with pytest.raises(StorageUnavailable, match="cannot be opened to write"):
            store.apply(Changes(rows={("other", 0): _lease("other", 1000)}, fence=1000))
        assert not isinstance(store._unusable, DatabaseDamaged)
    finally:
        store.close()


_UNDER_A_DESCRIPTOR_LIMIT = """
import os, resource, sys
from pathlib import Path
from lockd.daemon.store import Store
db, boot = Path(sys.argv[1]), sys.argv[2]
store = Store(db, boot, background_check=True, defer_check=True)
# Every descriptor taken from here on, as clients may take them after READY.
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, hard))
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
store.start_check()
store.wait_checked()  # raises if the check (or the switch to the writer) needed a descriptor
print("checked", store.stored_fence())
store.close()
"""


@pytest.mark.parametrize("crash", [False, True])
def test_the_check_runs_when_every_descriptor_is_taken_after_the_start(
    db_path: Path, tmp_path: Path, crash: bool
) -> None:
    """SQLite's own opens (the -wal, the -shm) happen before READY too, after a crash as well.

    In a child process: the limit is lowered to what is open, every hole
    filled, then the check begun. Patching Python's opens would miss
    SQLite's, which is how the crash path's lazy -wal open slipped through.
    """
    import subprocess
    import sys

    if crash:
        target, fence = _crashed(db_path, tmp_path), 999
    else:
        _write(db_path)
        target, fence = db_path, len(KEYS)
    run = subprocess.run(
        [sys.executable, "-c", _UNDER_A_DESCRIPTOR_LIMIT, str(target), BOOT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["checked", str(fence)]


def test_a_second_store_on_a_crash_database_being_checked_is_refused(
    db_path: Path, tmp_path: Path
) -> None:
    """Until its writer holds the exclusive lock, the first store's flock() keeps others out."""
    crashed = _crashed(db_path, tmp_path)
    before = _files(crashed)
    first = Store(crashed, BOOT, background_check=True, defer_check=True)
    try:
        with pytest.raises(StoreError, match="in use by another process"):
            Store(crashed, BOOT, background_check=True, defer_check=True)
        assert _files(crashed) == before
    finally:
        first.close()
    Store(crashed, BOOT, background_check=True, defer_check=True).close()  # free again


def test_a_crash_start_that_fails_midway_closes_everything_before_its_lock(
    db_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No connection left open, no -shm left behind, the files as found, then the lock let go."""
    crashed = _crashed(db_path, tmp_path)
    before = _files(crashed)

    def fails(self: Store) -> int | None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(Store, "_read_seq", fails)
    with pytest.raises(StoreError):
        Store(crashed, BOOT, background_check=True, defer_check=True)
    monkeypatch.undo()
    assert _files(crashed) == before
    assert not crashed.with_name(crashed.name + "-shm").exists()
    here = str(crashed.parent.resolve())
    still_open = [
        target
        for fd in os.listdir("/proc/self/fd")
        if (target := os.path.realpath(f"/proc/self/fd/{fd}")).startswith(here)
    ]
    assert still_open == []
    Store(crashed, BOOT, background_check=True, defer_check=True).close()  # not locked
