"""One log line per event, ``key=value`` pairs, to stderr (journald reads it)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

# sd-daemon(3) priority prefixes, which journald turns into the entry's
# priority, so `journalctl -p warning` selects lockd's warnings.
_SYSLOG_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


def kv(**fields: object) -> str:
    """Format fields as ``a=1 b="two words"``; values are quoted when needed."""
    parts = []
    for name, value in fields.items():
        text = "" if value is None else str(value)
        if text == "" or any(c in text for c in ' "=\\') or not text.isprintable():
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
            text = text.encode("unicode_escape").decode("ascii").replace('\\\\"', '\\"')
        parts.append(f"{name}={text}")
    return " ".join(parts)


class JournalPrefixFormatter(logging.Formatter):
    """Prefixes each line with ``<N>`` (its syslog priority) for journald."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _SYSLOG_PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        # A traceback spans lines; journald reads a prefix on each line.
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


def stderr_is_journal() -> bool:
    """True when stderr is the journal stream systemd connected (JOURNAL_STREAM)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = stream.partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(device), int(inode))
    except (ValueError, OSError):
        return False


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    fmt = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
    if stderr_is_journal():
        # journald stamps entries itself; a second timestamp is noise.
        handler.setFormatter(
            JournalPrefixFormatter("level=%(levelname)s logger=%(name)s %(message)s")
        )
    else:
        handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger("lockd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class LogThrottle:
    """At most one log line per key (say, event and principal) per ``interval`` seconds.

    One user must not be able to write the daemon's log at its own pace (a
    flood of denied requests made 3.3 MB/s of log). :meth:`admit` says
    whether to write this line; a line that is written carries, in
    ``suppressed``, how many of that key's lines were left out since the
    previous one, so nothing is hidden, only counted (a burst's count is
    reported with the key's next line). At most ``max_keys`` keys are
    remembered, the one written longest ago forgotten first.
    """

    def __init__(
        self,
        interval: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 4096,
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._max_keys = max_keys
        #: key -> (clock of its last written line, lines left out since); oldest first.
        self._seen: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()

    def admit(self, key: Hashable) -> int | None:
        """None: leave this line out (it is counted). Else write it, with this many suppressed."""
        now = self._clock()
        seen = self._seen
        entry = seen.get(key)
        if entry is not None:
            written, left_out = entry
            if now - written < self.interval:
                seen[key] = (written, left_out + 1)
                return None
            del seen[key]
        seen[key] = (now, 0)
        if len(seen) > self._max_keys:
            seen.popitem(last=False)  # the key written longest ago
        return 0 if entry is None else entry[1]
