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

import fcntl
import select
import socket
import sys
import termios
import time
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


async def send_all(sock: socket.socket, data: bytes) -> None:
    """Write all of ``data``, waiting until ``sock`` is writable whenever its buffer is full."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        view = view[sent:]


def recv_ready(sock: socket.socket) -> bytes | None:
    """What ``sock`` has to read right now without waiting (b"" at EOF), or None."""
    try:
        return sock.recv(RECV_BYTES)
    except BlockingIOError:
        return None


def unread_bytes(sock: socket.socket) -> int:
    """Bytes the peer sent that ``sock`` has not read yet (0 once closed)."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int.from_bytes(raw, sys.byteorder)


class PollGate:
    """Whether polling pays just now: shared by every connection of one server.

    Polling spares a wake-up when one client sends its next request at once
    and the daemon would otherwise sleep for it. With several clients busy
    at once (B3: 16 processes on 2 CPUs) that never comes to pass: another
    connection's request soon ends the poll (:meth:`BusyPoll.next_bytes`
    stops for it), and until then the poll took a CPU the clients needed
    to make their next requests, even when the poll ended in a hit. So
    the gate closes for every connection for ``hold_off_ns`` when another
    connection cut a poll short, or when the last :data:`BUSY_CONNECTIONS`
    chances to poll came from as many different connections within
    ``window_ns``; polls resume after a quiet spell. One client streaming
    alone (B1) asks from one connection; hand-offs (B2) alternate the
    releaser's and the next holder's connections and cut no poll short
    (the other waiters are blocked on their acquires): both keep polling.
    """

    __slots__ = ("_recent", "closed_until", "hold_off_ns", "window_ns")

    #: how long polling stays off once several clients were seen busy.
    HOLD_OFF_NS = 10_000_000
    #: this many different connections asking in a row ...
    BUSY_CONNECTIONS = 4
    #: ... within this long: several clients are busy at once.
    WINDOW_NS = 5_000_000

    def __init__(self, hold_off_ns: int = HOLD_OFF_NS, window_ns: int = WINDOW_NS) -> None:
        self.hold_off_ns = hold_off_ns
        self.window_ns = window_ns
        #: no connection polls before this (``now_ns`` time).
        self.closed_until = 0
        #: (fd, time) of the last chances to poll, oldest first.
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.BUSY_CONNECTIONS)

    def admit(self, fd: int, now: int) -> bool:
        """Whether connection ``fd`` may poll now; notes its chance."""
        if now < self.closed_until:
            return False
        recent = self._recent
        recent.append((fd, now))
        if (
            len(recent) == self.BUSY_CONNECTIONS
            and now - recent[0][1] <= self.window_ns
            and len({seen for seen, _ in recent}) == self.BUSY_CONNECTIONS
        ):
            self.closed_until = now + self.hold_off_ns
            return False
        return True


class BusyPoll:
    """Wait a little for a connection's next request by polling its socket, adaptively.

    Why: a client that sends its next request as soon as it has a reply
    (a loop of try/release, a script taking several keys) makes the round
    trip strictly serial, and on a VM every side that sleeps between
    requests pays for a cross-CPU wake-up: the sender's ``send`` runs the
    kernel's wake-up (an inter-processor interrupt, a VM exit here) and the
    sleeper comes back through the idle loop. perf put ~40 % of the
    daemon's CPU under B1 there (bench/README.md, "Busy-polling"). Polling
    with non-blocking ``recv`` for up to ``budget_ns`` instead of parking
    in epoll means the client's ``send`` finds nobody to wake, and the
    daemon's CPU per request goes *down* although it polls.

    Polling costs a CPU the whole budget when nothing comes, so it adapts:
    a miss makes the connection skip its next 1, 3, 7, ... 63 chances
    (doubling per miss in a row); a hit starts again from nothing, and
    only bytes that end a request line count as one (blank lines do not). A
    connection whose client pauses between requests (``lockd run``
    renewing, a cron job) is polled rarely; one that streams is polled
    every time. It stops at once, without counting a miss, when another
    connection has a request waiting or a new one comes in (``others``, the
    server's epoll of every connection and the listening socket): those are
    served through the scheduler as before, and with a ``gate`` no
    connection polls for a while (:class:`PollGate`). Nothing else runs
    while it polls (the expiry timer, a woken waiter's task), hence the
    small budget.
    """

    __slots__ = ("budget_ns", "gate", "misses", "skip")

    #: consecutive misses that count; the skip is at most ``2**MAX_MISSES - 1``.
    MAX_MISSES = 6

    def __init__(self, budget_ns: int, gate: PollGate | None = None) -> None:
        self.budget_ns = budget_ns
        self.gate = gate
        self.misses = 0
        #: chances to let pass before polling again (after misses).
        self.skip = 0

    def next_bytes(
        self,
        sock: socket.socket,
        others: select.epoll | None = None,
        now_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> bytes | None:
        """What ``sock`` sends within the budget (b"" at EOF), or None."""
        if self.budget_ns <= 0:
            return None
        fd = sock.fileno()
        gate = self.gate
        if gate is not None:
            start = now_ns()
            if not gate.admit(fd, start):
                return None
        if self.skip:
            self.skip -= 1
            return None
        if gate is None:
            start = now_ns()
        deadline = start + self.budget_ns
        while True:
            data = recv_ready(sock)
            if data is not None:
                if data and (b"\n" not in data or data.isspace()):
                    # No whole request: a client trickling bytes, or sending
                    # blank lines (which are no requests), must not keep the
                    # daemon polling for it.
                    self._missed()
                else:
                    self.misses = 0
                return data
            if others is not None and any(ready != fd for ready, _ in others.poll(0, 2)):
                if gate is not None:
                    gate.closed_until = start + gate.hold_off_ns
                return None
            if now_ns() >= deadline:
                break
        self._missed()
        return None

    def _missed(self) -> None:
        self.misses = min(self.misses + 1, self.MAX_MISSES)
        self.skip = (1 << self.misses) - 1


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
