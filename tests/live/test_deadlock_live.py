"""Deadlock detection against a real daemon: two and three connections (docs/contract.md §12).

Both backends; the etcd backend does not look for cycles (docs/etcd-design.md), so
its runs of the deadlock tests are skipped as ``no_deadlock_detection``
(tests/backend_differences.py), and only the plain queue runs there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest
from lockd_client import DeadlockError, Handle, LockClient
from lockd_client.aio import AsyncLockClient

from lockd.cli.common import failure_for
from lockd.exitcodes import EXIT_DEADLOCK
from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for, wait_for_asyncio
from lockd.testing.wire import RawConn, check_error, unique

pytestmark = pytest.mark.both_backends


@pytest.fixture
def clients(lockd: DaemonProcess) -> Iterator[list[LockClient]]:
    opened = [LockClient(str(lockd.socket)) for _ in range(3)]
    try:
        yield opened
    finally:
        for client in opened:
            client.close()


def waiters(client: LockClient, key: str) -> int:
    return client.status(key).waiters


@pytest.mark.differs("no_deadlock_detection")
def test_two_clients_crossing_keys_the_closing_one_gets_deadlock_error(
    lockd: DaemonProcess, clients: list[LockClient]
) -> None:
    a, b, watcher = clients
    k1, k2 = unique("k1"), unique("k2")
    a1 = a.try_acquire(k1, ttl=60)
    b2 = b.try_acquire(k2, ttl=60)
    assert a1 is not None and b2 is not None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        b_waits = pool.submit(b.acquire, k1, 60, 30)
        wait_for(lambda: waiters(watcher, k1) == 1, timeout=10)
        started = time.monotonic()
        with pytest.raises(DeadlockError) as raised:
            a.acquire(k2, ttl=60, timeout=30)
        assert time.monotonic() - started < 5  # at once, not at the timeout
        assert raised.value.code == "DEADLOCK" and raised.value.status == 409
        assert raised.value.cycle == [k2, k1]
        assert k1 in str(raised.value) and k2 in str(raised.value)
        # what a command makes of it: exit 7, one line naming the cycle, the --json code.
        failure = failure_for(raised.value)
        assert failure.exit_code == EXIT_DEADLOCK == 7
        assert "\n" not in failure.message and f"{k2!r} -> {k1!r} -> {k2!r}" in failure.message
        assert (failure.code, failure.details) == ("DEADLOCK", {"cycle": [k2, k1]})
        # refused, not queued; the other side still waits, and gets k1 once a lets go.
        assert waiters(watcher, k2) == 0 and not b_waits.done()
        a.release(a1)
        got: Handle = b_waits.result(timeout=15)
        assert got.key == k1
    b.release(got)
    b.release(b2)
    log = lockd.read_log()
    assert "event=deadlock" in log and k2 in log


def acquire(conn: RawConn, rid: int, key: str) -> None:
    conn.send({"id": rid, "op": "acquire", "key": key, "ttlMs": 60_000, "timeoutMs": 30_000})


def take(conn: RawConn, key: str) -> dict[str, Any]:
    held: dict[str, Any] = conn.result({"id": "t", "op": "tryAcquire", "key": key, "ttlMs": 60_000})
    assert held, key
    return held


@pytest.mark.differs("no_deadlock_detection")
def test_three_connections_in_a_ring_on_the_wire(lockd: DaemonProcess) -> None:
    k1, k2, k3 = unique("r1"), unique("r2"), unique("r3")
    conns = [RawConn(lockd.socket) for _ in range(4)]
    try:
        c1, c2, c3, watcher = conns
        holds = [take(conn, key) for conn, key in ((c1, k1), (c2, k2), (c3, k3))]
        acquire(c1, 1, k2)  # 1 waits for 2
        acquire(c2, 2, k3)  # 2 waits for 3
        wait_for(
            lambda: all(
                watcher.result({"id": "s", "op": "status", "key": k})["waiters"] == 1
                for k in (k2, k3)
            ),
            timeout=10,
        )
        acquire(c3, 3, k1)  # 3 would wait for 1: the ring closes
        reply = c3.reply()
        assert reply["id"] == 3 and not reply["ok"]
        error = check_error(reply, "DEADLOCK", 409)
        assert error["details"] == {"cycle": [k1, k2, k3]}
        # The refused side lets go: 2 gets k3, then releases k2 and 1 gets it.
        c3.result({"id": 4, "op": "release", "key": k3, "handle": holds[2]["handle"]})
        granted2 = c2.reply()
        assert granted2["id"] == 2 and granted2["ok"], granted2
        c2.result({"id": 5, "op": "release", "key": k2, "handle": holds[1]["handle"]})
        granted1 = c1.reply()
        assert granted1["id"] == 1 and granted1["ok"], granted1
    finally:
        for conn in conns:
            conn.close()


def test_a_plain_queue_of_clients_is_served_in_order(clients: list[LockClient]) -> None:
    """No false positive: waiters behind one holder, none holding anything else."""
    a, b, c = clients
    key = unique("q")
    first = a.try_acquire(key, ttl=60)
    assert first is not None
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        b_waits = pool.submit(b.acquire, key, 60, 30)
        wait_for(lambda: waiters(a, key) == 1, timeout=10)
        c_waits = pool.submit(c.acquire, key, 60, 30)
        wait_for(lambda: waiters(a, key) == 2, timeout=10)
        a.release(first)
        b.release(b_waits.result(timeout=15))
        c.release(c_waits.result(timeout=15))


async def parked(client: AsyncLockClient, key: str) -> bool:
    return (await client.status(key)).waiters > 0


@pytest.mark.differs("no_deadlock_detection")
def test_the_asyncio_client_raises_deadlock_error_too(lockd: DaemonProcess) -> None:
    async def main() -> None:
        k1, k2 = unique("a1"), unique("a2")
        async with AsyncLockClient(str(lockd.socket)) as a, AsyncLockClient(str(lockd.socket)) as b:
            a1 = await a.try_acquire(k1, ttl=60)
            b2 = await b.try_acquire(k2, ttl=60)
            assert a1 is not None and b2 is not None
            b_waits = asyncio.create_task(b.acquire(k1, ttl=60, timeout=30))
            await wait_for_asyncio(lambda: parked(a, k1), 10, "b's acquire parked")
            with pytest.raises(DeadlockError) as raised:
                await a.acquire(k2, ttl=60, timeout=30)
            assert raised.value.cycle == [k2, k1]
            await a.release(a1)
            got = await asyncio.wait_for(b_waits, 15)
            await b.release(got)
            await b.release(b2)

    asyncio.run(main())
