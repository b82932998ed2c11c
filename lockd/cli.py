"""The ``lockd`` command line. Commands are thin: they talk to the daemon
only through :mod:`lockd_client` (``serve`` is the exception: it *is* the
daemon).

Exit codes (also in ``lockd --help``): 0 done; 1 key busy or wait timed out;
2 usage; 3 access denied; 4 rate limited; 5 daemon unreachable; 6 lease lost
or not the holder.
"""

from __future__ import annotations

import sys

import click

from .config import resolve_paths

EXIT_CODES_HELP = """\b
Exit codes:
  0  done
  1  key busy, or the wait timed out
  2  usage error
  3  access denied
  4  rate limited
  5  daemon unreachable
  6  lease lost, or not the holder
"""


@click.group(epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lockd")
def main() -> None:
    """lockd: leases on named keys for the processes of one host."""


@main.command()
@click.option("--system", is_flag=True, help="System mode: /run/lockd, /var/lib/lockd, /etc/lockd.")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False), help="Socket path.")
@click.option("--db", type=click.Path(dir_okay=False), help="SQLite database path.")
@click.option(
    "--config",
    "config_dir",
    type=click.Path(file_okay=False),
    help="Config folder (lockd.toml, rule-sets/).",
)
def serve(system: bool, socket_path: str | None, db: str | None, config_dir: str | None) -> None:
    """Run the daemon in the foreground (stops cleanly on SIGTERM)."""
    from .daemon import StartupError, run

    paths = resolve_paths(system=system, socket=socket_path, db=db, config=config_dir)
    try:
        code = run(paths)
    except StartupError as exc:
        click.echo(f"lockd: cannot start: {exc}", err=True)
        sys.exit(1)
    sys.exit(code)
