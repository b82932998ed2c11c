"""What ``lockd run`` was asked to do, and how it speaks (SPEC §9).

The vocabulary shared by :mod:`lockd.runlease` (taking the key) and
:mod:`lockd.runner` (the whole run): kept apart so that neither has to import
the other. Re-exported by :mod:`lockd.runner`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import IO, Any

from lockd.exitcodes import EXIT_BUSY

__all__ = ["OnLost", "Reporter", "RunOptions", "format_ms"]


class OnLost(StrEnum):
    """What to do to COMMAND when the lease is lost (``--on-lost``)."""

    TERM = "term"  # SIGTERM to the group, SIGKILL after --grace
    KILL = "kill"  # SIGKILL to the group at once
    IGNORE = "ignore"  # only report; exit 6 once COMMAND is done


@dataclass(frozen=True)
class RunOptions:
    """What ``lockd run`` was asked to do. Durations are whole milliseconds."""

    key: str
    command: tuple[str, ...]
    ttl_ms: int = 60_000
    wait_ms: int | None = None  # None: a single tryAcquire
    owner: str | None = None
    on_lost: OnLost = OnLost.TERM
    grace_ms: int = 10_000
    conflict_exit_code: int = EXIT_BUSY
    socket_path: str | None = None
    quiet: bool = False  # no stderr line when the key is busy / the wait timed out


class Reporter:
    """``lockd run``'s own voice: one line per event on stderr.

    stdout belongs to COMMAND, so nothing is ever written there. With
    ``json_lines`` each line is ``{"error": {"code", "message", "details"}}``,
    the shape of the daemon's errors, for scripts that parse stderr.
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        *,
        json_lines: bool = False,
        prog: str = "lockd run",
    ) -> None:
        self._stream = stream
        self.json_lines = json_lines
        self.prog = prog

    def __call__(self, code: str, message: str, **details: Any) -> None:
        """Write one line: ``code`` is a stable name such as ``KEY_BUSY`` or ``LEASE_LOST``."""
        stream = self._stream if self._stream is not None else sys.stderr
        if self.json_lines:
            body = {"code": code, "message": message, "details": details}
            line = json.dumps({"error": body}, ensure_ascii=False)
        else:
            line = f"{self.prog}: {message}"
        with contextlib.suppress(OSError, ValueError):  # a closed stderr must not hide the exit
            stream.write(line + "\n")
            stream.flush()


def format_ms(ms: int) -> str:
    """A duration for humans: ``600ms``, ``10s``, ``1.5s``, ``2m``."""
    if ms < 1000:
        return f"{ms}ms"
    if ms % 60_000 == 0:
        return f"{ms // 60_000}m"
    return f"{ms / 1000:g}s"
