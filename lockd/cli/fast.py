"""The console script's entry: the hot commands without click, the rest with it.

Scripts call ``lockd locks status KEY`` and ``lockd run KEY -- COMMAND`` in
loops, and importing click alone costs about as much as starting Python
(bench/startup.py). :func:`main` reads those two command lines itself and
runs the same bodies the click commands run (:mod:`lockd.cli.hot_commands`);
it never imports click for them. ``lockd serve`` too: a restart's time to
its first ``hello`` is mostly imports (issue 26); its body is
:mod:`lockd.cli.serve_command`.

It takes a command line only when it understands every word of it:

- ``lockd [--socket S] locks status [--socket S] [--json] KEY`` (options in
  any order, ``-- KEY`` for a key starting with ``-``);
- ``lockd [--socket S] run [OPTIONS] KEY -- COMMAND...`` and ``lockd run
  [OPTIONS] -- KEY -- COMMAND...``, with the options a script uses: --ttl,
  --wait, --owner, --shared, --limit, --on-lost, --grace,
  --kill-descendants, --conflict-exit-code, -q/--quiet, --socket, --json
  (``--opt VALUE`` or ``--opt=VALUE``);
- ``lockd [--socket S] serve [OPTIONS]`` with every option of ``serve``:
  --system, --socket, --db, --config, --json, --adopt-fence-mark,
  --accept-data-loss, --etcd.

Anything else goes to the click group unchanged (:data:`lockd.cli.root.main`):
help, other commands, an unknown, repeated or misplaced option, a value that
does not parse or is out of range, a key that is not UTF-8, shell completion,
a stream that is not UTF-8. So every usage error, message and exit code is
the click path's own; ``tests/live/test_cli_fast.py`` compares the two paths. It
imports :mod:`lockd_client` (every command needs it) but not click.
"""

from __future__ import annotations

import gc
import os
import sys

from lockd_client import MAX_LIMIT, SOCKET_ENV

from lockd.contract import MAX_TIMEOUT_MS, MAX_TTL_MS

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = ["RunCall", "ServeCall", "StatusCall", "main", "recognise"]


class _NotOurs(Exception):
    """The command line is not one the fast path takes: click reads it."""


class StatusCall:
    """``lockd locks status``, read from the command line."""

    __slots__ = ("as_json", "key", "root_socket", "socket_path")

    def __init__(
        self, key: str, socket_path: str | None, as_json: bool, root_socket: str | None
    ) -> None:
        self.key = key
        self.socket_path = socket_path
        self.as_json = as_json
        self.root_socket = root_socket

    def __call__(self) -> int:
        _use_root_socket(self.root_socket)
        from lockd.cli.hot_commands import show_status
        from lockd.cli.output import failure_from

        try:
            show_status(self.key, self.socket_path, self.as_json)
        except (Exception, KeyboardInterrupt) as exc:
            failure = failure_from(exc)
            if failure is None:
                raise
            failure.show(as_json=self.as_json)
            return failure.exit_code
        return 0


class RunCall:
    """``lockd run``, read from the command line: RunOptions' fields, as given."""

    __slots__ = ("fields", "hints", "json_output", "root_socket")

    def __init__(
        self,
        fields: dict[str, object],
        json_output: bool,
        hints: list[str],
        root_socket: str | None,
    ) -> None:
        self.fields = fields
        self.json_output = json_output
        #: warnings click prints while it reads the options (a bare number under 1 s)
        self.hints = hints
        self.root_socket = root_socket

    def __call__(self) -> int:
        _use_root_socket(self.root_socket)
        from lockd.cli.hot_commands import run_command
        from lockd.run.options import OnLost, RunOptions
        from lockd.run.supervisor import run_locked  # noqa: F401  (loaded before the collector is back)

        # Loaded: lockd run may supervise COMMAND for hours, with the
        # collector on as in any program (see main()); what is loaded so far
        # is frozen first, as the gc docs advise before a fork: the
        # collector never walks it again, so neither lockd run nor its
        # forked guardian writes to (and copies) the pages they share.
        gc.freeze()
        gc.enable()

        if self.hints and not self.json_output:
            from lockd.cli.output import echo  # here: a run prints nothing of its own else

            for hint in self.hints:
                echo(f"lockd: warning: {hint}", err=True)
        fields = dict(self.fields)
        if "on_lost" in fields:
            fields["on_lost"] = OnLost(str(fields["on_lost"]))
        opts = RunOptions(**fields)  # type: ignore[arg-type]  # checked while reading
        return run_command(opts, json_output=self.json_output)


class ServeCall:
    """``lockd serve``, read from the command line: serve_daemon's arguments, as given."""

    __slots__ = ("options", "root_socket")

    def __init__(self, options: dict[str, str | bool | None], root_socket: str | None) -> None:
        self.options = options
        self.root_socket = root_socket

    def __call__(self) -> int:
        _use_root_socket(self.root_socket)
        gc.enable()  # the daemon runs for long: as for the click commands (see main())
        try:
            from lockd.cli.serve_command import serve_daemon

            return serve_daemon(**self.options)  # type: ignore[arg-type]  # checked while reading
        except KeyboardInterrupt:
            # Ctrl-C before the daemon handles SIGINT itself (imports, opening
            # the database): what click's main says and returns for it.
            sys.stderr.write("Aborted!\n")
            return 1


#: ``serve``'s options: flags (True) and those taking a value (False), by name.
_SERVE_OPTIONS = {
    "--system": ("system", True),
    "--json": ("json_output", True),
    "--adopt-fence-mark": ("adopt_fence_mark", True),
    "--accept-data-loss": ("accept_data_loss", True),
    "--socket": ("socket_path", False),
    "--db": ("db", False),
    "--config": ("config_dir", False),
    "--etcd": ("etcd", False),
}


def _serve(args: Sequence[str], root_socket: str | None) -> ServeCall:
    options: dict[str, str | bool | None] = {
        dest: (False if flag else None) for dest, flag in _SERVE_OPTIONS.values()
    }
    seen: set[str] = set()
    i = 0
    while i < len(args):
        name = args[i].partition("=")[0] if args[i].startswith("--") else args[i]
        if name not in _SERVE_OPTIONS:
            raise _NotOurs  # --help, a positional word, an unknown option: click says
        dest, flag = _SERVE_OPTIONS[name]
        _once(seen, dest)
        if flag:
            if args[i] != name:
                raise _NotOurs  # --system=...: click's message
            options[dest] = True
            i += 1
            continue
        _, value, i = _value(args, i)
        if not value:
            raise _NotOurs
        if dest in ("socket_path", "db"):
            value = _socket(value)  # click.Path(dir_okay=False)
        elif dest == "config_dir" and os.path.exists(value) and not os.path.isdir(value):
            raise _NotOurs  # click.Path(file_okay=False) refuses a file
        options[dest] = value
    return ServeCall(options, root_socket)


def _use_root_socket(path: str | None) -> None:
    """``lockd --socket PATH ...``: as ``$LOCKD_SOCKET`` (lockd.cli.common.use_socket)."""
    if path is not None:
        os.environ[SOCKET_ENV] = path


# --------------------------------------------------------------------------- reading


def _value(args: Sequence[str], i: int) -> tuple[str, str, int]:
    """The option at ``args[i]`` and its value (``--opt V`` or ``--opt=V``), and the next index."""
    word = args[i]
    if word.startswith("--") and "=" in word:
        name, _, value = word.partition("=")
        return name, value, i + 1
    if i + 1 >= len(args) or args[i + 1].startswith("-"):
        raise _NotOurs  # missing value, or one click may read otherwise
    return word, args[i + 1], i + 2


def _socket(value: str) -> str:
    # click.Path(dir_okay=False) refuses an existing directory.
    if os.path.isdir(value):
        raise _NotOurs
    return value


def _key(value: str) -> str:
    try:
        value.encode("utf-8")  # else click's own message (lockd.cli.common.check_key_argument)
    except UnicodeEncodeError:
        raise _NotOurs from None
    return value


def _int(value: str, low: int, high: int) -> int:
    if not (value.isascii() and value.isdigit()):
        raise _NotOurs
    number = int(value)
    if not low <= number <= high:
        raise _NotOurs
    return number


def _duration(
    name: str, value: str, hints: list[str], *, min_ms: int, max_ms: int, forever: bool = False
) -> int:
    # Imported here: ``locks status`` has no duration to read (re, decimal).
    from lockd.cli.durations import DurationError, check_duration, seconds_hint

    try:
        ms = check_duration(value, min_ms=min_ms, max_ms=max_ms, forever=forever)
    except DurationError:
        raise _NotOurs from None
    hint = seconds_hint(name, value, ms)
    if hint is not None:
        hints.append(hint)
    return ms


def _once(seen: set[str], dest: str) -> None:
    if dest in seen:
        raise _NotOurs  # click's "last one wins" and its warnings: leave it to click
    seen.add(dest)


def _status(args: Sequence[str], root_socket: str | None) -> StatusCall:
    key: str | None = None
    socket_path: str | None = None
    as_json = False
    seen: set[str] = set()
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--json":
            _once(seen, "json")
            as_json = True
            i += 1
        elif word == "--socket" or word.startswith("--socket="):
            _once(seen, "socket")
            _, value, i = _value(args, i)
            socket_path = _socket(value)
        elif word == "--":
            if key is not None or len(args) != i + 2:
                raise _NotOurs
            key = _key(args[i + 1])
            i += 2
        elif word.startswith("-") or key is not None:
            raise _NotOurs
        else:
            key = _key(word)
            i += 1
    if key is None:
        raise _NotOurs
    return StatusCall(key, socket_path, as_json, root_socket)


#: ``lockd run`` options that take a value -> RunOptions field.
_RUN_VALUES = {
    "--ttl": "ttl_ms",
    "--wait": "wait_ms",
    "--owner": "owner",
    "--limit": "limit",
    "--on-lost": "on_lost",
    "--grace": "grace_ms",
    "--conflict-exit-code": "conflict_exit_code",
    "--socket": "socket_path",
}
#: ``lockd run`` flags -> RunOptions field (``json`` is lockd run's own voice).
_RUN_FLAGS = {
    "--shared": "shared",
    "--kill-descendants": "kill_descendants",
    "-q": "quiet",
    "--quiet": "quiet",
    "--json": "json",
}


def _run(args: Sequence[str], root_socket: str | None) -> RunCall:
    if "--" not in args:
        raise _NotOurs
    cut = list(args).index("--")
    before, after = args[:cut], list(args[cut + 1 :])
    fields: dict[str, object] = {}
    hints: list[str] = []
    seen: set[str] = set()
    key: str | None = None
    i = 0
    while i < len(before):
        word = before[i]
        if word in _RUN_FLAGS:
            _once(seen, _RUN_FLAGS[word])
            fields[_RUN_FLAGS[word]] = True
            i += 1
            continue
        name = word.partition("=")[0] if word.startswith("--") else word
        if name in _RUN_VALUES:
            dest = _RUN_VALUES[name]
            _once(seen, dest)
            name, value, i = _value(before, i)
            fields[dest] = _run_value(name, value, hints)
            continue
        if word.startswith("-") or key is not None:
            raise _NotOurs
        key = _key(word)
        i += 1
    if key is None:
        # lockd run [OPTIONS] -- KEY -- COMMAND: a key starting with '-'
        if len(after) < 3 or after[1] != "--":
            raise _NotOurs
        key, after = _key(after[0]), after[2:]
    if not after:
        raise _NotOurs
    if fields.get("shared") and int(str(fields.get("limit", 1))) > 1:
        raise _NotOurs  # --shared takes no --limit: click says so
    json_output = bool(fields.pop("json", False))
    fields["key"], fields["command"] = key, tuple(after)
    return RunCall(fields, json_output, hints, root_socket)


def _run_value(name: str, value: str, hints: list[str]) -> object:
    # lockd run's own pieces, loaded for lockd run only (not for locks status).
    from lockd.run.options import MIN_TTL_MS, OnLost

    if name == "--ttl":
        return _duration(name, value, hints, min_ms=MIN_TTL_MS, max_ms=MAX_TTL_MS)
    if name == "--wait":
        return _duration(name, value, hints, min_ms=0, max_ms=MAX_TIMEOUT_MS, forever=True)
    if name == "--grace":
        return _duration(name, value, hints, min_ms=0, max_ms=MAX_TTL_MS)
    if name == "--limit":
        return _int(value, 1, MAX_LIMIT)
    if name == "--conflict-exit-code":
        return _int(value, 0, 255)
    if name == "--on-lost":
        if value not in {mode.value for mode in OnLost}:  # click.Choice: case-sensitive
            raise _NotOurs
        return value
    if name == "--socket":
        return _socket(value)
    return value  # --owner


def recognise(argv: Sequence[str]) -> StatusCall | RunCall | ServeCall | None:
    """The hot command ``argv`` (``sys.argv[1:]``) asks for, or None: click reads it.

    Reads only; nothing is printed or changed until the call is made. The
    ``--json`` it reads is the one click's ``json_requested`` sees (a
    ``--json`` before any ``--``): every other word there is an option it
    knows, a value that does not start with ``-``, or KEY.
    """
    try:
        root_socket: str | None = None
        i = 0
        while i < len(argv) and (argv[i] == "--socket" or argv[i].startswith("--socket=")):
            if root_socket is not None:
                raise _NotOurs
            _, value, i = _value(argv, i)
            root_socket = _socket(value)
        rest = argv[i:]
        if list(rest[:2]) == ["locks", "status"]:
            return _status(rest[2:], root_socket)
        if list(rest[:1]) == ["run"]:
            return _run(rest[1:], root_socket)
        if list(rest[:1]) == ["serve"]:
            return _serve(rest[1:], root_socket)
    except _NotOurs:
        return None
    return None


# --------------------------------------------------------------------------- entry


def streams_are_utf8() -> bool:
    """True when stdout and stderr encode UTF-8 (click would re-wrap an ASCII one)."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or ""
        if encoding.lower().replace("-", "").replace("_", "") != "utf8":
            return False
    return True


def completing(environ: Mapping[str, str]) -> bool:
    """True when click's shell completion is asked for (``_LOCKD_COMPLETE=...``)."""
    return any(name.startswith("_") and name.endswith("_COMPLETE") for name in environ)


def main() -> None:
    """``lockd``: a hot command without click, anything else through the click group.

    The ``lockd`` script (bin/lockd) and ``python -m lockd`` turn the cyclic
    garbage collector off before they import anything: loading modules makes
    many objects and no garbage, and the collections it set off cost a
    ``lockd run`` ~3 ms of CPU (issue 24, bench/startup.py). It is turned
    back on for every command but ``locks status`` (one request, then exit)
    once that command's modules are loaded: here for the click commands
    (``serve``, ``locks top`` run for long), in :class:`RunCall` for ``lockd
    run``. When a hot command is done, it ends as :func:`_exit` says.
    """
    call: Callable[[], int] | None = None
    if streams_are_utf8() and not completing(os.environ):
        call = recognise(sys.argv[1:])
    if call is None:
        gc.enable()
        from lockd.cli.root import main as click_main

        click_main()
        return
    _exit(call())


def _exit(status: int) -> None:
    """End a hot command with ``status``, without the interpreter's teardown when nothing needs it.

    Tearing down every module and object costs ``lockd run`` ~7 ms of CPU
    (issue 24): after its fork, each page the teardown writes faults. It is
    skipped (``os._exit``) only when it has nothing to do that anyone could
    see: stdout and stderr flushed without error, no ``atexit`` handler (a
    tool such as coverage, or logging once imported, registers one), and no
    thread left that the interpreter would wait for. Otherwise the usual
    exit, frozen first (see :func:`main`), so a failed flush still ends as
    Python ends it (the message and status 120).
    """
    gc.freeze()
    if _nothing_left_to_do():
        os._exit(status)
    sys.exit(status)


def _nothing_left_to_do() -> bool:
    """True when the interpreter's exit would only free memory (see :func:`_exit`)."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except Exception:
        return False
    import atexit

    if getattr(atexit, "_ncallbacks", lambda: 1)():
        return False
    threading = sys.modules.get("threading")
    if threading is not None:
        main = threading.main_thread()
        for thread in threading.enumerate():
            if thread is not main and not thread.daemon and thread.is_alive():
                return False
    return True
