"""``lockd serve``'s body, shared by the click command and the fast path (no click to start).

A restart's time to its first ``hello`` is mostly the interpreter and its
imports (issue 26); click and the CLI's modules add ~12-15 ms of CPU to
what the daemon imports anyway, several times that in wall time on a busy
box. So ``lockd serve``
with a command line :mod:`lockd.cli.fast` fully understands runs this
without importing click; anything else (help, a bad option) goes through
the click command (:func:`lockd.cli.root.serve`), which runs this too. Both
print a refused start the same way: click is imported for that line only.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from typing import NoReturn


def serve_daemon(
    *,
    system: bool,
    socket_path: str | None,
    db: str | None,
    config_dir: str | None,
    json_output: bool,
    adopt_fence_mark: bool,
    accept_data_loss: bool,
    etcd: str | None,
) -> int:
    """Run the daemon until it stops; its exit status. A refused start exits here (1 or 2)."""
    # Imported here, not at start-up: every other command (and every <TAB>
    # of shell completion) would pay for trio, SQLite and platformdirs.
    from lockd.config import ConfigError, resolve_paths
    from lockd.daemon.serve import StartupError, run

    try:
        # The folders come from the environment, not from a file the operator
        # wrote: an unsafe one stops the start (exit 1); it is no config mistake.
        paths = resolve_paths(system=system, socket=socket_path, db=db, config=config_dir)
    except ConfigError as exc:
        cannot_start(exc, json_output, config=False)
    try:
        endpoints = tuple(url.strip() for url in etcd.split(",")) if etcd is not None else ()
        return run(
            paths,
            adopt_fence_mark=adopt_fence_mark,
            accept_data_loss=accept_data_loss,
            etcd=endpoints,
        )
    except (StartupError, ConfigError) as exc:
        cannot_start(exc, json_output, config=isinstance(exc, ConfigError))


def cannot_start(exc: Exception, json_output: bool, *, config: bool) -> NoReturn:
    """Say why ``serve`` stops in one line and exit.

    A config mistake (lockd.toml, the files it names) exits 2, as a usage
    error; anything else that stops a start exits 1. Under --json the code is
    USAGE either way (details.reason says which).
    """
    import sys

    import click  # for this line only: the fast path's start never loads it

    from lockd.exitcodes import EXIT_USAGE, USAGE, error_document

    message = f"cannot start: {'config: ' if config else ''}{' '.join(str(exc).split())}"
    if json_output:
        details = {"reason": "bad_config" if config else "startup_failed"}
        click.echo(error_document(USAGE, message, details), err=True)
    else:
        click.echo(f"lockd: {message}", err=True)
    sys.exit(EXIT_USAGE if config else 1)
