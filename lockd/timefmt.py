"""Wire times: RFC 3339, UTC, milliseconds (``2026-11-30T03:31:00.123Z``).

Shared at the top because the daemon (lease deadlines in replies) and the
rules (``loadedAt``, reload errors; also shown by ``lockd rules check``)
write the same format, and :mod:`lockd.rules` must not import
:mod:`lockd.daemon`. Times are whole milliseconds since the Unix epoch
everywhere here, never float seconds.
"""

from __future__ import annotations

import functools
import time


def wall_ms() -> int:
    """Now on the wall clock, in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


@functools.lru_cache(maxsize=256)
def _utc_second(seconds: int) -> str:
    # Deadlines of one busy second share their prefix; strftime is the
    # costly part of formatting a reply time.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def format_epoch_ms(epoch_ms: int) -> str:
    """``2026-11-30T03:31:00.123Z`` for milliseconds since the epoch."""
    seconds, millis = divmod(epoch_ms, 1000)
    return f"{_utc_second(seconds)}.{millis:03d}Z"
