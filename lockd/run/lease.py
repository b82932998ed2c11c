"""The lease side of ``lockd run``: taking the key (SPEC §9).

The key is taken once (``tryAcquire``) or waited for (``acquire``), always
with ``releaseOnClose`` so that a ``lockd run`` killed outright frees the key
at once: the kernel closes its connection and the daemon releases. Keeping
it is the client's :class:`lockd_client.AutoRenewer` (the one ``lock()``
uses), driven by :mod:`lockd.run.supervisor`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from lockd_client import (
    DaemonUnavailableError,
    Handle,
    InvalidRequestError,
    LockAccessDeniedError,
    LockClient,
    LockdError,
    LockTimeoutError,
    RateLimitedError,
    ShuttingDownError,
)

from lockd.contract import WAIT_FOREVER
from lockd.describe import who_holds
from lockd.exitcodes import EXIT_INTERRUPTED, EXIT_USAGE, exit_code_for
from lockd.run.options import Reporter, RunOptions
from lockd.timefmt import format_duration_ms
from lockd.waitline import WaitLine

__all__ = ["Grant", "take_lease"]

#: Time allowed for the "who holds it" lookup after a busy key or a timed-out wait.
_STATUS_TIMEOUT = 2.0


# -- taking the key -----------------------------------------------------------


@dataclass
class Grant:
    """A granted lease and our conservative estimate of its end (monotonic clock)."""

    handle: Handle
    expires_at: float


def take_lease(client: LockClient, opts: RunOptions, report: Reporter) -> Grant | int:
    """Take the key as ``opts`` asks; return the Grant, or the exit code when we did not get it.

    The lease's end is estimated on the monotonic clock so that a wall-clock
    step cannot fool the renewer: for one attempt, from the moment the request
    was sent (the grant came later, so the real end is later); after a wait,
    the grant moment is unknown, so the daemon's ``leaseExpiresAt`` is read
    against our wall clock (same host, same clock) and capped at the TTL.
    """
    ttl = opts.ttl_ms / 1000
    sent = time.monotonic()
    try:
        if opts.wait_ms is None:
            handle = client.try_acquire(
                opts.key,
                ttl,
                owner=opts.owner,
                release_on_close=True,
                shared=opts.shared,
                limit=opts.limit,
            )
        else:
            # On a terminal, one live line while waiting (lockd.waitline).
            live = not (opts.quiet or report.json_lines)
            with WaitLine(opts.key, opts.socket_path) if live else contextlib.nullcontext():
                handle = client.acquire(
                    opts.key,
                    ttl,
                    None if opts.wait_ms == WAIT_FOREVER else opts.wait_ms / 1000,
                    owner=opts.owner,
                    release_on_close=True,
                    shared=opts.shared,
                    limit=opts.limit,
                )
    except LockTimeoutError:
        wait = format_duration_ms(opts.wait_ms or 0)
        if not opts.quiet:
            hint = _holder_hint(client, opts.key)
            report(
                "LOCK_TIMEOUT",
                f"timed out after {wait} waiting for key {opts.key!r}{hint}; COMMAND not run",
                key=opts.key,
            )
        return opts.conflict_exit_code
    except KeyboardInterrupt:
        report("INTERRUPTED", f"interrupted while waiting for key {opts.key!r}", key=opts.key)
        return EXIT_INTERRUPTED
    except LockdError as exc:
        return _report_error(report, exc, opts.key)
    except ValueError as exc:  # the client's own checks: key, owner, ttl out of range
        report("INVALID_REQUEST", f"invalid request: {exc}", key=opts.key)
        return EXIT_USAGE
    if handle is None:
        if not opts.quiet:
            hint = _holder_hint(client, opts.key)
            report("KEY_BUSY", f"key {opts.key!r} is busy{hint}; COMMAND not run", key=opts.key)
        return opts.conflict_exit_code
    received = time.monotonic()
    if opts.wait_ms is None:
        expires_at = sent + ttl
    else:
        left = ttl
        if handle.lease_expires_at is not None:
            left = min(ttl, handle.lease_expires_at.timestamp() - time.time())
        expires_at = received + left
    return Grant(handle, expires_at)


def _report_error(report: Reporter, exc: LockdError, key: str) -> int:
    """Say a daemon/client error in one line; its exit code is every command's (SPEC §9)."""
    if isinstance(exc, LockAccessDeniedError):
        report(exc.code, f"access denied for key {key!r}: {exc.message}", key=key)
    elif isinstance(exc, RateLimitedError):
        after = "" if exc.retry_after is None else f"; retry in {exc.retry_after:g}s"
        report(exc.code, f"rate limited: {exc.message}{after}", key=key)
    elif isinstance(exc, InvalidRequestError):
        report(exc.code, f"invalid request: {exc.message}", key=key)
    elif isinstance(exc, DaemonUnavailableError):
        report(exc.code, exc.message, socket=exc.socket_path)
    elif isinstance(exc, ShuttingDownError):
        report(exc.code, f"the daemon is shutting down: {exc.message}", key=key)
    else:  # INTERNAL, PROTOCOL_ERROR, ...: the daemon could not serve us.
        report(exc.code, f"daemon error: {exc.message}", key=key)
    return exit_code_for(exc)


def _holder_hint(client: LockClient, key: str) -> str:
    """`` (held by user:alice (owner run-1, pid 4242 backup.sh))`` for the busy message.

    Every holder of a shared key or a full semaphore is named (up to three);
    empty if unknown.
    """
    client.request_timeout = _STATUS_TIMEOUT
    try:
        status = client.status(key)
    except LockdError:
        return ""
    return f" (held by {who_holds(status)})" if status.held else ""
