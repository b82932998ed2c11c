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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from lockd.core import Refused
from lockd.daemon.backends import BackendUnavailable, RemoteBackend, RemoteHold, RemoteStatus
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
from lockd.daemon.service import LockService, timed_out, visible_locks
from lockd.daemon.waiterview import waiter_list
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
    ) -> RemoteReply:
        """Decide ``request``; raises ProtocolError (BACKEND_UNAVAILABLE among them).

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
                return await self._acquire(caller, conn, request, pending, parked)
            # A bare cancel scope: trio.fail_after wraps one in a generator,
            # which costs as much again on every request.
            with trio.CancelScope(relative_deadline=self.backend.timeout):
                if isinstance(request, Acquire):
                    return await self._acquire(caller, conn, request, pending)
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
        if release_bound:
            self.backend.connection_closed(conn)

    def gauges(self) -> dict[str, object]:
        return self.backend.gauges()

    # ------------------------------------------------------------ acquire

    async def _acquire(
        self,
        caller: Caller,
        conn: int,
        req: Acquire,
        pending: int,
        parked: trio.Event | None = None,
    ) -> RemoteReply:
        service = self.service
        service.check_acquire(caller, req, pending=pending)
        now = service.clock.boot_ms()
        if req.timeout_ms is None:
            retry_after = service.take_attempt(caller, now)
            if retry_after is not None:
                raise service.rate_limited(retry_after)
            outcome = await self.backend.acquire(req, caller, conn, None)
        else:
            # Over the rate limit a blocking acquire waits for room, within
            # its own timeout (SPEC 6), as the embedded path does.
            deadline = now + req.timeout_ms
            while (retry_after := service.take_attempt(caller, now)) is not None:
                if now >= deadline:
                    service.stats.count("rateLimited")
                    raise timed_out(req)
                if parked is not None:
                    parked.set()  # it waits for room: the connection goes on
                await trio.sleep(min(retry_after, deadline - now) / 1000)
                now = service.clock.boot_ms()
            left = max(0, deadline - now) / 1000
            outcome = await self.backend.acquire(req, caller, conn, left, parked)
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
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                kv(event="granted", key=req.key, principal=caller.principal, fence=outcome.fence)
            )
        return RemoteReply(self.handle_view(outcome), outcome)

    # ------------------------------------------------------ the other ops

    async def _answer(self, caller: Caller, request: Request) -> Any:
        service, backend = self.service, self.backend
        if isinstance(request, Release):
            if not await backend.release(request.key, request.handle):
                return {"released": False, "reason": "not_holder"}
            service.stats.count("releases")
            if log.isEnabledFor(logging.DEBUG):
                log.debug(kv(event="released", key=request.key, principal=caller.principal))
            return {"released": True}
        if isinstance(request, Renew):
            hold = await backend.find(request.key, request.handle)
            if hold is None:
                service.authorize(caller, "renew", request.key)
                return {"renewed": False, "reason": "lease_lost"}
            service.authorize(caller, "renew", request.key, mode=hold.mode, limit=hold.limit)
            renewed = await backend.renew(hold, request.ttl_ms)
            if renewed is None:
                return {"renewed": False, "reason": "lease_lost"}
            service.stats.count("renewals")
            return {"renewed": True, "leaseExpiresAt": format_epoch_ms(renewed.expires_at)}
        if isinstance(request, Status):
            return self.status_view(await backend.status(request.key))
        if isinstance(request, ListLocks):
            service.authorize(caller, "list")
            page, after = await backend.list_held(request.prefix, request.limit, request.after)
            return {"locks": visible_locks(caller, map(self.status_view, page)), "next": after}
        if isinstance(request, Break):
            return await self._break(caller, request)
        raise AssertionError(f"unhandled op {request.op}")

    async def _break(self, caller: Caller, request: Break) -> dict[str, Any]:
        self.service.authorize(caller, "break", request.key)
        broken = await self.backend.break_lock(request.key)
        return self.service.break_result(caller, request.key, request.reason, broken)

    # ------------------------------------------------------------ views

    def handle_view(self, hold: RemoteHold) -> dict[str, Any]:
        """The handle of a grant; ``ttlMs`` is the effective TTL (whole seconds)."""
        return {
            "key": hold.key,
            "handle": hold.handle,
            "fence": hold.fence,
            "owner": hold.owner,
            "ttlMs": hold.ttl_ms,
            "leaseExpiresAt": format_epoch_ms(hold.expires_at),
        }

    def holder_view(self, hold: RemoteHold, now: int) -> dict[str, Any]:
        return {
            "heldBy": hold.principal,
            "owner": hold.owner,
            "fence": hold.fence,
            "leaseExpiresAt": format_epoch_ms(hold.expires_at),
            "expiresInMs": max(0, hold.expires_at - now),
            "pid": hold.pid,
            "process": hold.process,
            "node": hold.node,
        }

    def status_view(self, st: RemoteStatus) -> dict[str, Any]:
        """SPEC 3, 10, 11: as the embedded status, plus ``node`` on each holder."""
        now = self.service.clock.wall_ms()
        holders = [self.holder_view(hold, now) for hold in st.holds[:MAX_LISTED_HOLDERS]]
        first = st.holds[0] if st.holds else None
        return {
            "key": st.key,
            "held": bool(holders),
            **(holders[0] if holders else dict.fromkeys(HOLDER_FIELDS)),
            "waiters": st.waiters,
            "waiterList": waiter_list(st.queue, now),
            "mode": first.mode if first else None,
            "limit": first.limit if first else None,
            "holderCount": len(st.holds),
            "holders": holders,
        }


#: holders listed per key by status and list (SPEC 10).
MAX_LISTED_HOLDERS = 100
HOLDER_FIELDS = (
    "heldBy",
    "owner",
    "fence",
    "leaseExpiresAt",
    "expiresInMs",
    "pid",
    "process",
    "node",
)
