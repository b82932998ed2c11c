"""Requests decided by a remote backend (etcd), awaited in the request's own task.

The embedded path (``LockService.acquire``/``answer``) is synchronous; with
a remote backend every lock operation waits for the backend's commit, so
:class:`RemoteService` answers them as coroutines. What is per host stays
exactly as in the embedded path and is the same code (``LockService``):
the rules (``authorize``), the pending limit per connection, the rate limit
and its waits, the counters. ``hello``, ``rules`` and ``stats`` are still
answered by ``LockService.answer`` without the backend, so they answer
while etcd is down; everything else fails with ``BACKEND_UNAVAILABLE``
after at most ``etcd_timeout`` (a blocking acquire keeps waiting instead,
within its own ``timeoutMs``).

Lease-loss events (docs/contract.md §12) are told for every hold granted on one of
this daemon's listening connections: a break sent to this daemon (which
waits for that holder to stop, as on the embedded backend), a re-take
through it, and the end of its etcd session (``cause: "session"``: the
``releaseOnClose`` holds tied to it are gone); a break or re-take through
another host's daemon, an expiry in etcd and a session lease etcd ended
are seen by the backend's watch of the holds (``HoldWatch``,
:meth:`RemoteService.follow_losses`) and told the moment it sees them. A
break through another host's daemon asks this one, through etcd, to stop
a listening holder first (:meth:`RemoteService.await_stop`; the backend
ends the hold after it): docs/etcd-design.md §6a.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from lockd.core import Refused
from lockd.daemon.backends import BackendUnavailable, RemoteBackend, RemoteHold
from lockd.daemon.events import RETAKE, SESSION, PendingBreak, Watched
from lockd.daemon.holder import holder_process
from lockd.daemon.leases import Lease
from lockd.daemon.protocol import (
    Acquire,
    Break,
    Hello,
    ListLocks,
    ProtocolError,
    Release,
    Renew,
    Request,
    Rules,
    Stats,
    Status,
)
from lockd.daemon.remoteviews import RemoteViews
from lockd.daemon.service import BrokenHold, LockService, timed_out, visible_locks
from lockd.identity import Caller
from lockd.logfmt import kv
from lockd.timefmt import format_epoch_ms

log = logging.getLogger("lockd.daemon.remote")

#: answered by ``LockService.answer`` at once, backend or not.
LOCAL_OPS = (Hello, Rules, Stats)


@dataclass(slots=True)
class RemoteReply:
    """Write ``result``; ``grant`` is the hold it hands out, released if it cannot be written."""

    result: Any
    grant: RemoteHold | None = None


class RemoteService:
    def __init__(self, service: LockService, backend: RemoteBackend) -> None:
        self.service = service
        self.backend = backend
        #: handles this daemon is releasing now: their deletion is no loss.
        self._releasing: set[str] = set()
        #: the wire documents of the backend's holds (a grant, status, list).
        #: ``pid_place``: where this daemon's pids mean something (``alive``).
        self.views = RemoteViews(service.clock, backend.node, getattr(backend, "pid_place", None))

    @staticmethod
    def awaits(request: Request) -> bool:
        """True for the requests the backend must decide (every one but hello, rules, stats)."""
        return not isinstance(request, LOCAL_OPS)

    async def answer(
        self,
        caller: Caller,
        conn: int,
        request: Request,
        *,
        pending: int,
        parked: trio.Event | None = None,
        listens: bool = False,
    ) -> RemoteReply:
        """Decide ``request``; raises ProtocolError (BACKEND_UNAVAILABLE among them).

        ``listens``: connection ``conn`` asked for events (its grants say so
        in etcd, so a break through another daemon waits for them).

        A blocking acquire sets ``parked`` once it waits (queued, waiting
        for room under the rate limit, or for etcd): see
        ``RemoteBackend.acquire``.

        Every request but a blocking acquire (which waits within its own
        ``timeoutMs``) is answered within the backend's timeout as a whole,
        however many calls to etcd it takes; a write cut short is cleaned
        up by the backend (a grant that may have committed is released).
        """
        try:
            if isinstance(request, Acquire) and request.timeout_ms is not None:
                return await self._acquire(caller, conn, request, pending, parked, listens)
            told: list[Watched] = []
            if isinstance(request, Break):
                if self.service.break_grace_ms > 0:
                    # Not within the time limit below: a listening holder, here
                    # or on another host, may take up to break_grace to stop.
                    # The backend bounds each of its etcd calls itself.
                    return RemoteReply(await self._break_waiting(caller, request))
                told = await self._wait_for_listeners(caller, request)
            # A bare cancel scope: trio.fail_after wraps one in a generator,
            # which costs as much again on every request.
            with trio.CancelScope(relative_deadline=self.backend.timeout):
                if isinstance(request, Acquire):
                    return await self._acquire(caller, conn, request, pending, listens=listens)
                if isinstance(request, Break):
                    return RemoteReply(await self._break(caller, request, told))
                return RemoteReply(await self._answer(caller, request))
            raise BackendUnavailable(f"no answer within {self.backend.timeout:g} s")
        except BackendUnavailable as exc:
            self.service.stats.count("backendUnavailable")
            log.warning(kv(event="backend_unavailable", op=request.op, error=exc))
            raise ProtocolError(
                "BACKEND_UNAVAILABLE",
                "the etcd backend did not answer in time; retry later",
            ) from None

    def release_undelivered(self, grant: Lease | RemoteHold) -> None:
        assert not isinstance(grant, Lease), "a remote backend's grants are its own holds"
        self.service.stats.count("releases")
        log.info(kv(event="released_undelivered", key=grant.key, principal=grant.principal))
        self.backend.release_undelivered(grant)

    def connection_closed(self, conn: int, *, release_bound: bool) -> None:
        self.service.losses.connection_closed(conn)
        if release_bound:
            self.backend.connection_closed(conn)

    def gauges(self) -> dict[str, object]:
        return self.backend.gauges()

    # --------------------------------------------------------- loss events

    def session_lost(self, holds: Sequence[RemoteHold]) -> None:
        """The daemon's etcd session ended: the bound holds granted here went with it."""
        service = self.service
        at = service.notices.at()
        for hold in holds:
            event = service.losses.lost(hold.handle, SESSION, at)
            if event is not None:
                service.on_lost(event)

    def follow_losses(self, watch: HoldWatchLike) -> None:
        """Have ``watch`` follow, in the backend, each hold whose holder listens."""
        losses = self.service.losses
        watch.on_loss = self.hold_lost
        watch.on_released = losses.forget
        watch.is_watched = lambda handle: losses.watched(handle) is not None
        watch.watched_holds = lambda: [(w.key, w.handle) for w in losses.holds()]
        watch.any_watched = lambda: len(losses) > 0
        watch.await_stop = self.await_stop
        losses.on_watch = lambda watched: watch.follow(watched.handle, watched.fence)

    def hold_lost(
        self, key: str, handle: str, cause: str, by: str | None, reason: str | None
    ) -> None:
        """The backend saw a watched hold end without this daemon: tell its holder now."""
        if handle in self._releasing:
            return  # its own release, through this daemon: not a loss
        service = self.service
        event = service.losses.lost(handle, cause, service.notices.at(), by=by, reason=reason)
        if event is not None:
            log.info(kv(event="hold_lost", key=key, cause=cause, by=by))
            service.on_lost(event)

    async def _wait_for_listeners(self, caller: Caller, request: Break) -> list[Watched]:
        """A break of holds granted on this daemon's listening connections: tell, then wait.

        Each holder still in etcd is told at once and keeps its hold until it
        says ``stopped``, closes, or ``break_grace`` passes; the break itself
        (one transaction) follows. Returns the holds told.
        """
        service, losses, key = self.service, self.service.losses, request.key
        watched = losses.of_key(key)
        if not watched and not losses.stopping_of_key(key):
            return []
        service.gate.authorize(caller, "break", key)
        listening: list[Watched] = []
        with trio.CancelScope(relative_deadline=self.backend.timeout) as scope:
            for hold in watched:
                if await self.backend.find(key, hold.handle) is not None:
                    listening.append(hold)
                else:
                    losses.forget(hold.handle)  # gone already (expired): nothing to tell
        if scope.cancelled_caught:
            raise BackendUnavailable(f"no answer within {self.backend.timeout:g} s")
        now = service.clock.boot_ms()
        pending, events = losses.begin_break(
            key,
            request.reason,
            caller.principal,
            listening,
            [],
            now + service.break_grace_ms,
            service.notices.at(),
        )
        for event in events:
            service.on_lost(event)
        await self._until_stopped(pending)
        return pending.stopping

    async def _break_waiting(self, caller: Caller, request: Break) -> dict[str, Any]:
        """A break that gives every listening holder its ``break_grace`` (docs/contract.md §12.1).

        In the backend's first transaction every hold nobody listens for
        ends; those of this daemon's listening connections stay while their
        holders are told here and waited for, those of other daemons' while
        their daemons do the same (etcd-design.md §6a). Answered once all
        are gone.
        """
        service, losses, key = self.service, self.service.losses, request.key
        service.gate.authorize(caller, "break", key)
        watched = losses.of_key(key)
        keep = frozenset(
            {w.handle for w in watched} | {w.handle for w in losses.stopping_of_key(key)}
        )
        told: list[Watched] = []

        async def stop_local(present: list[str]) -> None:
            still = set(present)
            for gone in (w for w in watched if w.handle not in still):
                losses.forget(gone.handle)  # ended already (expired): nothing to tell
            listening = [w for w in watched if w.handle in still]
            if not listening and not losses.stopping_of_key(key):
                return
            pending, events = losses.begin_break(
                key,
                request.reason,
                caller.principal,
                listening,
                [],
                service.clock.boot_ms() + service.break_grace_ms,
                service.notices.at(),
            )
            told.extend(pending.stopping)
            for event in events:
                service.on_lost(event)
            await self._until_stopped(pending)

        deleted = await self.backend.break_lock(
            key,
            by=caller.principal,
            reason=request.reason,
            grace_ms=service.break_grace_ms,
            keep=keep,
            stop_local=stop_local,
        )
        for hold in deleted:
            losses.forget(hold.handle)
        handles = {hold.handle for hold in deleted}
        broken: list[BrokenHold] = [*deleted, *(w for w in told if w.handle not in handles)]
        broken.sort(key=lambda hold: hold.fence)
        return service.break_result(caller, key, request.reason, broken)

    async def await_stop(self, ask: StopRequest) -> bool:
        """A break through another daemon asks a hold granted here to stop (holdstop.py).

        Its holder is told at once (with who broke it and why) and keeps the
        hold until it says ``stopped``, closes, or the break's grace passes;
        then the caller deletes the hold. False when the hold is not watched
        any more (released, told already, its connection gone): nothing to do.
        """
        service, losses = self.service, self.service.losses
        watched = losses.watched(ask.handle)
        if watched is None:
            return False
        now = service.clock.boot_ms()
        pending, events = losses.begin_break(
            ask.key,
            ask.reason or "",
            ask.by or "",
            [watched],
            [],
            now + ask.grace_ms,
            service.notices.at(),
        )
        log.info(kv(event="break_waits", key=ask.key, by=ask.by, holders=len(events)))
        for event in events:
            service.on_lost(event)
        await self._until_stopped(pending)
        return True

    async def _until_stopped(self, pending: PendingBreak) -> None:
        """Wait until every holder ``pending`` told stopped, or its grace passed."""
        service = self.service
        try:
            while not service.break_ready(pending):
                woken = trio.Event()
                pending.wake = woken.set
                with trio.move_on_after(service.ms_until(pending.deadline) / 1000):
                    await woken.wait()
        finally:
            service.losses.end_break(pending)

    # ------------------------------------------------------------ acquire

    async def _acquire(
        self,
        caller: Caller,
        conn: int,
        req: Acquire,
        pending: int,
        parked: trio.Event | None = None,
        listens: bool = False,
    ) -> RemoteReply:
        service = self.service
        service.gate.check_acquire(caller, req, pending=pending)
        # The hold records the process that will use it (docs/contract.md §12.2).
        if req.pid is not None:
            holder = holder_process(caller, req.pid)
            caller = dataclasses.replace(
                caller, pid=holder.pid or 0, process=holder.process, start=holder.start
            )
        now = service.clock.boot_ms()
        if req.timeout_ms is None:
            retry_after = service.gate.take_attempt(caller, now)
            if retry_after is not None:
                raise service.gate.rate_limited(retry_after)
            outcome = await self.backend.acquire(req, caller, conn, None, listens=listens)
        else:
            # Over the rate limit a blocking acquire waits for room, within
            # its own timeout (docs/contract.md §6), as the embedded path does.
            deadline = now + req.timeout_ms
            while (retry_after := service.gate.take_attempt(caller, now)) is not None:
                if now >= deadline:
                    service.stats.count("rateLimited")
                    raise timed_out(req)
                if parked is not None:
                    parked.set()  # it waits for room: the connection goes on
                await trio.sleep(min(retry_after, deadline - now) / 1000)
                now = service.clock.boot_ms()
            left = max(0, deadline - now) / 1000
            outcome = await self.backend.acquire(req, caller, conn, left, parked, listens=listens)
        if isinstance(outcome, Refused):
            raise ProtocolError(
                "INVALID_REQUEST",
                outcome.message,
                details={"field": outcome.field, **outcome.details},
            )
        if outcome is None:
            if req.timeout_ms is None:
                return RemoteReply(None)
            service.stats.count("timeouts")
            raise timed_out(req)
        service.stats.count("grants")  # a re-take is a grant too, as in the engine
        if parked is not None and parked.is_set():
            service.stats.count("handoffs")  # it waited: a release, expiry or break handed it over
        if outcome.retake:
            service.stats.count("retakes")
            self._tell_retaken(caller, outcome)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                kv(event="granted", key=req.key, principal=caller.principal, fence=outcome.fence)
            )
        return RemoteReply(self.views.handle_view(outcome), outcome)

    def _tell_retaken(self, caller: Caller, hold: RemoteHold) -> None:
        """A re-take through this daemon ended the same owner's holds granted here: tell them."""
        service = self.service
        if hold.owner is None or not len(service.losses):
            return
        for watched in service.losses.same_owner(hold.key, caller.principal, hold.owner):
            if watched.handle != hold.handle:
                event = service.losses.lost(
                    watched.handle, RETAKE, service.notices.at(), by=caller.principal
                )
                if event is not None:
                    service.on_lost(event)

    # ------------------------------------------------------ the other ops

    async def _answer(self, caller: Caller, request: Request) -> Any:
        service, backend = self.service, self.backend
        if isinstance(request, Release):
            losses = service.losses
            if losses.stopping(request.handle) is not None:
                # Told of a break: its release is its stop. The break that
                # waits for it deletes the hold; the handle is fenced.
                losses.hold_ended(request.handle)
                return {"released": False, "reason": "not_holder"}
            # Its deletion, seen by the watch of the holds, is no loss.
            self._releasing.add(request.handle)
            try:
                released = await backend.release(request.key, request.handle)
            finally:
                self._releasing.discard(request.handle)
                # Also when it failed: the backend ends the hold itself once
                # etcd answers (its clean-up list), and that deletion, seen by
                # the watch of the holds, is what the holder asked for, no loss.
                losses.forget(request.handle)
            if not released:
                return {"released": False, "reason": "not_holder"}
            service.stats.count("releases")
            if log.isEnabledFor(logging.DEBUG):
                log.debug(kv(event="released", key=request.key, principal=caller.principal))
            return {"released": True}
        if isinstance(request, Renew):
            if service.losses.stopping(request.handle) is not None:
                service.gate.authorize(caller, "renew", request.key)
                return {"renewed": False, "reason": "lease_lost"}  # broken; its holder was told
            hold = await backend.find(request.key, request.handle)
            if hold is None:
                service.gate.authorize(caller, "renew", request.key)
                return {"renewed": False, "reason": "lease_lost"}
            service.gate.authorize(caller, "renew", request.key, mode=hold.mode, limit=hold.limit)
            renewed = await backend.renew(hold, request.ttl_ms)
            if renewed is None:
                return {"renewed": False, "reason": "lease_lost"}
            service.stats.count("renewals")
            return {"renewed": True, "leaseExpiresAt": format_epoch_ms(renewed.expires_at)}
        if isinstance(request, Status):
            return self.views.status_view(await backend.status(request.key))
        if isinstance(request, ListLocks):
            service.gate.authorize(caller, "list")
            page, after = await backend.list_held(request.prefix, request.limit, request.after)
            return {
                "locks": visible_locks(caller, map(self.views.status_view, page)),
                "next": after,
            }
        raise AssertionError(f"unhandled op {request.op}")

    async def _break(self, caller: Caller, request: Break, told: list[Watched]) -> dict[str, Any]:
        """Delete every hold of the key; ``told``: the holders told first (they count as broken).

        A told hold that ended while its holder was stopping (its lease ran
        out) is gone from etcd, and still reported: as on the embedded backend.
        """
        self.service.gate.authorize(caller, "break", request.key)
        deleted = await self.backend.break_lock(
            request.key,
            by=caller.principal,
            reason=request.reason,
            grace_ms=self.service.break_grace_ms,
        )
        losses = self.service.losses
        for hold in deleted:  # told already (see _wait_for_listeners), or not listening
            losses.forget(hold.handle)
        handles = {hold.handle for hold in deleted}
        broken: list[BrokenHold] = [*deleted, *(w for w in told if w.handle not in handles)]
        broken.sort(key=lambda hold: hold.fence)
        return self.service.break_result(caller, request.key, request.reason, broken)


class StopRequest(Protocol):
    """A break through another daemon asking a hold granted here to stop (etcd: ``StopAsked``)."""

    @property
    def key(self) -> str: ...
    @property
    def handle(self) -> str: ...
    @property
    def by(self) -> str | None: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def grace_ms(self) -> int: ...


class HoldWatchLike(Protocol):
    """What :meth:`RemoteService.follow_losses` wires up (etcd: ``HoldWatch``)."""

    on_loss: Callable[[str, str, str, str | None, str | None], None]
    on_released: Callable[[str], object]
    is_watched: Callable[[str], bool]
    watched_holds: Callable[[], list[tuple[str, str]]]
    any_watched: Callable[[], bool]
    await_stop: Callable[[StopRequest], Awaitable[bool]]

    def follow(self, handle: str, fence: int) -> None: ...
