"""The trio edge: listener, connections, waiting, the expiry timer.

The server only waits and talks; :class:`~lockd.daemon.service.LockService`
decides. It reads requests, hands each to the service (``answer`` for every
op but acquire, ``acquire`` and then the step it returns for an acquire),
does the waiting a step asks for, and writes the reply. It never touches the
engine or the clock: the timer asks the service for the next deadline, the
``stats`` op and systemd's STATUS= line ask it for the gauges.

One task reads each connection and handles every request that can be
answered at once inline, in order; only an ``acquire`` that has to wait
(:class:`~lockd.daemon.service.WaitForRoom` or
:class:`~lockd.daemon.engine.Parked`) gets a task of its own, so pipelined
requests behind it are served while it waits. After answering, a
connection whose next request is already there reads it at once, without
a scheduler pass (:meth:`LockServer._read_now`, at most
:data:`INLINE_READS` in a row): a client that sends as soon as it has its
reply usually has, since on a busy box it preempts the daemon inside the
``send`` that woke it. On an idle box the client runs on the other CPU, and
the connection polls its socket a moment for the request before parking
(``busy_poll_us``, adaptive: :class:`~lockd.daemon.sockio.BusyPoll`), which
spares both sides a cross-CPU wake-up per request.

Group commit: the replies of requests handled inline wait in an outbox.
After a connection's requests of one read, the batch is committed -- one
SQLite transaction for the requests of every connection served in that
loop pass (:meth:`LockServer._batch_point`) -- and then every reply is
written (:meth:`LockServer._batch_ended`); when the commit fails, each
request of the batch is answered STORAGE_UNAVAILABLE. Replies are written
by a per-connection :class:`~lockd.daemon.sockio.ReplyWriter` and may come
out of order; they carry the request id. A reply that hands out a grant
carries it, and the grant is released when the reply cannot be written.

Parked acquires wait on a :class:`trio.Event` that the service's
``on_resolved`` sets when the engine resolves the waiter (grant, timeout) --
after the commit, so a woken waiter's grant is already durable. A grant is
written right there, inside the commit, before the replies of its batch
(the releaser's among them). A single
timer task sleeps until the engine's earliest deadline; every request moves
that deadline earlier if needed.

Adding an op: parse it in ``protocol``, decide it in ``LockService.answer``;
the server needs a change only if the op has to wait or concerns the
connection itself (its parked acquires, its closing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import select
import signal
import socket as stdsocket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import trio

from lockd.daemon import fdlimit, sockio, systemd, unidentified
from lockd.daemon.backends import RemoteHold
from lockd.daemon.engine import Lease, Parked, Waiter
from lockd.daemon.events import LossEvent, PendingBreak
from lockd.daemon.memory import TrimAfterDrop
from lockd.daemon.protocol import (
    Acquire,
    Cancel,
    Hello,
    LineSplitter,
    ProtocolError,
    Request,
    RequestId,
    Stopped,
    encode_error,
    encode_event,
    encode_protocol_error,
    encode_result,
    parse_request,
)
from lockd.daemon.remote import RemoteReply
from lockd.daemon.service import (
    AcquireStep,
    LockService,
    Reply,
    WaitForRoom,
    shutting_down,
    storage_unavailable,
)
from lockd.daemon.store import StorageUnavailable
from lockd.identity import (
    Caller,
    IdentityConfig,
    IdentityUnavailable,
    identify,
    peer_credentials,
    process_name,
    process_start,
)
from lockd.logfmt import LogThrottle, kv

log = logging.getLogger("lockd.daemon.server")

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: seconds between STATUS= updates to systemd when the load changed.
STATUS_INTERVAL = 5.0
#: longest the expiry timer sleeps before looking at the boot clock again.
TIMER_MAX_SLEEP = 1.0


@dataclass(eq=False)
class Connection:
    id: int
    sock: stdsocket.socket
    caller: Caller
    #: writes the replies in order (set once the connection's nursery is open).
    writer: sockio.ReplyWriter | None = None
    #: requests of this connection waiting in tasks of their own.
    waiting: int = 0
    #: those waits by request id, for ``cancel`` (a client reusing an id gets a list).
    waits: dict[RequestId, list[_Wait]] = field(default_factory=dict)
    #: set while a blocking acquire a remote backend decides is not parked yet:
    #: the next line waits for it (see ``_read_lines``; the other requests it
    #: decides are awaited by the connection's task itself).
    remote_busy: trio.Event | None = None
    #: polls for the next request a moment before parking (see ``_read_now``).
    busy: sockio.BusyPoll = field(default_factory=lambda: sockio.BusyPoll(0))
    #: asked for lease-loss events (``hello {"events": true}``, docs/contract.md §12).
    events: bool = False


@dataclass(eq=False, slots=True)
class _Outgoing:
    """A reply held until the group commit of its batch is done."""

    conn: Connection
    request_id: RequestId | None
    data: bytes
    #: the lease the reply hands out (released when it cannot be written).
    grant: Lease | None
    #: the reply acknowledges effects of the batch: when its commit fails,
    #: the request is answered STORAGE_UNAVAILABLE instead.
    needs_commit: bool


@dataclass(eq=False)
class _Wait:
    """One acquire waiting in a task of its own, as ``cancel`` sees it."""

    #: None for a request a remote backend decides (``_answer_remote``).
    step: AcquireStep | None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: set by ``cancel``: answer CANCELLED, not the step's outcome.
    cancelled: bool = False
    #: the step's reply left its commit to the group commit (see LockService.deferred).
    deferred: bool = False
    #: its grant was sent when the engine handed it over (see LockServer._wake).
    answered: bool = False


#: Requests a connection may read without a scheduler pass in between.
INLINE_READS = 8
#: Refused connections kept open for a moment at once (more are closed at once).
MAX_LINGERING = 64
#: What :meth:`LockServer._admit` returns for a connection no uid count holds
#: (an owner's, or one whose peer credentials could not be read).
NOT_COUNTED = -1


@dataclass
class Limits:
    """What one connection may take of the server (the pending-acquire limit
    is a decision of the service: ``LockService.max_pending_per_connection``)."""

    max_connections: int = 1024
    max_line_bytes: int = 65536
    #: connections one uid may hold at once (owners are not counted).
    max_connections_per_uid: int = 64
    #: seconds a connection may sit on an incomplete request line.
    partial_line_timeout: float = 10.0
    #: incomplete request lines held for all connections together, in bytes.
    max_buffered_bytes: int = 16 * 1024 * 1024
    #: nanoseconds a connection's task polls for its next request before it
    #: parks (0: never; see :class:`~lockd.daemon.sockio.BusyPoll`).
    busy_poll_ns: int = 0

    @property
    def owner_reserve(self) -> int:
        """Slots of ``max_connections`` only owners may take: root always gets in."""
        return min(16, self.max_connections // 4)


class LockServer:
    def __init__(
        self,
        service: LockService,
        identity: IdentityConfig,
        limits: Limits,
        *,
        reload_rules: Callable[[], object] | None = None,
        resolve: Callable[[stdsocket.socket], Caller] | None = None,
    ) -> None:
        self.service = service
        self.identity = identity
        self.limits = limits
        self.reload_rules = reload_rules
        self._resolve = resolve or self._resolve_peer
        self._conn_ids = 0
        self.connections: dict[int, Connection] = {}
        self._open_connections = 0
        #: open connections per uid (owners are not counted).
        self._per_uid: dict[int, int] = {}
        #: bytes of incomplete request lines held, all connections together.
        self._buffered = 0
        #: refused connections waiting a moment before they are closed.
        self._lingering = 0
        self._events: dict[int, trio.Event] = {}
        #: parked waiters by id: whom to send the grant when the engine hands it over.
        self._parked: dict[int, tuple[Connection, Acquire, _Wait]] = {}
        self._timer_scope: trio.CancelScope | None = None
        #: the engine deadline (boot ms) the timer scope was last pointed at.
        self._timer_target: int | None = None
        self.shutting_down = False
        self._started_at = time.monotonic()
        self.service.on_resolved = self._wake
        self.service.server_gauges = self.gauges
        # Group commit (see _batch_point): replies wait in the outbox until
        # the commit of their batch; the service calls _batch_ended after it.
        self.service.group_commit = True
        self.service.on_batch_end = self._batch_ended
        self.service.on_lost = self._tell_lost
        self._outbox: list[_Outgoing] = []
        #: every connection socket, level-triggered: "is another request
        #: waiting to be read?" in one non-blocking epoll_wait.
        self._readable = select.epoll()
        #: busy-polling off for every connection while several are busy (sockio.PollGate).
        self._poll_gate = sockio.PollGate()
        self._flush_wanted = trio.Event()
        self._shutdown_event = trio.Event()
        #: breaks waiting for their told holders to stop (woken at shutdown).
        self._breaks: set[PendingBreak] = set()
        self._warnings = fdlimit.ThrottledWarnings(log)
        #: internal errors are logged once per principal per interval, with counts.
        self._error_log = LogThrottle()
        self._memory = TrimAfterDrop("connections", 8)

    # ------------------------------------------------------------ lifecycle

    def _resolve_peer(self, sock: stdsocket.socket) -> Caller:
        caller = identify(sock, self.identity)
        # The process name is read here, once per connection, so that status
        # can show who holds a key (docs/contract.md §3) without a /proc read per grant.
        return dataclasses.replace(
            caller, process=process_name(caller.pid), start=process_start(caller.pid)
        )

    async def serve(
        self,
        listen_sock: stdsocket.socket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until :meth:`shutdown` (or SIGTERM/SIGINT); then close cleanly."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._timer)
            nursery.start_soon(self._flusher)
            await nursery.start(self._signals)
            watchdog = systemd.watchdog_interval()
            if watchdog or os.environ.get("NOTIFY_SOCKET"):
                nursery.start_soon(self._report_to_systemd, watchdog)
            async with trio.open_nursery() as conns:
                accepting = trio.CancelScope()
                conns.start_soon(self._accept_loop, listen_sock, conns, accepting)
                # A connection coming in ends a busy poll (see _read_now).
                with contextlib.suppress(OSError):
                    self._readable.register(listen_sock, select.EPOLLIN)
                systemd.ready(self._status_line())
                task_status.started()
                await self._shutdown_event.wait()
                systemd.stopping()
                accepting.cancel()
                with contextlib.suppress(OSError):
                    self._readable.unregister(listen_sock)
                await self._drain_waiters()
                conns.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
        self._readable.close()
        log.info(kv(event="stopped", held=self.service.gauges().get("held")))

    def shutdown(self) -> None:
        """Begin a clean stop: parked acquires get SHUTTING_DOWN, leases stay."""
        if not self.shutting_down:
            log.info(kv(event="stopping", waiters=self.service.gauges()["waiters"]))
            self.shutting_down = True
            self._shutdown_event.set()
            for pending in list(self._breaks):
                pending.wake()

    async def _drain_waiters(self) -> None:
        """Answer every parked acquire with SHUTTING_DOWN before closing."""
        for waiter_id, event in list(self._events.items()):
            del waiter_id
            event.set()
        for wait in self._remote_waits():
            wait.scope.cancel()
        with trio.move_on_after(2):
            while self._events or self._remote_waits():
                await trio.sleep(0.01)

    def _remote_waits(self) -> list[_Wait]:
        """Blocking acquires a remote backend is deciding now."""
        return [
            wait
            for conn in self.connections.values()
            for waits in conn.waits.values()
            for wait in waits
            if wait.step is None
        ]

    async def _signals(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.open_signal_receiver(*HANDLED_SIGNALS) as signals:
            # daemon.build() blocked these signals before the socket could
            # answer; one that came early is delivered to us now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS)
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self._reload()
                else:
                    self.shutdown()

    def _reload(self) -> None:
        if self.reload_rules is None:
            return
        systemd.reloading()
        try:
            self.reload_rules()
        finally:
            systemd.ready(self._status_line())

    async def _report_to_systemd(self, watchdog: float | None) -> None:
        """WATCHDOG=1 pings (when enabled) and a fresh STATUS= line.

        Pinged from the event loop itself: a blocked loop stops the pings and
        systemd restarts the daemon. Without a watchdog, STATUS= still follows
        the load every few seconds for ``systemctl status``.
        """
        interval = min(watchdog, STATUS_INTERVAL) if watchdog else STATUS_INTERVAL
        last_status = ""
        while True:
            if watchdog:
                systemd.watchdog_ping()
            line = self._status_line()
            if line != last_status:
                systemd.status(line)
                last_status = line
            await trio.sleep(interval)

    def _status_line(self) -> str:
        gauges = self.service.gauges()
        held, waiters = gauges.get("held"), gauges["waiters"]
        return (
            # A remote backend knows no count of every host's holds.
            (f"{held} lock{'s' if held != 1 else ''} held, " if held is not None else "")
            + f"{waiters} waiter{'s' if waiters != 1 else ''}, "
            f"{len(self.connections)} connection{'s' if len(self.connections) != 1 else ''}"
        )

    def gauges(self) -> dict[str, Any]:
        """The server's own gauges; the service adds the engine's for ``stats``."""
        return {
            "uptimeMs": int((time.monotonic() - self._started_at) * 1000),
            "connections": len(self.connections),
        }

    # ---------------------------------------------------------------- timer

    def _wake(self, waiter: Waiter) -> None:
        """A parked waiter was resolved, and that is committed: answer a grant now.

        Runs inside the commit, before the replies of its batch go out, so
        the waiter gets the key before the releaser hears that it let go
        (strict FIFO as the clients see it) and without waiting for its
        task's turn. The task still runs to leave the queue's bookkeeping.
        """
        event = self._events.get(waiter.id)
        if event is None:
            return
        parked = self._parked.pop(waiter.id, None)
        if parked is not None and waiter.lease is not None:
            conn, req, wait = parked
            wait.answered = True
            reply = self.service.parked_reply(req, waiter)
            self._send(conn, encode_result(req.id, reply.result), reply.grant)
        event.set()

    def _reschedule(self) -> None:
        """Make sure the timer fires no later than the engine's earliest deadline.

        Runs after every request, so it only ever moves the timer *earlier*:
        when the earliest deadline moved later (a release, a renew) the timer
        fires early once, finds nothing due and re-arms. In steady traffic
        that makes this a heap peek and a comparison; moving trio's deadline
        on every grant and release showed up as ~7 us per request.
        """
        scope = self._timer_scope
        if scope is None:
            return
        deadline = self.service.next_deadline()
        if deadline is None:
            return
        target = self._timer_target
        if target is not None and target <= deadline:
            return
        self._timer_target = deadline
        delay = self.service.ms_until(deadline) / 1000
        # trio's clock stops during suspend, CLOCK_BOOTTIME does not: never
        # sleep long, so hand-offs after a resume are late by a second at most.
        scope.deadline = trio.current_time() + min(delay, TIMER_MAX_SLEEP)

    async def _timer(self) -> None:
        while True:
            with trio.CancelScope() as scope:
                self._timer_scope = scope
                self._timer_target = None
                scope.deadline = math.inf
                self._reschedule()
                await trio.sleep_forever()
            self._timer_scope = None
            try:
                if not self.service.tick():
                    # The disk is full or failing: the batch stays pending in
                    # the engine; retry it shortly (any request retries too).
                    await trio.sleep(TIMER_MAX_SLEEP)
            except Exception:
                self.service.stats.count("internalErrors")
                log.exception(kv(event="internal_error", op="tick"))
                await trio.sleep(TIMER_MAX_SLEEP)

    # ---------------------------------------------------------- connections

    async def _accept_loop(
        self, listen_sock: stdsocket.socket, nursery: trio.Nursery, scope: trio.CancelScope
    ) -> None:
        spare_fd = fdlimit.SpareFd()
        try:
            with scope:
                await self._accept_forever(listen_sock, nursery, spare_fd)
        finally:
            spare_fd.close()

    async def _accept_forever(
        self, listen_sock: stdsocket.socket, nursery: trio.Nursery, spare_fd: fdlimit.SpareFd
    ) -> None:
        listen_sock.setblocking(False)
        while True:
            try:
                sock = await sockio.accept(listen_sock)
            except OSError as exc:
                # Out of descriptors: refuse the waiting client at once rather
                # than leave it in the backlog (see fdlimit.SpareFd).
                if exc.errno in fdlimit.OUT_OF_FDS and spare_fd.refuse_one(listen_sock):
                    self.service.stats.count("connectionsRefused")
                    self._warnings.warn("connection_refused", "no_file_descriptors")
                    continue
                if exc.errno in (*fdlimit.OUT_OF_FDS, errno.ENOBUFS, errno.ENOMEM):
                    self._warnings.warn("accept_failed", errno.errorcode[exc.errno])
                    await trio.sleep(0.1)
                    continue
                if self.shutting_down or exc.errno == errno.EBADF:
                    return
                raise
            # Counted here, not when the connection's task first runs, so a
            # burst of connects cannot overshoot the limit.
            uid = self._admit(sock)
            if uid is None:
                if self._lingering < MAX_LINGERING:
                    self._lingering += 1
                    nursery.start_soon(self._linger_and_close, sock)
                else:
                    sock.close()
                continue
            self._open_connections += 1
            nursery.start_soon(self._serve_connection, sock, uid)

    async def _linger_and_close(self, sock: stdsocket.socket) -> None:
        """Close a refused connection once the client has sent (or after a second).

        Closed at once, the client's first request would fail with EPIPE
        before it could read the line that says why it was refused.
        """
        try:
            with trio.move_on_after(1.0):
                with contextlib.suppress(OSError):
                    await sockio.recv_some(sock)
        finally:
            self._lingering -= 1
            sock.close()

    def _admit(self, sock: stdsocket.socket) -> int | None:
        """Count a new connection against the limits; its uid, or None when refused.

        One uid may hold ``max_connections_per_uid`` connections, and the last
        ``owner_reserve`` slots are for owners (root and the daemon's user),
        so one member holding idle connections never shuts out everyone
        else, root included. A refused client gets one line saying why
        (``RATE_LIMITED``, ``id`` null) before the connection closes.
        """
        limits = self.limits
        try:
            uid: int | None = peer_credentials(sock).uid
        except OSError:
            uid = None  # the identity step will refuse it
        owner = uid is not None and uid in (0, self.identity.daemon_uid)
        ceiling = limits.max_connections if owner else limits.max_connections - limits.owner_reserve
        if self._open_connections >= ceiling:
            why, limit = "max_connections", limits.max_connections
        elif uid is not None and not owner:
            if self._per_uid.get(uid, 0) < limits.max_connections_per_uid:
                self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
                return uid
            why, limit = "max_connections_per_uid", limits.max_connections_per_uid
        else:
            return NOT_COUNTED
        self.service.stats.count("connectionsRefused")
        self._warnings.warn("connection_refused", why, uid=uid, limit=limit)
        who = "the daemon" if why == "max_connections" else f"uid {uid}"
        refusal = encode_error(
            None,
            "RATE_LIMITED",
            f"too many connections to {who} ({why} = {limit}); close some and retry",
            {"limit": limit, "reason": why},
        )
        with contextlib.suppress(OSError):
            sock.send(refusal)
            sock.shutdown(stdsocket.SHUT_WR)
        return None

    def _release_uid(self, uid: int) -> None:
        if uid == NOT_COUNTED:
            return
        count = self._per_uid.get(uid, 0) - 1
        if count > 0:
            self._per_uid[uid] = count
        else:
            self._per_uid.pop(uid, None)

    async def _serve_connection(self, sock: stdsocket.socket, uid: int) -> None:
        try:
            await self._serve_counted(sock)
        finally:
            self._release_uid(uid)

    async def _serve_counted(self, sock: stdsocket.socket) -> None:
        #: bytes read before the caller was identified, not yet served.
        early = b""
        try:
            caller = self._resolve(sock)
        except IdentityUnavailable as exc:
            # Never guess who it is (an admin would become a member): its
            # requests are answered BACKEND_UNAVAILABLE until a lookup works.
            self.service.stats.count("connectionsRefused")
            reason = "no_file_descriptors" if exc.errno in fdlimit.OUT_OF_FDS else "no_identity"
            self._warnings.warn("connection_refused", reason, error=exc.strerror or exc)
            identified = await unidentified.serve_until_identified(
                sock,
                self._resolve,
                exc,
                max_line_bytes=self.limits.max_line_bytes,
                partial_line_timeout=self.limits.partial_line_timeout,
            )
            if identified is None:
                self._open_connections -= 1
                sockio.close(sock)
                return
            caller, early = identified
        except OSError as exc:
            self._open_connections -= 1
            log.warning(kv(event="peer_unknown", error=exc))
            sock.close()
            return
        self._conn_ids += 1
        conn = Connection(
            self._conn_ids,
            sock,
            caller,
            busy=sockio.BusyPoll(self.limits.busy_poll_ns, self._poll_gate),
        )
        self.connections[conn.id] = conn
        self._memory.observe(len(self.connections))
        self.service.stats.count("connectionsAccepted")
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                kv(event="connected", conn=conn.id, principal=caller.principal, pid=caller.pid)
            )
        # Only a hint for _batch_point: a connection it cannot watch is served all the same.
        with contextlib.suppress(OSError):
            self._readable.register(sock, select.EPOLLIN)
        try:
            async with trio.open_nursery() as nursery:
                conn.writer = writer = sockio.ReplyWriter(
                    sock, nursery.start_soon, self._release_undelivered
                )
                await self._read_loop(conn, nursery, early)
                # Answer what was read before the end (the peer may only
                # have shut down its sending side).
                self._flush()
                await writer.wait_drained()
                nursery.cancel_scope.cancel()
        finally:
            # Ending without a drain (cancelled): its replies are dropped and
            # their grants released; the other connections' go out.
            if conn.writer is not None:
                conn.writer.closed = True
            self._flush()
            with contextlib.suppress(OSError):
                self._readable.unregister(sock)
            self._open_connections -= 1
            del self.connections[conn.id]
            self._memory.observe(len(self.connections))  # a flood gone: memory back
            try:
                # A stop is not the client leaving: its releaseOnClose leases
                # stay committed as plain TTL leases, as across a crash.
                self.service.connection_closed(conn.id, release_bound=not self.shutting_down)
            except Exception:
                self.service.stats.count("internalErrors")
                log.exception(kv(event="internal_error", op="connection_closed"))
            self._reschedule()
            sockio.close(sock)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(kv(event="disconnected", conn=conn.id))

    async def _read_loop(self, conn: Connection, nursery: trio.Nursery, early: bytes = b"") -> None:
        splitter = LineSplitter(self.limits.max_line_bytes)
        try:
            await self._read_lines(conn, nursery, splitter, early)
        finally:
            self._buffered -= splitter.pending

    async def _read_lines(
        self, conn: Connection, nursery: trio.Nursery, splitter: LineSplitter, early: bytes = b""
    ) -> None:
        """Read and answer lines; a partial line is bounded in time and in total bytes."""
        limits = self.limits
        inline = 0
        #: trio time the first byte of the incomplete line came.
        line_started = 0.0
        while True:
            data: bytes | None = None
            try:
                if early:  # read before the caller could be identified
                    data, early = early, b""
                elif splitter.pending:
                    # Half a request: the rest must come soon after its first
                    # byte, or the bytes (and the slot) go back; a byte now
                    # and then does not extend it. Idle between lines is fine.
                    with trio.move_on_at(line_started + limits.partial_line_timeout):
                        data = await sockio.recv_some(conn.sock)
                    if data is None:
                        await self._close_stalled(conn, "partial_line_timeout")
                        return
                else:
                    data = self._read_now(conn) if inline < INLINE_READS else None
                    if data is None:
                        inline = 0
                        data = await sockio.recv_some(conn.sock)
                    else:
                        inline += 1
            except (trio.ClosedResourceError, OSError):
                return
            if not data:
                return
            before = splitter.pending
            lines = splitter.feed(data)
            self._buffered += splitter.pending - before
            if splitter.pending and (lines or not before):
                line_started = trio.current_time()  # a new incomplete line began
            for line in lines:
                if not line or line.isspace():
                    continue  # a blank line is no request: it costs its read, no reply
                if conn.remote_busy is not None:
                    # One request in flight to a remote backend per connection:
                    # a client pipelining thousands of lines must not make the
                    # daemon send thousands of etcd requests at once, and its
                    # requests take effect in the order it sent them.
                    self._batch_point(conn)
                    await conn.remote_busy.wait()
                remote = self._handle_line(conn, line, nursery)
                if remote is not None:
                    # Answered before the next line is read (the replies
                    # queued before it go out first).
                    self._batch_point(conn)
                    await remote
                elif self.service.gate.costly_rule_ran():
                    # A rule took milliseconds: the other connections go
                    # before this one's next line (issue 21).
                    self._batch_point(conn)
                    await trio.lowlevel.checkpoint()
            self._batch_point(conn)
            writer = conn.writer
            if writer is not None and writer.backlogged:
                # The peer does not read its replies: read none of its
                # requests until it does, so what it costs us stays bounded.
                await writer.wait_drained()
            pause_ms = self.service.gate.rule_cpu_pause_ms(conn.caller)
            if pause_ms:
                # Its rules used its share of the daemon: it waits behind
                # the others (its connections are not read) until it is back.
                await trio.sleep(pause_ms / 1000)
            if self._buffered > limits.max_buffered_bytes and splitter.pending:
                await self._close_stalled(conn, "max_buffered_bytes")
                return
            if splitter.too_long:
                self.service.stats.count("invalidRequests")
                limit = self.limits.max_line_bytes
                self._flush()  # the lines before it are answered first
                self._send(
                    conn,
                    encode_error(
                        None,
                        "INVALID_REQUEST",
                        f"request line longer than {limit} bytes; closing the connection",
                        {"limit": limit, "field": None},
                    ),
                )
                return

    async def _close_stalled(self, conn: Connection, why: str) -> None:
        """Say why, then end a connection whose incomplete line costs too much."""
        self.service.stats.count("connectionsStalled")
        self._warnings.warn("connection_closed", why, uid=conn.caller.uid)
        limits = self.limits
        if why == "partial_line_timeout":
            message = (
                f"request line incomplete for {limits.partial_line_timeout:g} s; "
                "closing the connection"
            )
            details: dict[str, Any] = {"field": None, "reason": why}
        else:
            message = "too many bytes of incomplete request lines held; closing the connection"
            details = {"field": None, "reason": why, "limit": limits.max_buffered_bytes}
        self._flush()
        self._send(conn, encode_error(None, "INVALID_REQUEST", message, details))
        assert conn.writer is not None
        await conn.writer.wait_drained()

    def _send(self, conn: Connection, data: bytes, grant: Lease | RemoteHold | None = None) -> None:
        """Write one reply now (or queue it behind a slow one); release an undeliverable grant."""
        writer = conn.writer
        if (writer is None or not writer.write(data, grant)) and grant is not None:
            self._release_undelivered(grant)
        elif conn.events and grant is not None:
            if isinstance(grant, Lease):
                self.service.watch_grant(conn.id, grant)
            else:  # a remote backend's grant: told of what this daemon sees (see remote)
                self.service.losses.watch(conn.id, grant)

    def _release_undelivered(self, grant: Lease | RemoteHold) -> None:
        try:
            self.service.backend.release_undelivered(grant)
        except Exception:
            # A bug: logged; the rest of a batch's replies must still go out.
            self.service.stats.count("internalErrors")
            log.exception(kv(event="internal_error", op="release_undelivered"))
        self._reschedule()

    # ---------------------------------------------------------- group commit

    def _queue(
        self,
        conn: Connection,
        request_id: RequestId | None,
        data: bytes,
        grant: Lease | None = None,
        *,
        needs_commit: bool = False,
    ) -> None:
        self._outbox.append(_Outgoing(conn, request_id, data, grant, needs_commit))

    def _read_now(self, conn: Connection) -> bytes | None:
        """``conn``'s next bytes if they are there already and nothing else waits to be served.

        A client that sends its next request as soon as it has the reply
        (on 2 CPUs, often before the daemon is back from ``send``) gets it
        read here without a scheduler pass and an epoll re-registration.
        Not while a batch is open (its other connections' tasks must run to
        join it) or another connection has a request waiting: those go first.

        When nothing is there yet, the connection polls for it a moment
        (:class:`~lockd.daemon.sockio.BusyPoll`; a request of another
        connection or a new connection ends it at once) -- unless it has an
        acquire waiting: its client is most likely blocked on that one, and
        the next thing to happen is another connection's release.
        """
        if self._outbox or self.service.batch_open:
            return None
        if len(self.connections) > 1:
            fd = conn.sock.fileno()
            ours = False
            for ready_fd, _ in self._readable.poll(0, 2):
                if ready_fd != fd:
                    return None
                ours = True
            if ours:
                return sockio.recv_ready(conn.sock)
        else:
            data = sockio.recv_ready(conn.sock)
            if data is not None:
                return data
        if conn.waiting:
            return None
        return conn.busy.next_bytes(conn.sock, self._readable)

    def _batch_point(self, conn: Connection) -> None:
        """After a connection's requests of one read: commit and answer, unless more are coming.

        When another connection has a request waiting to be read, its task
        runs in this same loop pass (or the next), and its requests join the
        batch: one commit for all of them, then every reply. The last one to
        find nobody else waiting commits; the flusher task commits in the
        next pass in case that never happens (a readable connection whose
        task is busy elsewhere). A lone connection commits at once, without it.
        """
        if not self._outbox and not self.service.batch_open:
            return
        if len(self.connections) > 1:
            fd = conn.sock.fileno()
            for ready_fd, _ in self._readable.poll(0, 2):
                if ready_fd != fd:
                    self._flush_wanted.set()
                    return
        self._flush()

    async def _flusher(self) -> None:
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            self._flush()

    def _flush(self) -> None:
        """Commit the batch; the service then calls :meth:`_batch_ended` to send its replies."""
        if not self._outbox and not self.service.batch_open:
            return
        try:
            self.service.commit_fact("group_commit")
        except Exception:
            self.service.stats.count("internalErrors")
            log.exception(kv(event="internal_error", op="group_commit"))

    def _batch_ended(self, error: BaseException | None) -> None:
        """Send the replies of a batch whose commit is done, or fail those it acknowledged.

        A failed commit was rolled back: the requests it would have made
        durable get STORAGE_UNAVAILABLE (INTERNAL when it failed for a bug).
        """
        outbox, self._outbox = self._outbox, []
        if error is not None:
            self._reschedule()  # the rollback may have brought back an earlier deadline
        for out in outbox:
            if error is None or not out.needs_commit:
                self._send(out.conn, out.data, out.grant)
            elif isinstance(error, StorageUnavailable):
                self._send(out.conn, encode_protocol_error(storage_unavailable(out.request_id)))
            else:
                failed = encode_error(out.request_id, "INTERNAL", "internal error; see the log")
                self._send(out.conn, failed)

    # ------------------------------------------------------------- requests

    def _handle_line(
        self, conn: Connection, line: bytes, nursery: trio.Nursery
    ) -> Coroutine[Any, Any, None] | None:
        """Answer one request into the outbox, or hand it to a task of its own if it must wait.

        A request a remote backend decides without waiting in a queue comes
        back as a coroutine for the connection's own task to await.
        """
        started = time.perf_counter()
        handed_off = False
        request: Request | None = None
        service = self.service
        service.deferred = False
        try:
            request = parse_request(line)
            if self.shutting_down:
                raise shutting_down()
            if isinstance(request, Cancel):
                result = {"cancelled": self._cancel(conn, request.target)}
                self._queue(conn, request.id, encode_result(request.id, result))
            elif isinstance(request, Stopped):
                result = service.stopped(conn.id, request)
                self._queue(conn, request.id, encode_result(request.id, result))
            elif isinstance(request, Hello):
                result = service.answer(conn.caller, request)
                # asked: say whether they are on (docs/contract.md §12)
                if request.events is not None:
                    conn.events = request.events
                    result = {**result, "events": conn.events}
                self._queue(conn, request.id, encode_result(request.id, result))
            elif service.backend.awaits(request):
                handed_off = True
                if isinstance(request, Acquire) and request.timeout_ms is not None:
                    self._answer_remote(conn, nursery, request, started)
                else:
                    return self._answer_remote_now(conn, request, started)
            elif isinstance(request, Acquire):
                step = service.acquire(conn.caller, conn.id, request, pending=conn.waiting)
                if isinstance(step, Reply):
                    self._reply(conn, request.id, step, needs_commit=service.deferred)
                else:
                    self._wait_in_task(conn, nursery, request, started, step)
                    handed_off = True
            else:
                result = service.answer(conn.caller, request)
                if isinstance(result, PendingBreak):
                    self._finish_break_in_task(conn, nursery, request, started, result)
                    handed_off = True
                    return None
                self._queue(
                    conn,
                    request.id,
                    encode_result(request.id, result),
                    needs_commit=service.deferred,
                )
        except ProtocolError as exc:
            self._reply_error(conn, request, exc)
        except Exception:
            self._reply_internal(conn, request)
        finally:
            if request is not None and not handed_off:
                self._observe(request.op, started)
            self._reschedule()
        return None

    def _finish_break_in_task(
        self,
        conn: Connection,
        nursery: trio.Nursery,
        request: Request,
        started: float,
        pending: PendingBreak,
    ) -> None:
        """Wait until a break's told holders stopped (or its grace passed), then end it.

        The decisions are the service's (``break_ready``, ``finish_break``);
        this task only sleeps until the grace deadline or a wake-up (a
        ``stopped``, a connection closing, a hold ending). A break cut
        short (the daemon stopping, the requester leaving) still ends the
        holds: their holders were told they are lost.
        """
        service = self.service

        async def run() -> None:
            finished = False
            try:
                while not service.break_ready(pending) and not self.shutting_down:
                    woken = trio.Event()
                    pending.wake = woken.set
                    with trio.move_on_after(service.ms_until(pending.deadline) / 1000):
                        await woken.wait()
                finished = True
                result = service.finish_break(conn.caller, pending)
                self._queue(conn, request.id, encode_result(request.id, result))
            except ProtocolError as exc:
                self._reply_error(conn, request, exc)
            except Exception:
                self._reply_internal(conn, request)
            finally:
                if not finished:
                    with contextlib.suppress(Exception):
                        service.finish_break(conn.caller, pending)
                self._flush()
                self._observe(request.op, started)
                self._reschedule()

        self._breaks.add(pending)
        nursery.start_soon(self._forget_break_after, pending, run)

    async def _forget_break_after(
        self, pending: PendingBreak, run: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            await run()
        finally:
            self._breaks.discard(pending)

    def _tell_lost(self, event: LossEvent) -> None:
        """Write a loss event to its connection, ahead of any reply that depends on it."""
        conn = self.connections.get(event.conn)
        if conn is not None and conn.writer is not None:
            conn.writer.write(encode_event(event.wire()))

    def _reply(
        self, conn: Connection, request_id: RequestId, reply: Reply, *, needs_commit: bool
    ) -> None:
        """Queue a reply for the batch; a grant whose reply cannot be written is released."""
        self._queue(
            conn,
            request_id,
            encode_result(request_id, reply.result),
            reply.grant,
            needs_commit=needs_commit,
        )

    def _reply_error(self, conn: Connection, request: Request | None, exc: ProtocolError) -> None:
        if exc.code == "INVALID_REQUEST":
            self.service.stats.count("invalidRequests")
        if request is not None and exc.request_id is None:
            exc.request_id = request.id
        self._queue(conn, exc.request_id, encode_protocol_error(exc))

    def _reply_internal(self, conn: Connection, request: Request | None) -> None:
        """A bug: log the traceback, answer INTERNAL; connection and daemon live on."""
        self.service.stats.count("internalErrors")
        # One caller that can trigger a bug must not fill the log with tracebacks.
        suppressed = self._error_log.admit(conn.caller.principal)
        if suppressed is not None:
            op = getattr(request, "op", None)
            log.exception(kv(event="internal_error", op=op, suppressed=suppressed))
        rid = request.id if request is not None else None
        self._queue(conn, rid, encode_error(rid, "INTERNAL", "internal error; see the log"))

    def _observe(self, op: str, started: float) -> None:
        self.service.stats.observe(op, (time.perf_counter() - started) * 1000)

    # ------------------------------------------------------- a remote backend

    async def _answer_remote_now(self, conn: Connection, request: Request, started: float) -> None:
        """A request a remote backend (etcd) decides without waiting in a queue.

        The connection's own task awaits it before reading its next line: one
        request in flight per connection, taking effect in the order sent,
        without a task of its own (whose start and end cost as much CPU as
        the reply's etcd call, measured on B1). A grant whose reply cannot be
        written is released.
        """
        backend = self.service.backend
        try:
            answer = backend.answer(conn.caller, conn.id, request, pending=conn.waiting)
            await self._send_remote(conn, request, answer)
        finally:
            self._observe(request.op, started)

    async def _send_remote(
        self, conn: Connection, request: Request, answer: Awaitable[RemoteReply]
    ) -> None:
        """Write the backend's answer to ``request``, or its error; release an undelivered grant."""
        try:
            reply = await answer
            self._send(conn, encode_result(request.id, reply.result), reply.grant)
        except ProtocolError as exc:
            self._reply_error(conn, request, exc)
        except Exception:
            self._reply_internal(conn, request)
        finally:
            self._flush()  # the error replies above wait in the outbox

    def _answer_remote(
        self, conn: Connection, nursery: trio.Nursery, request: Acquire, started: float
    ) -> None:
        """A blocking acquire a remote backend (etcd) decides, answered in a task of its own.

        It is registered like a parked one, so ``cancel`` and shutdown can
        withdraw it (the backend leaves the queue when its task is
        cancelled); a grant that is withdrawn or cannot be written is
        released.
        """
        backend = self.service.backend
        pending = conn.waiting
        # The connection's next line waits until it is parked (bounded by
        # the pending-acquire limit, it must not hold up later requests
        # while it waits, but a status right behind it must count it).
        conn.remote_busy = done = trio.Event()
        wait = _Wait(None)
        conn.waits.setdefault(request.id, []).append(wait)
        conn.waiting += 1

        async def answer() -> RemoteReply:
            reply: RemoteReply | None = None
            with wait.scope:
                reply = await backend.answer(
                    conn.caller, conn.id, request, pending=pending, parked=done
                )
                wait.step = Reply(None)  # answered: a cancel now comes too late
            if reply is None or wait.cancelled:
                if reply is not None and reply.grant is not None:
                    backend.release_undelivered(reply.grant)
                if self.shutting_down:
                    raise shutting_down()
                raise ProtocolError(
                    "CANCELLED",
                    "the acquire was withdrawn by cancel",
                    details={"key": request.key},
                )
            return reply

        async def run() -> None:
            try:
                await self._send_remote(conn, request, answer())
            finally:
                self._forget_wait(conn, request.id, wait)
                if conn.remote_busy is done:
                    conn.remote_busy = None
                done.set()
                self._observe(request.op, started)

        nursery.start_soon(run)

    def _forget_wait(self, conn: Connection, request_id: RequestId, wait: _Wait) -> None:
        waits = conn.waits.get(request_id, [])
        if wait in waits:
            waits.remove(wait)
        if not waits:
            conn.waits.pop(request_id, None)
        conn.waiting -= 1

    # -------------------------------------------------------- waiting acquires

    def _wait_in_task(
        self,
        conn: Connection,
        nursery: trio.Nursery,
        req: Acquire,
        started: float,
        step: WaitForRoom | Parked,
    ) -> None:
        """Follow an acquire that has to wait in a task of its own, counted per connection."""
        wait = _Wait(step)
        self._track(conn, req, wait)  # before any await: the waiter may be resolved at once
        conn.waits.setdefault(req.id, []).append(wait)

        async def run() -> None:
            try:
                reply: Reply | None = None
                with wait.scope:
                    reply = await self._wait_for_reply(conn, req, wait)
                if wait.answered:
                    return  # its grant went out when it was handed over
                if wait.cancelled or reply is None:
                    raise ProtocolError(
                        "CANCELLED",
                        f"the acquire of {req.key!r} was withdrawn by cancel",
                        request_id=req.id,
                        details={"key": req.key},
                    )
                self._reply(conn, req.id, reply, needs_commit=wait.deferred)
            except ProtocolError as exc:
                self._reply_error(conn, req, exc)
            except Exception:
                self._reply_internal(conn, req)
            finally:
                # Its own batch: committed (if a grant after a wait for
                # room left it pending) and answered now.
                self._flush()
                waits = conn.waits.get(req.id, [])
                if wait in waits:
                    waits.remove(wait)
                if not waits:
                    conn.waits.pop(req.id, None)
                conn.waiting -= 1
                self.service.wait_ended(conn.caller)
                self._observe(req.op, started)
                self._reschedule()

        conn.waiting += 1
        self.service.wait_started(conn.caller)
        nursery.start_soon(run)

    def _cancel(self, conn: Connection, target: RequestId) -> bool:
        """``cancel``: withdraw this connection's waiting acquire ``target``, if still waiting.

        Synchronous, so nothing can grant the waiter between the check and
        the withdrawal. A waiter the engine already resolved (granted, timed
        out) keeps its answer, which is on its way: ``cancelled: false``.
        """
        withdrawn = False
        for wait in conn.waits.get(target, ()):
            step = wait.step
            if wait.cancelled or isinstance(step, Reply):
                continue
            if isinstance(step, Parked):
                if step.waiter.resolved:
                    continue
                self.service.cancel_waiter(step.waiter)  # out of the queue, now
            wait.cancelled = True
            wait.scope.cancel()
            withdrawn = True
        if withdrawn:
            self._reschedule()
        return withdrawn

    def _track(self, conn: Connection, req: Acquire, wait: _Wait) -> None:
        """Give a parked waiter the event its resolution sets."""
        step = wait.step
        if isinstance(step, Parked):
            self._events[step.waiter.id] = trio.Event()
            self._parked[step.waiter.id] = (conn, req, wait)
            self._reschedule()  # its deadline may be the earliest now

    async def _wait_for_reply(self, conn: Connection, req: Acquire, wait: _Wait) -> Reply:
        """Do the waiting each step asks for until the service has the reply."""
        while True:
            step = wait.step
            if isinstance(step, Reply):
                return step
            assert step is not None, "remote waits are answered by _answer_remote"
            if isinstance(step, WaitForRoom):
                with trio.move_on_after(step.delay_ms / 1000):
                    await self._shutdown_event.wait()
                if self.shutting_down:
                    raise shutting_down()
                self.service.deferred = False
                wait.step = self.service.acquire_after_wait(conn.caller, conn.id, req, step)
                wait.deferred = self.service.deferred
                self._track(conn, req, wait)
            else:
                waiter = step.waiter
                try:
                    await self._events[waiter.id].wait()
                finally:
                    self._events.pop(waiter.id, None)
                    self._parked.pop(waiter.id, None)
                    # Cancelled (connection gone) or woken by shutdown: leave
                    # the queue before anything else can hand us the key.
                    self.service.cancel_waiter(waiter)
                wait.step = self.service.parked_reply(req, waiter)
                wait.deferred = False  # granted or timed out by a commit already done
