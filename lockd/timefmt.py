"""Wire times: RFC 3339, UTC, milliseconds (``2026-11-30T03:31:00.123Z``).

Shared at the top because the daemon (lease deadlines in replies) and the
rules (``loadedAt``, reload errors; also shown by ``lockd rules check``)
write the same format, and :mod:`lockd.rules` must not import
:mod:`lockd.daemon`. Times are whole milliseconds since the Unix epoch
everywhere here, never float seconds.
"""

from __future__ import annotations

import time


def wall_ms() -> int:
    """Now on the wall clock, in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


#: ``_utc_second`` answers lately given: deadlines of one busy second share
#: their prefix, and strftime is the costly part of formatting a reply time.
#: A dict, not ``functools.lru_cache``: the CLI imports this module, and
#: functools (with collections) is a start-up cost (issue 24). Bounded;
#: emptied when full.
_utc_seconds: dict[int, str] = {}
_UTC_SECONDS_MAX = 256


def _utc_second(seconds: int) -> str:
    text = _utc_seconds.get(seconds)
    if text is None:
        if len(_utc_seconds) >= _UTC_SECONDS_MAX:
            _utc_seconds.clear()
        text = _utc_seconds[seconds] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    return text


def format_epoch_ms(epoch_ms: int) -> str:
    """``2026-11-30T03:31:00.123Z`` for milliseconds since the epoch."""
    seconds, millis = divmod(epoch_ms, 1000)
    return f"{_utc_second(seconds)}.{millis:03d}Z"


def format_duration_ms(ms: int | float) -> str:
    """A human duration: ``250ms``, ``42s``, ``3m 5s``, ``2h 10m``, ``1d 3h``.

    Rounded down to the unit shown, so a countdown never overstates what is
    left (``1.5s`` shows as ``1s``); every command and ``lockd run`` use it.
    """
    ms = round(ms)
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms // 1000  # floor: a countdown never overstates what is left
    if seconds < 60:
        return f"{seconds}s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {sec}s" if sec else f"{minutes}m"
    hours, minute = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minute}m" if minute else f"{hours}h"
    days, hour = divmod(hours, 24)
    return f"{days}d {hour}h" if hour else f"{days}d"
