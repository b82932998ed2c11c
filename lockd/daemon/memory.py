"""Give memory back to the system after a flood of waits has gone.

64 connections x 1,024 blocking acquires took the daemon from 33 to 367 MB,
and it stayed there after they left: the objects are freed, but glibc keeps
freed heap pages for reuse. :class:`TrimAfterDrop` watches a gauge (waits
pending, connections open); when a high-water mark of at least
``min_high`` has fallen by half, it calls ``malloc_trim(0)``, which hands
free pages back. A few milliseconds at most, and only after such a drop
(a handful of times as a flood ends, never per request).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.memory")


def _libc_trim() -> Callable[[], object] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def collect_and_trim() -> None:
        # Cancelled waits leave cycles (an exception, its traceback, the
        # frames); they are only freed by a full collection.
        gc.collect()
        trim(0)

    return collect_and_trim


class TrimAfterDrop:
    """Calls ``trim`` each time a gauge fell to half its high-water mark (at least ``min_high``)."""

    def __init__(self, name: str, min_high: int, trim: Callable[[], object] | None = None) -> None:
        self.name = name
        self.min_high = min_high
        self._trim = trim if trim is not None else _libc_trim()
        self.high = 0
        self.trims = 0

    def observe(self, pending: int) -> None:
        if pending > self.high:
            self.high = pending
        elif self.high >= self.min_high and pending <= self.high // 2:
            log.info(kv(event="memory_trim", gauge=self.name, high=self.high, now=pending))
            self.high = pending
            self.trims += 1
            if self._trim is not None:
                self._trim()
