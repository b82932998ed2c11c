"""The asyncio and trio clients against a real daemon (docs/contract.md §8 "Async programs").

Same operations as the sync client, one pipelined connection for many tasks,
and cancellation that never leaves a key held: the race between a grant and
a cancel is run hundreds of times for each library.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Protocol

import pytest
import trio
from lockd_client import (
    Handle,
    LockClient,
    LockLostError,
    LockStatus,
    LockTimeoutError,
    UntrustedDaemonError,
)
from lockd_client.aio import AsyncLockClient
from lockd_client.trio import TrioLockClient

from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for, wait_for_asyncio, wait_for_trio

pytestmark = pytest.mark.both_backends

RACES = 300
#: The cancel races' jitter (seconds): before the first of release/cancel, and between them.
RACE_LEADS = (0, 0, 0.0005, 0.002)
RACE_GAPS = (0, 0, 0.0001, 0.0005, 0.001)


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """The module's one daemon (on its backend): each test uses keys of its own.

    ``test_asyncio_operations`` lists every ``aio:`` key: it starts a daemon of its own.
    """
    return lockd


class StatusClient(Protocol):
    """The status call both async clients have (asyncio's and trio's)."""

    async def status(self, key: str) -> LockStatus: ...


async def parked(client: StatusClient, key: str, waiters: int) -> bool:
    return (await client.status(key)).waiters == waiters


async def idle(client: StatusClient, key: str) -> bool:
    status = await client.status(key)
    return not status.held and status.waiters == 0


async def renewed_past(client: StatusClient, key: str, first_end: datetime, ttl_ms: int) -> bool:
    """The daemon's end of the lease on ``key`` lies a whole TTL past the grant's, ``first_end``."""
    expires = (await client.status(key)).lease_expires_at
    assert expires is not None
    return (expires - first_end).total_seconds() * 1000 >= ttl_ms


def held(socket: object, key: str) -> bool:
    with LockClient(str(socket)) as client:
        return client.status(key).held


def settles_free(socket: object, key: str, timeout: float = 10.0) -> bool:
    """The key is free (a crossing grant's release may take a moment to land)."""
    with LockClient(str(socket)) as client:
        try:
            wait_for(lambda: not client.status(key).held, timeout, interval=0.005)
        except TimeoutError:
            return False
    return True


# -- asyncio ------------------------------------------------------------------------------


def test_asyncio_operations(daemon_paths: DaemonProcess) -> None:
    daemon = daemon_paths.start()

    async def main() -> None:
        async with AsyncLockClient(daemon.socket) as client:
            assert (await client.hello())["protocol"] == 1
            handle = await client.acquire("aio:k", ttl=30, timeout=1, owner="o")
            assert isinstance(handle, Handle) and handle.owner == "o"
            assert await client.try_acquire("aio:k", ttl=30) is None
            status = await client.status("aio:k")
            assert status.held and status.fence == handle.fence
            assert [s.key for s in await client.list(prefix="aio:")] == ["aio:k"]
            assert (await client.renew(handle, ttl=60)).renewed
            with pytest.raises(LockTimeoutError):
                await client.acquire("aio:k", ttl=30, timeout=0.05)
            assert (await client.release(handle)).released
            assert not (await client.release(handle)).released
            assert "counters" in await client.stats()

    asyncio.run(main())


def test_asyncio_many_tasks_share_one_connection(daemon: DaemonProcess) -> None:
    """50 tasks take turns on one key through one client; the loop never blocks."""
    order: list[int] = []

    async def main() -> None:
        async with AsyncLockClient(daemon.socket) as client:

            async def worker(n: int) -> None:
                async with client.lock("aio:shared-conn", ttl=30, timeout=30):
                    if not order:
                        # The first holder waits, on the same connection, until the 49
                        # others are parked at the daemon: the loop and the connection
                        # stay free for other requests while acquires wait.
                        await wait_for_asyncio(
                            lambda: parked(client, "aio:shared-conn", 49), 20, "49 parked"
                        )
                    order.append(n)

            await asyncio.gather(*(worker(n) for n in range(50)))
            with LockClient(daemon.socket) as sync:
                assert sync.stats()["connections"] >= 1

    asyncio.run(main())
    assert sorted(order) == list(range(50))
    assert not held(daemon.socket, "aio:shared-conn")


def test_asyncio_lock_renews_and_reports_loss(daemon: DaemonProcess) -> None:
    async def main() -> None:
        async with (
            AsyncLockClient(daemon.socket) as client,
            AsyncLockClient(daemon.socket) as observer,  # leaves the renewer's line alone
        ):
            async with client.lock("aio:renew", ttl=0.3, timeout=1) as handle:
                # Renewed in the background until the daemon's end of the lease lies the
                # asked TTL past the grant's: the key was kept past that TTL (etcd's
                # leases are longer, whole seconds: there it takes a renewal or two).
                first_end = handle.lease_expires_at
                assert first_end is not None
                await wait_for_asyncio(
                    lambda: renewed_past(observer, "aio:renew", first_end, 300),
                    20,
                    "renewals past the first TTL",
                    interval=0.05,
                )
                assert (await client.status("aio:renew")).fence == handle.fence
            lost: list[Handle] = []
            with pytest.raises(LockLostError):
                async with client.lock("aio:lost", ttl=0.6, timeout=1, on_lost=lost.append):
                    with LockClient(daemon.socket) as admin:
                        assert admin.break_lock("aio:lost", "test").broken
                    await wait_for_asyncio(lambda: lost, 2, "on_lost called")
            assert lost

    asyncio.run(main())


def test_asyncio_wait_for_timeout_withdraws_the_waiter(daemon: DaemonProcess) -> None:
    """``asyncio.wait_for`` around a parked acquire: the waiter leaves the queue at once."""

    async def main() -> None:
        async with (
            AsyncLockClient(daemon.socket) as holder,
            AsyncLockClient(daemon.socket) as client,
        ):
            h = await holder.acquire("aio:withdraw", ttl=30, timeout=1)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.acquire("aio:withdraw", ttl=30, timeout=20), 0.2)
            await wait_for_asyncio(lambda: parked(holder, "aio:withdraw", 0), 3, "no waiter")
            assert (await holder.status("aio:withdraw")).waiters == 0  # not after 20 s
            assert (await holder.release(h)).released
            assert not (await holder.status("aio:withdraw")).held  # nobody was handed it

    asyncio.run(main())


def test_asyncio_cancel_race_never_leaves_the_key_held(daemon: DaemonProcess) -> None:
    """A release and a cancel at nearly the same instant, {RACES} times."""
    rng = random.Random(11)
    outcomes = {"granted": 0, "cancelled": 0}

    async def main() -> None:
        async with (
            AsyncLockClient(daemon.socket) as holder,
            AsyncLockClient(daemon.socket) as client,
        ):
            for i in range(RACES):
                key = f"aio:race:{i % 7}"
                h = await holder.acquire(key, ttl=30, timeout=5)
                task = asyncio.create_task(client.acquire(key, ttl=30, timeout=10))

                async def release(h: Handle = h) -> None:
                    await holder.release(h)

                async def cancel(task: asyncio.Task[Handle] = task) -> None:
                    task.cancel()

                lead, gap = rng.choice(RACE_LEADS), rng.choice(RACE_GAPS)
                first, second = (release, cancel) if rng.random() < 0.5 else (cancel, release)
                # The jitter IS the test: it moves the cancel around the grant's instant.
                await asyncio.sleep(lead)
                await first()
                await asyncio.sleep(gap)  # the jitter again (see above)
                await second()
                try:
                    got = await task
                except asyncio.CancelledError:
                    outcomes["cancelled"] += 1
                else:
                    outcomes["granted"] += 1
                    assert (await client.release(got)).released
                await wait_for_asyncio(
                    lambda key=key: idle(holder, key), 2, f"race {i}: {key} free", 0.002
                )

    asyncio.run(main())
    assert outcomes["cancelled"] > 0 and outcomes["granted"] > 0, outcomes


def test_asyncio_client_imports_no_trio() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import lockd_client.aio\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "bad = sorted(m for m in new if m != 'lockd_client' and m not in sys.stdlib_module_names)\n"
        "assert 'trio' not in sys.modules and not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# -- trio --------------------------------------------------------------------------------


async def test_trio_operations(daemon: DaemonProcess) -> None:
    async with TrioLockClient(daemon.socket) as client:
        handle = await client.acquire("trio:k", ttl=30, timeout=1)
        assert await client.try_acquire("trio:k", ttl=30) is None
        assert (await client.status("trio:k")).fence == handle.fence
        assert (await client.renew(handle, ttl=60)).renewed
        with pytest.raises(LockTimeoutError):
            await client.acquire("trio:k", ttl=30, timeout=0.05)
        assert (await client.release(handle)).released


@pytest.mark.sqlite_only("the asyncio twin runs on etcd; the daemon sees the same requests")
async def test_trio_many_tasks_share_one_connection(daemon: DaemonProcess) -> None:
    order: list[int] = []
    async with TrioLockClient(daemon.socket) as client:

        async def worker(n: int) -> None:
            async with client.lock("trio:shared-conn", ttl=30, timeout=30):
                order.append(n)
                await trio.lowlevel.checkpoint()  # let the others run while this one holds

        async with trio.open_nursery() as nursery:
            for n in range(50):
                nursery.start_soon(worker, n)
    assert sorted(order) == list(range(50))


async def test_trio_cancel_scope_withdraws_and_lock_cleans_up(daemon: DaemonProcess) -> None:
    async with TrioLockClient(daemon.socket) as holder, TrioLockClient(daemon.socket) as client:
        h = await holder.acquire("trio:withdraw", ttl=30, timeout=1)
        with trio.move_on_after(0.2) as scope:
            await client.acquire("trio:withdraw", ttl=30, timeout=20)
        assert scope.cancelled_caught
        await wait_for_trio(lambda: parked(holder, "trio:withdraw", 0), 5, "no waiter")
        assert (await holder.release(h)).released
        # A block cancelled from outside still releases (shielded cleanup).
        with trio.move_on_after(0.2):
            async with client.lock("trio:cancelled-block", ttl=30, timeout=1):
                await trio.sleep_forever()  # until move_on_after cancels the block
        assert not (await holder.status("trio:cancelled-block")).held


@pytest.mark.sqlite_only("the asyncio twin runs on etcd; the daemon sees the same requests")
async def test_trio_cancel_race_never_leaves_the_key_held(daemon: DaemonProcess) -> None:
    rng = random.Random(12)
    cancelled = granted = 0
    async with TrioLockClient(daemon.socket) as holder, TrioLockClient(daemon.socket) as client:
        for i in range(RACES):
            key = f"trio:race:{i % 7}"
            h = await holder.acquire(key, ttl=30, timeout=5)
            got: list[Handle] = []

            async def take(
                scope: trio.CancelScope, key: str = key, got: list[Handle] = got
            ) -> None:
                with scope:
                    got.append(await client.acquire(key, ttl=30, timeout=10))

            scope = trio.CancelScope()

            async def release(h: Handle = h) -> None:
                await holder.release(h)

            async def cancel(scope: trio.CancelScope = scope) -> None:
                scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(take, scope, key, got)
                lead, gap = rng.choice(RACE_LEADS), rng.choice(RACE_GAPS)
                first, second = (release, cancel) if rng.random() < 0.5 else (cancel, release)
                # The jitter IS the test: it moves the cancel around the grant's instant.
                await trio.sleep(lead)
                await first()
                await trio.sleep(gap)  # the jitter again (see above)
                await second()
            if got:
                granted += 1
                assert (await client.release(got[0])).released
            else:
                cancelled += 1
            await wait_for_trio(lambda key=key: idle(holder, key), 5, f"{key} free", 0.002)
    assert cancelled > 0 and granted > 0


def test_async_clients_refuse_an_untrusted_socket_folder(short_tmp: Path) -> None:
    """The same trust checks as the sync client, before anything is sent."""
    folder = short_tmp / "open"
    folder.mkdir()
    os.chmod(folder, 0o777)  # anyone could swap the socket: not sticky
    path = folder / "lockd.sock"

    async def with_asyncio() -> None:
        async with AsyncLockClient(path) as client:
            with pytest.raises(UntrustedDaemonError, match="writable by other users"):
                await client.hello()

    async def with_trio() -> None:
        async with TrioLockClient(path) as client:
            with pytest.raises(UntrustedDaemonError, match="writable by other users"):
                await client.hello()

    asyncio.run(with_asyncio())
    trio.run(with_trio)
