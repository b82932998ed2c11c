"""lockd for trio: :class:`TrioLockClient` (imports trio; nothing else in
:mod:`lockd_client` does).

The same operations as :class:`lockd_client.LockClient`, as coroutines, over
ONE pipelined connection shared by every task of the client. The client runs
its reader and writer in a nursery of its own, so it is used as an async
context manager::

    import trio
    from lockd_client.trio import TrioLockClient

    async def main() -> None:
        async with TrioLockClient() as client:
            async with client.lock("nightly-report", ttl=60, timeout=10) as handle:
                await build_report(fence=handle.fence)

    trio.run(main)

A cancel scope around a waiting ``acquire`` (``trio.move_on_after``,
``trio.fail_after``, a cancelled nursery) withdraws it from the daemon's
queue with ``cancel``; a grant that crossed the cancel is released at once
(see :mod:`lockd_client._async`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import TracebackType
from typing import Any

import trio

from ._aconnect import connect_unix
from ._async import AsyncClientBase, BlockGuard, ConnectionLost, Pipeline, ReplyTimeout, Slot
from ._errors import LockdError
from ._trust import check_folder, check_peer

__all__ = ["TrioLockClient"]

_READ_CHUNK = 65536
#: Cleanup (stopping the renewer, the release) runs shielded from an outer
#: cancellation, but never longer than this.
_CLEANUP_LIMIT = 10.0


class _EventSlot(Slot):
    def __init__(self) -> None:
        self.event = trio.Event()
        self.lost: ConnectionLost | None = None

    def deliver(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.event.set()

    def fail(self, lost: ConnectionLost) -> None:
        self.lost = lost
        self.event.set()


class _ScopeGuard(BlockGuard):
    """A cancel scope around a ``lock()`` block: the scope catches its own cancellation."""

    def __init__(self) -> None:
        self._scope = trio.CancelScope()

    def __enter__(self) -> _ScopeGuard:
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._scope.__exit__(*exc)

    def cancel(self) -> None:
        self.fired = True
        self._scope.cancel()

    async def absorb(self, exc: BaseException | None) -> bool:
        return exc is None  # the scope caught its Cancelled; anything else is the block's


class TrioLockClient(AsyncClientBase[_EventSlot]):
    """A trio client for the lockd daemon; use it as ``async with TrioLockClient() as c``.

    ``socket_path``, ``request_timeout`` and ``retry_window`` as for
    :class:`lockd_client.LockClient`.
    """

    _nursery_manager: AbstractAsyncContextManager[trio.Nursery] | None = None
    _nursery: trio.Nursery | None = None
    _io_scope: trio.CancelScope | None = None
    _connecting: trio.Lock | None = None

    async def __aenter__(self) -> TrioLockClient:
        self._nursery_manager = trio.open_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with trio.CancelScope(shield=True):
            await self.aclose()
        manager, self._nursery_manager = self._nursery_manager, None
        if manager is not None:
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
            self._nursery = None
            await manager.__aexit__(exc_type, exc, tb)

    def _require_nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise LockdError(
                "use TrioLockClient as `async with TrioLockClient() as client:`",
                code="CLIENT_CLOSED",
            )
        return self._nursery

    async def _open(self) -> Pipeline[_EventSlot]:
        nursery = self._require_nursery()
        if self._connecting is None:
            self._connecting = trio.Lock()
        async with self._connecting:  # many tasks, one connection
            if self._pipe is not None and not self._pipe.dead:
                return self._pipe
            await self._shutdown()
            trusted = check_folder(self.socket_path)  # as the sync client: before sending
            # Not open_unix_socket(path): it takes EAGAIN (a full backlog) for a
            # connect in progress and hands back an unconnected socket (_aconnect).
            sock = await connect_unix(
                self.socket_path,
                self.request_timeout,
                sleep=trio.sleep,
                wait_writable=trio.lowlevel.wait_writable,
            )
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
            try:
                check_peer(self.socket_path, stream.socket, trusted)
            except BaseException:
                await stream.aclose()
                raise
            outgoing, queued = trio.open_memory_channel[bytes](math.inf)

            def send(data: bytes) -> None:
                try:
                    outgoing.send_nowait(data)  # unbounded: never blocks, never awaits
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    raise ConnectionLost("the connection is closing", sent=False) from None

            pipe = Pipeline(send, _EventSlot, lambda: next(self._ids))
            scope = self._io_scope = trio.CancelScope()

            async def run_io() -> None:
                with scope:
                    try:
                        async with trio.open_nursery() as io:
                            io.start_soon(_write, stream, queued, pipe)
                            await _read(stream, pipe)
                            io.cancel_scope.cancel()
                    finally:
                        pipe.die("the connection was closed")
                        outgoing.close()
                        with trio.CancelScope(shield=True):
                            await stream.aclose()

            nursery.start_soon(run_io)
            return pipe

    async def _wait(self, slot: _EventSlot, timeout: float | None) -> dict[str, Any]:
        with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
            await slot.event.wait()
        if scope.cancelled_caught:
            raise ReplyTimeout()
        if slot.lost is not None:
            raise ConnectionLost(slot.lost.reason, protocol=slot.lost.protocol)
        assert slot.reply is not None
        return slot.reply

    async def _sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    def _block_guard(self) -> BlockGuard:
        return _ScopeGuard()

    def _background(self, run: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        nursery = self._require_nursery()
        scope = trio.CancelScope()
        done = trio.Event()

        async def main() -> None:
            try:
                with scope:
                    await run()
            finally:
                done.set()

        nursery.start_soon(main)

        async def stop() -> None:
            scope.cancel()
            await done.wait()

        return stop

    def _cleanup_scope(self) -> AbstractContextManager[Any]:
        scope = trio.move_on_after(_CLEANUP_LIMIT)
        scope.shield = True
        return scope

    async def _shutdown(self) -> None:
        scope, self._io_scope = self._io_scope, None
        if scope is not None:
            scope.cancel()


async def _read(stream: trio.SocketStream, pipe: Pipeline[_EventSlot]) -> None:
    while not pipe.dead:
        try:
            data = await stream.receive_some(_READ_CHUNK)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            pipe.die(f"reading failed ({exc})")
            return
        pipe.feed(data)


async def _write(
    stream: trio.SocketStream,
    queued: trio.MemoryReceiveChannel[bytes],
    pipe: Pipeline[_EventSlot],
) -> None:
    async for data in queued:
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            pipe.die(f"sending failed ({exc})")
            return
