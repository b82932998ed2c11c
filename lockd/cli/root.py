"""The ``lockd`` command line's root group (click). Commands are thin: they
talk to the daemon only through :mod:`lockd_client` (``serve`` is the exception: it *is* the
daemon; ``rules check`` and ``rules test`` are local too).

Layout: this module holds the root group, ``serve``, ``whoami`` and ``stats``;
``lockd locks ...`` lives in :mod:`lockd.cli.locks`, ``lockd rules ...`` in
:mod:`lockd.cli.rules`, shared pieces (exit codes, durations, errors, output)
in :mod:`lockd.cli.common`, and ``lockd run`` in :mod:`lockd.cli.run`. The
console script starts in :mod:`lockd.cli.fast`, which runs the hot commands
without click and hands every other command line to :data:`main`.

Exit codes: :mod:`lockd.exitcodes` (their meanings, shown by ``lockd --help``,
and :func:`~lockd.exitcodes.exit_code_for`, which client error exits how).

Shell completion is click's: ``eval "$(_LOCKD_COMPLETE=bash_source lockd)"``
(``zsh_source``, ``fish_source``).
"""

from __future__ import annotations

import re
import sys
from typing import Any

import click

from lockd.cli.common import (
    EXIT_CODES_HELP,
    LockdGroup,
    client_command,
    json_option,
    open_client,
    print_json,
    render_fields,
    render_table,
    socket_option,
    use_socket,
)
from lockd.metrics import COUNTERS, GAUGES
from lockd.timefmt import format_duration_ms

__all__ = ["EXIT_CODES_HELP", "main"]


@click.group(
    cls=LockdGroup,
    epilog=EXIT_CODES_HELP,
    context_settings={"help_option_names": ["-h", "--help"]},
    # Imported when used (start-up time: bench/startup.py, tests/unit/test_cli_startup.py).
    lazy={
        "locks": "lockd.cli.locks:locks",
        "rules": "lockd.cli.rules:rules",
        "run": "lockd.cli.run:run",
    },
)
@click.version_option(package_name="lockd")
@click.option(
    "--socket",
    type=click.Path(dir_okay=False),
    metavar="PATH",
    expose_value=False,
    callback=use_socket,
    help="Daemon socket for the command that follows (as $LOCKD_SOCKET; the "
    "command's own --socket wins).",
)
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
@click.option(
    "--json",
    "json_output",
    is_flag=True,
    help='A start-up error as one JSON line on stderr ({"error": {...}}, code USAGE).',
)
@click.option(
    "--adopt-fence-mark",
    is_flag=True,
    help="Start although the database holds a lower fence than its fence mark "
    "(after losing it: see docs/operations.md); fences continue above the mark.",
)
@click.option(
    "--accept-data-loss",
    is_flag=True,
    help="Start although acknowledged leases were lost or damaged (see docs/operations.md): "
    "the log says what; no key is granted until every lease that may be lost has run out.",
)
@click.option(
    "--etcd",
    "etcd",
    metavar="URL[,URL...]",
    help="Keep the lock state in this etcd cluster (docs/contract.md §11): [backend] kind etcd "
    "with these endpoints; the other [backend] keys of lockd.toml still apply.",
)
def serve(
    system: bool,
    socket_path: str | None,
    db: str | None,
    config_dir: str | None,
    json_output: bool,
    adopt_fence_mark: bool,
    accept_data_loss: bool,
    etcd: str | None,
) -> None:
    """Run the daemon in the foreground (stops cleanly on SIGTERM).

    It logs key=value lines to stderr. A mistake in lockd.toml (or a file it
    names) is one line naming the file and the fix, exit status 2; any other
    start-up error (a bad rule set, a live daemon on the socket, a database
    in use) is one line and exit status 1.
    """
    from lockd.cli.serve_command import serve_daemon  # shared with lockd.cli.fast

    sys.exit(
        serve_daemon(
            system=system,
            socket_path=socket_path,
            db=db,
            config_dir=config_dir,
            json_output=json_output,
            adopt_fence_mark=adopt_fence_mark,
            accept_data_loss=accept_data_loss,
            etcd=etcd,
        )
    )


# --------------------------------------------------------------------------- whoami


@main.command()
@socket_option
@json_option
@client_command
def whoami(socket_path: str | None, as_json: bool) -> None:
    """Who the daemon thinks you are: principal, role, uid, pid."""
    with open_client(socket_path) as client:
        hello = client.hello()
        where = client.socket_path
    if as_json:
        print_json(hello)
        return
    daemon = f"lockd {hello.get('version')}, protocol {hello.get('protocol')}, at {where}"
    click.echo(
        render_fields(
            [
                ("Principal", hello.get("principal")),
                ("Role", hello.get("role")),
                ("Uid", hello.get("uid")),
                ("Pid", hello.get("pid")),
                ("Daemon", daemon),
            ]
        )
    )


# --------------------------------------------------------------------------- stats

STATS_FORMATS = ("text", "json", "openmetrics", "prometheus")


@main.command()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(STATS_FORMATS),
    default=None,
    help="text (default); json (the daemon's result); openmetrics (OpenMetrics 1.0, "
    "ends with # EOF); prometheus (classic text format, typed for node_exporter's "
    "textfile collector).",
)
@socket_option
@json_option
@client_command
def stats(fmt: str | None, socket_path: str | None, as_json: bool) -> None:
    """Counters, gauges and latency percentiles (owners, admins, services).

    \b
    For node_exporter's textfile collector (write, then rename):
      lockd stats --format prometheus > /var/lib/node_exporter/lockd.prom.$$ &&
        mv /var/lib/node_exporter/lockd.prom.$$ /var/lib/node_exporter/lockd.prom
    """
    if as_json:
        if fmt not in (None, "json"):
            raise click.UsageError(f"--json conflicts with --format {fmt}")
        fmt = "json"
    with open_client(socket_path) as client:
        snapshot = client.stats()
    if fmt == "json":
        print_json(snapshot)
    elif fmt in ("openmetrics", "prometheus"):
        click.echo(render_metrics(snapshot, openmetrics=fmt == "openmetrics"), nl=False)
    else:
        click.echo(render_stats_text(snapshot))


_QUANTILES = (("p50Ms", "0.5"), ("p90Ms", "0.9"), ("p99Ms", "0.99"), ("maxMs", "1"))
LATENCY_METRIC = "lockd_request_duration_seconds"


def _snake(name: str) -> str:
    """``connectionsAccepted`` -> ``connections_accepted`` (metric-name safe)."""
    text = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
    return re.sub(r"[^a-z0-9_]", "_", text)


def _words(name: str) -> str:
    return _snake(name).replace("_", " ")


def _number(value: float | int) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def _seconds(ms: float | int) -> str:
    """Milliseconds as seconds in plain decimal: 5.491 -> ``0.005491`` (no float noise)."""
    from decimal import Decimal

    value = (Decimal(repr(ms)) / 1000).normalize()
    return format(value, "f")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def render_metrics(snapshot: dict[str, Any], *, openmetrics: bool) -> str:
    """The stats as OpenMetrics 1.0 text, or the classic Prometheus text format.

    Both: gauges ``lockd_<name>`` (``...Ms`` gauges become ``..._seconds``),
    counters ``lockd_<name>_total``, latency as one summary
    ``lockd_request_duration_seconds{op=...}`` with quantiles 0.5, 0.9, 0.99
    and 1 (the max) over the daemon's recent window, plus ``_count`` (the
    daemon keeps no ``_sum``). OpenMetrics names a counter family without
    ``_total``, adds ``# UNIT`` and ends with ``# EOF``. node_exporter's
    textfile collector parses the classic format: it reads OpenMetrics too,
    but then sees the counters as untyped, which ``prometheus`` avoids.
    """
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, unit: str | None = None) -> None:
        lines.append(f"# TYPE {name} {kind}")
        if unit and openmetrics:
            lines.append(f"# UNIT {name} {unit}")
        lines.append(f"# HELP {name} {help_text}")

    for key, value in snapshot.items():
        if key in ("counters", "latency") or not _is_number(value):
            continue
        help_text = GAUGES.get(key, f"lockd gauge {key}.")
        if key.endswith("Ms"):
            name = f"lockd_{_snake(key[:-2])}_seconds"
            family(name, "gauge", help_text, "seconds")
            lines.append(f"{name} {_seconds(value)}")
        else:
            name = f"lockd_{_snake(key)}"
            family(name, "gauge", help_text)
            lines.append(f"{name} {_number(value)}")

    counters = snapshot.get("counters")
    for key, value in (counters if isinstance(counters, dict) else {}).items():
        if not _is_number(value):
            continue
        base = f"lockd_{_snake(key)}"
        family(base if openmetrics else f"{base}_total", "counter", COUNTERS.get(key, str(key)))
        lines.append(f"{base}_total {_number(value)}")

    latency = snapshot.get("latency")
    if isinstance(latency, dict) and latency:
        family(
            LATENCY_METRIC,
            "summary",
            "Request latency per op over the recent window (a blocking acquire includes its "
            "wait); quantile 1 is the window's maximum.",
            "seconds",
        )
        for op, summary in latency.items():
            if not isinstance(summary, dict):
                continue
            label = f'op="{_label(str(op))}"'
            for field, quantile in _QUANTILES:
                if _is_number(summary.get(field)):
                    seconds = _seconds(summary[field])
                    lines.append(f'{LATENCY_METRIC}{{{label},quantile="{quantile}"}} {seconds}')
            if _is_number(summary.get("count")):
                lines.append(f"{LATENCY_METRIC}_count{{{label}}} {_number(summary['count'])}")
    if openmetrics:
        lines.append("# EOF")
    return "\n".join(lines) + "\n"


def render_stats_text(snapshot: dict[str, Any]) -> str:
    """Human form: gauges, counters, then a latency table."""
    gauges: list[tuple[str, object]] = []
    for key, value in snapshot.items():
        if key in ("counters", "latency"):
            continue
        label = _words(key[:-2] if key.endswith("Ms") else key).capitalize()
        shown = format_duration_ms(value) if key.endswith("Ms") and _is_number(value) else value
        gauges.append((label, shown))
    parts = [render_fields(gauges)]
    counters = snapshot.get("counters")
    if isinstance(counters, dict) and counters:
        rows = [(_words(k), v) for k, v in counters.items()]
        parts.append(render_table(("COUNTER", "VALUE"), rows))
    latency = snapshot.get("latency")
    if isinstance(latency, dict) and latency:
        rows = []
        for op, s in latency.items():
            s = s if isinstance(s, dict) else {}
            rows.append(
                (op, s.get("count"), *(s.get(f) for f in ("p50Ms", "p90Ms", "p99Ms", "maxMs")))
            )
        headers = ("OP", "COUNT", "P50 MS", "P90 MS", "P99 MS", "MAX MS")
        parts.append(render_table(headers, rows))
    return "\n\n".join(parts)
