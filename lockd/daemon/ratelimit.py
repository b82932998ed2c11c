"""Acquire rate limit (SPEC §6): at most N counted attempts per rolling window.

Pure and clock-free: every call takes ``now_ms`` from the caller (the daemon
passes its monotonic/boot clock), so tests drive time by hand.

Why an exact sliding log (a deque of attempt times per principal) rather than
fixed buckets or a two-bucket estimate: SPEC §6 promises "600 acquire attempts
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
