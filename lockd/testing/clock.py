"""Clocks a test moves by hand, for code that takes the daemon's ``Clock``.

:class:`FakeClock` stands for ``lockd.daemon.clock.Clock`` (boot time for
deadlines, wall time for what is printed): nothing moves it but the test, so
a lease expires when the test says so, without sleeping. The trio timers of
a test do not see it; code that also waits on trio's clock wants trio's
``MockClock`` beside it.

:class:`SkippedClock` is the system's clock plus time the test skips ahead:
for code whose other half keeps real time (a real etcd cluster's leases), when
the test needs the code to believe that time has passed, and nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class FakeClock:
    """Boot and wall time in ms, moved only by :meth:`advance` (or by setting ``now``)."""

    #: boot-clock ms (an arbitrary start: deadlines are differences).
    now: int = 1_000_000
    #: the wall time (ms since the Unix epoch) at boot time 0.
    epoch_ms: int = 1_700_000_000_000

    def boot_ms(self) -> int:
        return self.now

    def wall_ms(self) -> int:
        return self.epoch_ms + self.now

    def advance(self, ms: int) -> None:
        self.now += ms


@dataclass
class SkippedClock:
    """The system's boot and wall clocks, plus ``skipped`` ms the test has added."""

    skipped: int = 0

    def boot_ms(self) -> int:
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000 + self.skipped

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.skipped

    def skip(self, ms: int) -> None:
        self.skipped += ms
