"""HTTP/1.1 for the etcd gateway client: h11 on trio streams, a few kept connections per endpoint.

Why this and not a general HTTP client (httpx, which the gateway used first):

- **CPU per request.** The daemon makes one or two etcd calls per lock
  operation, so the client's own cost is a large part of lockd-on-etcd's
  throughput. httpx + httpcore + anyio cost ~1.1 ms of CPU per call on the
  bench box; h11 (the sans-I/O protocol library under httpcore) driven
  directly on a trio stream costs about a third of it
  (``bench/etcd_baseline.py``'s ``gateway`` and ``h11`` floors).
- **One write per request.** Head and body go out in one ``send_all``
  (one TLS record with TLS), so etcd wakes once per call; httpcore writes
  them separately.
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
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import trio

# A response head larger than this is not an etcd gateway talking.
MAX_HEAD_BYTES = 64 * 1024
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


class Connection:
    """One HTTP/1.1 connection: a trio stream and the h11 state machine that speaks on it."""

    def __init__(self, stream: trio.abc.Stream, origin: Origin) -> None:
        self.stream = stream
        self.origin = origin
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._closed_by_peer = False
        self._got_head = False  # of the response to the request last sent

    def reusable(self) -> bool:
        """Both sides finished the last exchange, the server did not ask to close, and
        the socket has nothing to read (an idle server that closed shows as readable)."""
        if self._h11.our_state is not h11.IDLE or self._h11.their_state is not h11.IDLE:
            return False
        return not _readable(self.stream)

    async def send_request(self, target: str, body: bytes, headers: Headers) -> None:
        """POST ``body`` in one write; ``MaybeSent`` if the write fails part-way."""
        all_headers = [
            ("Host", self.origin.host_header),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            *headers,
        ]
        try:
            data = self._h11.send(h11.Request(method="POST", target=target, headers=all_headers))
            data = (data or b"") + (self._h11.send(h11.Data(data=body)) or b"")
            data += self._h11.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError as exc:  # a header we built is invalid: nothing sent
            raise NotSent(f"cannot send the request: {exc}") from None
        self._got_head = False
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise MaybeSent(f"connection broke while sending ({exc!r})") from None

    async def receive_head(self) -> h11.Response:
        """The response's status line and headers (``MaybeSent`` on anything else)."""
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Response):
                self._got_head = True
                return event
            if not isinstance(event, h11.InformationalResponse):  # 100 Continue is skipped
                raise MaybeSent(f"unexpected {type(event).__name__} before the response")

    async def receive_data(self) -> bytes | None:
        """The next piece of the body; None at its end (the connection may then be kept)."""
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                if event.data:
                    return bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                if self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE:
                    self._h11.start_next_cycle()
                return None
            else:
                raise MaybeSent(f"unexpected {type(event).__name__} in the response body")

    async def _next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                if self._closed_by_peer and not self._got_head:
                    raise MaybeSent("the server closed the connection before answering") from None
                raise MaybeSent(f"malformed response ({exc})") from None
            if event is not h11.NEED_DATA:
                if isinstance(event, h11.ConnectionClosed):
                    raise MaybeSent("the server closed the connection before answering")
                return event
            try:
                data = await self.stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise MaybeSent(f"connection broke while receiving ({exc!r})") from None
            self._closed_by_peer = not data
            self._h11.receive_data(bytes(data))  # b"" marks the end of the stream

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class StreamingResponse:
    """A response read as it arrives (an etcd watch); owns its connection until closed."""

    def __init__(self, pool: Pool, connection: Connection, head: h11.Response) -> None:
        self._pool = pool
        self._connection: Connection | None = connection
        self.status = head.status_code
        self.reason = head.reason.decode("latin-1")
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
        try:
            with trio.move_on_after(read_timeout if read_timeout is not None else float("inf")):
                head = await connection.receive_head()
                chunks = []
                while (data := await connection.receive_data()) is not None:
                    chunks.append(data)
                response = Response(
                    head.status_code, head.reason.decode("latin-1"), b"".join(chunks)
                )
                await self.give_back(connection)
                return response
            raise MaybeSent(f"no answer within {read_timeout:g} s")
        except BaseException:
            await connection.aclose()  # mid-exchange: its state is unknown
            raise

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
        if self._closed or len(idle) >= self._max_idle or not connection.reusable():
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
        return Connection(stream, origin)


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
