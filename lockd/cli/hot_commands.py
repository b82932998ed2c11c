"""The bodies of the hot commands, ``lockd locks status`` and ``lockd run``, without click.

Scripts call these two in loops, so the console script runs them through a
path that never imports click (:mod:`lockd.cli.fast`); every other command
line, and every one the fast path does not fully understand, goes to the
click commands (:mod:`lockd.cli.locks`, :mod:`lockd.cli.run`). Both paths
call the functions here once the command line is read, so what is asked of
the daemon and what is printed is one piece of code.
"""

from __future__ import annotations

import os

from lockd_client import LockClient

from lockd.exitcodes import EXIT_BUG, EXIT_INTERRUPTED

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from lockd.run.options import RunOptions

__all__ = ["run_command", "show_status"]


def show_status(key: str, socket_path: str | None, as_json: bool) -> None:
    """``lockd locks status KEY``: who holds KEY, printed; client errors propagate.

    The caller turns an exception into the one stderr line and exit code
    (:func:`lockd.cli.output.failure_from`).
    """
    # Imported here, not with the module: lockd run, which shares it, prints
    # no table (issue 24, start-up).
    from lockd.cli.output import (
        echo,
        format_relative,
        format_time,
        print_json,
        render_fields,
        render_table,
    )
    from lockd.describe import (
        HOLDER_COLUMNS,
        WAITER_COLUMNS,
        holder_cells,
        mode_text,
        pid_cell,
        waiter_cells,
    )

    with LockClient(socket_path) as client:
        st = client.status(key)
    if as_json:
        print_json(st.raw)
        return
    expires = (
        f"{format_relative(st.expires_in_ms)} ({format_time(st.lease_expires_at)})"
        if st.held
        else None
    )
    held = "no"
    if st.held:
        held = "yes" if st.holder_count <= 1 else f"yes, by {st.holder_count} holders"
    echo(
        render_fields(
            [
                ("Key", st.key),
                ("Held", held),
                ("Mode", mode_text(st)),
                ("Held by", st.held_by),
                ("Owner", st.owner),
                ("Pid", pid_cell(st)),
                ("Process", st.process),
                *([("Node", st.node)] if st.node else []),
                ("Fence", st.fence),
                ("Expires", expires),
                ("Waiters", st.waiters),
            ]
        )
    )
    if st.holder_count > 1:  # the fields above are the oldest grant; here is everyone
        rows = [(*holder_cells(h), format_relative(h.expires_in_ms)) for h in st.holders]
        table = render_table((*HOLDER_COLUMNS, "EXPIRES IN"), rows)
        echo("Holders:\n" + "\n".join(f"  {line}" for line in table.splitlines()))
    if st.waiter_list:  # docs/contract.md §12: who waits, in queue order
        queue_rows = [(*waiter_cells(w), *([w.node] if st.node else [])) for w in st.waiter_list]
        headers = (*WAITER_COLUMNS, *(["NODE"] if st.node else []))
        table = render_table(headers, queue_rows)
        echo("Queue:\n" + "\n".join(f"  {line}" for line in table.splitlines()))
        if st.waiters > len(st.waiter_list):
            echo(f"  ... {st.waiters - len(st.waiter_list)} more waiting")


def run_command(opts: RunOptions, *, json_output: bool) -> int:
    """``lockd run`` once its command line is read: its exit status.

    Never raises for a failure of its own: one line on stderr (a JSON line
    with ``json_output``) and the documented status, 70 for a bug in lockd
    (``LOCKD_DEBUG=1`` re-raises it for a traceback).
    """
    # Imported when run, not at start-up (threads, subprocess): other commands
    # and shell completion do not pay for it.
    from lockd.run.options import Reporter
    from lockd.run.supervisor import run_locked

    report = Reporter(json_lines=json_output)
    try:
        return run_locked(opts, report)
    except KeyboardInterrupt:
        # A Ctrl-C in the instant between taking the key and installing the
        # forwarder: 130 like a shell, never click's "Aborted!" with 1 ("busy").
        # The key is freed as our connection closes (releaseOnClose).
        report("INTERRUPTED", "interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: one line and 70, not a traceback that exits 1 ("busy")
        from lockd.cli.output import DEBUG_ENV

        if os.environ.get(DEBUG_ENV):
            raise
        report(
            "BUG",
            f"unexpected error (a bug in lockd; set {DEBUG_ENV}=1 for a traceback):"
            f" {type(exc).__name__}: {exc}",
        )
        return EXIT_BUG
