"""Every Python client acts on a pushed loss at once (docs/contract.md §12), against a real daemon.

The holds here have a TTL of a minute, so no renewal comes within the
test: what the clients see, they were told by the daemon. The sync client
calls ``on_lost`` and raises ``LockLostError`` at its next call; the
asyncio and trio clients cancel the guarded block, which ends in
``LockLostError`` carrying the cause and the admin's reason. A break is
sent from a thread of its own: it is answered only once the block let go.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import trio
from lockd_client import LockClient, LockLostError
from lockd_client.aio import AsyncLockClient
from lockd_client.trio import TrioLockClient

from lockd.testing.daemon import DaemonProcess

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """One daemon for the module (conftest's ``lockd``): each test uses keys of its own."""
    return lockd


#: a pushed loss must reach the block long before this (the bench measures ms).
PROMPT = 5.0


def _break_in_thread(socket: object, key: str, reason: str) -> tuple[threading.Thread, list[float]]:
    answered: list[float] = []

    def run() -> None:
        with LockClient(str(socket)) as admin:
            assert admin.break_lock(key, reason).broken
        answered.append(time.monotonic())

    return threading.Thread(target=run, daemon=True), answered


def test_sync_on_lost_fires_and_the_next_call_raises(daemon: DaemonProcess) -> None:
    told = threading.Event()
    with LockClient(daemon.socket) as client:
        breaker, answered = _break_in_thread(daemon.socket, "sync", "nightly swap")
        lock = client.lock("sync", ttl=60, timeout=5, on_lost=lambda h: told.set())
        with pytest.raises(LockLostError) as at_end, lock as handle:
            breaker.start()
            assert told.wait(PROMPT) and handle.lost
            with pytest.raises(LockLostError) as at_call:
                client.try_acquire("other", ttl=1)
            assert at_call.value.cause == "break"
            assert "nightly swap" in at_call.value.reason
            client.status("other")  # raised once, not at every call
        assert at_end.value.cause == "break" and "nightly swap" in str(at_end.value)
        breaker.join(10)
        assert answered


def test_sync_retake_names_the_new_holder(daemon: DaemonProcess) -> None:
    told = threading.Event()
    with LockClient(daemon.socket) as client, LockClient(daemon.socket) as again:
        lock = client.lock("job", ttl=60, timeout=5, owner="run-1", on_lost=lambda h: told.set())
        with pytest.raises(LockLostError) as caught, lock:
            again.acquire("job", ttl=60, timeout=5, owner="run-1")
            assert told.wait(PROMPT)
        assert caught.value.cause == "retake"
        assert "re-taken by user:" in caught.value.reason


def _asyncio_block(socket: str, key: str, reason: str) -> tuple[LockLostError, float]:
    async def main() -> tuple[LockLostError, float]:
        breaker, _ = _break_in_thread(socket, key, reason)
        async with AsyncLockClient(socket) as client:
            try:
                async with client.lock(key, ttl=60, timeout=5):
                    breaker.start()
                    started = time.monotonic()
                    await asyncio.Event().wait()  # until the loss cancels the block
            except LockLostError as exc:
                assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
                await asyncio.sleep(0)  # no cancellation left over for the caller
                return exc, time.monotonic() - started
        raise AssertionError("the block was not cancelled")

    return asyncio.run(main())


def test_asyncio_block_is_cancelled_with_the_reason(daemon: DaemonProcess) -> None:
    error, took = _asyncio_block(str(daemon.socket), "aio", "disk swap")
    assert error.cause == "break" and "disk swap" in str(error)
    assert took < PROMPT


def test_asyncio_block_that_never_awaits_ends_in_lock_lost(daemon: DaemonProcess) -> None:
    """Nothing is read while the block does not await: its release finds the hold gone."""

    async def main() -> LockLostError:
        async with AsyncLockClient(str(daemon.socket)) as client:
            with pytest.raises(LockLostError) as caught:
                async with client.lock("busy", ttl=60, timeout=5):
                    breaker, _ = _break_in_thread(daemon.socket, "busy", "r")
                    breaker.start()
                    breaker.join(10)  # blocking, no await: the break is done (and told) meanwhile
            await asyncio.sleep(0)  # no stray cancellation reaches the caller
            breaker.join(10)
            return caught.value

    error = asyncio.run(main())
    assert error.code == "LEASE_LOST" and "not_holder" in str(error)


async def test_trio_block_is_cancelled_with_the_reason(daemon: DaemonProcess) -> None:
    breaker, answered = _break_in_thread(daemon.socket, "trio", "rack moved")
    started = 0.0
    async with TrioLockClient(str(daemon.socket)) as client:
        with pytest.raises(LockLostError) as caught:
            async with client.lock("trio", ttl=60, timeout=5):
                breaker.start()
                started = time.monotonic()
                await trio.sleep_forever()  # until the loss cancels the block
        took = time.monotonic() - started
    assert caught.value.cause == "break" and "rack moved" in str(caught.value)
    assert took < PROMPT
    await trio.to_thread.run_sync(breaker.join, 10)
    assert answered


async def test_trio_expiry_cancels_the_block(daemon: DaemonProcess) -> None:
    async with TrioLockClient(str(daemon.socket)) as client:
        with pytest.raises(LockLostError) as caught:
            # Not renewed: only the daemon's event can end the block early.
            async with client.lock("short", ttl=0.3, timeout=5, auto_renew=False):
                await trio.sleep_forever()  # until the loss cancels the block
    assert caught.value.cause == "expired"
    assert "ran out" in caught.value.reason
