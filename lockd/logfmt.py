"""One log line per event, ``key=value`` pairs, to stderr (journald reads it)."""

from __future__ import annotations

import logging
import sys


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


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    )
    root = logging.getLogger("lockd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
