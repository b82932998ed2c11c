"""A tiny HTTP/1.1 server on 127.0.0.1 for the etcd client's tests (h11 on trio).

Each request goes to a handler that answers with a ``Reply`` (JSON or raw
body, Content-Length or chunked), ``Stream`` (chunked lines, then the
connection stays open until the client closes it), ``Raw`` (bytes written
as they are, then the connection closes: malformed answers) or ``CLOSE``
(the connection closes without an answer, after the request was read).
``SILENT`` never answers. ``stop`` closes the listener and every connection, so the port refuses
connections from then on, as a dead etcd member's would.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import h11
import trio


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    connection: int  # which of the server's connections it came on (0, 1, ...)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Reply:
    status: int = 200
    json: Any = None
    body: bytes = b""
    chunked: bool = False
    close: bool = False  # "Connection: close", then close
    drop: bool = False  # close right after the reply, without saying so (an idle timeout)

    def payload(self) -> bytes:
        return json.dumps(self.json).encode() if self.json is not None else self.body


@dataclass(frozen=True)
class Stream:
    lines: Sequence[bytes]
    pieces: int = 1  # each line split into this many chunks


@dataclass(frozen=True)
class Raw:
    data: bytes


CLOSE = object()  # close the connection after reading the request, without answering
SILENT = object()  # never answer (the connection stays open)

Handler = Callable[[Request], Reply | Stream | Raw | object]


@dataclass
class StubServer:
    handler: Handler
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    port: int = 0
    _scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, nursery: trio.Nursery) -> StubServer:
        listeners = await nursery.start(self._serve)
        self.port = listeners[0].socket.getsockname()[1]
        return self

    def stop(self) -> None:
        self._scope.cancel()

    async def _serve(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        with self._scope:
            await trio.serve_tcp(self._connection, 0, host="127.0.0.1", task_status=task_status)

    async def _connection(self, stream: trio.SocketStream) -> None:
        number = self.connections
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                request = await _read_request(stream, conn, number)
                if request is None:
                    return
                self.requests.append(request)
                answer = self.handler(request)
                if answer is CLOSE:
                    return
                if answer is SILENT:
                    await trio.sleep_forever()
                if isinstance(answer, Raw):
                    await stream.send_all(answer.data)
                    return
                if isinstance(answer, Stream):
                    await _send_stream(stream, conn, answer)
                    await trio.sleep_forever()
                assert isinstance(answer, Reply)
                await _send_reply(stream, conn, answer)
                if answer.close or answer.drop:
                    return
                conn.start_next_cycle()


async def _read_request(
    stream: trio.SocketStream, conn: h11.Connection, number: int
) -> Request | None:
    head: h11.Request | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return None
            conn.receive_data(data)
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            headers = {k.decode().lower(): v.decode() for k, v in head.headers}
            return Request(head.method.decode(), head.target.decode(), headers, body, number)
        else:  # ConnectionClosed
            return None


async def _send_reply(stream: trio.SocketStream, conn: h11.Connection, reply: Reply) -> None:
    payload = reply.payload()
    headers = [("Content-Type", "application/json")]
    if reply.chunked:
        headers.append(("Transfer-Encoding", "chunked"))
    else:
        headers.append(("Content-Length", str(len(payload))))
    if reply.close:
        headers.append(("Connection", "close"))
    data = conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
    if reply.chunked:  # in three chunks, so the client has to put them together
        third = max(1, len(payload) // 3)
        for start in range(0, len(payload), third):
            data += conn.send(h11.Data(data=payload[start : start + third])) or b""
    elif payload:
        data += conn.send(h11.Data(data=payload)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)


async def _send_stream(stream: trio.SocketStream, conn: h11.Connection, answer: Stream) -> None:
    headers = [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")]
    await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)) or b"")
    for line in answer.lines:
        size = max(1, -(-len(line) // answer.pieces))
        for start in range(0, len(line), size):
            await stream.send_all(conn.send(h11.Data(data=line[start : start + size])) or b"")
            # A pause, so the client reads the pieces separately (it shows no sign of
            # having read one: nothing to wait on).
            await trio.sleep(0.001)
