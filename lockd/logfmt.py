"""One log line per event, ``key=value`` pairs, to stderr (journald reads it)."""

from __future__ import annotations

import logging
import os
import sys

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
