"""A full disk under a real daemon: STORAGE_UNAVAILABLE, no ghost holds (issue 9 item 12).

The database lives on a tiny tmpfs that the test fills up, so every commit
fails the way it does on a full disk (SQLITE_FULL from a WAL append). Needs
root (to mount); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for
from lockd.testing.wire import RawConn, check_error, unique

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str = "2m") -> Iterator[Path]:
    path.mkdir(mode=0o700)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path) -> Path:
    """Take every free byte of the file system ``folder`` is on."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)
    return filler


def status(conn: RawConn, key: str) -> dict[str, Any]:
    result: dict[str, Any] = conn.result({"id": "st", "op": "status", "key": key})
    return result


def take(conn: RawConn, rid: int, key: str, **args: Any) -> dict[str, Any]:
    return conn.call({"id": rid, "op": "tryAcquire", "key": key, "ttlMs": 600_000, **args})


def test_full_disk_refuses_writes_answers_reads_and_recovers(short_tmp: Path) -> None:
    with tiny_tmpfs(short_tmp / "state") as state:
        daemon = DaemonProcess.in_folder(short_tmp)
        daemon.start()
        holder, waiter, reader = (RawConn(daemon.socket) for _ in range(3))
        try:
            kept = unique("kept")
            granted = take(holder, 1, kept)
            assert granted["ok"] and granted["result"], granted
            handle = granted["result"]["handle"]
            # The waiter parks (parking writes nothing, so it works on a full disk).
            waiter.send(
                {"id": 2, "op": "acquire", "key": kept, "ttlMs": 600_000, "timeoutMs": 60_000}
            )
            # The waiter is on another connection: wait until it is parked.
            wait_for(lambda: status(reader, kept)["waiters"] == 1, timeout=10)
            filler = fill(state)

            # Grants now fail: each gets STORAGE_UNAVAILABLE and leaves nothing behind.
            failed: str | None = None
            for i in range(2000):
                key = unique("fail")
                reply = take(holder, 100 + i, key)
                if not reply["ok"]:
                    check_error(reply, "STORAGE_UNAVAILABLE", 503)
                    failed = key
                    break
                assert reply["result"] is not None
            assert failed is not None, "no write ever failed on a full tmpfs"
            ghost = reader.result({"id": 3, "op": "status", "key": failed})
            assert ghost["held"] is False and ghost["holders"] == [], "a ghost hold"

            # Reads answer from memory; a release that cannot be written did not happen.
            assert reader.result({"id": 4, "op": "status", "key": kept})["held"] is True
            reply = holder.call({"id": 5, "op": "release", "key": kept, "handle": handle})
            check_error(reply, "STORAGE_UNAVAILABLE", 503)
            still = reader.result({"id": 6, "op": "status", "key": kept})
            assert still["fence"] == granted["result"]["fence"] and still["waiters"] == 1
            stats = reader.result({"id": 7, "op": "stats"})
            assert stats["counters"]["storageErrors"] >= 2, stats

            # Room again: the same requests succeed, the waiter gets the key.
            filler.unlink()
            released = holder.result({"id": 8, "op": "release", "key": kept, "handle": handle})
            assert released == {"released": True}
            handed = waiter.reply()
            assert handed["id"] == 2 and handed["ok"], handed
            retried = take(holder, 9, failed)
            assert retried["ok"] and retried["result"] is not None
        finally:
            for conn in (holder, waiter, reader):
                conn.close()
            daemon.terminate()

        # Everything acknowledged is on disk: a restart shows the same holders.
        daemon.start()
        check = RawConn(daemon.socket)
        try:
            after = check.result({"id": 1, "op": "status", "key": kept})
            assert after["fence"] == handed["result"]["fence"]
            assert check.result({"id": 2, "op": "status", "key": failed})["held"] is True
        finally:
            check.close()
            daemon.terminate()
