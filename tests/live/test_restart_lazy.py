"""A restarted daemon on more leases than its first chunk, before its check (issue 26).

A real ``lockd serve`` answers ``hello`` before it has read its stored
leases (keys and deadlines come in chunks of 8,192 rows between requests)
and before its whole-file integrity check has begun (50 ms after READY).
Against such a daemon: a lease whose key lies past the first chunk holds
its key from the very first request, and a row found damaged by that first
request fails closed (STORAGE_UNAVAILABLE; no grant of any key), after
which the check stops the daemon with the refusal's line.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lockd_client import LockClient, StorageUnavailableError

from lockd.daemon.engine import Changes, Lease
from lockd.daemon.store import Store, read_boot_id
from lockd.testing.daemon import DaemonProcess

#: More than two chunks of the restore (8,192 rows each).
COUNT = 20_000
LAST = f"stored:{COUNT - 1:06d}"


def _lease(key: str, fence: int, expires_at: int) -> Lease:
    return Lease(
        key=key,
        handle=f"handle-of-{key}-xxxxxxxx",
        fence=fence,
        owner=None,
        principal="user:somebody",
        ttl_ms=3_600_000,
        expires_at=expires_at,
    )


def _stored(db: Path) -> None:
    """COUNT leases of this boot, an hour to run, then a clean stop (no WAL left)."""
    db.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    until = time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000 + 3_600_000
    store = Store(db, read_boot_id())
    keys = [f"stored:{i:06d}" for i in range(COUNT)]
    rows: dict[tuple[str, int], Lease | None] = {
        (key, 0): _lease(key, i + 1, until) for i, key in enumerate(keys)
    }
    store.apply(Changes(rows=rows, fence=COUNT))
    store.close()


@pytest.fixture
def stopped() -> Iterator[DaemonProcess]:
    """A daemon not started yet, its database holding COUNT leases."""
    root = Path(tempfile.mkdtemp(prefix="lockd-", dir="/tmp"))
    daemon = DaemonProcess.in_folder(root)
    _stored(daemon.db)
    try:
        yield daemon
    finally:
        daemon.terminate()
        shutil.rmtree(root, ignore_errors=True)


def test_a_lease_past_the_first_chunk_holds_its_key_from_the_first_request(
    stopped: DaemonProcess,
) -> None:
    stopped.start()
    with LockClient(str(stopped.socket)) as client:
        assert client.try_acquire(LAST, ttl=60) is None  # held by its stored lease
        status = client.status(LAST)
        assert status.held and status.holders[0].fence == COUNT
        granted = client.try_acquire("fresh", ttl=60)  # a write: waits for the check
        assert granted is not None and granted.fence > COUNT
    assert "event=database_damaged" not in stopped.read_log()


def test_a_damaged_row_found_by_the_first_request_fails_closed(
    stopped: DaemonProcess,
) -> None:
    data = bytearray(stopped.db.read_bytes())
    at = data.index(f"handle-of-{LAST}-".encode())
    data[at] = ord("H")  # still a valid row: a different handle, caught by its CRC only
    stopped.db.write_bytes(bytes(data))
    stopped.start()
    with LockClient(str(stopped.socket)) as client:
        with pytest.raises(StorageUnavailableError):
            client.status(LAST)
        with pytest.raises(StorageUnavailableError):
            client.try_acquire(LAST, ttl=60)  # never granted over a lease that may be alive
        with pytest.raises(StorageUnavailableError):
            client.try_acquire("fresh", ttl=60)  # nor any other key: writes stopped
    assert stopped.proc is not None
    # The check, once it has run, finds the same row and ends the daemon by
    # itself, as a refused start (no SIGTERM: that would interrupt the check).
    assert stopped.proc.wait(timeout=120) == 1
    assert "1 of 20000 lease rows fail their checksum" in stopped.read_log()
