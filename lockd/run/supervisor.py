"""Run a command while holding a lease: the engine of ``lockd run`` (docs/contract.md §9).

``lockd run`` replaces flock(1) for programs that should not overlap, with two
differences a lease forces on us: the lease runs out unless renewed, and it can
be taken away (broken by an admin, re-taken by the same owner). A run:

1. takes the key (:func:`lockd.run.lease.take_lease`);
2. starts COMMAND through its guardian (:mod:`lockd.run.guardian`), with
   ``LOCKD_KEY``, ``LOCKD_HANDLE``, ``LOCKD_FENCE`` and ``LOCKD_SOCKET`` in
   its environment: on a terminal as a job of its own that gets the
   terminal, otherwise in a session of its own; SIGINT, SIGTERM and SIGHUP
   are passed on to its process group (:mod:`lockd.run.process`);
3. renews the lease from the client's :class:`~lockd_client.AutoRenewer`
   thread (every third of the TTL, a safety margin before the end); when the
   lease is lost, the guardian ends every process of COMMAND before the
   lease expires (``--on-lost``);
4. waits until nothing of COMMAND is left (flock's rule for what it leaves
   in the background, unless ``--kill-descendants``), releases the key and
   returns COMMAND's status the way a shell reports it (128+N for death by
   signal N).

This module is that sequence and the supervision loop; the option and report
types live in :mod:`lockd.run.options`, COMMAND's process group in
:mod:`lockd.run.process`. Nothing here knows about click;
:mod:`lockd.cli.run` is the thin command on top.
"""

from __future__ import annotations

import errno
import os
import time

from lockd_client import AutoRenewer, Handle, LockClient, LockdError
from lockd_client._renewer import log as client_log

from lockd.exitcodes import (
    EXIT_CANNOT_EXECUTE,
    EXIT_LOST,
    EXIT_NOT_FOUND,
)
from lockd.run.guardian import NO_TERMINAL, TERMINAL_FOREGROUND
from lockd.run.lease import Grant, LeaseKeeper, take_lease
from lockd.run.options import OnLost, Reporter, RunOptions
from lockd.run.process import (
    CommandNotStarted,
    Guardian,
    Message,
    SignalForwarder,
    become_subreaper,
    end_descendants,
    exit_status,
    foreground_group,
    killpg,
    set_foreground,
    terminal_mode,
)
from lockd.timefmt import format_duration_ms

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    import signal
else:
    import _signal as signal  # the signal module without its enums (issue 24)

__all__ = ["run_locked"]


#: Time allowed for the final release.
_RELEASE_TIMEOUT = 5.0
_RELEASE_RETRY_WINDOW = 2.0
#: How long lockd run, failing itself, waits for the guardian to end COMMAND.
_GUARDIAN_WAIT = 30.0


def run_locked(opts: RunOptions, report: Reporter | None = None) -> int:
    """Do everything ``lockd run`` does and return its exit status.

    Must run on the main thread (signal handlers, PDEATHSIG). While we wait
    for the key, signals keep their usual effect (SIGINT ends the wait with
    130; SIGTERM and SIGHUP end the process, and the daemon drops the waiter
    with the connection); once the key is ours, they are forwarded.
    """
    report = report or Reporter()
    # The renewer logs its retries and the loss as warnings; lockd run says
    # what matters itself, one line per event (JSON lines with --json), so
    # Python's last-resort handler must not add its own lines to stderr.
    client_log.quiet()
    client = LockClient(opts.socket_path)
    mode = terminal_mode()
    # Before the key: COMMAND's process is forked (not run) so that the
    # acquire can name its pid as the holder's (docs/contract.md §12.2).
    guardian = Guardian(opts.command, mode)
    try:
        got = take_lease(client, opts._replace(holder_pid=guardian.command_pid), report)
        if isinstance(got, int):
            return got
        with SignalForwarder() as forwarder:
            return _run_holding(client, got, opts, report, forwarder, guardian, mode)
    finally:
        # The guardian first: it holds the key (a copy of the connection)
        # until every process of COMMAND is gone; closing the client shuts
        # the connection down for every copy.
        guardian.close()
        client.close()
        if not guardian.posters_left:
            # The renewer was stopped in _run_holding (or never started): no
            # post() comes any more. One still running (stuck in a call past
            # stop()'s wait) keeps the pipe: the process's exit closes it.
            guardian.dispose()


def _run_holding(
    client: LockClient,
    lease: Grant,
    opts: RunOptions,
    report: Reporter,
    forwarder: SignalForwarder,
    guardian: Guardian,
    mode: int,
) -> int:
    """Run COMMAND under ``lease``, then release; return the exit status."""
    handle = lease.handle
    started = _start_command(client, handle, opts, report, guardian)
    if started is not None:
        return started
    pgid = guardian.command_pid
    forwarder.on_signal = lambda sig: guardian.post(Message("signal", str(sig)))
    forwarder.attach(pgid)
    own_group = os.getpgrp()

    renewer = LeaseKeeper(client, lease, opts.ttl_ms, lambda: guardian.post(Message("renewer")))
    renewer.start()
    outcome = _Outcome()
    try:
        _supervise(guardian, renewer, opts, report, forwarder, mode, outcome)
    finally:
        if mode == TERMINAL_FOREGROUND:
            _take_terminal_back(pgid, own_group)
        if not guardian.finished:
            # An error in lockd run itself: everything COMMAND started goes too.
            guardian.end_all(0)
            while not guardian.finished and guardian.next_message(_GUARDIAN_WAIT) is not None:
                pass
        guardian.close()
        renewer.stop()
        guardian.posters_left = renewer.alive
    status = exit_status(outcome.returncode if outcome.returncode is not None else -9)
    lost = outcome.lost
    if lost is not None:
        renewer.work_stopped()  # COMMAND is gone: a break may hand the key on now
        # Every process of COMMAND is gone by now (the guardian said "empty").
        # No release: either the daemon fenced the handle already, or it did
        # not answer in time and the lease is about to run out; in both cases
        # our exit closes the connection, which frees a lease still bound to it.
        if opts.on_lost is OnLost.IGNORE:
            report(
                "LEASE_LOST",
                f"COMMAND exited with status {status}; exiting {EXIT_LOST}: the lease on"
                f" {handle.key!r} was lost while it ran",
                key=handle.key,
                commandStatus=status,
            )
        return EXIT_LOST
    if not _release(client, handle, report, quiet_not_holder=False):
        return EXIT_LOST
    return status


def _start_command(
    client: LockClient,
    handle: Handle,
    opts: RunOptions,
    report: Reporter,
    guardian: Guardian,
) -> int | None:
    """Start COMMAND (through its guardian) with the lease in its environment.

    Returns None once it runs, or the exit status if it cannot start.
    """
    env = {
        **os.environ,
        "LOCKD_KEY": handle.key,
        "LOCKD_HANDLE": handle.handle,
        "LOCKD_FENCE": str(handle.fence),
        "LOCKD_SOCKET": client.socket_path,
    }
    become_subreaper()
    try:
        guardian.go(env, _connection_fd(client))
    except CommandNotStarted as exc:
        _release(client, handle, report, quiet_not_holder=True)
        missing = exc.errno == errno.ENOENT
        what = "not found" if missing else f"cannot be executed ({exc.strerror or exc})"
        report(
            "COMMAND_NOT_FOUND" if missing else "COMMAND_NOT_EXECUTABLE",
            f"{opts.command[0]}: command {what}",
            command=opts.command[0],
        )
        return EXIT_NOT_FOUND if missing else EXIT_CANNOT_EXECUTE
    return None


def _connection_fd(client: LockClient) -> int | None:
    """The socket of the connection the hold is bound to (``releaseOnClose``).

    The guardian keeps a copy so that the daemon sees the connection close
    only after every process of COMMAND is gone. The sync client has no
    public accessor for it; None (no copy, the key is freed when ``lockd
    run`` dies) if its shape ever changes.
    """
    conn = getattr(client, "_conn", None)
    sock = getattr(conn, "_sock", None)
    try:
        return int(sock.fileno()) if sock is not None else None
    except (OSError, ValueError):
        return None


class _Outcome:
    """What the supervision saw: COMMAND's return code, and why the lease was lost."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.lost: str | None = None


def _supervise(
    guardian: Guardian,
    renewer: AutoRenewer,
    opts: RunOptions,
    report: Reporter,
    forwarder: SignalForwarder,
    mode: int,
    outcome: _Outcome,
) -> None:
    """Wait until nothing of COMMAND is left, acting on a lost lease as ``opts.on_lost`` says.

    Runs on the main thread; signal handlers (forwarding) run in between.
    When COMMAND's first process exits, what it left running keeps the key
    (flock's way) unless ``--kill-descendants``, a lost lease or a signal to
    ``lockd run`` says to end it.
    """
    pgid = guardian.command_pid
    ending = False

    def end_all(grace_ms: int) -> None:
        nonlocal ending
        if not ending:
            ending = True
            guardian.end_all(grace_ms)

    while True:
        timeout: float | None = None
        if outcome.lost is None:
            timeout = max(0.0, renewer.give_up_at() - time.monotonic())
        message = guardian.next_message(timeout)
        if message is not None:
            if message.word in ("empty", "gone"):
                if message.word == "gone":
                    report.warning(
                        "GUARDIAN_LOST",
                        "the process guarding COMMAND ended unexpectedly; killing what is left",
                    )
                    end_descendants(lambda _line: None)
                return
            if message.word == "exit":
                outcome.returncode = int(message.rest)
                if mode == TERMINAL_FOREGROUND:
                    _take_terminal_back(pgid, os.getpgrp())
                # After a loss (term or kill) the end is under way already;
                # with --on-lost ignore, what COMMAND left is waited for.
                if forwarder.signalled or opts.kill_descendants:
                    end_all(opts.grace_ms)
            elif message.word == "signal" and outcome.returncode is not None:
                end_all(opts.grace_ms)  # COMMAND is gone; what it left must go too
            elif message.word == "stopped" and mode != NO_TERMINAL:
                _stop_like_a_job(pgid)
            elif message.word == "eperm":
                pid, _, name = message.rest.partition(" ")
                report.warning(
                    "CANNOT_CONTAIN",
                    f"cannot signal process {pid} ({name}) started by COMMAND (not permitted:"
                    " set-uid?); lockd run waits for it to exit before it lets the key go",
                    pid=int(pid),
                    process=name,
                )
        if outcome.lost is None:
            outcome.lost = _lost_reason(renewer)
            if outcome.lost is not None:
                _report_lost(outcome.lost, opts, report)
                if opts.on_lost is not OnLost.IGNORE:
                    end_all(_lost_grace(opts))


def _lost_grace(opts: RunOptions) -> int:
    return 0 if opts.on_lost is OnLost.KILL else opts.grace_ms


def _take_terminal_back(command_group: int, own_group: int) -> None:
    """Give the terminal back to ``lockd run``'s group if COMMAND's side still has it."""
    current = foreground_group()
    if current is None or current == own_group:
        return
    if current == command_group or not _group_exists(current):
        set_foreground(own_group)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_like_a_job(command_group: int) -> None:
    """COMMAND was stopped (Ctrl-Z, SIGTTIN): stop ``lockd run`` too, as a shell's job stops.

    The terminal goes back to our group first, then our group gets SIGTSTP,
    so the shell that started us sees the job stopped and takes the terminal.
    When the shell resumes us (``fg`` makes our group the foreground again,
    ``bg`` does not), COMMAND gets the terminal back if we have it, then
    SIGCONT. While stopped, the lease is not renewed: a stop longer than the
    TTL loses it. In an orphaned process group (no shell to resume us) the
    kernel drops the SIGTSTP and COMMAND is resumed at once.
    """
    own_group = os.getpgrp()
    if foreground_group() == command_group:
        set_foreground(own_group)
    killpg(own_group, signal.SIGTSTP)
    if foreground_group() == own_group:
        set_foreground(command_group)
    killpg(command_group, signal.SIGCONT)


def _report_lost(reason: str, opts: RunOptions, report: Reporter) -> None:
    """Say the lease is lost and what ``--on-lost`` does about it."""
    head = f"lease on {opts.key!r} lost ({reason})"
    if opts.on_lost is OnLost.IGNORE:  # the failure is reported when COMMAND exits
        report.warning(
            "LEASE_LOST",
            f"{head}; --on-lost ignore: COMMAND keeps running without the lock",
            key=opts.key,
            action="ignore",
        )
    elif opts.on_lost is OnLost.KILL:
        report(
            "LEASE_LOST",
            f"{head}; sent SIGKILL to every process of COMMAND",
            key=opts.key,
            action="kill",
        )
    else:
        report(
            "LEASE_LOST",
            f"{head}; sent SIGTERM to every process of COMMAND,"
            f" SIGKILL in {format_duration_ms(opts.grace_ms)}",
            key=opts.key,
            action="term",
        )


def _lost_reason(renewer: AutoRenewer) -> str | None:
    """Why the lease is lost, or None while it holds.

    The renewer says so when renew answers ``renewed: false`` or renewals
    keep failing; past its give-up point without a renewal, we say so
    ourselves (a renew call stuck in the kernel must not delay acting).
    """
    if renewer.lost_reason is not None:
        return renewer.lost_reason
    if time.monotonic() >= renewer.give_up_at():
        return "no successful renewal in time, the lease is about to run out"
    return None


def _release(
    client: LockClient, handle: Handle, report: Reporter, *, quiet_not_holder: bool
) -> bool:
    """Release the key; False only when the daemon says we no longer held it.

    A release that cannot reach the daemon is reported but not fatal: the key
    is freed anyway when this process exits (``releaseOnClose``) or, after a
    daemon restart, when the TTL runs out.
    """
    client.request_timeout = _RELEASE_TIMEOUT
    client.retry_window = _RELEASE_RETRY_WINDOW
    try:
        result = client.release(handle)
    except LockdError as exc:
        report.warning(
            "RELEASE_FAILED",
            f"could not release key {handle.key!r} ({exc.message}); it is freed when this"
            " process exits, or when its TTL runs out",
            key=handle.key,
        )
        return True
    if result.released or quiet_not_holder:
        return True
    report(
        "LEASE_LOST",
        f"lease on {handle.key!r} was lost before COMMAND finished (release answered"
        f" {result.reason or 'released: false'}); exiting {EXIT_LOST}",
        key=handle.key,
    )
    return False
