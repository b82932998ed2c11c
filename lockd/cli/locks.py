"""``lockd locks ...``: list, status, acquire, renew, release, break.

Thin commands over :class:`lockd_client.LockClient` (never the daemon's
internals). What a script can rely on (docs/contract.md §9):

- ``acquire`` makes ONE non-blocking attempt unless ``--wait`` is given and
  prints the handle id alone on stdout, so ``H=$(lockd locks acquire k --ttl
  60s)`` works. It never asks for ``releaseOnClose``: the lease must outlive
  the ``lockd`` process that took it. Busy or timed out: exit 1.
- ``renew`` / ``release`` with a handle that no longer holds the key: exit 6.
  They read the handle from ``LOCKD_HANDLE`` (as ``lockd run`` exports it)
  or from stdin with ``--handle -``: an argument is visible to every user of
  the host in ``/proc/PID/cmdline`` (``ps``), and holding the handle id is
  what proves a hold, so a handle given as an argument still works but gets
  a warning on stderr.
- ``break`` of a free key: exit 0, saying it was free.
- ``--json`` prints the daemon's result as ONE JSON document, also for
  ``renewed: false``, ``released: false`` and ``broken: false``; the exit
  code still tells. Every failure (busy, denied, unreachable, lease lost ...)
  prints exactly one ``{"error": {...}}`` line on stderr; a busy key leaves
  stdout empty.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from typing import NoReturn

import click
from click.core import ParameterSource
from lockd_client import LockClient, LockStatus, LockTimeoutError

from lockd.cli.common import (
    EXIT_CODES_HELP,
    JSON_STYLE,
    TTL,
    WAIT,
    WAIT_FOREVER,
    LazyGroup,
    TableWriter,
    check_key_argument,
    client_command,
    fail,
    format_relative,
    format_time,
    json_option,
    ms_until,
    open_client,
    print_json,
    shared_options,
    socket_option,
    warn,
)
from lockd.cli.hot_commands import show_status
from lockd.contract import HOLDER_FIELDS
from lockd.describe import HOLDER_COLUMNS, holder_cells, mode_text, pid_cell, who_holds
from lockd.exitcodes import EXIT_BUSY, EXIT_LOST, EXIT_USAGE, USAGE
from lockd.textsafe import visible
from lockd.timefmt import format_duration_ms


def complete_keys(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[click.shell_completion.CompletionItem]:
    """Shell completion of KEY from the daemon's ``list`` (owners/admins; else nothing).

    Short timeouts and no error output: a <TAB> must never hang or print.
    """
    from click.shell_completion import CompletionItem

    try:
        with LockClient(
            ctx.params.get("socket_path"), connect_timeout=0.5, request_timeout=1.0
        ) as client:
            locks = client.list(prefix=incomplete or None, limit=200)
    except Exception:
        return []
    return [CompletionItem(s.key) for s in locks]


KEY = click.argument("key", shell_complete=complete_keys, callback=check_key_argument)


@click.group(epilog=EXIT_CODES_HELP, cls=LazyGroup, lazy={"top": "lockd.cli.top:top"})
def locks() -> None:
    """Take, inspect and free locks."""


def _holder_phrase(status: LockStatus) -> str:
    """``held by user:alice (owner run-1, pid 4242 backup.sh) for 42s more``."""
    left = f" for {format_duration_ms(status.expires_in_ms)} more" if status.expires_in_ms else ""
    return f"held by {who_holds(status)}{left}"


def _busy(client: LockClient, key: str, *, shared: bool = False) -> tuple[str, dict[str, object]]:
    """Who holds ``key`` right now, best effort (it may have changed already).

    The text to append to the message, and the error's ``details``. A shared
    request that found only shared holders was turned away by the queue (a
    writer waits ahead, and shared requests never overtake it: docs/contract.md §10):
    that is said, since "held by N holders (shared)" alone reads as a bug.
    """
    details: dict[str, object] = {"key": key}
    try:
        status = client.status(key)
    except Exception:
        return "", details
    if not status.held:
        return "", details
    details["holder"] = {k: status.raw.get(k) for k in HOLDER_FIELDS if k in status.raw}
    if status.holder_count > 1:
        details["holderCount"] = status.holder_count
        details["mode"] = status.mode
        details["limit"] = status.limit
    text = f": {_holder_phrase(status)}"
    if shared and status.mode == "shared" and status.waiters:
        ahead = status.waiter_list[0] if status.waiter_list else None
        who = f" ({ahead.principal}, {ahead.mode})" if ahead is not None else ""
        text += (
            f"; {status.waiters} queued ahead{who}: a shared request never overtakes a "
            "queued exclusive one"
        )
        details["waiters"] = status.waiters
    return text, details


LIST_COLUMNS = ("KEY", "MODE", *HOLDER_COLUMNS, "EXPIRES IN", "WAITERS")
#: locks asked for per ``list`` request (the daemon's default page).
LIST_PAGE = 1000


@locks.command("list")
@click.option("--prefix", metavar="P", help="Only keys that start with P.")
@click.option(
    "--limit", type=click.IntRange(min=1), metavar="N", help="At most N locks (default: all)."
)
@click.option("--after", metavar="KEY", help="Start after KEY (the NEXT of an earlier listing).")
@socket_option
@json_option
@client_command
def list_cmd(
    prefix: str | None,
    limit: int | None,
    after: str | None,
    socket_path: str | None,
    as_json: bool,
) -> None:
    """Every held lock in key order (owners, admins and services).

    Fetched and printed a page at a time, so a daemon with a million locks
    is never blocked and the table starts at once. With --json: one document
    {"locks": [...], "next": KEY or null}; next is set when --limit cut the
    listing, to pass as --after.
    """
    with open_client(socket_path) as client:
        pages = _pages(client, prefix, limit, after)
        if as_json:
            _stream_json(pages)
        else:
            _stream_table(pages, prefix)


#: one page of ``list``: its locks, and the key after which the next starts.
Page = tuple[list[LockStatus], str | None]


def _pages(
    client: LockClient, prefix: str | None, limit: int | None, after: str | None
) -> Iterator[Page]:
    """``list`` pages from ``after`` on, until the end or ``limit`` locks."""
    left = limit
    while True:
        page = client.list_page(prefix, LIST_PAGE if left is None else min(left, LIST_PAGE), after)
        yield page
        locks, after = page
        if left is not None:
            left -= len(locks)
        if after is None or left == 0:
            return


#: bytes of ``list --json`` kept in memory before the rest spills to a temporary file.
JSON_SPOOL_BYTES = 8 << 20


def _stream_json(pages: Iterator[Page]) -> None:
    """One JSON document, all or nothing: stdout gets it only once every page came.

    A failure on any page (the daemon going away, access denied) leaves
    stdout empty, as docs/contract.md §9 promises for ``--json``; the document is built a
    page at a time in a spooled temporary file (in memory up to
    :data:`JSON_SPOOL_BYTES`), so a million locks never sit in memory as objects.
    """
    import json
    import shutil
    import tempfile

    with tempfile.SpooledTemporaryFile(JSON_SPOOL_BYTES, mode="w+", encoding="utf-8") as spool:
        sep, next_key = "", None
        spool.write('{"locks":[')
        for locks, after in pages:
            entries = [json.dumps(lock.raw, **JSON_STYLE) for lock in locks]
            if entries:
                spool.write(sep + ",".join(entries))
                sep = ","
            next_key = after
        spool.write(f'],"next":{json.dumps(next_key, **JSON_STYLE)}}}\n')
        spool.seek(0)
        shutil.copyfileobj(spool, sys.stdout)
        sys.stdout.flush()


def _stream_table(pages: Iterator[Page], prefix: str | None) -> None:
    table: TableWriter | None = None
    # NODE (the host that granted each hold) only from a daemon that names
    # one (the etcd backend, docs/contract.md §11): decided on the first page with locks.
    with_node = False
    shown = 0
    for locks, _ in pages:
        if table is None and locks:
            with_node = any(_nodes(s) for s in locks)
            table = TableWriter((*LIST_COLUMNS, "NODE") if with_node else LIST_COLUMNS)
        rows = [row for s in locks for row in _list_rows(s, with_node=with_node)]
        if rows and table is not None:
            click.echo("\n".join(table.lines(rows)))
        shown += len(rows)
    if not shown:
        under = f" under {prefix!r}" if prefix else ""
        click.echo(f"no locks held{under}")


def _nodes(status: LockStatus) -> bool:
    """True when the daemon named the node of any holder of ``status``."""
    return status.node is not None or any(h.node is not None for h in status.holders or ())


def _list_rows(status: LockStatus, *, with_node: bool = False) -> list[tuple[object, ...]]:
    """A key's rows in ``locks list``: one per holder, the key and mode on the first."""
    rows = _holder_rows(status)
    if not with_node:
        return rows
    nodes = [h.node for h in status.holders or ()] or [status.node]
    return [(*row, nodes[i] if i < len(nodes) else "") for i, row in enumerate(rows)]


def _holder_rows(status: LockStatus) -> list[tuple[object, ...]]:
    holders = status.holders or ()
    if not holders:  # held (a list entry), but the daemon named no holder
        return [
            (
                status.key,
                mode_text(status),
                status.held_by,
                status.owner,
                pid_cell(status),
                status.process,
                status.fence,
                format_relative(status.expires_in_ms),
                status.waiters,
            )
        ]
    rows: list[tuple[object, ...]] = []
    for i, holder in enumerate(holders):
        first = i == 0
        rows.append(
            (
                status.key if first else "",
                mode_text(status) if first else "",
                *holder_cells(holder),
                format_relative(holder.expires_in_ms),
                status.waiters if first else "",
            )
        )
    if status.holder_count > len(holders):
        rows.append(
            ("", "", f"... {status.holder_count - len(holders)} more", "", "", "", "", "", "")
        )
    return rows


@locks.command()
@KEY
@socket_option
@json_option
@client_command
def status(key: str, socket_path: str | None, as_json: bool) -> None:
    """Who holds KEY, without trying to take it (exit 0 held or free)."""
    # The body is shared with the fast path (lockd.cli.fast), which runs it without click.
    show_status(key, socket_path, as_json)


@locks.command(short_help="Take KEY; print the handle id alone.")
@KEY
@click.option(
    "--ttl",
    type=TTL,
    default="60s",
    show_default=True,
    help="Lease time-to-live (60s, 5m, 1m30s, 500ms ...).",
)
@click.option("--owner", metavar="O", help="Name of the work (a run id); the same owner re-takes.")
@click.option(
    "--wait",
    type=WAIT,
    metavar="DURATION|forever",
    help="Wait up to this long in the daemon's queue ('forever': without limit). "
    "Default: one attempt, no wait.",
)
@shared_options
@socket_option
@json_option
@client_command
def acquire(
    key: str,
    ttl: int,
    owner: str | None,
    wait: int | None,
    shared: bool,
    limit: int,
    socket_path: str | None,
    as_json: bool,
) -> None:
    """Take KEY; print the handle id alone (for `locks renew`/`release`).

    \b
        H=$(lockd locks acquire backup --ttl 10m) || exit
        ...
        printf '%s\\n' "$H" | lockd locks release backup --handle -

    --shared takes a shared (reader) hold, --limit N one of N slots of a
    semaphore. The lease outlives this command: release it, or it ends after
    --ttl.
    Busy (or --wait timed out): exit 1. A wait that meets a daemon restart
    waits on in the new daemon's queue, for what is left of --wait.
    """
    # The holder status shows is the process that will use the handle, the
    # shell (or script) that called us, not this command about to exit. A
    # parent outside our pid namespace reads as 0, and 1 means the caller is
    # gone: then the daemon records this process, as it would without a pid.
    parent = os.getppid()
    user = parent if parent > 1 else None
    with open_client(socket_path) as client:
        if wait is None:
            handle = client.try_acquire(
                key, ttl=ttl / 1000, owner=owner, shared=shared, limit=limit, pid=user
            )
        else:
            from lockd.waitline import WaitLine

            try:
                # On a terminal (and not under --json) one live line says who
                # holds the key and where we are in the queue while we wait.
                with WaitLine(key, socket_path) if not as_json else nullcontext():
                    handle = client.acquire(
                        key,
                        ttl=ttl / 1000,
                        timeout=None if wait == WAIT_FOREVER else wait / 1000,
                        owner=owner,
                        shared=shared,
                        limit=limit,
                        pid=user,
                    )
            except LockTimeoutError as exc:
                text, details = _busy(client, key, shared=shared)
                fail(
                    f"timed out after {format_duration_ms(wait)} waiting for {key!r}{text}",
                    EXIT_BUSY,
                    code=exc.code,
                    details={**exc.details, **details},
                )
        if handle is None:
            text, details = _busy(client, key, shared=shared)
            fail(f"key {key!r} is busy{text}", EXIT_BUSY, details=details)
    if as_json:
        print_json(handle.raw)
    else:
        click.echo(handle.handle)


HANDLE_ENV = "LOCKD_HANDLE"

HANDLE = click.option(
    "--handle",
    "handle_id",
    envvar=HANDLE_ENV,
    show_envvar=True,
    metavar="H|-",
    help="The handle id; '-' reads it from stdin. Default: $LOCKD_HANDLE. "
    "An id given here is visible to every user in ps: prefer '-' or the variable.",
)


def _fail_not_held(key: str, what: str, reason: str | None, default: str) -> NoReturn:
    """Exit 6: the handle no longer holds ``key`` (renew and release say it alike)."""
    fail(
        f"{what}: the handle no longer holds {key!r} "
        f"({reason or default}: expired, broken, released or re-taken)",
        EXIT_LOST,
        details={"key": key, "reason": reason},
    )


def _handle_from(handle_id: str | None) -> str:
    """The handle id from stdin (``-``), ``$LOCKD_HANDLE`` or the argument.

    An argument gets a warning on stderr, except under ``--json``, whose
    stderr is one JSON document (the README says so).
    """
    ctx = click.get_current_context()
    if handle_id is None:
        fail(
            f"no handle: pass it on stdin with --handle -, or set {HANDLE_ENV}",
            EXIT_USAGE,
            code=USAGE,
        )
    if handle_id == "-":
        handle_id = sys.stdin.readline().strip()
        if not handle_id:
            fail("--handle -: no handle id on stdin", EXIT_USAGE, code=USAGE)
    elif ctx.get_parameter_source("handle_id") == ParameterSource.COMMANDLINE:
        warn(
            "a handle id given as an argument is visible to every user of this host"
            f" (ps, /proc/PID/cmdline); use --handle - (stdin) or {HANDLE_ENV}"
        )
    return handle_id


@locks.command()
@KEY
@HANDLE
@click.option("--ttl", type=TTL, required=True, help="New time-to-live, from now.")
@socket_option
@json_option
@client_command
def renew(
    key: str, handle_id: str | None, ttl: int, socket_path: str | None, as_json: bool
) -> None:
    """Extend the lease of handle H on KEY (lease lost: exit 6).

    \b
        printf '%s\\n' "$H" | lockd locks renew backup --handle - --ttl 10m
        LOCKD_HANDLE=$H lockd locks renew backup --ttl 10m
    """
    handle_id = _handle_from(handle_id)
    with open_client(socket_path) as client:
        result = client.renew((key, handle_id), ttl=ttl / 1000)
    if as_json:
        print_json(result.raw)
    if not result.renewed:
        _fail_not_held(key, "lease lost", result.reason, "lease_lost")
    if not as_json:
        left = format_relative(ms_until(result.lease_expires_at))
        click.echo(f"renewed {key!r}: expires {left} ({format_time(result.lease_expires_at)})")


@locks.command()
@KEY
@HANDLE
@socket_option
@json_option
@client_command
def release(key: str, handle_id: str | None, socket_path: str | None, as_json: bool) -> None:
    """Free KEY if handle H still holds it (not the holder: exit 6).

    \b
        printf '%s\\n' "$H" | lockd locks release backup --handle -
        LOCKD_HANDLE=$H lockd locks release backup
    """
    handle_id = _handle_from(handle_id)
    with open_client(socket_path) as client:
        result = client.release((key, handle_id))
    if as_json:
        print_json(result.raw)
    if not result.released:
        _fail_not_held(key, "not the holder", result.reason, "not_holder")
    if not as_json:
        click.echo(f"released {key!r}")


@locks.command("break")
@KEY
@click.option("--reason", required=True, metavar="TEXT", help="Why (logged by the daemon).")
@socket_option
@json_option
@client_command
def break_cmd(key: str, reason: str, socket_path: str | None, as_json: bool) -> None:
    """Free KEY whoever holds it (owners, admins); its handle is fenced.

    A free key is not an error: exit 0, saying it was free.
    """
    with open_client(socket_path) as client:
        result = client.break_lock(key, reason)
    if as_json:
        print_json(result.raw)
        return
    if not result.broken:
        click.echo(f"{key!r} was free: nothing to break")
        return
    extra: list[str] = []
    if result.owner:
        extra.append(f"owner {visible(result.owner)}")
    if result.fence is not None:
        extra.append(f"fence {result.fence}")
    detail = f" ({', '.join(extra)})" if extra else ""
    click.echo(f"broke {key!r}: it was held by {visible(result.held_by)}{detail}")
