"""A start that answers before its integrity check has read every row (issue 26).

The check of the whole file (``PRAGMA quick_check``, every row's checksum,
rows a lookup cannot find) runs in a thread and goes on after READY. These
tests hold that thread at a gate, so what they see is what a request sees
while the check has not run yet: the start read no row, a stored key
answers with its leases, a damaged row refuses the request that needs it
(and every write) before anything is decided from it, and the chunks of
the restore wait for the check.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockd.config import Paths, load_settings
from lockd.daemon import serve, storecheck
from lockd.daemon.clock import SystemClock
from lockd.daemon.engine import Changes, Lease, LockEngine
from lockd.daemon.leases import Busy
from lockd.daemon.store import DatabaseDamaged, Store, read_boot_id

BOOT = "11111111-2222-3333-4444-555555555555"
KEYS = [f"stored:{i:04d}" for i in range(300)]
#: leases run until then (boot-clock ms): far beyond any test's clock.
FAR = 1 << 40


def _lease(key: str, fence: int) -> Lease:
    return Lease(
        key=key,
        handle=f"handle-of-{key}-xxxxxxxx",
        fence=fence,
        owner=None,
        principal="user:alice",
        ttl_ms=1000,
        expires_at=FAR,
    )


def _write(db: Path, boot_id: str) -> None:
    """KEYS held, then a clean stop (no WAL left: the check runs in its thread)."""
    store = Store(db, boot_id)
    rows: dict[tuple[str, int], Lease | None] = {
        (key, 0): _lease(key, i + 1) for i, key in enumerate(KEYS)
    }
    store.apply(Changes(rows=rows, fence=len(KEYS)))
    store.close()


def _damage_handle(db: Path, key: str) -> None:
    """One character of ``key``'s handle changed: still a valid row, a different lease."""
    data = bytearray(db.read_bytes())
    at = data.index(f"handle-of-{key}-".encode())
    data[at] = ord("H")
    db.write_bytes(bytes(data))


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The integrity check's thread waits for this before it reads anything."""
    opened = threading.Event()
    run = storecheck.IntegrityCheck._run

    def gated(check: storecheck.IntegrityCheck) -> None:
        opened.wait(60)  # bounded: a test that never opens it still ends
        run(check)

    monkeypatch.setattr(storecheck.IntegrityCheck, "_run", gated)
    yield opened
    opened.set()


class _Counted:
    """Rows the store handed over (Store.read_hook)."""

    def __init__(self) -> None:
        self.rows = 0

    def __call__(self, rows: int) -> None:
        self.rows += rows


def test_start_reads_no_row_before_ready(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's own start (serve._open_store) with the check held: no row read."""
    paths = Paths(
        socket=tmp_path / "run" / "lockd.sock",
        db=tmp_path / "state" / "lockd.db",
        config_dir=tmp_path / "config",
        socket_mode=0o600,
    )
    (tmp_path / "run").mkdir(mode=0o700)
    _write(paths.db, read_boot_id())
    counted = _Counted()

    class CountingStore(Store):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.read_hook = counted

    monkeypatch.setattr(serve, "Store", CountingStore)
    store, engine = serve._open_store(paths, SystemClock(), False, load_settings(paths.config_dir))
    try:
        # Returned with the check still at its gate: READY does not wait for it.
        done = store.check_done
        assert done is not None and not done.is_set()
        assert counted.rows == 0
        assert engine.lease_count == 0 and engine.restoring
        # A request on a stored key reads that key's rows (one), checked.
        st = engine.status(SystemClock().boot_ms(), KEYS[123])
        assert st.holder_count == 1 and st.holders[0].fence == 124
        assert counted.rows == 1
        gate.set()
        store.wait_checked()
        engine.finish_restore(SystemClock().boot_ms())
        assert engine.lease_count == len(KEYS)
        assert counted.rows == 1 + len(KEYS)  # then the chunks: every row (one skipped)
    finally:
        gate.set()
        store.close()


def _lazy(db: Path) -> tuple[Store, LockEngine, _Counted]:
    store = Store(db, BOOT, background_check=True)
    counted = _Counted()
    store.read_hook = counted
    engine = LockEngine(fence=store.stored_fence())
    engine.restore_lazily(store.deadlines_after, store.leases_of)
    return store, engine, counted


def test_a_key_not_loaded_yet_answers_with_its_leases_while_the_check_runs(
    db_path: Path, gate: threading.Event
) -> None:
    _write(db_path, BOOT)
    store, engine, counted = _lazy(db_path)
    try:
        st = engine.status(0, KEYS[7])
        assert st.holder_count == 1 and st.holders[0].fence == 8
        taken = engine.acquire(0, KEYS[8], ttl_ms=1000, principal="user:bob")
        assert isinstance(taken, Busy)  # its stored lease holds it
        assert not engine.pending()  # a refusal changes nothing: no write waits
        assert counted.rows == 2 and engine.restoring
        # A write waits for the check (here: opened first, it passes).
        gate.set()
        granted = engine.acquire(0, "new", ttl_ms=1000, principal="user:bob")
        assert isinstance(granted, Lease) and granted.fence == len(KEYS) + 1
        store.apply(engine.drain())
        engine.finish_restore(0)
        assert engine.lease_count == len(KEYS) + 1
    finally:
        gate.set()
        store.close()


def test_a_damaged_row_refuses_the_request_that_needs_it(
    db_path: Path, gate: threading.Event
) -> None:
    """Before the check has run: the row is checked as it is read, nothing decided from it."""
    _write(db_path, BOOT)
    _damage_handle(db_path, KEYS[42])
    store, engine, _ = _lazy(db_path)
    try:
        with pytest.raises(DatabaseDamaged, match="fails its checksum"):
            engine.status(0, KEYS[42])
        with pytest.raises(DatabaseDamaged, match="fails its checksum"):
            engine.acquire(0, KEYS[42], ttl_ms=1000, principal="user:bob")
        assert engine.lease_count == 0  # still cold: nothing was made of it
        # Nothing is written any more, whatever the key (the check has not even run).
        with pytest.raises(DatabaseDamaged):
            store.apply(Changes(rows={("other", 0): _lease("other", 999)}, fence=999))
        # Another key's rows are sound and answer.
        assert engine.status(0, KEYS[41]).holder_count == 1
        # The check, once it runs, finds the same row: the daemon then stops.
        gate.set()
        with pytest.raises(DatabaseDamaged, match="1 of 300 lease rows fail their checksum"):
            store.wait_checked()
    finally:
        gate.set()
        store.close()


def test_a_damaged_row_in_a_chunk_read_before_the_check_is_caught_when_used(
    db_path: Path, gate: threading.Event
) -> None:
    """A chunk hands over keys and deadlines only; a key is checked when it is used."""
    _write(db_path, BOOT)
    _damage_handle(db_path, KEYS[200])
    store, engine, counted = _lazy(db_path)
    try:
        engine.finish_restore(0)  # every chunk, the check still at its gate
        assert counted.rows == len(KEYS) and engine.lease_count == len(KEYS)
        with pytest.raises(DatabaseDamaged, match="fails its checksum"):
            engine.status(0, KEYS[200])
        with pytest.raises(DatabaseDamaged, match="fails its checksum"):
            engine.list_held(0, prefix="stored:02", limit=10)  # a page that shows it
        with pytest.raises(DatabaseDamaged, match="fails its checksum"):
            engine.advance(FAR, 1_000)  # its deadline: the expiry reads it first
        assert engine.status(0, KEYS[199]).holder_count == 1
    finally:
        gate.set()
        store.close()


def test_rows_out_of_key_order_stop_the_chunks(db_path: Path, gate: threading.Event) -> None:
    """A key damaged into another place of the order: the cold index is not built on it."""
    _write(db_path, BOOT)
    data = bytearray(db_path.read_bytes())
    at = data.index(f"handle-of-{KEYS[150]}".encode()) - len(KEYS[150])
    assert data[at : at + len(KEYS[150])] == KEYS[150].encode()  # the row's key, before it
    data[at : at + len(KEYS[150])] = b"stored:9150"
    db_path.write_bytes(bytes(data))
    store, engine, _ = _lazy(db_path)
    try:
        with pytest.raises(DatabaseDamaged, match="out of key order"):
            engine.finish_restore(0)
        with pytest.raises(DatabaseDamaged):  # and nothing is written any more
            store.apply(Changes(rows={("other", 0): _lease("other", 999)}, fence=999))
    finally:
        gate.set()
        store.close()


def test_close_does_not_wait_for_a_check_of_every_row(db_path: Path, gate: threading.Event) -> None:
    """A stop during the check ends it (the next start checks again)."""
    _write(db_path, BOOT)
    store = Store(db_path, BOOT, background_check=True)
    check = store._check
    assert check is not None
    check.cancel()
    gate.set()
    store.close()
    assert check.done.is_set()
    with pytest.raises(DatabaseDamaged, match="interrupted"):
        check.result()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "lockd.db"
