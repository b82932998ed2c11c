"""Acquire rate limit (docs/contract.md §6): at most N counted attempts per rolling window.

Pure and clock-free: every call takes ``now_ms`` from the caller (the daemon
passes its monotonic/boot clock), so tests drive time by hand.

Why an exact sliding log (a deque of attempt times per principal) rather than
fixed buckets or a two-bucket estimate: docs/contract.md §6 promises "600 acquire attempts
per rolling hour", i.e. never more than N in *any* window of that length. A
fixed bucket lets 2N through around a bucket edge and a two-bucket estimate
can over- or under-count; both would make ``retryAfterMs`` a guess. The log is
exact, gives an exact ``retry_after_ms`` (when the oldest counted attempt ages
out), and its cost is bounded: a principal never holds more than N stamps
(600 ints), and callers are local users and services of one host.

Memory stays bounded however many principals appear: principals are kept in
order of their latest counted attempt, and every call evicts from the front
those whose attempts have all aged out (amortised O(1)). A principal that only
gets refusals keeps its place, which is right: refusals are not counted and
its newest counted attempt has not moved. Eviction only ever drops a principal
with no attempt left in the window, so it is correct whatever order calls
arrive in; the ordering only makes it prompt.

Who is exempt (owners, services) is the server's decision, not this module's.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

HOUR_MS = 3_600_000


class RateLimiter:
    """At most ``per_hour`` counted attempts per principal in any rolling window."""

    def __init__(self, per_hour: int, window_ms: int = HOUR_MS) -> None:
        if per_hour < 1:
            raise ValueError("per_hour must be at least 1")
        if window_ms < 1:
            raise ValueError("window_ms must be at least 1")
        self.limit = per_hour
        self.window_ms = window_ms
        # principal -> stamps of its counted attempts, oldest first; the dict is
        # ordered by each principal's newest stamp (least recent first).
        self._log: OrderedDict[str, deque[int]] = OrderedDict()

    @property
    def tracked(self) -> int:
        """How many principals have attempts in memory (for tests and stats)."""
        return len(self._log)

    def try_take(self, principal: str, now_ms: int) -> int | None:
        """Count one attempt: None when counted, else ms until a slot frees (> 0)."""
        self._evict(now_ms)
        stamps = self._log.get(principal)
        if stamps is None:
            stamps = deque()
            self._log[principal] = stamps
        else:
            self._prune(stamps, now_ms)
            if len(stamps) >= self.limit:
                return max(1, stamps[0] + self.window_ms - now_ms)
            self._log.move_to_end(principal)
        stamps.append(now_ms)
        return None

    def wait_hint(self, principal: str, now_ms: int) -> int:
        """Ms until ``principal`` has room (0 when it has room now); takes nothing."""
        self._evict(now_ms)
        stamps = self._log.get(principal)
        if stamps is None:
            return 0
        self._prune(stamps, now_ms)
        if len(stamps) < self.limit:
            return 0
        return max(1, stamps[0] + self.window_ms - now_ms)

    def used(self, principal: str, now_ms: int) -> int:
        """Counted attempts of ``principal`` in the window ending at ``now_ms``."""
        stamps = self._log.get(principal)
        if stamps is None:
            return 0
        self._prune(stamps, now_ms)
        return len(stamps)

    def _prune(self, stamps: deque[int], now_ms: int) -> None:
        # An attempt at t counts in windows (t - window, t]: gone at t + window.
        horizon = now_ms - self.window_ms
        while stamps and stamps[0] <= horizon:
            stamps.popleft()

    def _evict(self, now_ms: int) -> None:
        horizon = now_ms - self.window_ms
        log = self._log
        while log:
            principal, stamps = next(iter(log.items()))
            if stamps and stamps[-1] > horizon:
                return
            del log[principal]


class RuleCpuBudget:
    """CPU time each principal may spend in rule evaluations: a token bucket per principal.

    Why: a member's rule may cost up to ``rule_budget_ms`` per evaluation,
    and a verdict cache does not help against fresh keys, so one member
    asking for new keys in a loop kept the single-threaded daemon busy
    evaluating for it, and everyone else's requests waited behind (root's
    ``hello`` p50 from 0.4 to 10 ms). Each principal earns
    ``per_second_ms`` of rule CPU per second, up to ``burst_ms`` banked
    (by default 250 ms: a caller's first evaluation, which also pays for
    cel-python warming up, can cost 100 ms or more). An
    evaluation is charged what it used after it ran, which may take the
    balance below zero by at most one evaluation's budget; while the
    balance is not positive, no new evaluation runs for that principal
    (:meth:`wait_ms` says for how long). A flood then costs the daemon
    ``per_second_ms`` of CPU per second, not all of it, and only the
    flooding principal waits.

    Pure and clock-free like :class:`RateLimiter`: every call takes
    ``now_ms``. Principals whose balance is full again are forgotten, so
    memory stays bounded by the principals evaluated in the last second.
    """

    def __init__(self, per_second_ms: int, burst_ms: int = 250) -> None:
        if per_second_ms < 1 or burst_ms < 1:
            raise ValueError("per_second_ms and burst_ms must be at least 1")
        self.per_second_ms = per_second_ms
        self.burst_ms = burst_ms
        #: principal -> (balance in ms at ``stamp``, stamp); least recently charged first.
        self._balances: OrderedDict[str, tuple[float, int]] = OrderedDict()

    @property
    def capacity_ms(self) -> float:
        return float(self.burst_ms)

    @property
    def tracked(self) -> int:
        return len(self._balances)

    def _balance(self, principal: str, now_ms: int) -> float:
        entry = self._balances.get(principal)
        if entry is None:
            return self.capacity_ms
        balance, stamp = entry
        earned = max(0, now_ms - stamp) * self.per_second_ms / 1000
        return min(self.capacity_ms, balance + earned)

    def wait_ms(self, principal: str, now_ms: int) -> int:
        """0 when ``principal`` may have a rule evaluated now; else ms until it may."""
        self._evict(now_ms)
        balance = self._balance(principal, now_ms)
        if balance > 0:
            return 0
        return max(1, math.ceil((-balance + 0.001) * 1000 / self.per_second_ms))

    def charge(self, principal: str, cpu_ms: float, now_ms: int) -> None:
        """Take ``cpu_ms`` (what an evaluation used) from ``principal``'s balance."""
        balance = self._balance(principal, now_ms) - cpu_ms
        self._balances[principal] = (balance, now_ms)
        self._balances.move_to_end(principal)
        self._evict(now_ms)

    def _evict(self, now_ms: int) -> None:
        balances = self._balances
        while balances:
            principal = next(iter(balances))
            if self._balance(principal, now_ms) < self.capacity_ms:
                return
            del balances[principal]
