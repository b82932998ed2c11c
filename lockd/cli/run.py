"""``lockd run KEY [OPTIONS] -- COMMAND [ARGS]...``: flock(1) for lockd leases.

A thin click command over :mod:`lockd.run.supervisor`; registered on the ``lockd``
group by :mod:`lockd.cli`. Everything after the first ``--`` is COMMAND and
its arguments, never parsed as options, so ``lockd run k -- ls --help`` runs
``ls --help``. The ``--`` is required: without it, a COMMAND option such as
``-v`` would silently be read as one of ours.
"""

from __future__ import annotations

import click

from lockd.cli.common import Duration, check_key_argument, shared_options
from lockd.cli.hot_commands import run_command
from lockd.contract import MAX_TIMEOUT_MS, MAX_TTL_MS
from lockd.exitcodes import (
    EXIT_BUG,
    EXIT_BUSY,
    EXIT_CANNOT_EXECUTE,
    EXIT_DENIED,
    EXIT_INTERRUPTED,
    EXIT_LOST,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_RATE_LIMITED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    MEANING,
    exit_codes_help,
)
from lockd.run.options import MIN_TTL_MS, OnLost, RunOptions

__all__ = ["run"]

_COMMAND_META = "lockd.run.command"


class _RunCommand(click.Command):
    """A click Command that splits off everything after the first ``--`` as COMMAND."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta[_COMMAND_META] = tuple(args[cut + 1 :])
            args = args[:cut]
            key_after = _key_after_dashes(self, args, ctx.meta[_COMMAND_META])
            if key_after is not None:  # lockd run [OPTIONS] -- -KEY -- COMMAND
                ctx.meta[_COMMAND_META] = ctx.meta[_COMMAND_META][2:]
                args = [*args, "--", key_after]
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [
            "[OPTIONS]",
            "KEY",
            "-- COMMAND [ARGS]...  (a KEY starting with '-': -- KEY -- COMMAND)",
        ]


def _key_after_dashes(
    command: click.Command, before: list[str], after: tuple[str, ...]
) -> str | None:
    """KEY of ``lockd run [OPTIONS] -- KEY -- COMMAND``, for a key starting with ``-``.

    Only when no KEY came before the first ``--`` (every word there is an
    option or an option's value) and a second ``--`` follows the word after
    it; otherwise everything after the first ``--`` stays COMMAND.
    """
    if len(after) < 3 or after[1] != "--":
        return None
    takes_value = {
        opt
        for p in command.params
        if isinstance(p, click.Option) and not p.is_flag and not p.count
        for opt in p.opts
    }
    words = iter(before)
    for word in words:
        if not word.startswith("-"):
            return None  # a positional: KEY was given already
        if word in takes_value:
            next(words, None)
    return after[0]


_EXIT_CODES: tuple[tuple[int | str, str], ...] = (
    ("N", "COMMAND's own status; 128+N when it was killed by signal N"),
    (EXIT_OK, "with --conflict-exit-code 0: the key was busy, COMMAND not run"),
    (EXIT_BUSY, "key busy, or --wait timed out (change with --conflict-exit-code)"),
    # As for every command:
    *((code, MEANING[code]) for code in (EXIT_USAGE, EXIT_DENIED, EXIT_RATE_LIMITED)),
    (EXIT_UNAVAILABLE, MEANING[EXIT_UNAVAILABLE]),
    (EXIT_LOST, "lease lost while COMMAND ran (broken, re-taken, or renewals failed),"),
    ("", "also with --on-lost ignore, whatever COMMAND's status"),
    (EXIT_BUG, "a bug in lockd run (LOCKD_DEBUG=1 shows the traceback)"),
    (EXIT_CANNOT_EXECUTE, f"COMMAND cannot be executed; {EXIT_NOT_FOUND} COMMAND not found"),
    (EXIT_INTERRUPTED, "interrupted (SIGINT) while waiting for the key"),
)

_EPILOG = (
    exit_codes_help(_EXIT_CODES)
    + """\b
COMMAND's environment gets LOCKD_KEY, LOCKD_HANDLE, LOCKD_FENCE and
LOCKD_SOCKET. On a terminal it is a job of its own that gets the terminal
(Ctrl-C, Ctrl-Z, /dev/tty work); otherwise it runs in a session of its own.
SIGINT, SIGTERM and SIGHUP sent to lockd run are passed on to its process
group. Nothing COMMAND starts (setsid, nohup, double fork) outlives the key:
if lockd run dies, every descendant is killed and reaped before KEY is
freed; children COMMAND leaves in the background keep KEY held until they
exit, as under flock(1) (--kill-descendants ends them instead).
\b
A script that locks itself (compare the key; LOCKD_HANDLE may be another run's):
  [ "$LOCKD_KEY" = nightly-import ] || exec lockd run nightly-import -- "$0" "$@"
\b
Example (cron, never overlapping itself; a busy key is a quiet success):
  */5 * * * * lockd run -q --conflict-exit-code 0 nightly-import -- /usr/local/bin/import.sh
"""
)


@click.command(
    "run",
    cls=_RunCommand,
    epilog=_EPILOG,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.argument("key", callback=check_key_argument)
@click.argument("stray", nargs=-1)  # words before '--': only there to say '--' is missing
@click.option(
    "--ttl",
    "ttl_ms",
    type=Duration(min_ms=MIN_TTL_MS, max_ms=MAX_TTL_MS),
    default="60s",
    show_default=True,
    help="Lease time-to-live, renewed every third of it while COMMAND runs.",
)
@click.option(
    "--wait",
    "wait_ms",
    type=Duration(min_ms=0, max_ms=MAX_TIMEOUT_MS, forever=True),
    default=None,
    metavar="DURATION|forever",
    help="Wait up to this long for the key (first come, first served; 'forever': "
    "without limit). Default: one attempt, give up at once if the key is busy.",
)
@click.option(
    "--owner",
    default=None,
    help="Name of the work (a run id). A lockd run with the same owner, as the same "
    "user, takes the key over; the earlier holder then loses its lease.",
)
@shared_options
@click.option(
    "--on-lost",
    type=click.Choice([m.value for m in OnLost]),
    default=OnLost.TERM.value,
    show_default=True,
    help="When the lease is lost: term = SIGTERM to COMMAND's process group, SIGKILL "
    "after --grace; kill = SIGKILL at once; ignore = only report. Exit status 6 in "
    "every case.",
)
@click.option(
    "--grace",
    "grace_ms",
    type=Duration(min_ms=0),
    default="10s",
    show_default=True,
    help="With --on-lost term, --kill-descendants or a signal to lockd run: time between "
    "SIGTERM and SIGKILL for what COMMAND left running.",
)
@click.option(
    "--kill-descendants",
    is_flag=True,
    help="When COMMAND exits, end what it left running in the background (SIGTERM, "
    "SIGKILL after --grace). Default, as flock(1): KEY stays held until the last of "
    "them exits.",
)
@click.option(
    "--conflict-exit-code",
    type=click.IntRange(0, 255),
    default=1,
    show_default=True,
    help="Exit status when the key is busy or --wait times out (like flock -E).",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="Say nothing when the key is busy or --wait times out (for cron).",
)
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Daemon socket. Default: $LOCKD_SOCKET, else the user default.",
)
@click.option(
    "--json",
    "json_output",
    is_flag=True,
    help='lockd run\'s own messages on stderr as JSON lines ({"error": {code, message, '
    "details}}). stdout is always COMMAND's.",
)
@click.pass_context
def run(
    ctx: click.Context,
    key: str,
    stray: tuple[str, ...],
    ttl_ms: int,
    wait_ms: int | None,
    owner: str | None,
    shared: bool,
    limit: int,
    on_lost: str,
    grace_ms: int,
    kill_descendants: bool,
    conflict_exit_code: int,
    quiet: bool,
    socket_path: str | None,
    json_output: bool,
) -> None:
    """Run COMMAND while holding KEY, like flock(1) with a lease.

    Takes KEY (at once, or waiting up to --wait), runs COMMAND without a
    shell, renews the lease in the background, releases KEY when COMMAND
    exits (and whatever it left running has exited) and exits with COMMAND's
    status. If lockd run is killed, everything COMMAND started is killed and
    reaped, then KEY is freed. If the lease is lost while
    COMMAND runs, lockd run acts (--on-lost) before the lease runs out,
    says so on stderr and exits 6.
    """
    command: tuple[str, ...] | None = ctx.meta.get(_COMMAND_META)
    if stray:
        words = " ".join(stray)
        raise click.UsageError(f"missing '--' before COMMAND (lockd run KEY -- {words})")
    if command is None:
        raise click.UsageError("missing '--' before COMMAND (lockd run KEY -- COMMAND ...)")
    if not command:
        raise click.UsageError("no COMMAND after '--'")
    opts = RunOptions(
        key=key,
        command=command,
        ttl_ms=ttl_ms,
        wait_ms=wait_ms,
        owner=owner,
        shared=shared,
        limit=limit,
        on_lost=OnLost(on_lost),
        grace_ms=grace_ms,
        conflict_exit_code=conflict_exit_code,
        socket_path=socket_path,
        quiet=quiet,
        kill_descendants=kill_descendants,
    )
    # The rest is shared with the fast path (lockd.cli.fast), which runs it without click.
    ctx.exit(run_command(opts, json_output=json_output))
