"""What every ``lockd`` command shares: exit codes, durations, errors, output.

Why this module exists: the CLI is a contract for shell scripts (docs/contract.md §9), so
the pieces a script relies on must behave the same in every command:

- **Exit codes** (:data:`EXIT_CODES_HELP`, shown by ``lockd --help``) and the
  mapping from :mod:`lockd_client` errors to them, both defined once in
  :mod:`lockd.exitcodes` (``lockd run`` uses the same).
- **Errors are one line on stderr**, never a traceback: :func:`client_command`
  turns client errors into :class:`CliFailure`, and :class:`LockdGroup` prints
  click's usage errors on one line too (exit 2). With ``--json`` that line is
  ``{"error": {"code", "status", "message", "details"}}`` for every failure
  (:func:`lockd.exitcodes.error_document`).
- **Durations** (``500ms``, ``60s``, ``5m``, ``1h``, bare number = ms) parse
  through one click type, :class:`Duration`, so a bad value is a usage error
  with a one-line reason in every command, and a bare number below 1000 warns
  that it was read as milliseconds.
- **Output**: ``--json`` prints ONE JSON document (the daemon's wire result);
  human output is aligned tables and ``key: value`` blocks.

Nothing here imports trio, celpy or the daemon: ``lockd`` starts fast, which
shell completion (it runs the program on every <TAB>) depends on. The ``run``
command (:mod:`lockd.cli.run`) uses them as well.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from typing import IO, Any, NoReturn, ParamSpec, TypeVar

import click
from lockd_client import (
    MAX_LIMIT,
    DaemonUnavailableError,
    InternalError,
    InvalidRequestError,
    LockAccessDeniedError,
    LockClient,
    LockdError,
    LockTimeoutError,
    RateLimitedError,
    ShuttingDownError,
    SocketPermissionError,
)
from lockd_client._paths import SOCKET_ENV

from lockd.contract import MAX_TIMEOUT_MS, MAX_TTL_MS, WAIT_FOREVER
from lockd.exitcodes import (
    DAEMON_UNAVAILABLE,
    ERROR_STATUS,
    EXIT_BUG,
    EXIT_BUSY,
    EXIT_DEADLOCK,
    EXIT_DENIED,
    EXIT_INTERRUPTED,
    EXIT_LOST,
    EXIT_RATE_LIMITED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    KEY_BUSY,
    LEASE_LOST,
    USAGE,
    error_document,
    exit_code_for,
    exit_codes_help,
)
from lockd.textsafe import visible
from lockd.timefmt import format_duration_ms

# --------------------------------------------------------------------------- exit codes

EXIT_CODES_HELP = exit_codes_help()

#: Set to get a traceback instead of the one-line message for CLI bugs.
DEBUG_ENV = "LOCKD_DEBUG"


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


# --------------------------------------------------------------------------- --json errors

_json_errors = False  # set from the command line by LockdGroup, before any parsing


def json_requested(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among ``args`` (before a ``--``: after it is COMMAND's)."""
    if "--" in args:
        args = args[: list(args).index("--")]
    return "--json" in args


def json_errors() -> bool:
    """True when failures must be reported as one JSON line (docs/contract.md §9).

    From the command line as the root group saw it, or, for a command invoked
    on its own (tests), from its parsed ``--json`` option.
    """
    if _json_errors:
        return True
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if ctx.params.get("as_json") or ctx.params.get("json_output"):
            return True
        ctx = ctx.parent
    return False


#: The ``--json`` code of a failure that only has an exit code.
_CODE_FOR_EXIT = {
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


def echo_error(message: str, code: str, details: dict[str, Any] | None = None) -> None:
    """Report a failure on stderr: ``lockd: message``, or the JSON line under ``--json``."""
    if json_errors():
        click.echo(error_document(code, message, details), err=True)
    else:
        click.echo(f"lockd: {message}", err=True)


def warn(message: str) -> None:
    """``lockd: warning: message`` on stderr; nothing under ``--json``, whose
    stderr is kept for the one error document of a failure (docs/contract.md §9)."""
    if not json_errors():
        click.echo(f"lockd: warning: {message}", err=True)


class CliFailure(click.ClickException):
    """A command outcome that exits non-zero with one line on stderr.

    ``code`` is the ``--json`` error code (default: the one for ``exit_code``),
    ``details`` its details object.
    """

    def __init__(
        self,
        message: str,
        exit_code: int,
        *,
        code: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it per instance
        self.code = code or _CODE_FOR_EXIT.get(exit_code, "INTERNAL")
        self.details = details or {}

    def show(self, file: IO[Any] | None = None) -> None:
        echo_error(self.format_message(), self.code, self.details)


def fail(
    message: str,
    exit_code: int,
    *,
    code: str | None = None,
    details: dict[str, Any] | None = None,
) -> NoReturn:
    """Stop the command: ``lockd: message`` on stderr (or the JSON line), exit ``exit_code``."""
    raise CliFailure(message, exit_code, code=code, details=details)


def failure_for(exc: LockdError) -> CliFailure:
    """The CliFailure for a client error: its exit code, wire code and details.

    A client-side code outside the documented set (``DAEMON_UNTRUSTED``, a
    garbled reply's ``PROTOCOL_ERROR``) becomes ``DAEMON_UNAVAILABLE`` or
    ``INTERNAL``, the original in ``details.clientCode``.
    """
    code, details = exc.code, exc.details
    if code not in ERROR_STATUS:
        code = DAEMON_UNAVAILABLE if isinstance(exc, DaemonUnavailableError) else "INTERNAL"
        details = {**details, "clientCode": exc.code}
    # The message may quote a key or a holder (strings other users chose).
    return CliFailure(visible(describe_error(exc)), exit_code_for(exc), code=code, details=details)


P = ParamSpec("P")
R = TypeVar("R")


def client_command(func: Callable[P, R]) -> Callable[P, R]:
    """Wrap a command callback so nothing but one stderr line escapes it.

    Client errors map to their exit code; a ``ValueError`` (the client's own
    argument checks: key length, control characters) is a usage error;
    Ctrl-C exits 130; anything else is a bug in the CLI: one line, exit 70
    (``LOCKD_DEBUG=1`` re-raises it for a traceback).
    """

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except LockdError as exc:
            raise failure_for(exc) from None
        except ValueError as exc:
            raise CliFailure(f"invalid argument: {exc}", EXIT_USAGE) from None
        except KeyboardInterrupt:
            raise CliFailure("interrupted", EXIT_INTERRUPTED) from None
        except Exception as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            text = " ".join(str(exc).split()) or "no message"
            raise CliFailure(
                f"unexpected error (a bug in lockd; set {DEBUG_ENV}=1 for a traceback): "
                f"{type(exc).__name__}: {text}",
                EXIT_BUG,
            ) from None

    return wrapper


# --------------------------------------------------------------------------- usage errors


class _OneLineUsageError(click.UsageError):
    """A usage error on one line: ``lockd locks acquire: <reason> (see '... --help')``."""

    def show(self, file: IO[Any] | None = None) -> None:
        where = self.ctx.command_path if self.ctx is not None else "lockd"
        if json_errors():
            details = {"command": where}
            click.echo(error_document(USAGE, self.format_message(), details), err=True)
            return
        hint = ""
        if self.ctx is not None and self.ctx.help_option_names:
            hint = f" (see '{self.ctx.command_path} {self.ctx.help_option_names[-1]}')"
        click.echo(f"{where}: {self.format_message().rstrip('.')}{hint}", err=True)


def _one_line(exc: click.UsageError) -> click.UsageError:
    if isinstance(exc, _OneLineUsageError | click.exceptions.NoArgsIsHelpError):
        return exc  # the latter prints the help page on purpose
    one = _OneLineUsageError(" ".join(exc.format_message().split()), exc.ctx)
    one.exit_code = exc.exit_code  # type: ignore[misc]  # click reads it per instance
    return one


class LazyGroup(click.Group):
    """A group whose subcommands live in modules imported only when used.

    ``lazy`` maps a command name to ``"module:attribute"``. ``lockd locks
    status`` then imports neither ``lockd run``'s machinery nor the rules
    tooling, and ``lockd run`` not the ``locks`` commands: scripts call lockd
    in loops, and every module costs start-up time (bench/startup.py).
    """

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy: dict[str, str] = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in self.lazy:
            import importlib

            module_name, _, attribute = self.lazy[cmd_name].partition(":")
            command = getattr(importlib.import_module(module_name), attribute)
            assert isinstance(command, click.Command)
            self.add_command(command, cmd_name)
        return command


class LockdGroup(LazyGroup):
    """The root group: click's usage errors, from any subcommand, on one line (exit 2).

    Click prints usage, a hint and the error on four lines; docs/contract.md §9 wants one
    clear line on stderr (one JSON line with ``--json``, which is looked for
    here, before parsing, so that a usage error is reported in JSON too).
    Subcommands are parsed inside the root's :meth:`invoke`, so catching here
    covers every command.
    """

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        global _json_errors
        if parent is None:
            _json_errors = json_requested(args)
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise _one_line(exc) from None


# --------------------------------------------------------------------------- durations

_NUMBER = r"\d+(?:\.\d*)?|\.\d+"
#: one part of a compound duration; ``ms`` before ``m``.
_PART_RE = re.compile(rf"(?P<num>{_NUMBER})(?P<unit>ms|h|m|s)")
_BARE_NUMBER_RE = re.compile(_NUMBER)
_UNIT_MS = {"h": Decimal(3_600_000), "m": Decimal(60_000), "s": Decimal(1000), "ms": Decimal(1)}
#: the units from the largest down: a compound duration names them in this order.
_UNIT_ORDER = tuple(_UNIT_MS)
DURATION_FORMS = "500ms, 60s, 1.5s, 5m, 1m30s, 1h5m; a bare number is milliseconds"


def parse_duration_ms(text: str) -> int:
    """``"1.5s"`` -> 1500, ``"1m30s"`` -> 90000. Whole ms, rounded up; ValueError says why.

    A compound duration names its units from the largest down, each at most
    once (``1h5m``, ``1m30s``, ``2s250ms``), as Go's and systemd's do; a bare
    number is milliseconds (docs/contract.md §9). Decimal arithmetic keeps what was
    written: ``1.1s`` is 1100 ms, not 1101.
    """
    raw = text.strip()
    bad = ValueError(f"{text!r} is not a duration (use {DURATION_FORMS})")
    if _BARE_NUMBER_RE.fullmatch(raw):
        value = Decimal(raw)
    else:
        value, pos, last = Decimal(0), 0, -1
        for m in _PART_RE.finditer(raw):
            rank = _UNIT_ORDER.index(m.group("unit"))
            if m.start() != pos or rank <= last:
                raise bad
            value += Decimal(m.group("num")) * _UNIT_MS[m.group("unit")]
            pos, last = m.end(), rank
        if pos == 0 or pos != len(raw):
            raise bad
    return int(value.to_integral_value(rounding=ROUND_CEILING))


class Duration(click.ParamType):
    """A click type for durations; the value is whole milliseconds (int).

    ``min_ms``/``max_ms`` bound it (the daemon refuses a TTL of 0 or more
    than 24 h; checking here gives a usage error that names the option).
    """

    name = "duration"

    def __init__(self, *, min_ms: int = 0, max_ms: int = MAX_TTL_MS, forever: bool = False) -> None:
        self.min_ms = min_ms
        self.max_ms = max_ms
        #: ``forever`` is accepted and read as :data:`WAIT_FOREVER` (a wait without limit).
        self.forever = forever

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            ms = value
            if ms == WAIT_FOREVER and self.forever:
                return ms
        elif self.forever and str(value).strip().lower() == FOREVER:
            return WAIT_FOREVER
        else:
            try:
                ms = parse_duration_ms(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        if ms < self.min_ms:
            self.fail(f"{value!r} is too short: at least {_exact(self.min_ms)}", param, ctx)
        if ms > self.max_ms:
            self.fail(f"{value!r} is too long: at most {_exact(self.max_ms)}", param, ctx)
        if isinstance(value, str) and _BARE_NUMBER_RE.fullmatch(value.strip()) and 0 < ms < 1000:
            # flock's -w and timeout(1) count seconds: say what we read it as.
            name = param.opts[0] if param is not None and param.opts else "the duration"
            text = value.strip()
            warn(f"{name} {text} is {text} ms; write {text}s for seconds")
        return ms


def _exact(ms: int) -> str:
    """A limit written as a duration that parses back to exactly ``ms``."""
    if ms and ms % 3_600_000 == 0:
        return f"{ms // 3_600_000}h"
    if ms and ms % 1000 == 0:
        return f"{ms // 1000}s"
    return f"{ms}ms"


#: A lease TTL: 1 ms to 24 h.
TTL = Duration(min_ms=1, max_ms=MAX_TTL_MS)
#: ``--wait forever``: a blocking acquire without limit (docs/contract.md §12). The wire
#: needs ``timeoutMs``: the client sends the largest and parks again.
FOREVER = "forever"
#: A wait: 0 (answer at once) to 24 h, or ``forever``.
WAIT = Duration(min_ms=0, max_ms=MAX_TIMEOUT_MS, forever=True)


# --------------------------------------------------------------------------- keys


def check_key_argument(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A KEY from the command line must be UTF-8 (docs/contract.md §1): say so, not a codec error.

    Python hands over bytes that are not UTF-8 as lone surrogates
    (surrogateescape); encoding the request would fail far from the cause.
    """
    if value is None:
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise click.BadParameter(
            f"'{shown}' is not valid UTF-8: a key is 1-1024 bytes of UTF-8 text "
            "(check the shell's locale, or the file the key came from)"
        ) from None
    return value


# --------------------------------------------------------------------------- options


def use_socket(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """``lockd --socket PATH COMMAND``: the root's ``--socket`` becomes ``$LOCKD_SOCKET``.

    So ``--socket`` works before the subcommand as well as after it (docs/contract.md
    §12), for every command at once, ``serve`` and ``lockd run``'s COMMAND
    included; a subcommand's own ``--socket`` still wins.
    """
    if value is not None:
        os.environ[SOCKET_ENV] = value


def socket_option(func: Callable[P, R]) -> Callable[P, R]:
    """``--socket PATH``: which daemon; passed as ``socket_path`` (None: client default)."""
    return click.option(
        "--socket",
        "socket_path",
        type=click.Path(dir_okay=False),
        metavar="PATH",
        help="Daemon socket. Default: $LOCKD_SOCKET, else the user socket "
        "($XDG_RUNTIME_DIR/lockd/lockd.sock).",
    )(func)


def _check_limit(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value > 1 and ctx.params.get("shared"):
        raise click.BadParameter("--shared takes no --limit (a semaphore's slots are exclusive)")
    return value


def shared_options(func: Callable[P, R]) -> Callable[P, R]:
    """``--shared`` and ``--limit N`` (docs/contract.md §10); passed as ``shared`` and ``limit``."""
    func = click.option(
        "--limit",
        type=click.IntRange(1, MAX_LIMIT),
        default=1,
        show_default=True,
        metavar="N",
        callback=_check_limit,
        help="A semaphore: up to N holders at once, each in its own slot "
        "(like consul lock -n N). Every holder and waiter of the key names the same N.",
    )(func)
    return click.option(
        "--shared",
        is_flag=True,
        is_eager=True,  # read before --limit, which checks it
        help="A shared (reader) hold: any number of shared holders together, "
        "never with an exclusive one (like flock -s).",
    )(func)


def json_option(func: Callable[P, R]) -> Callable[P, R]:
    """``--json``: print one JSON document; passed as ``as_json``."""
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        help="Print one JSON document (the daemon's result) for scripts.",
    )(func)


def open_client(socket_path: str | None) -> LockClient:
    """A client for one command (close it, or use it as a context manager)."""
    return LockClient(socket_path)


# --------------------------------------------------------------------------- output


#: how every JSON document the CLI prints is written.
JSON_STYLE: dict[str, Any] = {"ensure_ascii": False, "separators": (",", ":")}


def print_json(value: Any) -> None:
    """ONE JSON document on one line: stable for scripts (``jq``, ``while read``)."""
    import json

    click.echo(json.dumps(value, **JSON_STYLE))


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
