"""The two clocks the daemon reads, behind one small seam for tests.

Lease deadlines run on CLOCK_BOOTTIME: it never steps when the wall clock
is set, and unlike CLOCK_MONOTONIC it keeps counting through suspend, so a
lease taken before a laptop sleeps has run out when it wakes. The wall clock
is only used to print deadlines as RFC 3339 times.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def boot_ms(self) -> int: ...

    def wall_ms(self) -> int: ...


class SystemClock:
    def boot_ms(self) -> int:
        return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000
