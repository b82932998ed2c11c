"""``lockd locks top``: a live view of holders, waiters and hand-off rates (issue 24).

Every ``--interval`` it reads ``list`` (all pages, up to ``--limit`` keys)
and, when the caller may, ``stats``, then redraws the screen: one block per
key with its holders and its queue, and a header with the rates since the
previous frame (grants, hand-offs to waiters, releases, expiries and
timeouts per second; a member, who may not read ``stats``, sees the keys
only). ``--once`` prints one frame and exits, for scripts and tests.

A frame is :func:`render_frame`, a plain function of what was read, so it is
tested without a terminal or a clock.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import click
from lockd_client import LockAccessDeniedError, LockClient, LockStatus

from lockd.cli.common import (
    Duration,
    client_command,
    format_relative,
    open_client,
    render_table,
    socket_option,
)
from lockd.describe import HOLDER_COLUMNS, WAITER_COLUMNS, holder_cells, mode_text, waiter_cells

#: the counters whose per-second rates the header shows, and their labels.
RATE_COUNTERS = (
    ("grants", "grants"),
    ("handoffs", "hand-offs"),
    ("releases", "releases"),
    ("expiries", "expiries"),
    ("timeouts", "timeouts"),
)
#: keys read per frame unless --limit says otherwise.
DEFAULT_KEYS = 200
_CLEAR = "\x1b[H\x1b[2J"


def rates(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, seconds: float
) -> dict[str, float] | None:
    """Per-second rates of :data:`RATE_COUNTERS` between two ``stats`` counter maps."""
    if before is None or after is None or seconds <= 0:
        return None
    out: dict[str, float] = {}
    for name, _label in RATE_COUNTERS:
        b, a = before.get(name), after.get(name)
        if isinstance(a, int) and isinstance(b, int):
            out[name] = max(0, a - b) / seconds
    return out


def render_frame(
    locks: Sequence[LockStatus],
    per_second: Mapping[str, float] | None,
    *,
    now: str,
    more: bool = False,
) -> str:
    """One screen: header (time, totals, rates), then each key's holders and queue."""
    waiting = sum(s.waiters for s in locks)
    header = [f"lockd top - {now} - {len(locks)} keys held, {waiting} waiting"]
    if per_second is not None:
        shown = ", ".join(
            f"{label} {per_second.get(name, 0.0):.1f}/s" for name, label in RATE_COUNTERS
        )
        header.append(shown)
    else:
        header.append("rates: - (stats is for owners, admins and services)")
    blocks = ["\n".join(header)]
    for status in locks:
        title = f"{status.key}  [{mode_text(status) or 'free'}]"
        rows = [(*holder_cells(h), format_relative(h.expires_in_ms)) for h in status.holders]
        lines = [title]
        lines += [
            "  " + line for line in render_table((*HOLDER_COLUMNS, "EXPIRES IN"), rows).splitlines()
        ]
        if status.waiter_list:
            queue = [waiter_cells(w) for w in status.waiter_list]
            table = render_table(WAITER_COLUMNS, queue)
            lines += ["  " + line for line in table.splitlines()]
            if status.waiters > len(status.waiter_list):
                lines.append(f"  ... {status.waiters - len(status.waiter_list)} more waiting")
        blocks.append("\n".join(lines))
    if more:
        blocks.append("... more keys (raise --limit or narrow --prefix)")
    if not locks:
        blocks.append("no locks held")
    return "\n\n".join(blocks)


def _read(
    client: LockClient, prefix: str | None, limit: int
) -> tuple[list[LockStatus], bool, dict[str, Any] | None]:
    locks, after = client.list_page(prefix, limit, None)
    try:
        counters = client.stats().get("counters")
    except LockAccessDeniedError:
        counters = None
    return locks, after is not None, counters if isinstance(counters, dict) else None


@click.command("top")
@click.option("--prefix", metavar="P", help="Only keys that start with P.")
@click.option(
    "--limit",
    type=click.IntRange(1, 10_000),
    default=DEFAULT_KEYS,
    show_default=True,
    metavar="N",
    help="At most N keys per frame.",
)
@click.option(
    "--interval",
    type=Duration(min_ms=100, max_ms=3_600_000),
    default="1s",
    show_default=True,
    help="Time between frames.",
)
@click.option("--once", is_flag=True, help="Print one frame and exit (no screen clearing).")
@socket_option
@client_command
def top(prefix: str | None, limit: int, interval: int, once: bool, socket_path: str | None) -> None:
    """A live view: every held key, its holders and its queue, and hand-off rates.

    Redraws every --interval until Ctrl-C. Members see the keys they hold or
    wait for; owners, admins and services see all, and the rates.
    """
    with open_client(socket_path) as client:
        before: dict[str, Any] | None = None
        before_at = time.monotonic()
        while True:
            locks, more, counters = _read(client, prefix, limit)
            at = time.monotonic()
            per_second = rates(before, counters, at - before_at)
            if per_second is None and counters is not None:
                per_second = {name: 0.0 for name, _ in RATE_COUNTERS}
            frame = render_frame(locks, per_second, now=time.strftime("%H:%M:%S"), more=more)
            if once:
                click.echo(frame)
                return
            click.echo(_CLEAR + frame, nl=True)
            before, before_at = counters, at
            try:
                time.sleep(interval / 1000)
            except KeyboardInterrupt:
                return
