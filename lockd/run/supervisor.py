"""Run a command while holding a lease: the engine of ``lockd run`` (SPEC §9).

``lockd run`` replaces flock(1) for programs that should not overlap, with two
differences a lease forces on us: the lease runs out unless renewed, and it can
be taken away (broken by an admin, re-taken by the same owner). A run:

1. takes the key (:func:`lockd.run.lease.take_lease`);
2. starts COMMAND in a session of its own, with ``LOCKD_KEY``, ``LOCKD_HANDLE``,
   ``LOCKD_FENCE`` and ``LOCKD_SOCKET`` in its environment, guarded so that it
   dies with ``lockd run`` and receives its SIGINT, SIGTERM and SIGHUP
   (:mod:`lockd.run.process`);
3. renews the lease from the client's :class:`~lockd_client.AutoRenewer`
   thread (every third of the TTL, a safety margin before the end); when the
   lease is lost, the main thread acts on COMMAND's whole process group
   before the lease expires (``--on-lost``);
4. releases the key when COMMAND exits and returns COMMAND's status the way a
   shell reports it (128+N for death by signal N).

This module is that sequence and the supervision loop; the option and report
types live in :mod:`lockd.run.options`, COMMAND's process group in
:mod:`lockd.run.process`. Nothing here knows about click;
:mod:`lockd.cli.run` is the thin command on top.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

from lockd_client import AutoRenewer, Handle, LockClient, LockdError

from lockd.exitcodes import (
    EXIT_CANNOT_EXECUTE,
    EXIT_LOST,
    EXIT_NOT_FOUND,
)
from lockd.run.lease import Grant, LeaseKeeper, take_lease
from lockd.run.options import OnLost, Reporter, RunOptions
from lockd.run.process import (
    GroupGuard,
    SignalForwarder,
    exit_status,
    group_alive,
    killpg,
    spawn_in_own_session,
)
from lockd.timefmt import format_duration_ms

__all__ = ["run_locked"]


#: Time allowed for the final release.
_RELEASE_TIMEOUT = 5.0
_RELEASE_RETRY_WINDOW = 2.0
#: How often a group that outlived its leader is checked during --grace.
_GROUP_POLL = 0.05


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
    logging.getLogger("lockd_client").addHandler(logging.NullHandler())
    client = LockClient(opts.socket_path)
    try:
        got = take_lease(client, opts, report)
        if isinstance(got, int):
            return got
        with SignalForwarder() as forwarder:
            return _run_holding(client, got, opts, report, forwarder)
    finally:
        client.close()


def _run_holding(
    client: LockClient,
    lease: Grant,
    opts: RunOptions,
    report: Reporter,
    forwarder: SignalForwarder,
) -> int:
    """Run COMMAND under ``lease``, then release; return the exit status."""
    handle = lease.handle
    proc = _start_command(client, handle, opts, report)
    if isinstance(proc, int):
        return proc
    forwarder.attach(proc.pid)
    guard = GroupGuard(proc.pid)

    wake = threading.Event()
    exited = threading.Event()
    renewer = LeaseKeeper(client, lease, opts.ttl_ms, wake.set)
    renewer.start()
    reaper = threading.Thread(
        target=_reap, args=(proc, exited, wake), name="lockd-run-reaper", daemon=True
    )
    reaper.start()
    lost: str | None = None
    try:
        lost = _supervise(proc, renewer, exited, wake, opts, report)
        guard.dismiss()
    finally:
        guard.close()  # after an error in lockd run itself: the group goes too
        renewer.stop()
    status = exit_status(proc.returncode)
    if lost is not None:
        renewer.work_stopped()  # COMMAND is gone: a break may hand the key on now
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
    client: LockClient, handle: Handle, opts: RunOptions, report: Reporter
) -> subprocess.Popen[bytes] | int:
    """Start COMMAND with the lease in its environment; the exit status if it cannot start."""
    env = {
        **os.environ,
        "LOCKD_KEY": handle.key,
        "LOCKD_HANDLE": handle.handle,
        "LOCKD_FENCE": str(handle.fence),
        "LOCKD_SOCKET": client.socket_path,
    }
    try:
        return spawn_in_own_session(opts.command, env)
    except OSError as exc:
        _release(client, handle, report, quiet_not_holder=True)
        missing = isinstance(exc, FileNotFoundError)
        what = "not found" if missing else f"cannot be executed ({exc.strerror or exc})"
        report(
            "COMMAND_NOT_FOUND" if missing else "COMMAND_NOT_EXECUTABLE",
            f"{opts.command[0]}: command {what}",
            command=opts.command[0],
        )
        return EXIT_NOT_FOUND if missing else EXIT_CANNOT_EXECUTE


def _reap(proc: subprocess.Popen[bytes], exited: threading.Event, wake: threading.Event) -> None:
    proc.wait()
    exited.set()
    wake.set()


def _supervise(
    proc: subprocess.Popen[bytes],
    renewer: AutoRenewer,
    exited: threading.Event,
    wake: threading.Event,
    opts: RunOptions,
    report: Reporter,
) -> str | None:
    """Wait for COMMAND to exit, acting on a lost lease as ``opts.on_lost`` says.

    Runs on the main thread; signal handlers (forwarding) run in between.
    Returns why the lease was lost, or None when it held to the end.
    """
    pgid = proc.pid
    lost: str | None = None
    kill_at: float | None = None  # --on-lost term: when SIGKILL follows
    while not exited.is_set():
        now = time.monotonic()
        timeout: float | None = None
        if lost is None:
            timeout = max(0.0, renewer.give_up_at() - now)
        elif kill_at is not None:
            timeout = max(0.0, kill_at - now)
        wake.wait(timeout)
        wake.clear()
        if exited.is_set():
            break
        if lost is None:
            lost = _lost_reason(renewer)
            if lost is not None:
                kill_at = _act_on_lost(pgid, lost, opts, report)
        if kill_at is not None and time.monotonic() >= kill_at:
            killpg(pgid, signal.SIGKILL)
            kill_at = None
    if kill_at is not None:
        # The leader obeyed SIGTERM; anything left in its group gets the rest
        # of --grace, then SIGKILL: no process of a lost lease keeps working.
        while group_alive(pgid) and time.monotonic() < kill_at:
            time.sleep(_GROUP_POLL)
        if group_alive(pgid):
            killpg(pgid, signal.SIGKILL)
    return lost if lost is not None else _lost_reason(renewer)


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


def _act_on_lost(pgid: int, reason: str, opts: RunOptions, report: Reporter) -> float | None:
    """Signal the group as ``--on-lost`` says and report it; return when SIGKILL is due."""
    head = f"lease on {opts.key!r} lost ({reason})"
    if opts.on_lost is OnLost.IGNORE:  # the failure is reported when COMMAND exits
        report.warning(
            "LEASE_LOST",
            f"{head}; --on-lost ignore: COMMAND keeps running without the lock",
            key=opts.key,
            action="ignore",
        )
        return None
    if opts.on_lost is OnLost.KILL:
        killpg(pgid, signal.SIGKILL)
        report(
            "LEASE_LOST",
            f"{head}; sent SIGKILL to COMMAND's process group",
            key=opts.key,
            action="kill",
        )
        return None
    killpg(pgid, signal.SIGTERM)
    report(
        "LEASE_LOST",
        f"{head}; sent SIGTERM to COMMAND's process group,"
        f" SIGKILL in {format_duration_ms(opts.grace_ms)}",
        key=opts.key,
        action="term",
    )
    return time.monotonic() + opts.grace_ms / 1000


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
