"""What a ``lockd`` command prints, without click: tables, fields, JSON, error lines.

Shared by the click commands (:mod:`lockd.cli.common` re-exports it) and the
fast path (:mod:`lockd.cli.fast`), which must print byte for byte what the
click path prints and may not import click. So this module never imports
click; :mod:`lockd.cli.common` holds the click side (:class:`CliFailure`,
``client_command``).
"""

from __future__ import annotations

import os
import sys

try:  # the C datetime: the datetime module runs its pure-Python twin first (issue 24)
    from _datetime import UTC, datetime
except ImportError:
    from datetime import UTC, datetime

from lockd_client import (
    DaemonUnavailableError,
    InternalError,
    InvalidRequestError,
    LockAccessDeniedError,
    LockdError,
    LockTimeoutError,
    RateLimitedError,
    ShuttingDownError,
    SocketPermissionError,
)

from lockd.exitcodes import (
    DAEMON_UNAVAILABLE,
    ERROR_STATUS,
    EXIT_BUG,
    EXIT_BUSY,
    EXIT_DEADLOCK,
    EXIT_DENIED,
    EXIT_INTERRUPTED,
    EXIT_LOST,
    EXIT_PIPE_CLOSED,
    EXIT_RATE_LIMITED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    KEY_BUSY,
    LEASE_LOST,
    USAGE,
    error_document,
    exit_code_for,
)
from lockd.textsafe import visible
from lockd.timefmt import format_duration_ms

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from typing import Any

#: Set to get a traceback instead of the one-line message for CLI bugs.
DEBUG_ENV = "LOCKD_DEBUG"


def echo(text: str, *, err: bool = False) -> None:
    """``text`` and a newline on stdout (stderr with ``err``), flushed.

    Under click (the ``click`` module loaded: the click path) this is
    ``click.echo``, which re-encodes a misconfigured ASCII stream; the fast
    path writes directly, and runs only when both streams are UTF-8
    (:func:`lockd.cli.fast.streams_are_utf8`), where the two write the same.
    """
    click = sys.modules.get("click")
    if click is not None:
        click.echo(text, err=err)
        return
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


# --------------------------------------------------------------------------- failures


#: The ``--json`` code of a failure that only has an exit code.
CODE_FOR_EXIT = {
    EXIT_BUSY: KEY_BUSY,
    EXIT_USAGE: USAGE,
    EXIT_DENIED: "LOCK_ACCESS_DENIED",
    EXIT_RATE_LIMITED: "RATE_LIMITED",
    EXIT_UNAVAILABLE: DAEMON_UNAVAILABLE,
    EXIT_LOST: LEASE_LOST,
    EXIT_DEADLOCK: "DEADLOCK",
    EXIT_INTERRUPTED: "CANCELLED",
    EXIT_BUG: "INTERNAL",
}


class Failure(Exception):
    """A command outcome that exits non-zero with one line on stderr (no click).

    ``code`` is the ``--json`` error code (default: the one for ``exit_code``),
    ``details`` its details object. :class:`lockd.cli.common.CliFailure` is
    the click exception made from one.
    """

    def __init__(
        self,
        message: str,
        exit_code: int,
        *,
        code: str | None = None,
        details: dict[str, Any] | None = None,
        quiet: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.code = code or CODE_FOR_EXIT.get(exit_code, "INTERNAL")
        self.details = details or {}
        self.quiet = quiet  # nothing to say: the status alone tells it

    def show(self, *, as_json: bool) -> None:
        """``lockd: message`` on stderr, or the one JSON error line under ``--json``."""
        if not self.quiet:
            echo_error(self.message, self.code, self.details, as_json=as_json)


def echo_error(
    message: str, code: str, details: dict[str, Any] | None = None, *, as_json: bool
) -> None:
    """Report a failure on stderr: ``lockd: message``, or the JSON line under ``--json``."""
    if as_json:
        echo(error_document(code, message, details), err=True)
    else:
        echo(f"lockd: {message}", err=True)


def describe_error(exc: LockdError) -> str:
    """One line for stderr (without the ``lockd: `` prefix)."""
    message = " ".join(exc.message.split())  # the one-line promise holds for any message
    if isinstance(exc, DaemonUnavailableError | SocketPermissionError):
        # The client's message names the socket and what to do.
        return message.removeprefix("lockd ")
    if isinstance(exc, LockAccessDeniedError):
        return f"access denied: {message}"
    if isinstance(exc, RateLimitedError):
        limit = f" (limit {exc.limit} attempts per hour)" if exc.limit is not None else ""
        return f"rate limited: {message}{limit}"
    if isinstance(exc, InvalidRequestError):
        field = f" (field {exc.field})" if exc.field else ""
        return f"invalid request: {message}{field}"
    if isinstance(exc, ShuttingDownError):
        return f"the daemon is shutting down: {message}; retry once it is back"
    if isinstance(exc, InternalError):
        return f"the daemon failed (internal error, see its log): {message}"
    if isinstance(exc, LockTimeoutError):
        return f"timed out: {message}"
    return f"{exc.code}: {message}"


def failure_for(exc: LockdError) -> Failure:
    """The Failure for a client error: its exit code, wire code and details.

    A client-side code outside the documented set (``DAEMON_UNTRUSTED``, a
    garbled reply's ``PROTOCOL_ERROR``) becomes ``DAEMON_UNAVAILABLE`` or
    ``INTERNAL``, the original in ``details.clientCode``.
    """
    code, details = exc.code, exc.details
    if code not in ERROR_STATUS:
        code = DAEMON_UNAVAILABLE if isinstance(exc, DaemonUnavailableError) else "INTERNAL"
        details = {**details, "clientCode": exc.code}
    # The message may quote a key or a holder (strings other users chose).
    return Failure(visible(describe_error(exc)), exit_code_for(exc), code=code, details=details)


def failure_from(exc: BaseException) -> Failure | None:
    """What a command body's exception means for the user; None: let it propagate.

    Client errors map to their exit code; a ``ValueError`` (the client's own
    argument checks: key length, control characters) is a usage error;
    Ctrl-C exits 130; anything else is a bug in the CLI: one line, exit 70
    (``LOCKD_DEBUG=1``: None, so that it propagates with its traceback).
    Exceptions that are not ``Exception`` (SystemExit ...) propagate.
    """
    if isinstance(exc, Failure):
        return exc
    if isinstance(exc, LockdError):
        return failure_for(exc)
    if isinstance(exc, ValueError):
        return Failure(f"invalid argument: {exc}", EXIT_USAGE)
    if isinstance(exc, KeyboardInterrupt):
        return Failure("interrupted", EXIT_INTERRUPTED)
    if isinstance(exc, BrokenPipeError):
        return pipe_closed()
    if not isinstance(exc, Exception) or os.environ.get(DEBUG_ENV):
        return None
    text = " ".join(str(exc).split()) or "no message"
    return Failure(
        f"unexpected error (a bug in lockd; set {DEBUG_ENV}=1 for a traceback): "
        f"{type(exc).__name__}: {text}",
        EXIT_BUG,
    )


def pipe_closed() -> Failure:
    """stdout's reader went away (``lockd locks list | head -1``): end as tools do that
    SIGPIPE ends -- status 141, nothing printed -- not as a bug.

    stdout is pointed at /dev/null first, so that the interpreter's last
    flush of what is still buffered does not fail again on its way out.
    """
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):  # no stdout descriptor at all: nothing will be flushed there
        pass
    return Failure("output closed", EXIT_PIPE_CLOSED, quiet=True)


# --------------------------------------------------------------------------- output
#: how every JSON document the CLI prints is written.
JSON_STYLE: dict[str, Any] = {"ensure_ascii": False, "separators": (",", ":")}


def print_json(value: Any) -> None:
    """ONE JSON document on one line: stable for scripts (``jq``, ``while read``)."""
    import json

    echo(json.dumps(value, **JSON_STYLE))


def format_time(when: datetime | None) -> str:
    """A wire time in the local zone: ``2026-11-30 05:10:39 UTC`` (``-`` for None)."""
    if when is None:
        return "-"
    local = when.astimezone()
    return local.strftime("%Y-%m-%d %H:%M:%S ") + (local.tzname() or local.strftime("%z"))


def format_relative(ms: int | None) -> str:
    """``in 42s`` / ``42s ago`` for milliseconds from now (``-`` for None)."""
    if ms is None:
        return "-"
    return f"in {format_duration_ms(ms)}" if ms >= 0 else f"{format_duration_ms(-ms)} ago"


def parse_time(value: object) -> datetime | None:
    """A wire time (``2026-11-30T03:31:00.123Z``) as an aware datetime; None if absent or bad."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def ms_until(when: datetime | None) -> int | None:
    """Milliseconds from now until ``when`` (negative when past)."""
    if when is None:
        return None
    now = datetime.now(tz=when.tzinfo)
    return int((when - now).total_seconds() * 1000)


def display_width(text: str) -> int:
    """Terminal columns of ``text`` (East Asian wide characters take two)."""
    if text.isascii():
        return len(text)
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _pad(text: str, width: int) -> str:
    return text + " " * (width - display_width(text))


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns aligned with two spaces between them; no trailing spaces."""
    return "\n".join(TableWriter(headers).lines(rows))


class TableWriter:
    """A table written as its rows arrive (``locks list`` streams page by page).

    The first batch fixes the column widths (with the header); a longer cell
    in a later batch widens its column from then on.
    """

    def __init__(self, headers: Sequence[str]) -> None:
        self._headers: list[str] | None = [str(c) for c in headers]
        self._widths = [0] * len(headers)

    def lines(self, rows: Iterable[Sequence[object]]) -> list[str]:
        """The next lines of the table (the header first, on the first call)."""
        cells = [["-" if c is None else visible(c) for c in r] for r in rows]
        if self._headers is not None:
            cells.insert(0, self._headers)
            self._headers = None
        for row in cells:
            self._widths = [
                max(w, display_width(c)) for w, c in zip(self._widths, row, strict=True)
            ]
        return [
            "  ".join(_pad(c, w) for c, w in zip(row, self._widths, strict=True)).rstrip()
            for row in cells
        ]


def render_fields(pairs: Iterable[tuple[str, object]]) -> str:
    """``Label:  value`` lines, values aligned (``-`` for None)."""
    items = [(f"{label}:", "-" if value is None else visible(value)) for label, value in pairs]
    width = max((len(label) for label, _ in items), default=0)
    return "\n".join(f"{label.ljust(width)}  {value}".rstrip() for label, value in items)
