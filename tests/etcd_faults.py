"""A fault-injecting etcd transport for the backend's tests: a stub gateway in front of a
real cluster.

``FaultyPool`` replaces an ``EtcdGateway``'s connection pool. Normally it passes
every request through to etcd. While ``failing`` is on it answers each request
(and each new watch) the way etcd's gateway answers while its member shuts
down gracefully: HTTP 408, gRPC code 1, "grpc: the client connection is
closing"; running watches get the same error as a streamed line. Writes may
be passed through to etcd first (``apply``), so the error hides a
committed write: an outcome the client cannot know. ``hits`` counts the
injected failures per path, so a test can show which call sites met one.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable

import trio

from lockd.daemon.backends.etcd.gateway import EtcdGateway
from lockd.daemon.backends.etcd.transport import Headers, Pool, Response, StreamingResponse

CLOSING = "grpc: the client connection is closing"
ERROR_BODY = json.dumps({"error": CLOSING, "code": 1, "message": CLOSING}).encode()
ERROR_LINE = json.dumps(
    {"error": {"grpc_code": 1, "http_code": 408, "message": CLOSING, "http_status": "Timeout"}}
).encode()


class FaultyPool(Pool):
    def __init__(self) -> None:
        super().__init__()
        self.failing = False
        #: requests for which this is true are sent to etcd before the error
        #: comes back (a write applied, its outcome hidden).
        self.apply: Callable[[str, bytes], bool] = lambda target, body: False
        #: only requests for which this is true fail (default: all).
        self.only: Callable[[str, bytes], bool] = lambda target, body: True
        self.hits: Counter[str] = Counter()
        #: awaited before each request goes on (a test holds one back with it).
        self.gate: Callable[[str, bytes], Awaitable[None]] | None = None
        self._flipped = trio.Event()

    def fail(self, on: bool = True) -> None:
        self.failing = on
        if on:
            self._flipped.set()
        else:
            self._flipped = trio.Event()

    async def request(
        self,
        url: str,
        target: str,
        body: bytes,
        headers: Headers = (),
        *,
        connect_timeout: float,
        read_timeout: float | None = None,
    ) -> Response:
        if self.gate is not None:
            await self.gate(target, body)
        if self.failing and self.only(target, body):
            self.hits[target] += 1
            if self.apply(target, body):
                await super().request(url, target, body, headers, connect_timeout=connect_timeout)
            await trio.lowlevel.checkpoint()
            return Response(408, "Request Timeout", ERROR_BODY)
        return await super().request(
            url, target, body, headers, connect_timeout=connect_timeout, read_timeout=read_timeout
        )

    async def stream(
        self,
        url: str,
        target: str,
        body: bytes,
        headers: Headers = (),
        *,
        connect_timeout: float,
    ) -> StreamingResponse:
        if self.failing and self.only(target, body):
            self.hits[target] += 1
            await trio.lowlevel.checkpoint()
            return _Refused()  # type: ignore[return-value]
        real = await super().stream(url, target, body, headers, connect_timeout=connect_timeout)
        return _Interruptible(real, self)  # type: ignore[return-value]


class _Refused:
    """A watch refused at its start, as a stopping member's gateway refuses it."""

    status = 408
    reason = "Request Timeout"

    async def read(self) -> bytes:
        return ERROR_BODY

    async def aclose(self) -> None:
        pass


class _Interruptible:
    """A live watch that gets the stopping member's error line once ``failing`` turns on."""

    def __init__(self, real: StreamingResponse, pool: FaultyPool) -> None:
        self._real = real
        self._pool = pool
        self.status, self.reason = real.status, real.reason

    async def next_line(self) -> bytes | None:
        line: bytes | None = None
        interrupted = False
        async with trio.open_nursery() as nursery:

            async def read() -> None:
                nonlocal line
                line = await self._real.next_line()
                nursery.cancel_scope.cancel()

            async def interrupt() -> None:
                nonlocal interrupted
                await self._pool._flipped.wait()
                if not self._pool.only("/v3/watch", b""):
                    await trio.sleep_forever()  # the fault is not for watches
                interrupted = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(read)
            nursery.start_soon(interrupt)
        if interrupted and line is None:
            self._pool.hits["/v3/watch"] += 1
            return ERROR_LINE
        return line

    async def read(self) -> bytes:
        return await self._real.read()

    async def aclose(self) -> None:
        await self._real.aclose()


def inject(gateway: EtcdGateway) -> FaultyPool:
    """Put a ``FaultyPool`` under ``gateway`` (before it made any request)."""
    pool = FaultyPool()
    gateway._http = pool
    return pool
