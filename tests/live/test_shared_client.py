"""Shared holds and semaphores from the client and the CLI against a real daemon
(docs/contract.md §10): ``shared=``/``limit=``, ``status().holders``, ``--shared`` and
``--limit N`` on ``locks acquire`` and ``run``, and how they are shown."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest
from lockd_client import InvalidRequestError, LockClient
from lockd_client.aio import AsyncLockClient

from lockd.testing.daemon import LOCKD, DaemonProcess
from lockd.testing.polling import wait_for

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:  # the fixture, not the function below
    """The module's one daemon (on the module's backend): each test has keys of its own."""
    return lockd


def lockd(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LOCKD, *args], capture_output=True, text=True, timeout=60, env=daemon.env
    )


def test_client_shared_and_semaphore(daemon: DaemonProcess) -> None:
    with LockClient(daemon.socket) as a, LockClient(daemon.socket) as b:
        r1 = a.try_acquire("sh:cfg", ttl=30, shared=True)
        r2 = b.try_acquire("sh:cfg", ttl=30, shared=True, owner="reader-2")
        assert r1 is not None and r2 is not None and r2.fence > r1.fence
        assert a.try_acquire("sh:cfg", ttl=30) is None  # a writer does not fit
        st = a.status("sh:cfg")
        assert (st.mode, st.limit, st.holder_count) == ("shared", 1, 2)
        assert [h.fence for h in st.holders] == [r1.fence, r2.fence]
        assert st.holders[1].owner == "reader-2" and st.holders[0].pid == os.getpid()

        slots = [a.acquire("sh:sem", ttl=30, timeout=1, limit=3) for _ in range(3)]
        assert a.try_acquire("sh:sem", ttl=30, limit=3) is None
        with pytest.raises(InvalidRequestError) as caught:
            a.try_acquire("sh:sem", ttl=30, limit=2)  # another limit while it is held
        assert caught.value.field == "limit" and caught.value.details["limit"] == 3
        assert a.status("sh:sem").holder_count == 3
        assert a.release(slots[0]).released
        assert a.try_acquire("sh:sem", ttl=30, limit=3) is not None
        with pytest.raises(ValueError, match="shared"):
            a.try_acquire("sh:x", ttl=30, shared=True, limit=2)
        with pytest.raises(ValueError, match="limit"):
            a.try_acquire("sh:x", ttl=30, limit=1001)


def test_lock_block_and_async_client_take_shared_holds(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with AsyncLockClient(daemon.socket) as client:
            first = client.lock("sh:async", ttl=30, timeout=5, shared=True)
            second = client.lock("sh:async", ttl=30, timeout=5, shared=True)
            async with first, second:
                assert (await client.status("sh:async")).holder_count == 2

    asyncio.run(main())
    with LockClient(daemon.socket) as client, client.lock("sh:sync", ttl=30, timeout=5, limit=2):
        assert client.status("sh:sync").limit == 2


def test_cli_shared_and_limit(daemon: DaemonProcess) -> None:
    for _ in range(2):
        got = lockd(daemon, "locks", "acquire", "sh:cli", "--ttl", "1m", "--shared")
        assert got.returncode == 0, got.stderr
    busy = lockd(daemon, "locks", "acquire", "sh:cli", "--ttl", "1m")
    assert busy.returncode == 1 and "2 holders (shared)" in busy.stderr
    status = lockd(daemon, "locks", "status", "sh:cli")
    assert "Mode:     shared" in status.stdout and "Held:     yes, by 2 holders" in status.stdout
    assert "Holders:" in status.stdout
    listing = lockd(daemon, "locks", "list", "--prefix", "sh:cli")
    lines = listing.stdout.splitlines()
    assert len(lines) == 3 and lines[1].startswith("sh:cli") and lines[2].startswith(" ")
    # lockd run: a reader runs beside the readers; a writer finds no room.
    reader = lockd(daemon, "run", "--shared", "sh:cli", "--", "sh", "-c", "echo read")
    assert reader.returncode == 0 and reader.stdout == "read\n", reader.stderr
    writer = lockd(daemon, "run", "--conflict-exit-code", "7", "sh:cli", "--", "true")
    assert writer.returncode == 7 and "2 holders" in writer.stderr


def test_run_limit_lets_n_commands_run_at_once(daemon: DaemonProcess) -> None:
    """``lockd run --limit 2``: two run, the third finds no free slot (exit 1)."""
    procs = [
        subprocess.Popen(
            [*LOCKD, "run", "--limit", "2", "sh:run", "--", "sleep", "30"],
            env=daemon.env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        with LockClient(daemon.socket) as client:
            wait_for(lambda: client.status("sh:run").holder_count >= 2, 20, "both runs holding")
        third = lockd(daemon, "run", "--limit", "2", "sh:run", "--", "true")
        assert third.returncode == 1
        assert "2 holders (2 slots)" in third.stderr and "pid" in third.stderr
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(20)
