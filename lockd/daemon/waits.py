"""Requests that wait in tasks of their own: parked acquires, remote acquires, breaks.

Most requests are answered inline by their connection's task. Three kinds
wait, each in a task of its own so the connection's later requests are
served meanwhile:

* an acquire the service parked in the engine's queue, or sent to wait for
  room under the rate limit (:meth:`Waits.wait_in_task`). A parked one
  waits on a :class:`trio.Event` that :meth:`Waits.wake` sets when the
  engine resolves it -- after the commit, so its grant is durable -- and a
  grant is written right there, inside the commit, before the replies of
  its batch (the releaser's among them: strict FIFO as clients see it);
* a blocking acquire a remote backend (etcd) decides
  (:meth:`Waits.answer_remote`), and any other request it decides, awaited
  by the connection's own task (:meth:`Waits.answer_remote_now`);
* a break waiting for its told holders to stop (:meth:`Waits.finish_break_in_task`).

``cancel`` withdraws a waiting acquire (:meth:`Waits.cancel`), and a stop
answers every one (:meth:`Waits.drain`). The decisions are the service's;
this module only waits. It is separate from the server
(:mod:`lockd.daemon.server`) because waiting is where the tasks, the
events and the cancel scopes are, and none of it concerns reading a
connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import trio

from lockd.daemon.connection import Connection, Wait
from lockd.daemon.engine import Parked, Waiter
from lockd.daemon.events import PendingBreak
from lockd.daemon.outbox import Outbox
from lockd.daemon.protocol import Acquire, ProtocolError, Request, RequestId, encode_result
from lockd.daemon.remote import RemoteReply
from lockd.daemon.service import LockService, Reply, WaitForRoom, shutting_down
from lockd.daemon.timer import ExpiryTimer


class Waits:
    """Every request waiting in a task of its own, and how each one ends."""

    def __init__(
        self,
        service: LockService,
        outbox: Outbox,
        timer: ExpiryTimer,
        connections: dict[int, Connection],
        stopping: trio.Event,
    ) -> None:
        self._service = service
        self._outbox = outbox
        self._timer = timer
        #: the server's open connections, by id.
        self._connections = connections
        #: set when the daemon begins to stop (the server's).
        self._stopping = stopping
        #: parked waiters by id: the event their resolution sets.
        self._events: dict[int, trio.Event] = {}
        #: parked waiters by id: whom to send the grant when the engine hands it over.
        self._parked: dict[int, tuple[Connection, Acquire, Wait]] = {}
        #: breaks waiting for their told holders to stop (woken at shutdown).
        self._breaks: set[PendingBreak] = set()

    # --------------------------------------------------------- stopping

    def wake_breaks(self) -> None:
        """The daemon stops: every waiting break ends now."""
        for pending in list(self._breaks):
            pending.wake()

    async def drain(self, answering: Callable[[], int] = lambda: 0) -> None:
        """Answer every parked acquire with SHUTTING_DOWN before closing.

        ``answering``: how many other requests are still to be answered
        SHUTTING_DOWN (the server's, waiting for the restart's integrity
        check): waited for within the same bound.
        """
        for event in list(self._events.values()):
            event.set()
        for wait in self._remote_waits():
            wait.scope.cancel()
        # Every wait's task answers (SHUTTING_DOWN, or what it already had)
        # and then leaves its connection's waits: wait for all of them, not
        # only the ones woken above -- a wait for rate-limit room started
        # just before the stop may not have run yet, and closing the
        # connections now would cancel it unanswered.
        with trio.move_on_after(2):
            while answering() or any(conn.waits for conn in self._connections.values()):
                await trio.sleep(0.01)

    def _remote_waits(self) -> list[Wait]:
        """Blocking acquires a remote backend is deciding now."""
        return [
            wait
            for conn in self._connections.values()
            for waits in conn.waits.values()
            for wait in waits
            if wait.step is None
        ]

    # -------------------------------------------------- parked acquires

    def wake(self, waiter: Waiter) -> None:
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
            reply = self._service.parked_reply(req, waiter)
            self._outbox.send(conn, encode_result(req.id, reply.result), reply.grant)
        event.set()

    def wait_in_task(
        self,
        conn: Connection,
        nursery: trio.Nursery,
        req: Acquire,
        started: float,
        step: WaitForRoom | Parked,
    ) -> None:
        """Follow an acquire that has to wait in a task of its own, counted per connection."""
        wait = Wait(step)
        self._track(conn, req, wait)  # before any await: the waiter may be resolved at once
        conn.waits.setdefault(req.id, []).append(wait)
        outbox = self._outbox

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
                outbox.reply(conn, req.id, reply, needs_commit=wait.deferred)
            except ProtocolError as exc:
                outbox.reply_error(conn, req, exc)
            except Exception:
                outbox.reply_internal(conn, req)
            finally:
                # Its own batch: committed (if a grant after a wait for
                # room left it pending) and answered now.
                outbox.flush()
                wait.leave(conn, req.id)
                self._service.wait_ended(conn.caller)
                outbox.observe(req.op, started)
                self._timer.reschedule()

        conn.waiting += 1
        self._service.wait_started(conn.caller)
        nursery.start_soon(run)

    def cancel(self, conn: Connection, target: RequestId) -> bool:
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
                self._service.cancel_waiter(step.waiter)  # out of the queue, now
            wait.cancelled = True
            wait.scope.cancel()
            withdrawn = True
        if withdrawn:
            self._timer.reschedule()
        return withdrawn

    def _track(self, conn: Connection, req: Acquire, wait: Wait) -> None:
        """Give a parked waiter the event its resolution sets."""
        step = wait.step
        if isinstance(step, Parked):
            self._events[step.waiter.id] = trio.Event()
            self._parked[step.waiter.id] = (conn, req, wait)
            self._timer.reschedule()  # its deadline may be the earliest now

    async def _wait_for_reply(self, conn: Connection, req: Acquire, wait: Wait) -> Reply:
        """Do the waiting each step asks for until the service has the reply."""
        service = self._service
        while True:
            step = wait.step
            if isinstance(step, Reply):
                return step
            assert step is not None, "remote waits are answered by answer_remote"
            if isinstance(step, WaitForRoom):
                with trio.move_on_after(step.delay_ms / 1000):
                    await self._stopping.wait()
                if self._stopping.is_set():
                    raise shutting_down()
                service.deferred = False
                wait.step = service.acquire_after_wait(conn.caller, conn.id, req, step)
                wait.deferred = service.deferred
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
                    service.cancel_waiter(waiter)
                wait.step = service.parked_reply(req, waiter)
                wait.deferred = False  # granted or timed out by a commit already done

    # ---------------------------------------------------- a remote backend

    async def answer_remote_now(self, conn: Connection, request: Request, started: float) -> None:
        """A request a remote backend (etcd) decides without waiting in a queue.

        The connection's own task awaits it before reading its next line: one
        request in flight per connection, taking effect in the order sent,
        without a task of its own (whose start and end cost as much CPU as
        the reply's etcd call, measured on B1). A grant whose reply cannot be
        written is released.
        """
        backend = self._service.backend
        try:
            answer = backend.answer(
                conn.caller, conn.id, request, pending=conn.waiting, listens=conn.events
            )
            await self._send_remote(conn, request, answer)
        finally:
            self._outbox.observe(request.op, started)

    async def _send_remote(
        self, conn: Connection, request: Request, answer: Awaitable[RemoteReply]
    ) -> None:
        """Write the backend's answer to ``request``, or its error; release an undelivered grant."""
        outbox = self._outbox
        try:
            reply = await answer
            outbox.send(conn, encode_result(request.id, reply.result), reply.grant)
        except ProtocolError as exc:
            outbox.reply_error(conn, request, exc)
        except Exception:
            outbox.reply_internal(conn, request)
        finally:
            outbox.flush()  # the error replies above wait in the outbox

    def answer_remote(
        self, conn: Connection, nursery: trio.Nursery, request: Acquire, started: float
    ) -> None:
        """A blocking acquire a remote backend (etcd) decides, answered in a task of its own.

        It is registered like a parked one, so ``cancel`` and shutdown can
        withdraw it (the backend leaves the queue when its task is
        cancelled); a grant that is withdrawn or cannot be written is
        released.
        """
        backend = self._service.backend
        stopping = self._stopping
        pending = conn.waiting
        # The connection's next line waits until it is parked (bounded by
        # the pending-acquire limit, it must not hold up later requests
        # while it waits, but a status right behind it must count it).
        conn.remote_busy = done = trio.Event()
        wait = Wait(None)
        conn.waits.setdefault(request.id, []).append(wait)
        conn.waiting += 1

        async def answer() -> RemoteReply:
            reply: RemoteReply | None = None
            with wait.scope:
                reply = await backend.answer(
                    conn.caller, conn.id, request, pending=pending, parked=done, listens=conn.events
                )
                wait.step = Reply(None)  # answered: a cancel now comes too late
            if reply is None or wait.cancelled:
                if reply is not None and reply.grant is not None:
                    backend.release_undelivered(reply.grant)
                if stopping.is_set():
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
                wait.leave(conn, request.id)
                if conn.remote_busy is done:
                    conn.remote_busy = None
                done.set()
                self._outbox.observe(request.op, started)

        nursery.start_soon(run)

    # --------------------------------------------------------------- breaks

    def finish_break_in_task(
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
        service, outbox, stopping = self._service, self._outbox, self._stopping

        async def run() -> None:
            finished = False
            try:
                while not service.break_ready(pending) and not stopping.is_set():
                    woken = trio.Event()
                    pending.wake = woken.set
                    with trio.move_on_after(service.ms_until(pending.deadline) / 1000):
                        await woken.wait()
                finished = True
                result = service.finish_break(conn.caller, pending)
                outbox.queue(conn, request.id, encode_result(request.id, result))
            except ProtocolError as exc:
                outbox.reply_error(conn, request, exc)
            except Exception:
                outbox.reply_internal(conn, request)
            finally:
                if not finished:
                    with contextlib.suppress(Exception):
                        service.finish_break(conn.caller, pending)
                outbox.flush()
                outbox.observe(request.op, started)
                self._timer.reschedule()

        self._breaks.add(pending)
        nursery.start_soon(self._forget_break_after, pending, run)

    async def _forget_break_after(
        self, pending: PendingBreak, run: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            await run()
        finally:
            self._breaks.discard(pending)
