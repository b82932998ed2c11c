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

The service decides the order of things; its parts do each thing, and the
service owns them: :class:`~lockd.daemon.gate.Gate` (access rules, pending
limits, rate limit: the same for every backend),
:class:`~lockd.daemon.commits.Commits` (the engine's effects to the store,
group commit, rollback), :class:`~lockd.daemon.lossnotice.LossNotices`
(lease-loss events of the engine's holds) and
:class:`~lockd.daemon.replies.Replies` (the wire documents).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from lockd import __version__
from lockd.daemon.breaks import Breaks
from lockd.daemon.clock import Clock
from lockd.daemon.commits import Commits
from lockd.daemon.engine import (
    Busy,
    Deadlock,
    Lease,
    LockEngine,
    Parked,
    Refused,
    TimedOut,
    Waiter,
)
from lockd.daemon.events import LossEvent, LossWatch, PendingBreak
from lockd.daemon.fastpath import FastPath
from lockd.daemon.gate import (
    COSTLY_RULE_S,
    DEFAULT_MAX_PENDING_PER_CONNECTION,
    DEFAULT_MAX_PENDING_PER_USER,
    PENDING_RETRY_HINT_MS,
    Decision,
    Gate,
    PolicyLike,
    RateLimiterLike,
    RuleCpuSpent,
)
from lockd.daemon.holder import holder_process
from lockd.daemon.lossnotice import LossNotices
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
    Rules,
    Stats,
    Status,
    Stopped,
)
from lockd.daemon.replies import (
    BrokenHold,
    Replies,
    break_result,
    deadlock,
    shutting_down,
    storage_unavailable,
    timed_out,
    visible_locks,
)
from lockd.daemon.stats import StatsRecorder
from lockd.daemon.store import StorageUnavailable, Store
from lockd.identity import Caller
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.backends import LockBackend, RemoteBackend
    from lockd.daemon.ratelimit import RuleCpuBudget

__all__ = [  # names other modules import from here, wherever they are defined
    "COSTLY_RULE_S",
    "DEFAULT_BREAK_GRACE_MS",
    "DEFAULT_MAX_PENDING_PER_CONNECTION",
    "DEFAULT_MAX_PENDING_PER_USER",
    "PENDING_RETRY_HINT_MS",
    "AcquireStep",
    "BrokenHold",
    "Decision",
    "LockService",
    "PolicyLike",
    "RateLimiterLike",
    "Reply",
    "RuleCpuSpent",
    "WaitForRoom",
    "shutting_down",
    "storage_unavailable",
    "timed_out",
    "visible_locks",
]

log = logging.getLogger("lockd.daemon.service")

#: how long a break waits for a holder listening for events to stop (docs/contract.md §12).
DEFAULT_BREAK_GRACE_MS = 5000

T = TypeVar("T")


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


#: what :meth:`LockService.acquire` and :meth:`LockService.acquire_after_wait` return.
AcquireStep = Reply | WaitForRoom | Parked


def _backend(service: LockService, remote: RemoteBackend | None) -> LockBackend:
    """The backend a service is built with (imported here: both import the service)."""
    if remote is None:
        from lockd.daemon.backends.embedded import EmbeddedBackend

        return EmbeddedBackend(service)
    from lockd.daemon.remote import RemoteService

    return RemoteService(service, remote)


class Delegated(Generic[T]):
    """An attribute of the service that one of its parts keeps: read and set there.

    The server and tests set these on the service (``service.group_commit =
    True``); the part that uses them holds them.
    """

    def __init__(self, part: str, name: str = "") -> None:
        self._part, self._name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = self._name or name

    def __get__(self, service: object, owner: type | None = None) -> T:
        return cast(T, getattr(getattr(service, self._part), self._name))

    def __set__(self, service: object, value: T) -> None:
        setattr(getattr(service, self._part), self._name, value)


class LockService:
    """One request at a time: its checks, the engine call, the commit, the reply document."""

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
        self.clock = clock
        self.stats = stats or StatsRecorder()
        self.gate = Gate(
            policy,
            ratelimiter,
            clock,
            self.stats,
            rule_cpu=rule_cpu,
            max_pending_per_connection=max_pending_per_connection,
            max_pending_per_user=max_pending_per_user,
        )
        self.replies = Replies(clock)
        #: lease-loss events (docs/contract.md §12): the holds granted to connections
        #: that listen, and the breaks waiting for their holders to stop.
        self.losses = LossWatch()
        self.notices = LossNotices(engine, self.losses, clock)
        self.commits = Commits(engine, store, clock, self.stats, self.notices)
        self.breaks = Breaks(
            engine, self.losses, self.notices, self.commits, self.stats, break_grace_ms
        )
        #: the backend behind the service, fixed here (backends/__init__.py):
        #: the embedded engine and store, or with ``remote`` (etcd) a remote
        #: backend, which holds the lock state (the engine and store stay
        #: empty) and whose answers the server awaits (``backend.awaits``).
        self.backend: LockBackend = _backend(self, remote)
        #: the common case answered with less work (lockd.daemon.fastpath): the
        #: embedded backend only; None sends every request the usual way.
        self.fast: FastPath | None = None
        if remote is None and store is not None:
            self.fast = FastPath(
                engine,
                store,
                self.gate,
                self.commits,
                self.losses,
                self.replies,
                clock,
                self.stats,
            )
        #: the server's own gauges (uptime, connections) for the ``stats`` op.
        self.server_gauges: Callable[[], dict[str, Any]] = dict

    # The parts' settings, as the server and tests set them on the service.
    policy = Delegated[PolicyLike]("gate")
    ratelimiter = Delegated[RateLimiterLike]("gate")
    rule_cpu = Delegated["RuleCpuBudget | None"]("gate")
    max_pending_per_connection = Delegated[int]("gate")
    max_pending_per_user = Delegated[int]("gate")
    _denial_log = Delegated[Any]("gate", "denial_log")
    #: how long a break waits for a listening holder to stop (docs/contract.md §12).
    break_grace_ms = Delegated[int]("breaks", "grace_ms")
    #: writes one loss event to its connection (the server sets it).
    on_lost = Delegated[Callable[[LossEvent], None]]("notices")
    #: called for each waiter the engine resolved, after the commit.
    on_resolved = Delegated[Callable[[Waiter], None]]("commits")
    #: group commit: requests leave their effects pending for the server.
    group_commit = Delegated[bool]("commits")
    #: the last request left its effects to the group commit (see Commits).
    deferred = Delegated[bool]("commits")
    #: called after every commit with its outcome (see Commits).
    on_batch_end = Delegated[Callable[[BaseException | None], None]]("commits")

    # ------------------------------------------------------------ plumbing

    def commit(self) -> None:
        """Persist the engine's pending effects, then wake resolved waiters (Commits)."""
        self.commits.commit()

    def commit_fact(self, what: str) -> bool:
        """Commit what time or a departed client did; False when the write failed."""
        return self.commits.commit_fact(what)

    def tick(self) -> bool:
        """Let time pass in the engine (the expiry timer calls this); False: retry soon."""
        return self.commits.tick()

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

    def gauges(self) -> dict[str, Any]:
        return self.backend.gauges()

    def wait_started(self, caller: Caller) -> None:
        """A blocking acquire of ``caller`` waits in a task now (the server says so)."""
        self.gate.wait_started(caller)

    def wait_ended(self, caller: Caller) -> None:
        """That wait is over (answered, cancelled, or its connection gone)."""
        self.gate.wait_ended(caller)

    # --------------------------------------------------------- loss events

    def watch_grant(self, conn: int, lease: Lease) -> None:
        """The grant of ``lease`` reached connection ``conn``, which listens for events."""
        self.notices.watch_grant(conn, lease)

    def stopped(self, conn: int, request: Stopped) -> dict[str, Any]:
        """``stopped``: the work of a broken hold of this connection has stopped."""
        return {"stopped": self.losses.stopped(conn, request.handle)}

    def break_ready(self, pending: PendingBreak) -> bool:
        """May the waiting break end now (every told holder stopped, or the grace is over)?"""
        return pending.ready(self.clock.boot_ms())

    def finish_break(self, caller: Caller, pending: PendingBreak) -> dict[str, Any]:
        """End a waiting break: the holds still stopping are released, the queue served."""
        return self.breaks.finish(caller, pending)

    # ------------------------------------------------------------ acquire

    def acquire(self, caller: Caller, conn: int, req: Acquire, *, pending: int) -> AcquireStep:
        """The first step of an acquire/tryAcquire on connection ``conn``.

        ``pending`` is how many of the connection's acquires are waiting now.
        """
        try:
            return self._acquire(caller, conn, req, pending=pending)
        except StorageUnavailable as exc:
            raise self.commits.read_failed(req.op, exc) from None

    def _acquire(self, caller: Caller, conn: int, req: Acquire, *, pending: int) -> AcquireStep:
        gate = self.gate
        try:
            gate.check_acquire(caller, req, pending=pending)
        except RuleCpuSpent as spent:
            if req.timeout_ms is None:
                raise
            # A blocking acquire waits for its caller's share, like for rate-limit room.
            gate.check_pending(caller, req, pending)
            now = self.clock.boot_ms()
            return self._wait_for_rules(req, now, now + req.timeout_ms, spent.retry_after_ms)
        now = self.commits.now()
        if self.store is not None:
            self.store.check_grants(now)  # none after an accepted data loss, for a while
        if req.timeout_ms is None:
            retry_after = gate.take_attempt(caller, now)
            if retry_after is not None:
                raise gate.rate_limited(retry_after)
            return self._acquire_in_engine(caller, conn, req, now, None)
        return self._acquire_within(caller, conn, req, now, now + req.timeout_ms)

    @staticmethod
    def _wait_for_rules(req: Acquire, now: int, deadline: int, wait_ms: int) -> WaitForRoom:
        if now >= deadline:
            raise timed_out(req)
        return WaitForRoom(min(wait_ms, deadline - now), deadline, authorized=False)

    def acquire_after_wait(
        self, caller: Caller, conn: int, req: Acquire, room: WaitForRoom
    ) -> AcquireStep:
        """The next step of a blocking acquire that waited for rate-limit room."""
        try:
            if not room.authorized:  # it waited for its rule CPU: the rules come first
                try:
                    self.gate.authorize_acquire(caller, req)
                except RuleCpuSpent as spent:
                    now = self.clock.boot_ms()
                    return self._wait_for_rules(req, now, room.deadline, spent.retry_after_ms)
            return self._acquire_within(caller, conn, req, self.commits.now(), room.deadline)
        except StorageUnavailable as exc:
            raise self.commits.read_failed(req.op, exc) from None

    def parked_reply(self, req: Acquire, waiter: Waiter) -> Reply:
        """The answer to a parked acquire once it left the queue."""
        if waiter.lease is not None:
            return Reply(self.replies.lease_view(waiter.lease), waiter.lease)
        if waiter.timed_out:
            raise timed_out(req)
        raise shutting_down()  # cancelled: the daemon is stopping

    def cancel_waiter(self, waiter: Waiter) -> None:
        """Take a parked acquire out of its queue, unless it already left."""
        if waiter.resolved:
            return
        self.commits.end_batch("cancel_waiter")
        self.engine.cancel_waiter(self.clock.boot_ms(), waiter)
        self.commits.commit_fact("cancel_waiter")

    def release_undelivered(self, lease: Lease) -> None:
        """A grant whose reply could not be written is released at once."""
        if self.engine.release(self.commits.now(), lease.key, lease.handle):
            self.stats.count("releases")
            log.info(kv(event="released_undelivered", key=lease.key, principal=lease.principal))
        self.commits.commit_fact("released_undelivered")

    def _acquire_within(
        self, caller: Caller, conn: int, req: Acquire, now: int, deadline: int
    ) -> AcquireStep:
        """Count the attempt of a blocking acquire, then ask the engine.

        Over the rate limit it waits for room, and when no room comes within
        its ``timeoutMs`` it still waits the timeout out before LOCK_TIMEOUT
        (docs/contract.md §6): a caller that retries on LOCK_TIMEOUT is paced by its own
        timeout, as it is when the key is busy, instead of spinning.
        """
        retry_after = self.gate.take_attempt(caller, now)
        left = deadline - now
        if retry_after is None:
            return self._acquire_in_engine(caller, conn, req, now, max(0, left))
        if left <= 0:
            self.stats.count("rateLimited")
            raise timed_out(req)
        return WaitForRoom(min(retry_after, left), deadline)

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
            self.notices.note_retake(caller, result)  # told once the commit below is done
        # A parked acquire waits in a task of its own after this returns:
        # its queue place must be committed now, not with the batch.
        self.commits.commit_request(now=isinstance(result, Parked))
        if isinstance(result, Refused):
            raise ProtocolError(
                "INVALID_REQUEST", result.message, details={"field": result.field, **result.details}
            )
        if isinstance(result, Lease):
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    kv(event="granted", key=req.key, principal=caller.principal, fence=result.fence)
                )
            return Reply(self.replies.lease_view(result), result)
        if isinstance(result, Busy):
            return Reply(None)
        if isinstance(result, TimedOut):
            self.stats.count("timeouts")
            raise timed_out(req)
        if isinstance(result, Deadlock):
            raise deadlock(caller, conn, req, result.cycle)
        return result

    # ------------------------------------------------------ the other ops

    def answer(self, caller: Caller, request: Request) -> Any:
        """The wire result of any request but an acquire."""
        try:
            return self._answer(caller, request)
        except StorageUnavailable as exc:
            raise self.commits.read_failed(request.op, exc) from None

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
            self.gate.authorize(caller, "renew", key, mode=hold.mode, limit=hold.limit)
        else:
            self.gate.authorize(caller, "renew", key)
        if self.losses.stopping(handle) is not None:
            return {"renewed": False, "reason": "lease_lost"}  # broken; its holder was told
        lease = self.engine.renew(self.commits.now(), key, handle, ttl_ms)
        self.commits.commit_request()
        if lease is None:
            return {"renewed": False, "reason": "lease_lost"}
        self.stats.count("renewals")
        return {"renewed": True, "leaseExpiresAt": self.replies.wall(lease.expires_at)}

    def release(self, caller: Caller, key: str, handle: str) -> dict[str, Any]:
        # A hold told of a break is fenced as far as its holder knows; its
        # release says it let go, which is what the break waits for.
        stopping = self.losses.stopping(handle) is not None
        released = self.engine.release(self.commits.now(), key, handle)
        self.commits.commit_request()
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
        self.commits.end_batch("connection_closed")
        self.losses.connection_closed(conn)
        now = self.clock.boot_ms()
        for lease in self.engine.connection_closed(now, conn, release_bound=release_bound):
            self.stats.count("releases")
            log.debug(kv(event="released_on_close", key=lease.key, principal=lease.principal))
        self.commits.commit_fact("connection_closed")

    def status(self, key: str) -> dict[str, Any]:
        st = self.engine.status(self.commits.now(), key)
        self.commits.commit_fact("status")
        return self.replies.status_view(st)

    def list(self, caller: Caller, prefix: str, limit: int, after: str | None) -> dict[str, Any]:
        self.gate.authorize(caller, "list")
        self.commits.restore_all("list")
        page = self.engine.list_held(self.commits.now(), prefix, limit, after)
        self.commits.commit_fact("list")
        return {
            "locks": visible_locks(caller, map(self.replies.status_view, page.locks)),
            "next": page.next,
        }

    def break_lock(self, caller: Caller, key: str, reason: str) -> dict[str, Any] | PendingBreak:
        """``break``: the result now, or a :class:`PendingBreak` when a holder listens.

        A holder listening for events is told at once and keeps its hold
        until it stops (docs/contract.md §12); the server waits (:meth:`break_ready`) and
        then calls :meth:`finish_break`. Holders that do not listen are
        released at once (:class:`~lockd.daemon.breaks.Breaks`).
        """
        self.gate.authorize(caller, "break", key)
        return self.breaks.begin(caller, key, reason)

    def break_result(
        self, caller: Caller, key: str, reason: str, broken: Sequence[BrokenHold]
    ) -> dict[str, Any]:
        """Log, count and answer a break that ended ``broken`` (oldest first), any backend."""
        return break_result(self.stats, caller, key, reason, broken)

    def stats_result(self, caller: Caller) -> dict[str, Any]:
        self.gate.authorize(caller, "stats")
        self.commits.restore_all("stats")
        return self.stats.snapshot({**self.server_gauges(), **self.gauges()})

    def rules(self, caller: Caller) -> dict[str, Any]:
        self.gate.authorize(caller, "rules")
        return self.gate.policy.rules_result()
