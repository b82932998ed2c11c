"""Durability across a daemon crash (docs/contract.md §4), with kill -9 and a real database.

A grant, renew or release is committed before its reply is sent, so
whatever a client was told survives ``kill -9``: leases keep their handles,
fences and deadlines; the fence counter never goes backwards; and only
leases from another boot are dropped at start.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from datetime import datetime
from typing import Any

from lockd_client import DaemonUnavailableError, Handle, LockClient, LockdError

from lockd.daemon.verify import row_checksum
from lockd.testing.daemon import DaemonProcess
from tests.live.test_integration import wait_for

#: Restarting rebuilds a deadline from the boot clock and the wall clock; both
#: are read at slightly different instants, so allow a few ms of drift.
DEADLINE_SLACK_MS = 20


def boot_ms() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


def expires(status_raw: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(status_raw["leaseExpiresAt"].replace("Z", "+00:00"))


def test_kill9_keeps_leases_handles_fences_and_deadlines(daemon_paths: DaemonProcess) -> None:
    daemon_paths.start()
    sock = str(daemon_paths.socket)
    holder = LockClient(sock)
    plain = holder.acquire("crash:plain", ttl=600, timeout=1)
    owned = holder.acquire("crash:owned", ttl=600, timeout=1, owner="run-7")
    bound = holder.acquire("crash:bound", ttl=600, timeout=1, release_on_close=True)
    short = holder.acquire("crash:short", ttl=0.3, timeout=1)
    kept = [plain, owned, bound]
    with LockClient(sock) as observer:
        before = {h.key: observer.status(h.key).raw for h in kept}
    daemon_paths.kill9()
    holder.close()  # the bound lease's connection is gone; the daemon was dead then

    daemon_paths.start()
    with LockClient(sock) as client:
        for handle in kept:
            now = client.status(handle.key).raw
            was = before[handle.key]
            assert now["held"] is True, handle.key
            assert (now["fence"], now["owner"], now["heldBy"]) == (
                was["fence"],
                was["owner"],
                was["heldBy"],
            )
            drift = abs((expires(now) - expires(was)).total_seconds() * 1000)
            assert drift <= DEADLINE_SLACK_MS, (handle.key, drift)
        # A lease that ran out while the daemon was down is free.
        wait_for(lambda: not client.status("crash:short").held, timeout=5)
        assert client.release(short).reason == "not_holder"
        # The original handles still prove the holds.
        assert client.renew(owned, ttl=600).renewed
        assert client.release(plain).released
        assert client.release(bound).released
        # The re-take still works after the crash, with a higher fence.
        again = client.acquire("crash:owned", ttl=60, timeout=1, owner="run-7")
        assert again.fence > max(h.fence for h in [*kept, short])
        assert client.release(owned).reason == "not_holder"
        fresh = client.acquire("crash:new", ttl=60, timeout=1)
        assert fresh.fence > again.fence
    assert daemon_paths.stop() == 0


def test_every_acknowledged_grant_survives_kill9(daemon_paths: DaemonProcess) -> None:
    """Grants keep coming until the daemon dies; each one acknowledged is kept."""
    daemon_paths.start()
    acknowledged: list[Handle] = []
    stop = threading.Event()

    def grab() -> None:
        with LockClient(str(daemon_paths.socket), retry_window=0.1) as client:
            i = 0
            while not stop.is_set():
                try:
                    handle = client.try_acquire(f"ack:{i}", ttl=600)
                except (DaemonUnavailableError, LockdError, OSError):
                    return
                assert handle is not None
                acknowledged.append(handle)
                i += 1

    thread = threading.Thread(target=grab, daemon=True)
    thread.start()
    wait_for(lambda: len(acknowledged) >= 50, timeout=20, what="50 grants")
    daemon_paths.kill9()
    stop.set()
    thread.join(20)
    assert not thread.is_alive()
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        listed = {lock.key: lock for lock in client.list(prefix="ack:")}
        for handle in acknowledged:
            assert handle.key in listed, f"{handle.key} was acknowledged but lost"
            assert listed[handle.key].fence == handle.fence
        # At most one grant may have been committed but not acknowledged.
        assert len(listed) - len(acknowledged) in (0, 1)
        assert client.release(acknowledged[-1]).released
        newest = max(lock.fence or 0 for lock in listed.values())
        assert client.acquire("ack:after", ttl=60, timeout=1).fence > newest


def insert_foreign_lease(db: str, key: str, fence: int) -> None:
    """Write a lease row as an earlier boot of the host would have left it."""
    values = (
        key,
        0,
        "F" * 22,
        fence,
        "old-run",
        "user:root",
        600_000,
        boot_ms() + 600_000,
        str(uuid.uuid4()),
        "exclusive",
        1,
        None,
        None,
    )
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO leases "
            "(key, slot, handle, fence, owner, principal, ttl_ms, expires_at, boot_id, "
            "mode, hold_limit, pid, process, chk) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*values, row_checksum(*values)),  # a row as lockd writes it (lockd.daemon.verify)
        )
    conn.close()


def test_lease_of_another_boot_is_dropped_at_start(daemon_paths: DaemonProcess) -> None:
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        mine = client.acquire("boot:mine", ttl=600, timeout=1)
        for _ in range(3):
            client.release(client.acquire("boot:churn", ttl=60, timeout=1))
        top = client.acquire("boot:top", ttl=600, timeout=1).fence
    daemon_paths.kill9()
    insert_foreign_lease(str(daemon_paths.db), "boot:old", fence=2)

    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        assert not client.status("boot:old").held
        assert client.status("boot:mine").fence == mine.fence
        assert client.release(("boot:old", "F" * 22)).reason == "not_holder"
        assert client.acquire("boot:old", ttl=60, timeout=1).fence > top
    wait_for(lambda: "event=dropped_earlier_boot leases=1" in daemon_paths.read_log(), timeout=5)
    assert daemon_paths.stop() == 0
    with sqlite3.connect(daemon_paths.db) as conn:
        rows = conn.execute("SELECT key, boot_id FROM leases ORDER BY key").fetchall()
    conn.close()
    boot_ids = {boot_id for _, boot_id in rows}
    assert len(boot_ids) == 1, "every row left must be of this boot"
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        assert boot_ids == {f.read().strip()}


def test_fence_never_goes_backwards_when_all_leases_are_gone(
    daemon_paths: DaemonProcess,
) -> None:
    daemon_paths.start()
    highest = 0
    for round_ in range(3):
        with LockClient(str(daemon_paths.socket)) as client:
            for i in range(4):
                handle = client.acquire(f"fence:{round_}:{i}", ttl=60, timeout=1)
                assert handle.fence > highest
                highest = handle.fence
                assert client.release(handle).released
            assert client.list() == []
        # Alternate a crash and a clean stop between rounds.
        if round_ % 2 == 0:
            daemon_paths.kill9()
        else:
            assert daemon_paths.stop() == 0
        with sqlite3.connect(daemon_paths.db) as conn:
            assert conn.execute("SELECT count(*) FROM leases").fetchone() == (0,)
        conn.close()
        daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        # A restart continues above the fence mark (lockd/daemon/fencemark.py):
        # strictly increasing, not contiguous.
        assert client.stats()["fence"] >= highest
        assert client.try_acquire("fence:last", ttl=60).fence > highest  # type: ignore[union-attr]
