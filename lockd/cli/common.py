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
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn, ParamSpec, TypeVar

import click
from lockd_client import MAX_LIMIT, LockClient, LockdError
from lockd_client._paths import SOCKET_ENV

from lockd.cli.durations import (
    DURATION_FORMS,
    FOREVER,
    DurationError,
    check_duration,
    parse_duration_ms,
    seconds_hint,
)
from lockd.cli.output import (
    CODE_FOR_EXIT,
    DEBUG_ENV,
    JSON_STYLE,
    Failure,
    TableWriter,
    describe_error,
    display_width,
    failure_from,
    format_relative,
    format_time,
    ms_until,
    parse_time,
    print_json,
    render_fields,
    render_table,
)
from lockd.cli.output import echo_error as _echo_error
from lockd.cli.output import failure_for as _failure_for
from lockd.contract import MAX_TIMEOUT_MS, MAX_TTL_MS, WAIT_FOREVER
from lockd.exitcodes import USAGE, error_document, exit_code_for, exit_codes_help

__all__ = [
    "DEBUG_ENV",
    "DURATION_FORMS",
    "EXIT_CODES_HELP",
    "FOREVER",
    "JSON_STYLE",
    "MAX_LIMIT",
    "TTL",
    "WAIT",
    "WAIT_FOREVER",
    "CliFailure",
    "Duration",
    "LazyGroup",
    "LockdGroup",
    "TableWriter",
    "check_key_argument",
    "client_command",
    "describe_error",
    "display_width",
    "echo_error",
    "exit_code_for",
    "fail",
    "failure_for",
    "format_relative",
    "format_time",
    "json_errors",
    "json_option",
    "json_requested",
    "ms_until",
    "open_client",
    "parse_duration_ms",
    "parse_time",
    "print_json",
    "render_fields",
    "render_table",
    "shared_options",
    "socket_option",
    "use_socket",
    "warn",
]

# --------------------------------------------------------------------------- exit codes

EXIT_CODES_HELP = exit_codes_help()


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


def echo_error(message: str, code: str, details: dict[str, Any] | None = None) -> None:
    """Report a failure on stderr: ``lockd: message``, or the JSON line under ``--json``."""
    _echo_error(message, code, details, as_json=json_errors())


def warn(message: str) -> None:
    """``lockd: warning: message`` on stderr; nothing under ``--json``, whose
    stderr is kept for the one error document of a failure (docs/contract.md §9)."""
    if not json_errors():
        click.echo(f"lockd: warning: {message}", err=True)


class CliFailure(click.ClickException):
    """A command outcome that exits non-zero with one line on stderr.

    ``code`` is the ``--json`` error code (default: the one for ``exit_code``),
    ``details`` its details object. The click form of
    :class:`lockd.cli.output.Failure` (which the fast path shows itself).
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
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it per instance
        self.code = code or CODE_FOR_EXIT.get(exit_code, "INTERNAL")
        self.details = details or {}
        self.quiet = quiet

    @classmethod
    def of(cls, failure: Failure) -> CliFailure:
        return cls(
            failure.message,
            failure.exit_code,
            code=failure.code,
            details=failure.details,
            quiet=failure.quiet,
        )

    def show(self, file: IO[Any] | None = None) -> None:
        if self.quiet:
            return
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
    """The CliFailure for a client error (:func:`lockd.cli.output.failure_for`)."""
    return CliFailure.of(_failure_for(exc))


P = ParamSpec("P")
R = TypeVar("R")


def client_command(func: Callable[P, R]) -> Callable[P, R]:
    """Wrap a command callback so nothing but one stderr line escapes it.

    What an exception means is :func:`lockd.cli.output.failure_from`, shared
    with the fast path: client errors map to their exit code, a
    ``ValueError`` is a usage error, Ctrl-C exits 130, anything else is a bug
    in the CLI: one line, exit 70 (``LOCKD_DEBUG=1`` re-raises it for a
    traceback).
    """

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (Exception, KeyboardInterrupt) as exc:
            failure = failure_from(exc)
            if failure is None:
                raise
            raise CliFailure.of(failure) from None

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


class Duration(click.ParamType):
    """A click type for durations; the value is whole milliseconds (int).

    ``min_ms``/``max_ms`` bound it (the daemon refuses a TTL of 0 or more
    than 24 h; checking here gives a usage error that names the option).
    The parsing and the checks are :mod:`lockd.cli.durations`, shared with
    the fast path.
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
        try:
            ms = check_duration(value, min_ms=self.min_ms, max_ms=self.max_ms, forever=self.forever)
        except DurationError as exc:
            self.fail(str(exc), param, ctx)
        name = param.opts[0] if param is not None and param.opts else "the duration"
        hint = seconds_hint(name, value, ms)
        if hint is not None:
            warn(hint)
        return ms


#: A lease TTL: 1 ms to 24 h.
TTL = Duration(min_ms=1, max_ms=MAX_TTL_MS)
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
