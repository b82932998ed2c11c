"""A damaged WAL or database after ``kill -9`` under load (issue 21, items 1 and 2).

Before: one flipped byte in the WAL, or the WAL cut short, and the daemon
started with about half of the acknowledged leases silently gone; a state
folder deleted just before a crash and it started empty, fences at 1.

Now every start after such damage either has every acknowledged lease
(with its fence, no acknowledged release undone) and hands out fences above
every fence acknowledged before, or refuses with one line naming the file
and what it found, leaving the database and its WAL byte for byte as they
were.

The crash is real: a daemon subprocess under load from a client thread,
killed with SIGKILL. The damage is then applied to copies of the files it
left, one variant at a time. One crash serves the whole module: every test
starts from the files exactly as it left them (``crashed`` restores them).
The fast lane restarts a real daemon on a handful of variants; the wide
sweep (``LOCKD_SLOW=1``) checks hundreds of offsets of both files and many
truncations through the daemon's own start-up code in-process
(``lockd.daemon.serve._open_store``), which is what ``lockd serve`` runs
before it answers anything.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lockd_client import Handle, LockClient, LockdError

from lockd.config import Paths, load_settings
from lockd.daemon.clock import SystemClock
from lockd.daemon.serve import StartupError, _open_store, _refusal
from lockd.daemon.store import StoreError
from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for

#: Size of a WAL header and of a frame (24-byte frame header + 1 KiB page).
WAL_HEADER = 32
FRAME = 24 + 1024

slow = pytest.mark.skipif(not os.environ.get("LOCKD_SLOW"), reason="wide sweep: set LOCKD_SLOW=1")


@dataclass
class Crashed:
    """What a daemon killed under load left behind, and what its clients were told."""

    root: Path
    #: key -> fence of every lease acknowledged and not released.
    held: dict[str, int]
    #: keys whose release was acknowledged.
    released: set[str]
    #: the highest fence acknowledged.
    highest: int
    #: file name (relative to root) -> bytes, as the crash left them.
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def db(self) -> Path:
        return self.root / "state" / "lockd.db"

    @property
    def wal(self) -> Path:
        return self.root / "state" / "lockd.db-wal"

    def restore(self) -> None:
        """Put every file back as the crash left it (and nothing else)."""
        shutil.rmtree(self.root / "state", ignore_errors=True)
        for record in self.root.glob("lockd-run.*"):
            record.unlink()
        for name, data in self.files.items():
            path = self.root / name
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.write_bytes(data)


def _crash_under_load(daemon: DaemonProcess) -> Crashed:
    """Leases in the database file (a clean stop) and in the WAL (kill -9 under load)."""
    held: dict[str, int] = {}
    released: set[str] = set()
    first: dict[str, Handle] = {}
    daemon.start()
    with LockClient(str(daemon.socket)) as client:
        for i in range(120):
            handle = client.try_acquire(f"stopped:{i:04d}:" + "x" * 20, ttl=600)
            assert handle is not None
            first[handle.key] = handle
            held[handle.key] = handle.fence
        for i in range(60):  # never touched again: their pages are in lockd.db only
            handle = client.try_acquire(f"quiet:{i:04d}:" + "y" * 20, ttl=600)
            assert handle is not None
            held[handle.key] = handle.fence
    highest = max(held.values())
    assert daemon.stop() == 0  # folds these into lockd.db
    daemon.start()
    lock = threading.Lock()
    stop = threading.Event()

    def load() -> None:
        nonlocal highest
        try:
            with LockClient(str(daemon.socket), retry_window=0) as client:
                i = 0
                while not stop.is_set():
                    handle = client.try_acquire(f"crashed:{i:04d}", ttl=600)
                    assert handle is not None
                    with lock:
                        held[handle.key], highest = handle.fence, handle.fence
                    old = first.pop(f"stopped:{i:04d}:" + "x" * 20, None)
                    if old is not None and i % 3 == 0:  # releases in the WAL too
                        with lock:
                            held.pop(old.key)  # sent: present or not after the crash
                        if client.release(old).released:
                            with lock:
                                released.add(old.key)
                    elif old is not None and i % 3 == 1:
                        client.renew(old, ttl=900)
                    i += 1
        except (LockdError, OSError):
            return

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    wait_for(lambda: len(held) >= 350, 30)
    daemon.kill9()
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    crashed = Crashed(daemon.root, dict(held), set(released), highest)
    for path in [*(daemon.root / "state").iterdir(), *daemon.root.glob("lockd-run.*")]:
        crashed.files[str(path.relative_to(daemon.root))] = path.read_bytes()
    assert crashed.wal.stat().st_size > 50 * FRAME, "the crash left its commits in the WAL"
    return crashed


@pytest.fixture(scope="module")
def crash() -> Iterator[Crashed]:
    """One crash under load for the module (what it leaves is only read, and restored)."""
    root = Path(tempfile.mkdtemp(prefix="lockd-", dir="/tmp"))
    daemon = DaemonProcess.in_folder(root)
    try:
        yield _crash_under_load(daemon)
    finally:
        daemon.terminate()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def crashed(crash: Crashed) -> Crashed:
    """The module's crash, its files put back as the crash left them (and nothing else)."""
    crash.restore()
    return crash


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def truncate(path: Path, length: int) -> None:
    os.truncate(path, length)


def check_start(crashed: Crashed, damage: Callable[[], None]) -> str:
    """Restore the crash, apply ``damage``, start in-process: "started" or "refused"."""
    crashed.restore()
    damage()
    before = {p: _digest(p) for p in (crashed.db, crashed.wal)}
    paths = Paths(
        socket=crashed.root / "lockd.sock",
        db=crashed.db,
        config_dir=crashed.root / "config",
        socket_mode=0o600,
    )
    try:
        store, engine = _open_store(paths, SystemClock(), False, load_settings(paths.config_dir))
    except StartupError as exc:
        message = str(exc)
        assert "\n" not in message, message
        assert str(crashed.db) in message or "lockd.db" in message, message
        after = {p: _digest(p) for p in (crashed.db, crashed.wal)}
        assert after == before, f"a refused start changed the files: {message}"
        return "refused"
    try:
        # The daemon answers while the rest of the checks run beside it
        # (after a crash too: Store._read_crash_first), then stops on what
        # they found, with the same line: _await_integrity.
        store.wait_checked()
    except StoreError as exc:
        store.close()
        message = _refusal(exc)
        assert "\n" not in message and "lockd.db" in message, message
        after = {p: _digest(p) for p in (crashed.db, crashed.wal)}
        assert after == before, f"a refused start changed the files: {message}"
        return "refused"
    try:
        rows = {lease.key: lease.fence for lease in store.leases()}
        lost = {k: f for k, f in crashed.held.items() if rows.get(k) != f}
        assert not lost, f"{len(lost)} acknowledged leases lost, e.g. {sorted(lost)[:3]}"
        undone = crashed.released & rows.keys()
        assert not undone, f"acknowledged releases undone: {sorted(undone)[:3]}"
        assert engine.fence >= crashed.highest, (engine.fence, crashed.highest)
    finally:
        store.close()
    return "started"


def _frames(crashed: Crashed) -> int:
    return (len(crashed.files["state/lockd.db-wal"]) - WAL_HEADER) // FRAME


# ---------------------------------------------------------------- fast lane


def test_flipped_byte_in_a_wal_frame_refused_untouched(crashed: Crashed) -> None:
    """A frame in the middle: SQLite would stop there and drop every commit after it."""
    middle = WAL_HEADER + (_frames(crashed) // 2) * FRAME
    assert check_start(crashed, lambda: flip(crashed.wal, middle + 24 + 100)) == "refused"
    assert check_start(crashed, lambda: flip(crashed.wal, middle + 10)) == "refused"  # its salt


def test_flipped_byte_in_the_wal_header_refused(crashed: Crashed) -> None:
    """Past the magic: SQLite would ignore the whole WAL."""
    assert check_start(crashed, lambda: flip(crashed.wal, 20)) == "refused"


def test_wal_cut_short_refused(crashed: Crashed) -> None:
    """At a frame boundary (SQLite sees a shorter, valid WAL) and inside a frame."""
    cut = WAL_HEADER + (_frames(crashed) - 20) * FRAME
    assert check_start(crashed, lambda: truncate(crashed.wal, cut)) == "refused"
    assert check_start(crashed, lambda: truncate(crashed.wal, cut + 500)) == "refused"


def test_flipped_byte_in_a_database_row_refused(crashed: Crashed) -> None:
    """A row's bytes in lockd.db: SQLite reads back a valid, different lease."""
    data = crashed.files["state/lockd.db"]
    offset = data.index(b"quiet:0030:")
    # in the key, and in the row's other bytes after it
    assert check_start(crashed, lambda: flip(crashed.db, offset + 9)) == "refused"
    assert check_start(crashed, lambda: flip(crashed.db, offset + 40)) == "refused"


def test_database_cut_short_refused(crashed: Crashed) -> None:
    """Cut at the page that holds rows found nowhere else (not in the WAL)."""
    page = crashed.files["state/lockd.db"].index(b"quiet:0030:") // 1024
    assert check_start(crashed, lambda: truncate(crashed.db, page * 1024)) == "refused"
    # The last page only: nothing of it may be needed (then the start has everything).
    size = len(crashed.files["state/lockd.db"])
    assert check_start(crashed, lambda: truncate(crashed.db, size - 1024)) in ("refused", "started")


def test_undamaged_crash_starts_with_every_lease(crashed: Crashed) -> None:
    assert check_start(crashed, lambda: None) == "started"


def test_real_daemon_refuses_a_damaged_wal_and_accepts_on_request(crashed: Crashed) -> None:
    """The whole path through ``lockd serve``: the refusal, then --accept-data-loss."""
    daemon = DaemonProcess.in_folder(crashed.root)  # on the crash's own files
    try:
        _refuse_then_accept_data_loss(crashed, daemon)
    finally:
        daemon.terminate()
        crashed.restore()  # what the accepting daemon wrote goes: the next test starts clean


def _refuse_then_accept_data_loss(crashed: Crashed, daemon_paths: DaemonProcess) -> None:
    flip(crashed.wal, WAL_HEADER + (_frames(crashed) // 2) * FRAME + 200)
    before = {p: _digest(p) for p in (crashed.db, crashed.wal)}
    run = daemon_paths.serve_once(timeout=60)
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("lockd: cannot start: database: "), line
    assert "acknowledged writes are gone" in line and "lockd.db-wal" in line, line
    assert {p: _digest(p) for p in (crashed.db, crashed.wal)} == before
    daemon_paths.extra_args = ["--accept-data-loss"]
    daemon_paths.start()
    log = daemon_paths.read_log()
    assert "event=data_loss_accepted" in log and "grants_held_ms=" in log
    with LockClient(str(daemon_paths.socket)) as client:
        # Leases that survived can be renewed and released; no key is granted
        # before every lease that may be lost (TTL 600 s) has run out.
        assert client.status("stopped:0001:" + "x" * 20).held
        with pytest.raises(LockdError) as refused:
            client.try_acquire("anything", ttl=10)
        assert refused.value.code == "STORAGE_UNAVAILABLE"
    daemon_paths.terminate()


def test_state_folder_deleted_then_kill9_is_refused(daemon_paths: DaemonProcess) -> None:
    """Deleted, then killed before the watcher ran: the run record outside says so."""
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        for i in range(5):
            assert client.try_acquire(f"k{i}", ttl=600) is not None
    shutil.rmtree(daemon_paths.db.parent)
    daemon_paths.kill9()  # at once: no database_lost, no fence mark written back
    run = daemon_paths.serve_once(timeout=60)
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert "lockd.db is missing, but lockd acknowledged" in line, line
    assert not daemon_paths.db.exists()  # refused before creating anything


def test_wal_deleted_then_kill9_is_refused(daemon_paths: DaemonProcess) -> None:
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        for i in range(5):
            assert client.try_acquire(f"k{i}", ttl=600) is not None
    daemon_paths.db.with_name("lockd.db-wal").unlink()
    daemon_paths.kill9()
    run = daemon_paths.serve_once(timeout=60)
    assert run.returncode == 1, run.stderr
    assert "acknowledged writes are gone" in run.stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------- wide sweep


@slow
def test_sweep_flipped_bytes_and_truncations(crashed: Crashed) -> None:
    wal_size = len(crashed.files["state/lockd.db-wal"])
    db_size = len(crashed.files["state/lockd.db"])
    outcomes: dict[str, int] = {}

    def record(what: str, damage: Callable[[], None]) -> None:
        result = check_start(crashed, damage)
        outcomes[f"{what} {result}"] = outcomes.get(f"{what} {result}", 0) + 1

    # Every header byte, then offsets spread over every frame (header and page).
    for offset in [*range(4, WAL_HEADER), *range(WAL_HEADER, wal_size, 997)]:
        record("wal flip", lambda o=offset: flip(crashed.wal, o))  # type: ignore[misc]
    for offset in range(0, db_size, 97):
        record("db flip", lambda o=offset: flip(crashed.db, o))  # type: ignore[misc]
    for length in [*range(WAL_HEADER, wal_size, FRAME * 7), *range(100, wal_size, 4099)]:
        record("wal cut", lambda n=length: truncate(crashed.wal, n))  # type: ignore[misc]
    for length in range(1024, db_size, 1024):
        record("db cut", lambda n=length: truncate(crashed.db, n))  # type: ignore[misc]
    print(outcomes)
    assert sum(outcomes.values()) > 500
