"""The daemon's decisions for each request, synchronous and free of sockets.

:class:`LockService` decides everything a request needs decided; the trio
server (``server.py``) only reads requests, waits, and writes replies. Every
method runs to completion without awaiting, so the engine never sees two
requests interleaved, and a commit always precedes the reply built from it.

Every op but ``acquire``/``tryAcquire`` is one call, :meth:`LockService.answer`,
which returns the wire result or raises :class:`ProtocolError`.

An acquire may have to wait, so it is answered in steps. The server calls
:meth:`LockService.acquire` and gets one of

* :class:`Reply` -- write ``result`` now. If ``grant`` is set the result hands
  out that lease, and the server must call :meth:`release_undelivered` when
  the reply cannot be written (nobody could ever present its handle);
* :class:`WaitForRoom` -- over the rate limit with time left: sleep
  ``delay_ms`` (until room comes, or out the timeout when it would come too
  late; or until shutdown), then call :meth:`acquire_after_wait`, which
  answers with a step again;
* :class:`~lockd.daemon.engine.Parked` -- queued in the engine: wait until
  :attr:`on_resolved` fires for the waiter (or the connection goes, or the
  daemon stops), call :meth:`cancel_waiter` (a no-op once resolved), then
  :meth:`parked_reply` for the final :class:`Reply`.

Refusals (access denied, too many pending acquires on the connection, rate
limited, timed out) are raised as :class:`ProtocolError` at any step. The
decision order of one acquire is: access (policy) -> pending limit per
connection -> rate limit -> engine -> commit -> result.

The server also asks the service when the engine next needs time to pass
(:meth:`next_deadline`, :meth:`ms_until`, then :meth:`tick`) and for the
engine's gauges (:meth:`gauges`); it never touches the engine or the clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lockd import __version__
from lockd.contract import HOLDER_FIELDS
from lockd.daemon.clock import Clock
from lockd.daemon.engine import (
    EXCLUSIVE,
    EXPIRY_CHUNK,
    Busy,
    Deadlock,
    KeyStatus,
    Lease,
    LockEngine,
    Parked,
    Refused,
    TimedOut,
    Waiter,
)
from lockd.daemon.events import EXPIRED, RETAKE, LossEvent, LossWatch, PendingBreak
from lockd.daemon.holder import holder_fields, holder_process
from lockd.daemon.memory import TrimAfterDrop
from lockd.daemon.protocol import (
    PROTOCOL_VERSION,
    Acquire,
    Break,
    Hello,
    ListLocks,
    ProtocolError,
    Release,
    Renew,
    Request,
    RequestId,
    Rules,
    Stats,
    Status,
    Stopped,
)
from lockd.daemon.stats import StatsRecorder
from lockd.daemon.store import StorageUnavailable, Store
from lockd.daemon.waiterview import QueuedWaiter, concerns, waiter_list
from lockd.identity import Caller
from lockd.logfmt import LogThrottle, kv
from lockd.rules.policy import PASS_ROLES
from lockd.timefmt import format_epoch_ms

if TYPE_CHECKING:
    from lockd.daemon.backends import LockBackend, RemoteBackend
    from lockd.daemon.ratelimit import RuleCpuBudget

log = logging.getLogger("lockd.daemon.service")

#: blocking acquires one connection may have waiting at once (docs/contract.md leaves it open).
DEFAULT_MAX_PENDING_PER_CONNECTION = 1024
#: how long a break waits for a holder listening for events to stop (docs/contract.md §12).
DEFAULT_BREAK_GRACE_MS = 5000
#: blocking acquires one principal may have waiting at once, all its connections together.
DEFAULT_MAX_PENDING_PER_USER = 1024
#: the ``retryAfterMs`` hint of a refusal over ``max_pending_per_user``.
PENDING_RETRY_HINT_MS = 1000


class Decision(Protocol):
    @property
    def allowed(self) -> bool: ...

    @property
    def reason(self) -> str: ...

    @property
    def cpu_s(self) -> float:
        """CPU seconds a rule evaluation behind this decision used (0 when none ran)."""
        ...


class PolicyLike(Protocol):
    def decide(
        self, caller: Caller, op: str, key: str, mode: str = ..., limit: int = ...
    ) -> Decision: ...

    def rules_result(self) -> dict[str, Any]: ...


class BrokenHold(Protocol):
    """What a break reports of a hold it ended (an engine lease or a remote hold)."""

    @property
    def principal(self) -> str: ...
    @property
    def owner(self) -> str | None: ...
    @property
    def fence(self) -> int: ...


class RateLimiterLike(Protocol):
    #: attempts allowed per principal per window.
    limit: int

    def try_take(self, principal: str, now_ms: int) -> int | None: ...


@dataclass(slots=True)
class Reply:
    """Write ``result`` now; ``grant`` is the lease it hands out, if any."""

    result: Any
    grant: Lease | None = None


@dataclass(slots=True)
class WaitForRoom:
    """A blocking acquire over the rate limit: ask again after ``delay_ms``."""

    delay_ms: int
    #: boot-clock ms when the acquire's ``timeoutMs`` runs out.
    deadline: int
    #: False while its caller's rule CPU was spent: the rules still have to pass.
    authorized: bool = True


#: a rule evaluation that costs this much CPU (seconds) lets other connections go first.
COSTLY_RULE_S = 0.001
#: ops whose rule a member's request may have evaluated (docs/contract.md §5).
_RULE_GATED = frozenset({"acquire", "tryAcquire", "renew"})


class RuleCpuSpent(ProtocolError):
    """A member's rule evaluations used up its share of the daemon's CPU for now."""

    def __init__(self, retry_after_ms: int, per_second_ms: int) -> None:
        super().__init__(
            "RATE_LIMITED",
            f"rule evaluations for this caller used their share of the daemon; "
            f"retry in {retry_after_ms} ms",
            details={
                "retryAfterMs": retry_after_ms,
                "limit": per_second_ms,
                "reason": "rule_cpu",
            },
        )
        self.retry_after_ms = retry_after_ms


#: what :meth:`LockService.acquire` and :meth:`LockService.acquire_after_wait` return.
AcquireStep = Reply | WaitForRoom | Parked


def _denied(op: str, key: str | None, caller: Caller) -> ProtocolError:
    where = f" on key {key!r}" if key is not None else ""
    return ProtocolError(
        "LOCK_ACCESS_DENIED",
        f"{caller.principal} (role {caller.role}) may not {op}{where}",
        details={"op": op, **({"key": key} if key is not None else {})},
    )


def _backend(service: LockService, remote: RemoteBackend | None) -> LockBackend:
    """The backend a service is built with (imported here: both import the service)."""
    if remote is None:
        from lockd.daemon.backends.embedded import EmbeddedBackend

        return EmbeddedBackend(service)
    from lockd.daemon.remote import RemoteService

    return RemoteService(service, remote)


def timed_out(req: Acquire) -> ProtocolError:
    return ProtocolError(
        "LOCK_TIMEOUT",
        f"key {req.key!r} was not granted within {req.timeout_ms} ms",
        details={"key": req.key, "timeoutMs": req.timeout_ms},
    )


def storage_unavailable(request_id: RequestId | None = None) -> ProtocolError:
    return ProtocolError(
        "STORAGE_UNAVAILABLE",
        "the lock database cannot be written (disk full or I/O error); "
        "nothing of the request took effect, retry later",
        request_id=request_id,
    )


def shutting_down() -> ProtocolError:
    return ProtocolError("SHUTTING_DOWN", "lockd is stopping")


def visible_locks(caller: Caller, entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """What ``list`` shows ``caller`` (docs/contract.md §12): everything to owners, admins and
    services; to a member only the keys it holds or waits for (a page may then
    hold fewer entries than ``limit``; ``next`` still goes on)."""
    if caller.role in PASS_ROLES:
        return list(entries)
    return [entry for entry in entries if concerns(entry, caller.principal)]


class LockService:
    def __init__(
        self,
        engine: LockEngine,
        store: Store | None,
        policy: PolicyLike,
        ratelimiter: RateLimiterLike,
        clock: Clock,
        stats: StatsRecorder | None = None,
        *,
        max_pending_per_connection: int = DEFAULT_MAX_PENDING_PER_CONNECTION,
        remote: RemoteBackend | None = None,
        break_grace_ms: int = DEFAULT_BREAK_GRACE_MS,
        rule_cpu: RuleCpuBudget | None = None,
        max_pending_per_user: int = DEFAULT_MAX_PENDING_PER_USER,
    ) -> None:
        self.engine = engine
        self.store = store
        self.policy = policy
        self.ratelimiter = ratelimiter
        self.clock = clock
        self.stats = stats or StatsRecorder()
        self.max_pending_per_connection = max_pending_per_connection
        #: each member's share of rule-evaluation CPU (None: unbounded).
        self.rule_cpu = rule_cpu
        self._costly_rule_ran = False
        self.max_pending_per_user = max_pending_per_user
        #: blocking acquires waiting now, by principal (owners not counted).
        self._pending_by_principal: dict[str, int] = {}
        #: every blocking acquire waiting now (owners' too), for the trim below.
        self._pending_total = 0
        #: memory goes back to the system once a flood of waits is over.
        self.memory = TrimAfterDrop("waits", 1024)
        #: denials are logged at most once per principal per interval, with counts.
        self._denial_log = LogThrottle()
        #: the backend behind the service, fixed here (backends/__init__.py):
        #: the embedded engine and store, or with ``remote`` (etcd) a remote
        #: backend, which holds the lock state (the engine and store stay
        #: empty) and whose answers the server awaits (``backend.awaits``).
        self.backend: LockBackend = _backend(self, remote)
        #: called for each waiter the engine resolved, after the commit.
        self.on_resolved: Callable[[Waiter], None] = lambda waiter: None
        #: the server's own gauges (uptime, connections) for the ``stats`` op.
        self.server_gauges: Callable[[], dict[str, Any]] = dict
        #: group commit: requests leave their effects pending (see
        #: :meth:`commit_request`) and the server commits them together.
        self.group_commit = False
        #: set by :meth:`commit_request` when it left the request's effects
        #: to the group commit; the server reads and clears it per request.
        self.deferred = False
        #: called after every commit with its outcome (None: committed, once
        #: its waiters were woken; else the error it was rolled back for):
        #: the server sends or fails the replies of the group commit's batch.
        self.on_batch_end: Callable[[BaseException | None], None] = lambda error: None
        #: lease-loss events (docs/contract.md §12): the holds granted to connections
        #: that listen, and the breaks waiting for their holders to stop.
        self.losses = LossWatch()
        self.break_grace_ms = break_grace_ms
        #: writes one loss event to its connection (the server sets it); called
        #: before any reply that depends on the loss goes out.
        self.on_lost: Callable[[LossEvent], None] = lambda event: None
        #: re-takes of watched holds, announced once their commit is done.
        self._retaken: list[LossEvent] = []

    # ----------------------------------------------------------- plumbing

    def commit(self) -> None:
        """Persist the engine's pending effects, then wake resolved waiters.

        When the write fails, the request that was running is undone in the
        engine (:meth:`LockEngine.rollback`: no ghost holds) and the error
        propagates; what time and departed clients did before it stays
        pending, its woken waiters still parked, until a commit succeeds.
        """
        changes = self.engine.pending()
        if not changes:
            self.engine.drain()
            self.on_batch_end(None)
            return
        assert self.store is not None, "a remote backend never changes the engine"
        try:
            self.store.apply(changes)
        except BaseException as exc:
            self.engine.rollback()
            self._rewatch_retaken()
            self.on_batch_end(exc)
            raise
        self.engine.drain()
        self._announce_losses(changes.expired)
        # The rows are in the store now: settled keys may leave memory.
        self.engine.demote(self.clock.boot_ms())
        if changes.grants:
            self.stats.count("grants", changes.grants)
        if changes.retakes:
            self.stats.count("retakes", changes.retakes)
        if changes.expired:
            self.stats.count("expiries", len(changes.expired))
            self._log_expired(changes.expired)
        for waiter in changes.resolved:
            if waiter.timed_out:
                self.stats.count("timeouts")
            elif waiter.lease is not None:
                self.stats.count("handoffs")
                if log.isEnabledFor(logging.DEBUG):
                    lease = waiter.lease
                    log.debug(
                        kv(
                            event="granted",
                            key=lease.key,
                            principal=lease.principal,
                            fence=lease.fence,
                        )
                    )
            self.on_resolved(waiter)
        self.on_batch_end(None)

    # ------------------------------------------------------- loss events

    def _at(self) -> str:
        return format_epoch_ms(self.clock.wall_ms())

    def _announce_losses(self, expired: list[Lease]) -> None:
        """After a commit: tell the listening holders of what it ended, then wake breaks.

        Runs before the commit's waiters are woken and its replies go out,
        so a holder hears of its loss before anyone hears of a grant that
        depends on it.
        """
        losses = self.losses
        if not (len(losses) or self._retaken or losses.breaks):
            return
        at = self._at() if expired else ""
        for lease in expired:
            event = losses.lost(lease.handle, EXPIRED, at)
            if event is not None:
                self.on_lost(event)
        retaken, self._retaken = self._retaken, []
        for event in retaken:
            self.on_lost(event)
        if losses.breaks:
            losses.still_stopping(lambda w: self.engine.find(w.key, w.handle) is not None)

    def _rewatch_retaken(self) -> None:
        """A failed commit undid its re-takes: the holds they ended are back, watched again."""
        retaken, self._retaken = self._retaken, []
        for event in retaken:
            lease = self.engine.find(event.key, event.handle)
            if lease is not None:
                self.losses.watch(event.conn, lease)
            else:
                self._retaken.append(event)

    def watch_grant(self, conn: int, lease: Lease) -> None:
        """The grant of ``lease`` reached connection ``conn``, which listens for events."""
        if self.engine.find(lease.key, lease.handle) is lease:
            self.losses.watch(conn, lease)
            return
        # Ended in the batch that granted it, before its reply went out (only
        # a re-take can: nobody else knew its handle yet): say so at once.
        self.on_lost(
            LossEvent(
                conn,
                lease.key,
                lease.handle,
                lease.fence,
                RETAKE,
                None,
                lease.principal,
                self._at(),
            )
        )

    def _note_retake(self, caller: Caller, lease: Lease) -> None:
        """A grant with an owner may have re-taken watched holds: told after the commit."""
        assert lease.owner is not None
        for watched in self.losses.same_owner(lease.key, caller.principal, lease.owner):
            if (
                watched.handle != lease.handle
                and self.engine.find(lease.key, watched.handle) is None
            ):
                event = self.losses.lost(watched.handle, RETAKE, self._at(), by=caller.principal)
                if event is not None:
                    self._retaken.append(event)

    def stopped(self, conn: int, request: Stopped) -> dict[str, Any]:
        """``stopped``: the work of a broken hold of this connection has stopped."""
        return {"stopped": self.losses.stopped(conn, request.handle)}

    def break_ready(self, pending: PendingBreak) -> bool:
        """May the waiting break end now (every told holder stopped, or the grace is over)?"""
        return pending.ready(self.clock.boot_ms())

    def finish_break(self, caller: Caller, pending: PendingBreak) -> dict[str, Any]:
        """End a waiting break: the holds still stopping are released, the queue served."""
        key = pending.key
        now = self._now()
        for watched in pending.stopping:
            if self.engine.find(key, watched.handle) is not None:
                self.engine.release(now, key, watched.handle)
        self.losses.end_break(pending)
        self.commit_request(now=True)
        broken = sorted([*pending.ended, *pending.stopping], key=lambda hold: hold.fence)
        return self.break_result(caller, key, pending.reason, broken)

    def _log_expired(self, expired: list[Lease]) -> None:
        """One info line per commit however many leases ran out; each at debug.

        A line per lease cost ~75 % of the loop time when 100,000 leases ran
        out together (issue 10). A lone expiry, the usual case, keeps its key
        on the info line.
        """
        if len(expired) == 1:
            lease = expired[0]
            log.info(
                kv(event="expired", key=lease.key, principal=lease.principal, fence=lease.fence)
            )
            return
        log.info(kv(event="expired", count=len(expired), more_due=self.engine.behind))
        if log.isEnabledFor(logging.DEBUG):
            for lease in expired:
                log.debug(
                    kv(event="expired", key=lease.key, principal=lease.principal, fence=lease.fence)
                )

    @property
    def batch_open(self) -> bool:
        """Requests of the group commit's batch wait for their commit."""
        return self.engine.requests_pending

    def next_deadline(self) -> int | None:
        """The engine's earliest lease or waiter deadline (boot-clock ms), if any."""
        return self.engine.next_deadline()

    def ms_until(self, deadline: int) -> int:
        """Milliseconds from now until ``deadline`` (0 when it has passed)."""
        return max(0, deadline - self.clock.boot_ms())

    def tick(self) -> bool:
        """Let time pass in the engine (the expiry timer calls this).

        False when the commit failed, or a due cold key's rows could not be
        read: the expiries and hand-offs stay pending and the timer retries
        shortly.
        """
        try:
            self.engine.advance(self._now(), EXPIRY_CHUNK)
        except StorageUnavailable as exc:
            self._read_failed("tick", exc)
            self.commit_fact("tick")  # what passed before the failed read
            return False
        return self.commit_fact("tick")

    def _read_failed(self, what: str, exc: StorageUnavailable) -> ProtocolError:
        """A cold key's rows could not be read (lockd.daemon.cold): a storage failure.

        The engine read them before taking the key out of the cold index,
        so the key stays cold and none of its leases is lost.
        """
        self.stats.count("storageErrors")
        log.warning(kv(event="storage_unavailable", during=what, error=exc))
        return storage_unavailable()

    def commit_request(self, *, now: bool = False) -> None:
        """Commit a request's effects; a storage failure becomes its error reply.

        Under :attr:`group_commit` the effects stay pending (unless ``now``)
        and :attr:`deferred` says so: the server commits the batch before
        it sends any reply of it, and answers STORAGE_UNAVAILABLE to each
        of the batch's requests when that commit fails.
        """
        if self.group_commit and not now:
            self.deferred = True
            return
        try:
            self.commit()
        except StorageUnavailable as exc:
            self.stats.count("storageErrors")
            log.warning(kv(event="storage_unavailable", error=exc))
            raise storage_unavailable() from None

    def commit_fact(self, what: str) -> bool:
        """Commit what time or a departed client did; on failure it stays pending.

        Used where no request can be refused: reads answer from memory and
        the batch goes out with the next commit that succeeds. False when
        the write failed.
        """
        try:
            self.commit()
        except StorageUnavailable as exc:
            self.stats.count("storageErrors")
            log.warning(kv(event="storage_unavailable", during=what, error=exc))
            return False
        return True

    def _now(self) -> int:
        """The boot clock for a call into the engine.

        Time passing is a fact the engine does not undo, so when a deadline
        has come, the batch of requests before it is committed first.
        """
        now = self.clock.boot_ms()
        if self.engine.requests_pending and self.engine.due(now):
            self._end_batch("time")
        return now

    def _end_batch(self, what: str) -> None:
        """Commit the group commit's batch before a fact the engine never undoes.

        The engine keeps no undo record across such a fact, so the batch's
        requests must be committed (or rolled back) before it.
        """
        if self.engine.requests_pending:
            self.commit_fact(what)

    def gauges(self) -> dict[str, Any]:
        return self.backend.gauges()

    def authorize(
        self,
        caller: Caller,
        op: str,
        key: str | None = None,
        *,
        mode: str = EXCLUSIVE,
        limit: int = 1,
    ) -> None:
        rule_cpu = self.rule_cpu
        if rule_cpu is not None and caller.role == "member" and op in _RULE_GATED:
            now = self.clock.boot_ms()
            wait = rule_cpu.wait_ms(caller.principal, now)
            if wait:
                self.stats.count("rateLimited")
                raise RuleCpuSpent(wait, rule_cpu.per_second_ms)
            decision = self.policy.decide(caller, op, key or "", mode, limit)
            if decision.cpu_s:
                rule_cpu.charge(caller.principal, decision.cpu_s * 1000, now)
                if decision.cpu_s >= COSTLY_RULE_S:
                    self._costly_rule_ran = True
        else:
            decision = self.policy.decide(caller, op, key or "", mode, limit)
        if not decision.allowed:
            self.stats.count("denials")
            suppressed = self._denial_log.admit(caller.principal)
            if suppressed is not None:
                log.info(
                    kv(
                        event="denied",
                        op=op,
                        key=key,
                        principal=caller.principal,
                        why=decision.reason,
                        suppressed=suppressed,
                    )
                )
            raise _denied(op, key, caller)

    # ------------------------------------------------------------ results

    def lease_view(self, lease: Lease) -> dict[str, Any]:
        return {
            "key": lease.key,
            "handle": lease.handle,
            "fence": lease.fence,
            "owner": lease.owner,
            "ttlMs": lease.ttl_ms,
            "leaseExpiresAt": self._wall(lease.expires_at),
        }

    def _wall(self, boot_deadline: int) -> str:
        return format_epoch_ms(self.clock.wall_ms() + boot_deadline - self.clock.boot_ms())

    def holder_view(self, lease: Lease) -> dict[str, Any]:
        """One holder as status shows it: never its handle id."""
        return {
            "heldBy": lease.principal,
            "owner": lease.owner,
            "fence": lease.fence,
            "leaseExpiresAt": self._wall(lease.expires_at),
            "expiresInMs": max(0, lease.expires_at - self.clock.boot_ms()),
            **holder_fields(lease.pid, lease.process, lease.pid_start),
        }

    def status_view(self, st: KeyStatus) -> dict[str, Any]:
        """docs/contract.md §3 and §10: the singular fields describe the oldest grant."""
        holders = [self.holder_view(lease) for lease in st.holders]
        oldest = holders[0] if holders else dict.fromkeys(HOLDER_FIELDS)
        return {
            "key": st.key,
            "held": bool(holders),
            **oldest,
            "waiters": st.waiters,
            "waiterList": self.waiter_list_view(st),
            "mode": st.mode,
            "limit": st.limit,
            "holderCount": st.holder_count,
            "holders": holders,
        }

    def waiter_list_view(self, st: KeyStatus) -> list[dict[str, Any]]:
        """docs/contract.md §12 ``waiterList``: the engine's queue on the wall clock."""
        wall, boot = self.clock.wall_ms(), self.clock.boot_ms()
        queued = (
            QueuedWaiter(w.principal, w.pid, w.process, w.mode, w.limit, wall + w.since - boot)
            for w in st.queue
            if not w.resolved
        )
        return waiter_list(queued, wall)

    # ------------------------------------------------------------ acquire

    def acquire(self, caller: Caller, conn: int, req: Acquire, *, pending: int) -> AcquireStep:
        """The first step of an acquire/tryAcquire on connection ``conn``.

        ``pending`` is how many of the connection's acquires are waiting now.
        """
        try:
            return self._acquire(caller, conn, req, pending=pending)
        except StorageUnavailable as exc:
            raise self._read_failed(req.op, exc) from None

    def _acquire(self, caller: Caller, conn: int, req: Acquire, *, pending: int) -> AcquireStep:
        try:
            self.check_acquire(caller, req, pending=pending)
        except RuleCpuSpent as spent:
            if req.timeout_ms is None:
                raise
            # A blocking acquire waits for its caller's share, like for rate-limit room.
            self._check_pending(caller, req, pending)
            now = self.clock.boot_ms()
            return self._wait_for_rules(req, now, now + req.timeout_ms, spent.retry_after_ms)
        now = self._now()
        if self.store is not None:
            self.store.check_grants(now)  # none after an accepted data loss, for a while
        if req.timeout_ms is None:
            retry_after = self.take_attempt(caller, now)
            if retry_after is not None:
                raise self.rate_limited(retry_after)
            return self._acquire_in_engine(caller, conn, req, now, None)
        return self._acquire_within(caller, conn, req, now, now + req.timeout_ms)

    def costly_rule_ran(self) -> bool:
        """Whether a rule evaluation of ``COSTLY_RULE_S`` or more ran since the last call."""
        ran, self._costly_rule_ran = self._costly_rule_ran, False
        return ran

    def rule_cpu_pause_ms(self, caller: Caller) -> int:
        """How long to read no more of ``caller``'s requests: 0 unless its rule share is spent."""
        rule_cpu = self.rule_cpu
        if rule_cpu is None or caller.role != "member":
            return 0
        return rule_cpu.wait_ms(caller.principal, self.clock.boot_ms())

    def _wait_for_rules(self, req: Acquire, now: int, deadline: int, wait_ms: int) -> WaitForRoom:
        if now >= deadline:
            raise timed_out(req)
        return WaitForRoom(min(wait_ms, deadline - now), deadline, authorized=False)

    def check_acquire(self, caller: Caller, req: Acquire, *, pending: int) -> None:
        """What every acquire passes first: the rules, then the connection's pending limit.

        A denied attempt counts against the caller's rate limit like any other
        (issue 21): refusals must not be a free way to keep the daemon busy.
        """
        try:
            self.authorize(caller, "acquire", req.key, mode=req.mode, limit=req.limit)
        except ProtocolError as exc:
            if exc.code == "LOCK_ACCESS_DENIED":
                self.take_attempt(caller, self.clock.boot_ms())
            raise
        self._check_pending(caller, req, pending)

    def _check_pending(self, caller: Caller, req: Acquire, pending: int) -> None:
        limit = self.max_pending_per_connection
        if req.timeout_ms and pending >= limit:
            raise ProtocolError(
                "INVALID_REQUEST",
                f"{limit} requests are already waiting on this connection",
                details={"field": None, "limit": limit},
            )
        # Per principal, over all its connections: one member with 64
        # connections x 1024 waits held 65,536 waiters (367 MB). RATE_LIMITED
        # (429) as for too many connections: retry once some of them ended.
        per_user = self.max_pending_per_user
        if req.timeout_ms and self._pending_by_principal.get(caller.principal, 0) >= per_user:
            self.stats.count("rateLimited")
            raise ProtocolError(
                "RATE_LIMITED",
                f"{caller.principal} has {per_user} acquires waiting already "
                f"(max_pending_per_user); retry once some have ended",
                details={
                    "retryAfterMs": PENDING_RETRY_HINT_MS,
                    "limit": per_user,
                    "reason": "max_pending_per_user",
                },
            )

    def wait_started(self, caller: Caller) -> None:
        """A blocking acquire of ``caller`` waits in a task now (the server says so)."""
        self._pending_total += 1
        self.memory.observe(self._pending_total)
        if caller.role != "owner":
            principal = caller.principal
            self._pending_by_principal[principal] = self._pending_by_principal.get(principal, 0) + 1

    def wait_ended(self, caller: Caller) -> None:
        """That wait is over (answered, cancelled, or its connection gone)."""
        self._pending_total -= 1
        self.memory.observe(self._pending_total)
        if caller.role != "owner":
            principal = caller.principal
            left = self._pending_by_principal.get(principal, 0) - 1
            if left > 0:
                self._pending_by_principal[principal] = left
            else:
                self._pending_by_principal.pop(principal, None)

    def acquire_after_wait(
        self, caller: Caller, conn: int, req: Acquire, room: WaitForRoom
    ) -> AcquireStep:
        """The next step of a blocking acquire that waited for rate-limit room."""
        try:
            if not room.authorized:  # it waited for its rule CPU: the rules come first
                try:
                    self.authorize(caller, "acquire", req.key, mode=req.mode, limit=req.limit)
                except RuleCpuSpent as spent:
                    now = self.clock.boot_ms()
                    return self._wait_for_rules(req, now, room.deadline, spent.retry_after_ms)
                except ProtocolError as exc:
                    if exc.code == "LOCK_ACCESS_DENIED":
                        self.take_attempt(caller, self.clock.boot_ms())
                    raise
            return self._acquire_within(caller, conn, req, self._now(), room.deadline)
        except StorageUnavailable as exc:
            raise self._read_failed(req.op, exc) from None

    def parked_reply(self, req: Acquire, waiter: Waiter) -> Reply:
        """The answer to a parked acquire once it left the queue."""
        if waiter.lease is not None:
            return Reply(self.lease_view(waiter.lease), waiter.lease)
        if waiter.timed_out:
            raise timed_out(req)
        raise shutting_down()  # cancelled: the daemon is stopping

    def cancel_waiter(self, waiter: Waiter) -> None:
        """Take a parked acquire out of its queue, unless it already left."""
        if waiter.resolved:
            return
        self._end_batch("cancel_waiter")
        self.engine.cancel_waiter(self.clock.boot_ms(), waiter)
        self.commit_fact("cancel_waiter")

    def release_undelivered(self, lease: Lease) -> None:
        """A grant whose reply could not be written is released at once."""
        if self.engine.release(self._now(), lease.key, lease.handle):
            self.stats.count("releases")
            log.info(kv(event="released_undelivered", key=lease.key, principal=lease.principal))
        self.commit_fact("released_undelivered")

    def _acquire_within(
        self, caller: Caller, conn: int, req: Acquire, now: int, deadline: int
    ) -> AcquireStep:
        """Count the attempt of a blocking acquire, then ask the engine.

        Over the rate limit it waits for room, and when no room comes within
        its ``timeoutMs`` it still waits the timeout out before LOCK_TIMEOUT
        (docs/contract.md §6): a caller that retries on LOCK_TIMEOUT is paced by its own
        timeout, as it is when the key is busy, instead of spinning.
        """
        retry_after = self.take_attempt(caller, now)
        left = deadline - now
        if retry_after is None:
            return self._acquire_in_engine(caller, conn, req, now, max(0, left))
        if left <= 0:
            self.stats.count("rateLimited")
            raise timed_out(req)
        return WaitForRoom(min(retry_after, left), deadline)

    def take_attempt(self, caller: Caller, now: int) -> int | None:
        """Count one acquire attempt; the ms to wait for room when over limit.

        Owners and services are not counted by the rate limit (docs/contract.md §6).
        """
        if caller.role in ("owner", "service"):
            return None
        return self.ratelimiter.try_take(caller.principal, now)

    def rate_limited(self, retry_after_ms: int) -> ProtocolError:
        self.stats.count("rateLimited")
        return ProtocolError(
            "RATE_LIMITED",
            f"too many acquire attempts; retry in {retry_after_ms} ms",
            details={"retryAfterMs": retry_after_ms, "limit": self.ratelimiter.limit},
        )

    def _acquire_in_engine(
        self, caller: Caller, conn: int, req: Acquire, now: int, wait_ms: int | None
    ) -> AcquireStep:
        holder = holder_process(caller, req.pid)
        result = self.engine.acquire(
            now,
            req.key,
            ttl_ms=req.ttl_ms,
            principal=caller.principal,
            owner=req.owner,
            conn=conn,
            release_on_close=req.release_on_close,
            wait_ms=wait_ms,
            mode=req.mode,
            limit=req.limit,
            pid=holder.pid,
            process=holder.process,
            pid_start=holder.start,
        )
        if isinstance(result, Lease) and req.owner is not None and len(self.losses):
            self._note_retake(caller, result)  # told once the commit below is done
        # A parked acquire waits in a task of its own after this returns:
        # its queue place must be committed now, not with the batch.
        self.commit_request(now=isinstance(result, Parked))
        if isinstance(result, Refused):
            raise ProtocolError(
                "INVALID_REQUEST", result.message, details={"field": result.field, **result.details}
            )
        if isinstance(result, Lease):
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    kv(event="granted", key=req.key, principal=caller.principal, fence=result.fence)
                )
            return Reply(self.lease_view(result), result)
        if isinstance(result, Busy):
            return Reply(None)
        if isinstance(result, TimedOut):
            self.stats.count("timeouts")
            raise timed_out(req)
        if isinstance(result, Deadlock):
            raise self._deadlock(caller, conn, req, result.cycle)
        return result

    @staticmethod
    def _deadlock(caller: Caller, conn: int, req: Acquire, cycle: list[str]) -> ProtocolError:
        """DEADLOCK for the acquire that would close ``cycle`` (docs/contract.md §12), logged."""
        log.warning(
            kv(
                event="deadlock",
                key=req.key,
                principal=caller.principal,
                conn=conn,
                cycle=" -> ".join([*cycle, cycle[0]]),
            )
        )
        path = " -> ".join(repr(key) for key in [*cycle, cycle[0]])
        return ProtocolError(
            "DEADLOCK",
            f"waiting for {req.key!r} would close a cycle of waits: {path}",
            details={"cycle": cycle},
        )

    # ------------------------------------------------------ the other ops

    def answer(self, caller: Caller, request: Request) -> Any:
        """The wire result of any request but an acquire."""
        try:
            return self._answer(caller, request)
        except StorageUnavailable as exc:
            raise self._read_failed(request.op, exc) from None

    def _answer(self, caller: Caller, request: Request) -> Any:
        if isinstance(request, Release):
            return self.release(caller, request.key, request.handle)
        if isinstance(request, Renew):
            return self.renew(caller, request.key, request.handle, request.ttl_ms)
        if isinstance(request, Status):
            return self.status(request.key)
        if isinstance(request, Hello):
            return self.hello(caller)
        if isinstance(request, ListLocks):
            return self.list(caller, request.prefix, request.limit, request.after)
        if isinstance(request, Break):
            return self.break_lock(caller, request.key, request.reason)
        # ``stopped`` concerns the connection: the server asks :meth:`stopped`.
        if isinstance(request, Stats):
            return self.stats_result(caller)
        if isinstance(request, Rules):
            return self.rules(caller)
        raise AssertionError(f"unhandled op {request.op}")

    def hello(self, caller: Caller) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            "principal": caller.principal,
            "role": caller.role,
            "uid": caller.uid,
            "pid": caller.pid,
        }

    def renew(self, caller: Caller, key: str, handle: str, ttl_ms: int) -> dict[str, Any]:
        # The rule sees the hold's own mode and limit (docs/contract.md §10).
        hold = self.engine.find(key, handle)
        if hold is not None:
            self.authorize(caller, "renew", key, mode=hold.mode, limit=hold.limit)
        else:
            self.authorize(caller, "renew", key)
        if self.losses.stopping(handle) is not None:
            return {"renewed": False, "reason": "lease_lost"}  # broken; its holder was told
        lease = self.engine.renew(self._now(), key, handle, ttl_ms)
        self.commit_request()
        if lease is None:
            return {"renewed": False, "reason": "lease_lost"}
        self.stats.count("renewals")
        return {"renewed": True, "leaseExpiresAt": self._wall(lease.expires_at)}

    def release(self, caller: Caller, key: str, handle: str) -> dict[str, Any]:
        # A hold told of a break is fenced as far as its holder knows; its
        # release says it let go, which is what the break waits for.
        stopping = self.losses.stopping(handle) is not None
        released = self.engine.release(self._now(), key, handle)
        self.commit_request()
        if released and len(self.losses):
            self.losses.forget(handle)
        if not released or stopping:
            return {"released": False, "reason": "not_holder"}
        self.stats.count("releases")
        if log.isEnabledFor(logging.DEBUG):
            log.debug(kv(event="released", key=key, principal=caller.principal))
        return {"released": True}

    def connection_closed(self, conn: int, *, release_bound: bool = True) -> None:
        self.backend.connection_closed(conn, release_bound=release_bound)

    def close_in_engine(self, conn: int, *, release_bound: bool) -> None:
        """The embedded backend's side of :meth:`connection_closed`."""
        self._end_batch("connection_closed")
        self.losses.connection_closed(conn)
        now = self.clock.boot_ms()
        for lease in self.engine.connection_closed(now, conn, release_bound=release_bound):
            self.stats.count("releases")
            log.debug(kv(event="released_on_close", key=lease.key, principal=lease.principal))
        self.commit_fact("connection_closed")

    def status(self, key: str) -> dict[str, Any]:
        st = self.engine.status(self._now(), key)
        self.commit_fact("status")
        return self.status_view(st)

    def list(self, caller: Caller, prefix: str, limit: int, after: str | None) -> dict[str, Any]:
        self.authorize(caller, "list")
        self._restore_all("list")
        page = self.engine.list_held(self._now(), prefix, limit, after)
        self.commit_fact("list")
        return {
            "locks": visible_locks(caller, map(self.status_view, page.locks)),
            "next": page.next,
        }

    def break_lock(self, caller: Caller, key: str, reason: str) -> dict[str, Any] | PendingBreak:
        """``break``: the result now, or a :class:`PendingBreak` when a holder listens.

        A holder listening for events is told at once and keeps its hold
        until it stops (docs/contract.md §12); the server waits (:meth:`break_ready`) and
        then calls :meth:`finish_break`. Holders that do not listen are
        released at once.
        """
        self.authorize(caller, "break", key)
        now = self._now()
        losses = self.losses
        listening = [w for w in losses.of_key(key) if self.engine.find(key, w.handle) is not None]
        if not listening and not losses.stopping_of_key(key):
            broken = self.engine.break_lock(now, key)
            self.commit_request()
            return self.break_result(caller, key, reason, broken)
        keep = {w.handle for w in listening} | {w.handle for w in losses.stopping_of_key(key)}
        ended = self._release_others(now, key, keep)
        # Before anyone is told: a write that fails leaves the break undone.
        self.commit_request(now=True)
        pending, events = losses.begin_break(
            key, reason, caller.principal, listening, ended, now + self.break_grace_ms, self._at()
        )
        log.info(kv(event="break_waits", key=key, by=caller.principal, holders=len(events)))
        for event in events:
            self.on_lost(event)
        return pending

    def _release_others(self, now: int, key: str, keep: set[str]) -> Sequence[Lease]:
        """Release the holds of ``key`` a break need not wait for (nobody listens for them).

        Only holds granted before the break (fence up to the current one):
        a waiter these releases let in is a new holder, not broken.
        """
        before = self.engine.fence
        ended: Sequence[Lease] = ()
        while True:
            others = [
                lease
                for lease in self.engine.status(now, key).holders
                if lease.handle not in keep and lease.fence <= before
            ]
            if not others:
                return ended
            for lease in others:
                self.engine.release(now, key, lease.handle)
            ended = (*ended, *others)

    def break_result(
        self, caller: Caller, key: str, reason: str, broken: Sequence[BrokenHold]
    ) -> dict[str, Any]:
        """Log, count and answer a break that ended ``broken`` (oldest first), any backend."""
        if not broken:
            log.info(kv(event="break_free_key", key=key, by=caller.principal, reason=reason))
            return {"broken": False}
        self.stats.count("breaks")
        oldest = broken[0]
        log.warning(
            kv(
                event="broken",
                key=key,
                by=caller.principal,
                holder=oldest.principal,
                fence=oldest.fence,
                holders=len(broken),
                reason=reason,
            )
        )
        return {
            "broken": True,
            "holders": len(broken),
            "heldBy": oldest.principal,
            "owner": oldest.owner,
            "fence": oldest.fence,
        }

    def _restore_all(self, what: str) -> None:
        """A restore in chunks is under way: read the rest now (this answer counts every key).

        Between commits only (:meth:`LockEngine.restore_step`), so what is
        pending is committed first; a failed commit or read fails the request.
        """
        if not self.engine.restoring:
            return
        if self.engine.pending() and not self.commit_fact(what):
            raise storage_unavailable()
        try:
            self.engine.finish_restore(self._now())
        except StorageUnavailable as exc:
            raise self._read_failed(what, exc) from None

    def stats_result(self, caller: Caller) -> dict[str, Any]:
        self.authorize(caller, "stats")
        self._restore_all("stats")
        return self.stats.snapshot({**self.server_gauges(), **self.gauges()})

    def rules(self, caller: Caller) -> dict[str, Any]:
        self.authorize(caller, "rules")
        return self.policy.rules_result()
