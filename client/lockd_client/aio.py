"""lockd for asyncio: :class:`AsyncLockClient` (standard library only).

The same operations as :class:`lockd_client.LockClient`, as coroutines that
never block the event loop, over ONE pipelined connection shared by every
task of the client::

    import asyncio
    from lockd_client.aio import AsyncLockClient

    async def main() -> None:
        async with AsyncLockClient() as client:
            async with client.lock("nightly-report", ttl=60, timeout=10) as handle:
                await build_report(fence=handle.fence)

Cancelling a task that waits in ``acquire`` (``task.cancel()``,
``asyncio.wait_for``, ``asyncio.timeout``) withdraws it from the daemon's
queue with ``cancel``; a grant that crossed the cancel is released at once:
cancellation never leaves a key held (see :mod:`lockd_client._async`).
A client belongs to the event loop it was first used in.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from ._aconnect import connect_unix
from ._async import AsyncClientBase, BlockGuard, ConnectionLost, Pipeline, ReplyTimeout, Slot
from ._trust import check_folder, check_peer

__all__ = ["AsyncLockClient"]


async def _writable(sock: socket.socket) -> None:
    """Wait until ``sock`` is writable (a connect in progress has finished)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(sock, wake)
    try:
        await ready
    finally:
        loop.remove_writer(sock)


_READ_CHUNK = 65536


class _FutureSlot(Slot):
    def __init__(self) -> None:
        self.future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    def deliver(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        if not self.future.done():
            self.future.set_result(reply)

    def fail(self, lost: ConnectionLost) -> None:
        if not self.future.done():
            self.future.set_exception(lost)


class _TaskGuard(BlockGuard):
    """Cancels the task running a ``lock()`` block (``task.cancel``), and takes it back."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task

    def __enter__(self) -> _TaskGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def cancel(self) -> None:
        if not self.fired:
            self.fired = True
            self._task.cancel("lockd: the lease was lost")

    async def absorb(self, exc: BaseException | None) -> bool:
        if exc is None:
            # The block ended (or swallowed the cancellation) before it came:
            # let it arrive here instead of at the caller's next await.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)
            self._task.uncancel()
            return True
        return isinstance(exc, asyncio.CancelledError) and self._task.uncancel() == 0


class AsyncLockClient(AsyncClientBase[_FutureSlot]):
    """An asyncio client for the lockd daemon; use ``async with`` or :meth:`aclose`.

    ``socket_path``, ``request_timeout`` and ``retry_window`` as for
    :class:`lockd_client.LockClient`.
    """

    _writer: asyncio.StreamWriter | None = None
    _reader_task: asyncio.Task[None] | None = None
    _connecting: asyncio.Lock | None = None  # made in the loop that first connects

    async def __aenter__(self) -> AsyncLockClient:
        return self

    async def _open(self) -> Pipeline[_FutureSlot]:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # many tasks, one connection
            if self._pipe is not None and not self._pipe.dead:
                return self._pipe
            await self._shutdown()
            trusted = check_folder(self.socket_path)  # as the sync client: before sending
            # Not open_unix_connection(path): it takes EAGAIN (a full backlog) for a
            # connect in progress and hands back an unconnected socket (_aconnect).
            sock = await connect_unix(
                self.socket_path, self.request_timeout, sleep=asyncio.sleep, wait_writable=_writable
            )
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            try:
                check_peer(self.socket_path, writer.get_extra_info("socket"), trusted)
            except BaseException:
                writer.close()
                raise

            def send(data: bytes) -> None:
                if writer.is_closing():
                    raise ConnectionLost("the connection is closing", sent=False)
                writer.write(data)  # buffered by the transport: never blocks

            pipe = Pipeline(send, _FutureSlot, lambda: next(self._ids))
            self._writer = writer
            self._reader_task = asyncio.create_task(_read(reader, pipe))
            return pipe

    async def _wait(self, slot: _FutureSlot, timeout: float | None) -> dict[str, Any]:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            with contextlib.suppress(ConnectionError):
                await writer.drain()  # back-pressure only; a broken pipe shows as EOF
        try:
            async with asyncio.timeout(timeout):
                return await slot.future
        except TimeoutError:
            raise ReplyTimeout() from None

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def _block_guard(self) -> BlockGuard:
        return _TaskGuard()

    def _background(self, run: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        async def main() -> None:
            await run()

        task = asyncio.create_task(main())

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        return stop

    async def _shutdown(self) -> None:
        writer, self._writer = self._writer, None
        task, self._reader_task = self._reader_task, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _read(reader: asyncio.StreamReader, pipe: Pipeline[_FutureSlot]) -> None:
    try:
        while not pipe.dead:
            try:
                data = await reader.read(_READ_CHUNK)
            except OSError as exc:
                pipe.die(f"reading failed ({exc.strerror or exc})")
                return
            pipe.feed(data)
    finally:
        pipe.die("the connection was closed")
