"""Strings other users chose, made safe to show on a terminal.

A process name (any user sets its own, /proc/PID/comm), an owner, a key, a
break reason or a principal reaches other users' terminals through ``lockd
locks list``/``status`` and ``lockd run``'s messages. Written raw, a newline
forges a table row, an escape sequence (ESC ``[``...) recolours, moves the
cursor or retitles the reader's terminal, and a bidi override (U+202E)
shows ``exe.sh`` as ``hs.exe``. :func:`visible` turns every character that
is not printable (Unicode categories C* and Z* but the space: controls,
format characters such as bidi overrides and zero-width joiners, line and
paragraph separators) into a visible escape (``\\n``, ``\\x1b``,
``\\u202e``); printable text, non-ASCII letters included, is kept as it is.
The daemon's log lines escape the same characters (:func:`lockd.logfmt.kv`).
JSON output is JSON and needs none of this: its encoder escapes controls.
"""

from __future__ import annotations

__all__ = ["visible"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def visible(value: object) -> str:
    """``str(value)`` with every unprintable character shown as an escape."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the usual case: one C-speed scan
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)
