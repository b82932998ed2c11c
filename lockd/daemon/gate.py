"""What a request must pass before the lock state is asked: rules, pending limits, rate limit.

The caller is already identified (peer credentials, :mod:`lockd.identity`).
:class:`Gate` then answers, per host and whatever backend holds the locks:

* may this caller do this (the access rules, :mod:`lockd.rules`), within
  its share of the CPU the rules may spend (docs/contract.md §5);
* may this connection, and this principal over all its connections, have
  one more blocking acquire waiting;
* is this acquire attempt within the caller's rate limit
  (docs/contract.md §6).

Refusals are raised as :class:`~lockd.daemon.protocol.ProtocolError` and
counted. The service (:mod:`lockd.daemon.service`) and the remote path
(:mod:`lockd.daemon.remote`) both ask it, so the embedded and the etcd
backends admit exactly the same requests; it is separate from the service
because none of it depends on the lock state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from lockd.core import EXCLUSIVE
from lockd.daemon.clock import Clock
from lockd.daemon.memory import TrimAfterDrop
from lockd.daemon.protocol import Acquire, ProtocolError
from lockd.daemon.stats import StatsRecorder
from lockd.identity import Caller
from lockd.logfmt import LogThrottle, kv

if TYPE_CHECKING:
    from lockd.daemon.ratelimit import RuleCpuBudget

# The service's logger: denials were logged there before this module was
# split out of it, and log filters may name it.
log = logging.getLogger("lockd.daemon.service")

#: blocking acquires one connection may have waiting at once (docs/contract.md leaves it open).
DEFAULT_MAX_PENDING_PER_CONNECTION = 1024
#: blocking acquires one principal may have waiting at once, all its connections together.
DEFAULT_MAX_PENDING_PER_USER = 1024
#: the ``retryAfterMs`` hint of a refusal over ``max_pending_per_user``.
PENDING_RETRY_HINT_MS = 1000
#: a rule evaluation that costs this much CPU (seconds) lets other connections go first.
COSTLY_RULE_S = 0.001
#: ops whose rule a member's request may have evaluated (docs/contract.md §5).
_RULE_GATED = frozenset({"acquire", "tryAcquire", "renew"})


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


class RateLimiterLike(Protocol):
    #: attempts allowed per principal per window.
    limit: int

    def try_take(self, principal: str, now_ms: int) -> int | None: ...


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


def _denied(op: str, key: str | None, caller: Caller) -> ProtocolError:
    where = f" on key {key!r}" if key is not None else ""
    return ProtocolError(
        "LOCK_ACCESS_DENIED",
        f"{caller.principal} (role {caller.role}) may not {op}{where}",
        details={"op": op, **({"key": key} if key is not None else {})},
    )


class Gate:
    """The access rules, the pending limits and the rate limit of one daemon."""

    def __init__(
        self,
        policy: PolicyLike,
        ratelimiter: RateLimiterLike,
        clock: Clock,
        stats: StatsRecorder,
        *,
        rule_cpu: RuleCpuBudget | None,
        max_pending_per_connection: int,
        max_pending_per_user: int,
    ) -> None:
        self.policy = policy
        self.ratelimiter = ratelimiter
        self.clock = clock
        self.stats = stats
        #: each member's share of rule-evaluation CPU (None: unbounded).
        self.rule_cpu = rule_cpu
        self._costly_rule_ran = False
        self.max_pending_per_connection = max_pending_per_connection
        self.max_pending_per_user = max_pending_per_user
        #: blocking acquires waiting now, by principal (owners not counted).
        self._pending_by_principal: dict[str, int] = {}
        #: every blocking acquire waiting now (owners' too), for the trim below.
        self._pending_total = 0
        #: memory goes back to the system once a flood of waits is over.
        self.memory = TrimAfterDrop("waits", 1024)
        #: denials are logged at most once per principal per interval, with counts.
        self.denial_log = LogThrottle()

    # -------------------------------------------------------------- rules

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
            suppressed = self.denial_log.admit(caller.principal)
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

    def authorize_acquire(self, caller: Caller, req: Acquire) -> None:
        """The rules for an acquire; a denied attempt counts against the rate limit.

        Refusals must not be a free way to keep the daemon busy (issue 21).
        """
        try:
            self.authorize(caller, "acquire", req.key, mode=req.mode, limit=req.limit)
        except ProtocolError as exc:
            if exc.code == "LOCK_ACCESS_DENIED":
                self.take_attempt(caller, self.clock.boot_ms())
            raise

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

    # ------------------------------------------------------ pending limits

    def check_acquire(self, caller: Caller, req: Acquire, *, pending: int) -> None:
        """What every acquire passes first: the rules, then the connection's pending limit.

        A denied attempt counts against the caller's rate limit like any other
        (issue 21): refusals must not be a free way to keep the daemon busy.
        """
        self.authorize_acquire(caller, req)
        self.check_pending(caller, req, pending)

    def check_pending(self, caller: Caller, req: Acquire, pending: int) -> None:
        """May one more blocking acquire wait, on this connection and for this principal?"""
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

    # ---------------------------------------------------------- rate limit

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
