"""Counters, gauges and per-op latency percentiles for the ``stats`` op.

Latencies keep the last :data:`WINDOW` samples per op in a ring (the
config's ``stats_window``): memory is fixed, percentiles describe recent
behaviour, and recording costs one list store on the hot path. The server
times one request in :data:`SAMPLE_EVERY` of those it answers at once (the
others are only counted: ``count`` stays exact), every one of an op that has
fewer than :data:`SAMPLE_ALL_BELOW` samples, and every request that
waits in a task of its own. A blocking acquire's latency includes its wait.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from lockd.metrics import COUNTERS

WINDOW = 2048
#: the server times one in this many of the requests it answers at once, at random...
SAMPLE_EVERY = 8
#: ...once an op has this many samples in its window; before that it times every one, so
#: that an op seldom asked still shows its latency (a single request included).
SAMPLE_ALL_BELOW = 128


class LatencyWindow:
    __slots__ = ("_next", "_samples", "count", "size")

    def __init__(self, size: int = WINDOW) -> None:
        self._samples: list[float] = []
        self._next = 0
        self.count = 0
        self.size = size

    @property
    def sampled(self) -> int:
        """How many samples the window holds (at most its size)."""
        return len(self._samples)

    def record(self, ms: float) -> None:
        self.count += 1
        if len(self._samples) < self.size:
            self._samples.append(ms)
        else:
            self._samples[self._next] = ms
            self._next = (self._next + 1) % self.size

    def summary(self) -> dict[str, float | int]:
        data = sorted(self._samples)
        if not data:
            return {"count": self.count}

        def pct(p: float) -> float:
            return round(data[min(len(data) - 1, int(p * len(data)))], 3)

        return {
            "count": self.count,
            "p50Ms": pct(0.50),
            "p90Ms": pct(0.90),
            "p99Ms": pct(0.99),
            "maxMs": round(data[-1], 3),
        }


class StatsRecorder:
    """What the ``stats`` op reports: counters by name, latencies by op.

    (Named apart from :class:`lockd.daemon.protocol.Stats`, the request.)
    """

    def __init__(self, window: int = WINDOW) -> None:
        self.counters: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self.latency: dict[str, LatencyWindow] = {}
        #: samples kept per op.
        self.window = window

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe(self, op: str, ms: float) -> None:
        window = self.latency.get(op)
        if window is None:
            window = self.latency[op] = LatencyWindow(self.window)
        window.record(ms)

    def tally_untimed(self, op: str) -> bool:
        """Count one untimed request of ``op``; False (count nothing: time it) while the op
        has fewer than :data:`SAMPLE_ALL_BELOW` samples, so every op gets percentiles soon.

        The server asks this of every request it did not choose to time.
        """
        window = self.latency.get(op)
        if window is None or window.sampled < SAMPLE_ALL_BELOW:
            return False
        window.count += 1
        return True

    def snapshot(self, gauges: dict[str, Any]) -> dict[str, Any]:
        return {
            **gauges,
            "counters": dict(self.counters),
            "latency": {op: w.summary() for op, w in sorted(self.latency.items())},
        }
