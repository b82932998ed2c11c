"""The fast path: an uncontended ``tryAcquire`` and a lone holder's ``release``, with less work.

Under many clients each doing try + release in a loop (bench B3), most
requests the daemon answers are a ``tryAcquire`` of a key nobody holds
and the ``release`` of that hold. :class:`FastPath` answers exactly those,
from the parsed request to the reply document, with what they need and
nothing else: one read of the boot clock (and one of the wall clock for
a grant's ``leaseExpiresAt``), no :class:`~lockd.daemon.leases.Waiter`
made for the request, no search of the deadline heaps, no ``HolderProcess``
record; the server moves its expiry timer only when the new lease runs
out before the timer's target (:meth:`ExpiryTimer.lease_added
<lockd.daemon.timer.ExpiryTimer.lease_added>`).

It answers as :class:`~lockd.daemon.service.LockService` would, in the same
order: the access rules and their refusals (:class:`~lockd.daemon.gate.Gate`,
a denied attempt counted by the rate limit), the rate limit, the engine's
decision (:func:`lockd.core.admit_free`, applied by the engine's
:class:`~lockd.daemon.lonekeys.LoneKeys`), the commit (the server's group
commit: the reply waits for it, and becomes STORAGE_UNAVAILABLE when it
fails), the counters and the reply. Before anything happens it checks
that the request is one it answers -- a ``tryAcquire`` naming no other
process, a key that is free and loaded, no deadline due, grants not on
hold after an accepted data loss, no watched hold an owner could re-take;
a ``release`` of a key's only holder with nobody queued, not being broken
-- and answers None otherwise, having done nothing: the server then
takes the usual path, which answers everything.

``tests/unit/test_fastpath.py`` runs the same request sequences through
both paths and requires the same answers and the same engine state.
"""

from __future__ import annotations

import logging
from typing import Any

from lockd.daemon.clock import Clock
from lockd.daemon.commits import Commits
from lockd.daemon.engine import Lease, LockEngine
from lockd.daemon.events import LossWatch
from lockd.daemon.gate import Gate
from lockd.daemon.holder import holder_process
from lockd.daemon.protocol import Acquire, Release, Request
from lockd.daemon.replies import Replies
from lockd.daemon.stats import StatsRecorder
from lockd.daemon.store import StorageUnavailable, Store
from lockd.identity import Caller
from lockd.logfmt import kv

# The service's logger: the fast path logs what the service would.
log = logging.getLogger("lockd.daemon.service")


class FastReply:
    """A fast-path answer: the wire result, and the lease it hands out (if any)."""

    __slots__ = ("grant", "result")

    def __init__(self, result: dict[str, Any], grant: Lease | None = None) -> None:
        self.result = result
        self.grant = grant


class FastPath:
    """Answers the common case or says None; the service's parts do each step."""

    def __init__(
        self,
        engine: LockEngine,
        store: Store,
        gate: Gate,
        commits: Commits,
        losses: LossWatch,
        replies: Replies,
        clock: Clock,
        stats: StatsRecorder,
    ) -> None:
        self._lone = engine.lone
        self._store = store
        self._gate = gate
        self._commits = commits
        self._losses = losses
        self._replies = replies
        self._clock = clock
        self._stats = stats

    def answer(self, caller: Caller, conn: int, request: Request) -> FastReply | None:
        """The reply to ``request`` from connection ``conn``, or None: ask the service.

        Only under the server's group commit, so that every fast answer's
        reply waits for the commit of its batch. Refusals are raised as the
        service raises them (:class:`~lockd.daemon.protocol.ProtocolError`).
        """
        if not self._commits.group_commit:
            return None
        kind = type(request)
        try:
            if kind is Acquire:
                return self.try_acquire(caller, conn, request)  # type: ignore[arg-type]
            if kind is Release:
                return self.release(caller, request)  # type: ignore[arg-type]
        except StorageUnavailable as exc:  # as LockService.acquire / answer
            raise self._commits.read_failed(request.op, exc) from None
        return None

    def try_acquire(self, caller: Caller, conn: int, req: Acquire) -> FastReply | None:
        """``tryAcquire`` of a free key: the grant, or None before anything was done."""
        if req.timeout_ms is not None:
            return None  # a blocking acquire: the service's (it may wait)
        pid = caller.pid
        if req.pid is not None and req.pid != pid:
            return None  # another process named: the service verifies it
        if req.owner is not None and len(self._losses):
            return None  # a watched hold of this owner may be re-taken: the service tells
        if self._store.grants_held_until:
            return None  # grants on hold, or the hold just ended: the service says which
        key = req.key
        now = self._clock.boot_ms()
        lone = self._lone
        if not lone.can_grant(now, key, req.mode, req.limit):
            return None
        gate = self._gate
        gate.authorize_acquire(caller, req)
        # Gate.check_pending passes every tryAcquire: it never waits.
        retry_after = gate.take_attempt(caller, now)
        if retry_after is not None:
            raise gate.rate_limited(retry_after)
        principal = caller.principal
        # The peer itself (no other pid was named, above): no /proc read.
        holder = holder_process(caller, None)
        lease = lone.grant(
            now,
            key,
            ttl_ms=req.ttl_ms,
            principal=principal,
            owner=req.owner,
            conn=conn,
            release_on_close=req.release_on_close,
            mode=req.mode,
            limit=req.limit,
            pid=holder.pid,
            process=holder.process,
            pid_start=holder.start,
        )
        self._commits.commit_request()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(kv(event="granted", key=key, principal=principal, fence=lease.fence))
        return FastReply(self._replies.lease_view(lease, now), lease)

    def release(self, caller: Caller, req: Release) -> FastReply | None:
        """``release`` by a key's only holder, nobody queued: released, or None before anything."""
        handle = req.handle
        losses = self._losses
        if losses.stopping(handle) is not None:
            return None  # told of a break: the service answers not_holder
        key = req.key
        if not self._lone.release(self._clock.boot_ms(), key, handle):
            return None
        self._commits.commit_request()
        if len(losses):
            losses.forget(handle)
        self._stats.count("releases")
        if log.isEnabledFor(logging.DEBUG):
            log.debug(kv(event="released", key=key, principal=caller.principal))
        return FastReply({"released": True})
