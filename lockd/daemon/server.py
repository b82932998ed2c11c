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
loop pass (:meth:`~lockd.daemon.outbox.Outbox.batch_point`) -- and then
every reply is written (:meth:`~lockd.daemon.outbox.Outbox.batch_ended`);
when the commit fails, each request of the batch is answered
STORAGE_UNAVAILABLE. Replies are written by a per-connection
:class:`~lockd.daemon.sockio.ReplyWriter` and may come out of order; they
carry the request id. A reply that hands out a grant carries it, and the
grant is released when the reply cannot be written.

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

:class:`LockServer` runs the daemon's tasks and each connection's read
loop, and dispatches each request line; its parts, which it owns, do the
rest: :class:`~lockd.daemon.door.Door` (accepting within the connection
limits, identifying the caller), :class:`~lockd.daemon.outbox.Outbox` (the
group commit and every reply written), :class:`~lockd.daemon.waits.Waits`
(parked acquires, remote acquires, break waits, cancel) and
:class:`~lockd.daemon.timer.ExpiryTimer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import select
import socket as stdsocket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import trio
from trio.lowlevel import wait_readable

from lockd.daemon import sockio, systemd
from lockd.daemon.connection import Connection
from lockd.daemon.door import MAX_LINGERING, NOT_COUNTED, Door
from lockd.daemon.events import PendingBreak
from lockd.daemon.memory import TrimAfterDrop
from lockd.daemon.outbox import Outbox
from lockd.daemon.protocol import (
    Acquire,
    Cancel,
    Hello,
    LineSplitter,
    ProtocolError,
    Request,
    Stopped,
    encode_error,
    encode_fast_result,
    encode_result,
    parse_request,
)
from lockd.daemon.service import LockService, Reply, shutting_down
from lockd.daemon.stats import SAMPLE_EVERY
from lockd.daemon.supervision import HANDLED_SIGNALS, STATUS_INTERVAL, Supervision
from lockd.daemon.timer import TIMER_MAX_SLEEP, ExpiryTimer
from lockd.daemon.waits import Waits
from lockd.identity import (
    Caller,
    IdentityConfig,
    identify,
    process_name,
    process_start,
)
from lockd.logfmt import kv

__all__ = [  # names other modules import from here, wherever they are defined
    "ANSWERED_BEFORE_CHECK",
    "HANDLED_SIGNALS",
    "INLINE_READS",
    "MAX_LINGERING",
    "NOT_COUNTED",
    "STATUS_INTERVAL",
    "TIMER_MAX_SLEEP",
    "Connection",
    "Limits",
    "LockServer",
]

log = logging.getLogger("lockd.daemon.server")

#: Requests a connection may read without a scheduler pass in between.
INLINE_READS = 8
#: the share of requests answered at once whose latency is timed.
_SAMPLED = 1 / SAMPLE_EVERY
_random = random.random
#: The ops answered while the store's integrity check still runs after a
#: restart (``LockServer.integrity_checked``): they read one key or none and
#: write nothing that cannot wait (``rules`` reads the rule sets only).
#: ``list`` and ``stats`` count every key (the rest of a chunked restore is
#: read first), so they wait like writes; so do ``cancel`` and ``stopped``,
#: which only ever concern requests made after the check.
ANSWERED_BEFORE_CHECK = frozenset({"hello", "status", "rules"})
#: Seconds :meth:`LockServer.open_gate` waits at most for what was sent during
#: the integrity check to be answered before leases run out again.
GATE_DRAIN_LIMIT = 2.0
#: Seconds between its looks meanwhile.
GATE_DRAIN_POLL = 0.001


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
    """The daemon's tasks, each connection's read loop, and the dispatch of its lines."""

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
        self._conn_ids = 0
        self.connections: dict[int, Connection] = {}
        #: bytes of incomplete request lines held, all connections together.
        self._buffered = 0
        self.shutting_down = False
        #: set once the store's integrity check passed (None: no store, or
        #: nothing to wait for). Until then only the ops of
        #: :data:`ANSWERED_BEFORE_CHECK` are answered; any other request waits
        #: for it in its connection's task, so the loop keeps answering the
        #: other connections (a write would otherwise block the whole
        #: daemon on the check; see :meth:`_after_check`).
        self.integrity_checked: trio.Event | None = None
        #: requests waiting for that check now (see _after_check).
        self._gated = 0
        #: open_gate waits for what was sent during the check to be answered.
        self._draining = False
        self._started_at = time.monotonic()
        #: every connection socket, level-triggered: "is another request
        #: waiting to be read?" in one non-blocking epoll_wait.
        self._readable = select.epoll()
        #: busy-polling off for every connection while several are busy (sockio.PollGate).
        self._poll_gate = sockio.PollGate()
        self._shutdown_event = trio.Event()
        self._memory = TrimAfterDrop("connections", 8)
        self._timer = ExpiryTimer(service)
        self._outbox = Outbox(service, self._timer, self.connections, self._readable)
        self._waits = Waits(
            service, self._outbox, self._timer, self.connections, self._shutdown_event
        )
        self._door = Door(
            limits,
            identity,
            service.stats,
            resolve or self._resolve_peer,
            self._shutdown_event,
        )
        self._supervision = Supervision(
            service.gauges, lambda: len(self.connections), self.shutdown, reload_rules
        )
        self.service.on_resolved = self._waits.wake
        self.service.server_gauges = self.gauges
        # Group commit (see Outbox.batch_point): replies wait in the outbox
        # until the commit of their batch; the service calls batch_ended after it.
        self.service.group_commit = True
        self.service.on_batch_end = self._outbox.batch_ended
        self.service.on_lost = self._outbox.tell_lost

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
            nursery.start_soon(self._timer.run)
            nursery.start_soon(self._outbox.flusher)
            await nursery.start(self._supervision.signals)
            watchdog = systemd.watchdog_interval()
            if watchdog or os.environ.get("NOTIFY_SOCKET"):
                nursery.start_soon(self._supervision.report, watchdog)
            async with trio.open_nursery() as conns:
                accepting = trio.CancelScope()
                conns.start_soon(
                    self._door.accept_loop, listen_sock, conns, accepting, self._serve_connection
                )
                # A connection coming in ends a busy poll (see _read_now).
                with contextlib.suppress(OSError):
                    self._readable.register(listen_sock, select.EPOLLIN)
                systemd.ready(self._supervision.status_line())
                task_status.started()
                await self._shutdown_event.wait()
                systemd.stopping()
                accepting.cancel()
                with contextlib.suppress(OSError):
                    self._readable.unregister(listen_sock)
                # Requests waiting for the integrity check answer
                # SHUTTING_DOWN too (_after_check).
                await self._waits.drain(lambda: self._gated)
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
            self._waits.wake_breaks()

    def gauges(self) -> dict[str, Any]:
        """The server's own gauges; the service adds the engine's for ``stats``."""
        return {
            "uptimeMs": int((time.monotonic() - self._started_at) * 1000),
            "connections": len(self.connections),
        }

    # ---------------------------------------------------------- connections

    async def _serve_connection(self, sock: stdsocket.socket, uid: int) -> None:
        try:
            await self._serve_counted(sock)
        finally:
            self._door.release_uid(uid)

    async def _serve_counted(self, sock: stdsocket.socket) -> None:
        identified = await self._door.identify(sock)
        if identified is None:
            return
        #: bytes read before the caller was identified, not yet served.
        caller, early = identified
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
        # Only a hint for batch_point: a connection it cannot watch is served all the same.
        with contextlib.suppress(OSError):
            self._readable.register(sock, select.EPOLLIN)
        outbox = self._outbox
        try:
            async with trio.open_nursery() as nursery:
                conn.writer = writer = sockio.ReplyWriter(
                    sock, nursery.start_soon, outbox.release_undelivered
                )
                splitter = LineSplitter(self.limits.max_line_bytes)
                try:
                    await self._read_lines(conn, nursery, splitter, early)
                finally:
                    self._buffered -= splitter.pending
                # Answer what was read before the end (the peer may only
                # have shut down its sending side).
                outbox.flush()
                await writer.wait_drained()
                nursery.cancel_scope.cancel()
        finally:
            # Ending without a drain (cancelled): its replies are dropped and
            # their grants released; the other connections' go out.
            if conn.writer is not None:
                conn.writer.closed = True
            outbox.flush()
            with contextlib.suppress(OSError):
                self._readable.unregister(sock)
            self._door.open_connections -= 1
            del self.connections[conn.id]
            self._memory.observe(len(self.connections))  # a flood gone: memory back
            try:
                # A stop is not the client leaving: its releaseOnClose leases
                # stay committed as plain TTL leases, as across a crash.
                self.service.connection_closed(conn.id, release_bound=not self.shutting_down)
            except Exception:
                self.service.stats.count("internalErrors")
                log.exception(kv(event="internal_error", op="connection_closed"))
            self._timer.reschedule()
            sockio.close(sock)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(kv(event="disconnected", conn=conn.id))

    # ------------------------------------------------------------- reading

    async def _read_lines(
        self, conn: Connection, nursery: trio.Nursery, splitter: LineSplitter, early: bytes = b""
    ) -> None:
        """Read and answer lines; a partial line is bounded in time and in total bytes."""
        limits = self.limits
        inline = 0
        #: trio time the first byte of the incomplete line came.
        line_started = 0.0
        #: splitter.pending, read once per feed.
        pending = 0
        while True:
            data: bytes | None = None
            try:
                if early:  # read before the caller could be identified
                    data, early = early, b""
                elif pending:
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
                        # sockio.recv_some, inlined: one coroutine frame
                        # less for every resumption of this task to pass.
                        sock = conn.sock
                        while data is None:
                            await wait_readable(sock)
                            data = sockio.recv_ready(sock)
                    else:
                        inline += 1
            except (trio.ClosedResourceError, OSError):
                return
            if not data:
                return
            before = pending
            lines = splitter.feed(data)
            pending = splitter.pending
            if pending != before:
                self._buffered += pending - before
            if pending and (lines or not before):
                line_started = trio.current_time()  # a new incomplete line began
            for line in lines:
                if not line or line.isspace():
                    continue  # a blank line is no request: it costs its read, no reply
                if conn.remote_busy is not None:
                    # One request in flight to a remote backend per connection:
                    # a client pipelining thousands of lines must not make the
                    # daemon send thousands of etcd requests at once, and its
                    # requests take effect in the order it sent them.
                    self._outbox.batch_point(conn)
                    await conn.remote_busy.wait()
                remote = self._handle_line(conn, line, nursery)
                if remote is not None:
                    # Answered before the next line is read (the replies
                    # queued before it go out first).
                    self._outbox.batch_point(conn)
                    await remote
                    if pending:
                        # The rest of the next line waited while we were not
                        # reading (an etcd round trip, the restart's
                        # integrity check): that is no slow client.
                        line_started = trio.current_time()
                elif self.service.gate.costly_rule_ran() and not self._draining:
                    # A rule took milliseconds: the other connections go
                    # before this one's next line (issue 21). Not while the
                    # gate drains (open_gate): it counts a connection done
                    # once its socket is empty, so lines already read must
                    # be answered before anything else runs.
                    self._outbox.batch_point(conn)
                    await trio.lowlevel.checkpoint()
            self._outbox.batch_point(conn)
            writer = conn.writer
            if writer is not None and writer.backlogged:
                # The peer does not read its replies: read none of its
                # requests until it does, so what it costs us stays bounded.
                await writer.wait_drained()
            gate = self.service.gate
            pause_ms = gate.rule_cpu_pause_ms(conn.caller) if gate.rule_cpu is not None else 0
            if pause_ms:
                # Its rules used its share of the daemon: it waits behind
                # the others (its connections are not read) until it is back.
                await trio.sleep(pause_ms / 1000)
            if pending and self._buffered > limits.max_buffered_bytes:
                await self._close_stalled(conn, "max_buffered_bytes")
                return
            if splitter.too_long:
                self.service.stats.count("invalidRequests")
                limit = self.limits.max_line_bytes
                self._outbox.flush()  # the lines before it are answered first
                self._outbox.send(
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
        self._door.warnings.warn("connection_closed", why, uid=conn.caller.uid)
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
        self._outbox.flush()
        self._outbox.send(conn, encode_error(None, "INVALID_REQUEST", message, details))
        assert conn.writer is not None
        await conn.writer.wait_drained()

    def _read_now(self, conn: Connection) -> bytes | None:
        """``conn``'s next bytes if they are there already and nothing else waits to be served.

        A client that sends its next request as soon as it has the reply
        (on 2 CPUs, often before the daemon is back from ``send``) gets it
        read here without a scheduler pass and an epoll re-registration.
        Not while a batch is open (its other connections' tasks must run to
        join it) or another connection has a request waiting: those go first.
        Nor while the poll gate is closed for several busy clients
        (:class:`~lockd.daemon.sockio.PollGate`): then another connection
        nearly always has a request waiting, and asking epoll only to learn
        that is a system call spent (B3; rare there, as a batch is usually
        open when a connection is done).

        When nothing is there yet, the connection polls for it a moment
        (:class:`~lockd.daemon.sockio.BusyPoll`; a request of another
        connection or a new connection ends it at once) -- unless it has an
        acquire waiting: its client is most likely blocked on that one, and
        the next thing to happen is another connection's release.
        """
        several = len(self.connections) > 1
        if several and time.perf_counter_ns() < self._poll_gate.closed_until:
            # Several clients are busy (B3): another connection nearly
            # always has a request waiting, so the poll below would only
            # cost an epoll_wait to learn it; wait through trio.
            return None
        if self._outbox.holding or self.service.batch_open:
            return None
        if several:
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

    # ------------------------------------------------------------- requests

    def gate_for_check(self) -> trio.Event:
        """Make writes wait for the restart's integrity check; the event :meth:`open_gate` sets.

        Leases stop running out now (:meth:`LockEngine.hold_leases`): a
        renew that arrives during the check waits for it (:meth:`_after_check`),
        and its lease must still be there when it is judged, however long
        the check took (seconds at 1 M leases). Nothing is granted before the
        check passed, so holding the leases costs nobody a key.
        """
        checked = trio.Event()
        self.integrity_checked = checked
        service = self.service
        service.engine.hold_leases(service.clock.boot_ms())
        return checked

    async def open_gate(self) -> None:
        """The check passed: answer what was sent meanwhile, then let leases run out.

        "What was sent meanwhile" is more than the requests waiting at the
        gate (:attr:`_gated`): only a connection's first request waits
        there, and its later lines (a second renew) are still unread in the
        socket. So leases stay held until no request waits at the gate and
        every connection open now has been seen with nothing left to read;
        then leases whose deadline passed and that no renew extended run
        out at the timer's next pass. A connection that never stops sending
        cannot hold every lease forever: the wait is bounded
        (:data:`GATE_DRAIN_LIMIT`), and said so in the log when it ends so.
        """
        checked = self.integrity_checked
        if checked is not None:
            checked.set()
        self.integrity_checked = None  # no gate left: one look per request less
        unread = list(self.connections.values())
        give_up = trio.current_time() + GATE_DRAIN_LIMIT
        self._draining = True
        try:
            await self._drain_gate(unread, give_up)
        finally:
            self._draining = False
        self.service.engine.release_leases()
        self._timer.reschedule()

    async def _drain_gate(self, unread: list[Connection], give_up: float) -> None:
        """:meth:`open_gate`'s wait: until nothing waits at the gate and no socket holds more."""
        while True:
            unread = [
                conn
                for conn in unread
                if self.connections.get(conn.id) is conn and sockio.unread_bytes(conn.sock)
            ]
            if not self._gated and not unread:
                break
            if trio.current_time() >= give_up:
                log.warning(
                    kv(
                        event="gate_drain_limit",
                        waiting=self._gated,
                        unread_connections=len(unread),
                        effect="leases run out again before these are answered",
                    )
                )
                break
            await trio.sleep(GATE_DRAIN_POLL)

    async def _after_check(
        self, checked: trio.Event, conn: Connection, line: bytes, nursery: trio.Nursery
    ) -> None:
        """Answer ``line`` once the store's integrity check has passed.

        Every request but :data:`ANSWERED_BEFORE_CHECK` changes or counts the
        stored state (or concerns one that did), so its commit must wait for
        the check (a damaged page could hide a lease). It waits here, in its
        connection's task, not in the commit: a commit runs on the event loop, where waiting for the
        check's thread stopped every connection for the whole scan (seconds
        at 1 M leases). The connection's later lines wait behind it, in
        order. A failed check stops the daemon; this request is never answered.
        A clean stop meanwhile answers it ``SHUTTING_DOWN``, as every request
        after the stop began (``_handle_line`` says so before the gate).
        """
        self._gated += 1  # serve() lets these answer before it closes the connections
        try:
            if not checked.is_set():
                async with trio.open_nursery() as first:  # the check, or the stop

                    async def until(event: trio.Event) -> None:
                        await event.wait()
                        first.cancel_scope.cancel()

                    first.start_soon(until, checked)
                    first.start_soon(until, self._shutdown_event)
            remote = self._handle_line(conn, line, nursery)
            if self.shutting_down:
                self._outbox.flush()  # out before the connections are closed
        finally:
            self._gated -= 1
        if remote is not None:
            await remote

    def _handle_line(
        self, conn: Connection, line: bytes, nursery: trio.Nursery
    ) -> Coroutine[Any, Any, None] | None:
        """Answer one request into the outbox, or hand it to a task of its own if it must wait.

        A request a remote backend decides without waiting in a queue comes
        back as a coroutine for the connection's own task to await.
        """
        # Latency is sampled (stats.SAMPLE_EVERY, all of an op's first
        # stats.SAMPLE_ALL_BELOW); a request that waits in a
        # task of its own is always timed, from its parse at the latest.
        timed = _random() < _SAMPLED
        started = time.perf_counter()
        handed_off = False
        fast_answer = False
        request: Request | None = None
        service = self.service
        try:
            request = parse_request(line)
            if self.shutting_down:
                raise shutting_down()
            checked = self.integrity_checked
            if (
                checked is not None
                and not checked.is_set()
                and request.op not in ANSWERED_BEFORE_CHECK
                # A row read already failed its checksum: every write is
                # refused at once (STORAGE_UNAVAILABLE), nothing to wait for.
                and (service.store is None or service.store.damaged is None)
            ):
                handed_off = True  # timed when it is answered, after the check
                return self._after_check(checked, conn, line, nursery)
            fast = service.fast
            if fast is not None:
                reply = fast.answer(conn.caller, conn.id, request)
                if reply is not None:
                    # It changed the lock state: the reply waits for the commit.
                    fast_answer = True
                    rid = request.id
                    grant = reply.grant
                    self._outbox.queue(
                        conn, rid, encode_fast_result(rid, reply.result), grant, needs_commit=True
                    )
                    if grant is not None:
                        self._timer.lease_added(grant.expires_at)
                    return None
            service.deferred = False
            if isinstance(request, Cancel):
                result = {"cancelled": self._waits.cancel(conn, request.target)}
                self._outbox.queue(conn, request.id, encode_result(request.id, result))
            elif isinstance(request, Stopped):
                result = service.stopped(conn.id, request)
                self._outbox.queue(conn, request.id, encode_result(request.id, result))
            elif isinstance(request, Hello):
                result = service.answer(conn.caller, request)
                # asked: say whether they are on (docs/contract.md §12)
                if request.events is not None:
                    conn.events = request.events
                    result = {**result, "events": conn.events}
                self._outbox.queue(conn, request.id, encode_result(request.id, result))
            elif service.backend.awaits(request):
                handed_off = True
                if isinstance(request, Acquire) and request.timeout_ms is not None:
                    self._waits.answer_remote(conn, nursery, request, started)
                else:
                    return self._waits.answer_remote_now(conn, request, started)
            elif isinstance(request, Acquire):
                step = service.acquire(conn.caller, conn.id, request, pending=conn.waiting)
                if isinstance(step, Reply):
                    self._outbox.reply(conn, request.id, step, needs_commit=service.deferred)
                else:
                    self._waits.wait_in_task(conn, nursery, request, started, step)
                    handed_off = True
            else:
                result = service.answer(conn.caller, request)
                if isinstance(result, PendingBreak):
                    self._waits.finish_break_in_task(conn, nursery, request, started, result)
                    handed_off = True
                    return None
                self._outbox.queue(
                    conn,
                    request.id,
                    encode_result(request.id, result),
                    needs_commit=service.deferred,
                )
        except ProtocolError as exc:
            self._outbox.reply_error(conn, request, exc)
        except Exception:
            self._outbox.reply_internal(conn, request)
        finally:
            if (
                request is not None
                and not handed_off
                and (timed or not service.stats.tally_untimed(request.op))
            ):
                self._outbox.observe(request.op, started)
            if not fast_answer:
                self._timer.reschedule()
        return None
