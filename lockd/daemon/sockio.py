"""Non-blocking stdlib sockets driven by trio's readiness waits.

Why not ``trio.SocketStream``: every trio socket call ends in a scheduler
pass, even when the kernel could answer at once, and lockd's round trip is
short enough that those passes dominated it (profiled: ~3 passes per
request). Here a reply that fits the socket buffer -- nearly all of them -- is
written without yielding, and a read waits for readiness once and then
reads. Order of replies on a connection is kept by :class:`ReplyWriter`,
whose queue only the slow path (a partially written reply) uses.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

RECV_BYTES = 65536


async def accept(listen: socket.socket) -> socket.socket:
    """Accept one connection; the returned socket is non-blocking."""
    while True:
        await trio.lowlevel.wait_readable(listen)
        try:
            sock, _ = listen.accept()
        except BlockingIOError:
            continue
        sock.setblocking(False)
        return sock


async def recv_some(sock: socket.socket) -> bytes:
    """Wait until ``sock`` is readable, then read what is there (b"" at EOF)."""
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            return sock.recv(RECV_BYTES)
        except BlockingIOError:
            continue


def recv_ready(sock: socket.socket) -> bytes | None:
    """What ``sock`` has to read right now without waiting (b"" at EOF), or None."""
    try:
        return sock.recv(RECV_BYTES)
    except BlockingIOError:
        return None


class ReplyWriter:
    """The replies of one connection, written in order without yielding when they fit.

    :meth:`write` is synchronous, so the server can send a whole group
    commit's replies from one place (and a waiter's grant before the
    releaser's answer). A reply the socket buffer cannot take goes into a
    queue that one task (started through ``spawn``) drains as the peer
    reads; later replies queue behind it, so bytes never interleave. A
    reply carries an optional token (the grant it hands out): when the peer
    is gone before it was written, ``undelivered`` gets the token.
    """

    __slots__ = ("_drained", "_queue", "_spawn", "_undelivered", "closed", "sock")

    def __init__(
        self,
        sock: socket.socket,
        spawn: Callable[[Callable[[], Awaitable[None]]], None],
        undelivered: Callable[[Any], None],
    ) -> None:
        self.sock = sock
        self._spawn = spawn
        self._undelivered = undelivered
        #: replies not yet (fully) written, oldest first; None when none waits.
        self._queue: deque[tuple[memoryview, Any]] | None = None
        self._drained: trio.Event | None = None
        #: the peer is gone (or the connection closing): nothing more is written.
        self.closed = False

    @property
    def backlogged(self) -> bool:
        return self._queue is not None

    @property
    def queued(self) -> int:
        """Replies waiting for the peer to read (the first maybe in part)."""
        return len(self._queue) if self._queue is not None else 0

    def write(self, data: bytes, token: Any = None) -> bool:
        """Write ``data`` now, or queue it; False when the peer is gone (``token`` not given)."""
        if self.closed:
            return False
        if self._queue is not None:
            self._queue.append((memoryview(data), token))
            return True
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.closed = True
            return False
        if sent < len(data):
            self._queue = deque([(memoryview(data)[sent:], token)])
            try:
                self._spawn(self._drain)
            except RuntimeError:  # the connection's nursery is closed: it is ending
                self._queue = None
                self.closed = True
                return False
        return True

    async def wait_drained(self) -> None:
        """Wait until every queued reply is written (or the peer is gone)."""
        if self._queue is None:
            return
        if self._drained is None:
            self._drained = trio.Event()
        await self._drained.wait()

    async def _drain(self) -> None:
        queue = self._queue
        assert queue is not None
        try:
            while queue:
                view, token = queue[0]
                await trio.lowlevel.wait_writable(self.sock)
                try:
                    sent = self.sock.send(view)
                except BlockingIOError:
                    continue
                if sent < len(view):
                    queue[0] = (view[sent:], token)
                else:
                    queue.popleft()
        except (trio.ClosedResourceError, OSError):
            self.closed = True
        finally:
            if queue:  # the peer is gone, or the connection is closing
                self.closed = True
            self._queue = None
            if self._drained is not None:
                self._drained.set()
                self._drained = None
            for _, token in queue:
                if token is not None:
                    self._undelivered(token)


def close(sock: socket.socket) -> None:
    """Close a socket other tasks may be waiting on (they get ClosedResourceError)."""
    trio.lowlevel.notify_closing(sock)
    sock.close()
