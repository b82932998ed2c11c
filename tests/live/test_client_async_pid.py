"""The asyncio and trio clients name the holder's process (``pid``), as the sync client does.

docs/contract.md §12.2: ``acquire`` and ``tryAcquire`` may name the process
that will use the hold; the daemon records it when it is the peer's
descendant (or parent) of the same uid. Here a child ``sleep`` of the test
process is named, so status shows ``sleep`` and its pid, alive. The field
is checked in the client before anything is sent, with the sync client's
rules (``grant_args``).
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator

import pytest
import trio
from lockd_client import LockClient
from lockd_client.aio import AsyncLockClient
from lockd_client.trio import TrioLockClient

from lockd.testing.daemon import DaemonProcess


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """The module's one daemon: each test holds keys of its own."""
    return lockd


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A descendant of this process: one the daemon believes as a holder."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        yield sleeper
    finally:
        sleeper.kill()
        sleeper.wait(5)


def _holder_of(daemon: DaemonProcess, key: str) -> tuple[object, object, object]:
    with LockClient(daemon.socket) as client:
        raw = client.status(key).raw
    return raw["pid"], raw["process"], raw["alive"]


def test_asyncio_acquire_and_try_acquire_send_pid(
    daemon: DaemonProcess, child: subprocess.Popen[bytes]
) -> None:
    async def main() -> None:
        async with AsyncLockClient(daemon.socket) as client:
            await client.acquire("aio:pid", ttl=30, timeout=1, pid=child.pid)
            tried = await client.try_acquire("aio:pid-try", ttl=30, pid=child.pid)
            assert tried is not None
            # Without a limit the acquire loops on the wire's longest wait: pid goes along.
            await client.acquire("aio:pid-forever", ttl=30, pid=child.pid)

    asyncio.run(main())
    for key in ("aio:pid", "aio:pid-try", "aio:pid-forever"):
        assert _holder_of(daemon, key) == (child.pid, "sleep", True)


def test_trio_acquire_and_try_acquire_send_pid(
    daemon: DaemonProcess, child: subprocess.Popen[bytes]
) -> None:
    async def main() -> None:
        async with TrioLockClient(daemon.socket) as client:
            await client.acquire("trio:pid", ttl=30, timeout=1, pid=child.pid)
            tried = await client.try_acquire("trio:pid-try", ttl=30, pid=child.pid)
            assert tried is not None

    trio.run(main)
    for key in ("trio:pid", "trio:pid-try"):
        assert _holder_of(daemon, key) == (child.pid, "sleep", True)


@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-3, ValueError), (True, TypeError), ("12", TypeError)]
)
def test_a_bad_pid_is_refused_before_sending(
    daemon: DaemonProcess, bad: object, error: type[Exception]
) -> None:
    async def main() -> None:
        async with AsyncLockClient(daemon.socket) as client:
            with pytest.raises(error, match="pid"):
                await client.acquire("aio:bad", ttl=30, timeout=1, pid=bad)
            with pytest.raises(error, match="pid"):
                await client.try_acquire("aio:bad", ttl=30, pid=bad)
            assert not (await client.status("aio:bad")).held

    asyncio.run(main())
