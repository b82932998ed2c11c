"""HTTP/1.1 for the etcd gateway client: kept connections per endpoint, on trio.

Why this and not a general HTTP client (httpx, which the gateway used first):

- **CPU per request.** The daemon makes one or two etcd calls per lock
  operation, so the client's own cost is a large part of lockd-on-etcd's
  throughput. httpx + httpcore + anyio cost ~1.1 ms of CPU per call on the
  bench box. Here the HTTP is ``http1.py`` (a strict parser for the one
  kind of server it talks to), and a plain-TCP connection is a non-blocking
  socket driven by trio's readiness waits as the daemon's own client
  sockets are (``sockio.py``): a request that fits the socket buffer goes
  out without a scheduler pass, and the answer is read once the socket is
  readable. (``trio.SocketStream`` ends every call in a scheduler pass.) TLS
  connections go through ``trio.SSLStream``.
- **One write per request.** Head and body go out in one send (one TLS
  record with TLS), so etcd wakes once per call.
- **Knowing what may have reached etcd.** The gateway's failover rules hinge
  on it: a write may be sent again only when it certainly was not sent.
  Here that line is explicit: ``NotSent`` only when no byte of the request
  went out on the connection (the connect or TLS handshake failed, before the
  request existed on the wire), ``MaybeSent`` for everything after the first
  byte was handed to the kernel (the peer closed, reset, answered garbage, or
  did not answer in time). A kept connection that the server closed while it
  sat idle shows as readable (end of file) before it is used: it is dropped
  and a new one opened, and the request is then sent once.

A connection serves one request at a time. Idle ones are kept per endpoint
(at most ``max_idle``, newest used first); a request cancelled or failed
mid-way closes its connection, since its state is unknown. A streaming
response (an etcd watch) owns its connection until it is closed: etcd ends
a watch when its connection closes.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import trio

from lockd.daemon import sockio
from lockd.daemon.backends.etcd.http1 import (
    END,
    Closed,
    Head,
    Malformed,
    ResponseReader,
    request_head,
)

RECEIVE_BYTES = 64 * 1024
DEFAULT_MAX_IDLE = 8

Headers = Sequence[tuple[str, str]]


class HttpFailure(Exception):
    """The request failed at the HTTP level (no complete, well-formed answer came back)."""


class NotSent(HttpFailure):
    """No byte of the request reached the connection: it had no effect at the server."""


class MaybeSent(HttpFailure):
    """The request may have reached the server; its effect is unknown."""


@dataclass(frozen=True)
class Origin:
    """Where an endpoint URL points: ``http://host:port`` or ``https://host:port``."""

    tls: bool
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: expected http://host:port or https://host:port")
        tls = parts.scheme == "https"
        return cls(tls, parts.hostname, parts.port or (443 if tls else 80))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Response:
    """A complete response: status, reason phrase and body (headers are not needed here)."""

    status: int
    reason: str
    body: bytes


class Wire(Protocol):
    """The byte stream under a connection."""

    async def send_all(self, data: bytes) -> None: ...

    async def receive_some(self) -> bytes: ...

    def idle(self) -> bool:
        """Nothing to read and not at its end (a kept connection the server did not close)."""
        ...

    async def aclose(self) -> None: ...


class _PlainWire:
    """A connected non-blocking TCP socket, driven by trio's readiness waits.

    A send that fits the socket buffer (every etcd request, in practice)
    does not yield; a receive waits until the socket is readable. Sending
    without a checkpoint is safe here: the wait for the answer that always
    follows is one.
    """

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    async def send_all(self, data: bytes) -> None:
        await sockio.send_all(self.sock, data)

    async def receive_some(self) -> bytes:
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            try:
                return self.sock.recv(RECEIVE_BYTES)
            except BlockingIOError:
                continue

    def idle(self) -> bool:
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # end of file, or bytes nobody asked for

    async def aclose(self) -> None:
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
        await trio.lowlevel.checkpoint()


class _StreamWire:
    """A trio stream (TLS: ``trio.SSLStream`` on a ``trio.SocketStream``)."""

    __slots__ = ("stream",)

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def send_all(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive_some(self) -> bytes:
        return bytes(await self.stream.receive_some(RECEIVE_BYTES))

    def idle(self) -> bool:
        return not _readable(self.stream)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class Connection:
    """One HTTP/1.1 connection: the bytes on the wire and the reader of its responses."""

    def __init__(self, wire: Wire, origin: Origin) -> None:
        self.wire = wire
        self.origin = origin
        self._reader = ResponseReader()
        self._in_exchange = False  # a request went out; its response is not read to the end

    def kept_alive(self) -> bool:
        """The last exchange ended cleanly and the server did not ask to close."""
        return not self._in_exchange and self._reader.reusable

    def reusable(self) -> bool:
        """Kept alive, and the socket has nothing to read (an idle server that closed
        shows as readable)."""
        return self.kept_alive() and self.wire.idle()

    async def send_request(self, target: str, body: bytes, headers: Headers) -> None:
        """POST ``body`` in one write; ``MaybeSent`` if the write fails part-way."""
        try:
            head = request_head(target, self.origin.host_header, len(body), headers)
        except ValueError as exc:  # a header we built is invalid: nothing sent
            raise NotSent(f"cannot send the request: {exc}") from None
        self._reader.next_response()
        self._in_exchange = True
        try:
            await self.wire.send_all(head + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise MaybeSent(f"connection broke while sending ({exc!r})") from None

    async def receive_head(self) -> Head:
        """The response's status line (``MaybeSent`` on anything but a well-formed one)."""
        reader = self._reader
        while True:
            try:
                head = reader.read_head()
            except Closed as exc:
                raise MaybeSent(str(exc)) from None
            except Malformed as exc:
                raise MaybeSent(f"malformed response ({exc})") from None
            if head is not None:
                return head
            await self._receive()

    async def receive_data(self) -> bytes | None:
        """The next piece of the body; None at its end (the connection may then be kept)."""
        reader = self._reader
        while True:
            try:
                piece = reader.read_body()
            except Malformed as exc:
                raise MaybeSent(f"malformed response ({exc})") from None
            if piece is END:
                self._in_exchange = False
                return None
            if piece is not None:
                assert isinstance(piece, bytes)
                return piece
            await self._receive()

    async def _receive(self) -> None:
        try:
            data = await self.wire.receive_some()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise MaybeSent(f"connection broke while receiving ({exc!r})") from None
        self._reader.feed(data)  # b"" marks the end of the stream

    async def aclose(self) -> None:
        await self.wire.aclose()


class StreamingResponse:
    """A response read as it arrives (an etcd watch); owns its connection until closed."""

    def __init__(self, pool: Pool, connection: Connection, head: Head) -> None:
        self._pool = pool
        self._connection: Connection | None = connection
        self.status = head.status
        self.reason = head.reason
        self._pending = b""
        self._ended = False

    async def next_line(self) -> bytes | None:
        """The body's next line (etcd's gateway ends each streamed message with a newline);
        None at the end of the body."""
        while True:
            newline = self._pending.find(b"\n")
            if newline >= 0:
                line = self._pending[:newline]
                self._pending = self._pending[newline + 1 :]
                return line
            data = await self._receive()
            if data is None:
                line, self._pending = self._pending, b""
                return line or None
            self._pending += data

    async def read(self) -> bytes:
        """The rest of the body (an error reply's), then the connection goes back to the pool."""
        chunks = [self._pending]
        self._pending = b""
        while (data := await self._receive()) is not None:
            chunks.append(data)
        return b"".join(chunks)

    async def _receive(self) -> bytes | None:
        connection = self._connection
        if self._ended:
            return None
        if connection is None:
            raise MaybeSent("the response was closed")
        try:
            data = await connection.receive_data()
        except BaseException:
            await self.aclose()
            raise
        if data is None:
            self._connection, self._ended = None, True
            await self._pool.give_back(connection)
        return data

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.aclose()


class Pool:
    """Connections to etcd endpoints: each request on a kept idle one, or a new one.

    ``ssl_context`` is used for ``https`` endpoints (server check and client
    certificate). ``connect_timeout`` bounds the TCP connect plus the TLS
    handshake; it and ``read_timeout`` (the response, after the request went
    out) are per request.
    """

    def __init__(
        self, ssl_context: ssl.SSLContext | None = None, *, max_idle: int = DEFAULT_MAX_IDLE
    ) -> None:
        self._ssl_context = ssl_context
        self._max_idle = max_idle
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, list[Connection]] = {}
        self._closed = False
        #: connections opened so far (tests check that kept ones are reused).
        self.connects = 0

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
        """POST ``body`` to ``target`` at the endpoint ``url``; the complete response.

        Raises ``NotSent`` when no connection could be made, ``MaybeSent``
        when the request went out (in part or whole) and no complete answer
        came back within ``read_timeout`` (None: no bound of its own).
        """
        connection = await self._send(url, target, body, headers, connect_timeout)
        response: Response | None = None
        try:
            if read_timeout is None:  # a write: bounded by the caller's deadline alone
                response = await self._receive(connection)
            else:
                with trio.move_on_after(read_timeout):
                    response = await self._receive(connection)
                if response is None:
                    raise MaybeSent(f"no answer within {read_timeout:g} s")
        except BaseException:
            await connection.aclose()  # mid-exchange: its state is unknown
            raise
        await self.give_back(connection)
        return response

    @staticmethod
    async def _receive(connection: Connection) -> Response:
        head = await connection.receive_head()
        body = await connection.receive_data()
        if body is not None:  # in more than one piece (rare: etcd's replies are small)
            chunks = [body]
            while (body := await connection.receive_data()) is not None:
                chunks.append(body)
            body = b"".join(chunks)
        return Response(head.status, head.reason, body or b"")

    async def stream(
        self,
        url: str,
        target: str,
        body: bytes,
        headers: Headers = (),
        *,
        connect_timeout: float,
    ) -> StreamingResponse:
        """POST, then return once the response head is in; read the body from the result."""
        connection = await self._send(url, target, body, headers, connect_timeout)
        try:
            head = await connection.receive_head()
        except BaseException:
            await connection.aclose()
            raise
        return StreamingResponse(self, connection, head)

    async def _send(
        self, url: str, target: str, body: bytes, headers: Headers, connect_timeout: float
    ) -> Connection:
        # A call whose caller's deadline has passed (or that was cancelled)
        # must not go out: the plain wire sends without a checkpoint of its own.
        await trio.lowlevel.checkpoint_if_cancelled()
        connection = await self._checkout(url, connect_timeout)
        try:
            await connection.send_request(target, body, headers)
        except BaseException:
            await connection.aclose()
            raise
        return connection

    async def give_back(self, connection: Connection) -> None:
        """Keep a connection whose exchange ended cleanly, or close it."""
        idle = self._idle.setdefault(connection.origin, [])
        if self._closed or len(idle) >= self._max_idle or not connection.kept_alive():
            await connection.aclose()
        else:
            idle.append(connection)

    async def aclose(self) -> None:
        """Close the idle connections; connections in use close when their request ends."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await connection.aclose()

    async def _checkout(self, url: str, connect_timeout: float) -> Connection:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin.parse(url)
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.reusable():
                return connection
            await connection.aclose()  # closed by the server while idle: nothing was sent on it
        if self._closed:
            # A bug of the caller, not an etcd failure: NotSent would make the
            # gateway try every endpoint until its timeout.
            raise RuntimeError("the etcd client is closed")
        return await self._connect(origin, connect_timeout)

    async def _connect(self, origin: Origin, timeout: float) -> Connection:
        stream: trio.abc.Stream | None = None
        try:
            with trio.fail_after(timeout):
                stream = await trio.open_tcp_stream(origin.host, origin.port)
                if origin.tls:
                    context = self._ssl_context or ssl.create_default_context()
                    stream = trio.SSLStream(
                        stream, context, server_hostname=origin.host, https_compatible=True
                    )
                    await stream.do_handshake()
        except trio.TooSlowError:
            await _close_quietly(stream)
            raise NotSent(f"cannot connect (no connection within {timeout:g} s)") from None
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            await _close_quietly(stream)
            raise NotSent(f"cannot connect ({exc!r})") from None
        except BaseException:
            await _close_quietly(stream)
            raise
        self.connects += 1
        if isinstance(stream, trio.SocketStream):
            # Plain TCP: the socket itself, non-blocking (TCP_NODELAY stays set).
            sock = socket.socket(fileno=stream.socket.detach())
            sock.setblocking(False)
            return Connection(_PlainWire(sock), origin)
        return Connection(_StreamWire(stream), origin)


async def _close_quietly(stream: trio.abc.Stream | None) -> None:
    if stream is not None:
        await trio.aclose_forcefully(stream)


def _readable(stream: trio.abc.Stream) -> bool:
    """Whether the socket under ``stream`` has data or end of file waiting (without blocking)."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if not isinstance(stream, trio.SocketStream):
        return False
    poller = select.poll()
    poller.register(stream.socket.fileno(), select.POLLIN)
    return bool(poller.poll(0))
