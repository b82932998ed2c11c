"""The group commit and every reply the server writes.

Replies of requests handled inline wait here, in the outbox, until the
commit of their batch: one SQLite transaction for the requests of every
connection served in one loop pass (:meth:`Outbox.batch_point`). The
service calls :meth:`Outbox.batch_ended` after each commit, and only then
do the replies go out -- or, when the commit failed, each request whose
effects it would have made durable is answered STORAGE_UNAVAILABLE
instead. A reply that hands out a grant carries it, and the grant is
released when the reply cannot be written (:meth:`Outbox.send`).
Lease-loss events are written from here too, ahead of any reply that
depends on them.

This is the server's writing side (:mod:`lockd.daemon.server` reads); it
is separate because every part of the server -- the connection loop, the
waiting acquires, the break waits -- answers through it.
"""

from __future__ import annotations

import logging
import select
import time
from dataclasses import dataclass

import trio

from lockd.daemon.backends import RemoteHold
from lockd.daemon.connection import Connection
from lockd.daemon.engine import Lease
from lockd.daemon.events import LossEvent
from lockd.daemon.protocol import (
    ProtocolError,
    Request,
    RequestId,
    encode_error,
    encode_event,
    encode_protocol_error,
    encode_result,
)
from lockd.daemon.service import LockService, Reply, storage_unavailable
from lockd.daemon.store import StorageUnavailable
from lockd.daemon.timer import ExpiryTimer
from lockd.logfmt import LogThrottle, kv

log = logging.getLogger("lockd.daemon.server")


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


class Outbox:
    """Replies waiting for their batch's commit, and the writing of every reply."""

    def __init__(
        self,
        service: LockService,
        timer: ExpiryTimer,
        connections: dict[int, Connection],
        readable: select.epoll,
    ) -> None:
        self._service = service
        self._timer = timer
        #: the server's open connections, by id.
        self._connections = connections
        #: every connection socket, level-triggered (the server's).
        self._readable = readable
        self._outbox: list[_Outgoing] = []
        self._flush_wanted = trio.Event()
        #: internal errors are logged once per principal per interval, with counts.
        self._error_log = LogThrottle()

    @property
    def holding(self) -> bool:
        """Replies wait for a commit."""
        return bool(self._outbox)

    # ------------------------------------------------------------- writing

    def send(self, conn: Connection, data: bytes, grant: Lease | RemoteHold | None = None) -> None:
        """Write one reply now (or queue it behind a slow one); release an undeliverable grant."""
        writer = conn.writer
        if (writer is None or not writer.write(data, grant)) and grant is not None:
            self.release_undelivered(grant)
        elif conn.events and grant is not None:
            if isinstance(grant, Lease):
                self._service.watch_grant(conn.id, grant)
            else:  # a remote backend's grant: told of what this daemon sees (see remote)
                self._service.losses.watch(conn.id, grant)

    def release_undelivered(self, grant: Lease | RemoteHold) -> None:
        try:
            self._service.backend.release_undelivered(grant)
        except Exception:
            # A bug: logged; the rest of a batch's replies must still go out.
            self._service.stats.count("internalErrors")
            log.exception(kv(event="internal_error", op="release_undelivered"))
        self._timer.reschedule()

    def tell_lost(self, event: LossEvent) -> None:
        """Write a loss event to its connection, ahead of any reply that depends on it."""
        conn = self._connections.get(event.conn)
        if conn is not None and conn.writer is not None:
            conn.writer.write(encode_event(event.wire()))

    # ------------------------------------------------------------- queueing

    def queue(
        self,
        conn: Connection,
        request_id: RequestId | None,
        data: bytes,
        grant: Lease | None = None,
        *,
        needs_commit: bool = False,
    ) -> None:
        self._outbox.append(_Outgoing(conn, request_id, data, grant, needs_commit))

    def reply(
        self, conn: Connection, request_id: RequestId, reply: Reply, *, needs_commit: bool
    ) -> None:
        """Queue a reply for the batch; a grant whose reply cannot be written is released."""
        self.queue(
            conn,
            request_id,
            encode_result(request_id, reply.result),
            reply.grant,
            needs_commit=needs_commit,
        )

    def reply_error(self, conn: Connection, request: Request | None, exc: ProtocolError) -> None:
        if exc.code == "INVALID_REQUEST":
            self._service.stats.count("invalidRequests")
        if request is not None and exc.request_id is None:
            exc.request_id = request.id
        self.queue(conn, exc.request_id, encode_protocol_error(exc))

    def reply_internal(self, conn: Connection, request: Request | None) -> None:
        """A bug: log the traceback, answer INTERNAL; connection and daemon live on."""
        self._service.stats.count("internalErrors")
        # One caller that can trigger a bug must not fill the log with tracebacks.
        suppressed = self._error_log.admit(conn.caller.principal)
        if suppressed is not None:
            op = getattr(request, "op", None)
            log.exception(kv(event="internal_error", op=op, suppressed=suppressed))
        rid = request.id if request is not None else None
        self.queue(conn, rid, encode_error(rid, "INTERNAL", "internal error; see the log"))

    def observe(self, op: str, started: float) -> None:
        """The request's latency, for the ``stats`` op (``started``: perf_counter)."""
        self._service.stats.observe(op, (time.perf_counter() - started) * 1000)

    # --------------------------------------------------------- group commit

    def batch_point(self, conn: Connection) -> None:
        """After a connection's requests of one read: commit and answer, unless more are coming.

        When another connection has a request waiting to be read, its task
        runs in this same loop pass (or the next), and its requests join the
        batch: one commit for all of them, then every reply. The last one to
        find nobody else waiting commits; the flusher task commits in the
        next pass in case that never happens (a readable connection whose
        task is busy elsewhere). A lone connection commits at once, without it.
        """
        if not self._outbox and not self._service.batch_open:
            return
        if len(self._connections) > 1:
            fd = conn.sock.fileno()
            for ready_fd, _ in self._readable.poll(0, 2):
                if ready_fd != fd:
                    self._flush_wanted.set()
                    return
        self.flush()

    async def flusher(self) -> None:
        """The task that commits a batch no connection's task committed."""
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            self.flush()

    def flush(self) -> None:
        """Commit the batch; the service then calls :meth:`batch_ended` to send its replies."""
        if not self._outbox and not self._service.batch_open:
            return
        try:
            self._service.commit_fact("group_commit")
        except Exception:
            self._service.stats.count("internalErrors")
            log.exception(kv(event="internal_error", op="group_commit"))

    def batch_ended(self, error: BaseException | None) -> None:
        """Send the replies of a batch whose commit is done, or fail those it acknowledged.

        A failed commit was rolled back: the requests it would have made
        durable get STORAGE_UNAVAILABLE (INTERNAL when it failed for a bug).
        """
        outbox, self._outbox = self._outbox, []
        if error is not None:
            self._timer.reschedule()  # the rollback may have brought back an earlier deadline
        for out in outbox:
            if error is None or not out.needs_commit:
                self.send(out.conn, out.data, out.grant)
            elif isinstance(error, StorageUnavailable):
                self.send(out.conn, encode_protocol_error(storage_unavailable(out.request_id)))
            else:
                failed = encode_error(out.request_id, "INTERNAL", "internal error; see the log")
                self.send(out.conn, failed)
