"""The lease side of ``lockd run``: taking the key and keeping it (docs/contract.md §9, §12).

The key is taken once (``tryAcquire``) or waited for (``acquire``), always
with ``releaseOnClose`` so that a ``lockd run`` killed outright frees the key
at once: the kernel closes its connection and the daemon releases. The
connection asks for lease-loss events first, so the daemon tells it the
moment the hold is broken, re-taken or runs out.

Keeping it is :class:`LeaseKeeper`, driven by :mod:`lockd.run.supervisor`:
the client's :class:`lockd_client.AutoRenewer` (the one ``lock()`` uses),
renewing on a connection of its own and listening for the loss on the
grant's. Its ``on_lost`` is called the moment the loss is known, with the
daemon's words in ``lost_reason`` (``broken by user:root: disk swap``).
Once the supervisor has acted on the loss -- COMMAND and everything it
started are gone -- it calls :meth:`LeaseKeeper.work_stopped`: after a
break, that tells the daemon (``stopped``) that it may hand the key on now
instead of after ``break_grace``.
"""

from __future__ import annotations

import time

from lockd_client import (
    AutoRenewer,
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
from lockd.exitcodes import EXIT_INTERRUPTED, EXIT_USAGE, exit_code_for
from lockd.run.options import Reporter, RunOptions
from lockd.timefmt import format_duration_ms

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Grant", "LeaseKeeper", "take_lease"]


#: Time allowed for the "who holds it" lookup after a busy key or a timed-out wait.
_STATUS_TIMEOUT = 2.0
#: Time allowed for telling the daemon the work stopped after a break.
_STOPPED_TIMEOUT = 2.0


# -- taking the key -----------------------------------------------------------


class Grant:
    """A granted lease and our conservative estimate of its end (monotonic clock)."""

    __slots__ = ("expires_at", "handle")

    def __init__(self, handle: Handle, expires_at: float) -> None:
        self.handle = handle
        self.expires_at = expires_at


def take_lease(client: LockClient, opts: RunOptions, report: Reporter) -> Grant | int:
    """Take the key as ``opts`` asks; return the Grant, or the exit code when we did not get it.

    The lease's end is estimated on the monotonic clock so that a wall-clock
    step cannot fool the renewer: for one attempt, from the moment the request
    was sent (the grant came later, so the real end is later); after a wait,
    the grant moment is unknown, so the daemon's ``leaseExpiresAt`` is read
    against our wall clock (same host, same clock) and capped at the TTL.
    """
    ttl = opts.ttl_ms / 1000
    # Before the grant: the hold must be taken on a connection that hears its loss.
    client.listen_for_losses()
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
                pid=opts.holder_pid,
            )
        else:
            timeout = None if opts.wait_ms == WAIT_FOREVER else opts.wait_ms / 1000

            def wait_for_key() -> Handle:
                return client.acquire(
                    opts.key,
                    ttl,
                    timeout,
                    owner=opts.owner,
                    release_on_close=True,
                    shared=opts.shared,
                    limit=opts.limit,
                    pid=opts.holder_pid,
                )

            if opts.quiet or report.json_lines:
                handle = wait_for_key()
            else:
                # On a terminal, one live line while waiting. Imported here:
                # it runs a thread (threading), a cost a run that does not
                # wait need not pay at start (issue 24).
                from lockd.waitline import WaitLine

                with WaitLine(opts.key, opts.socket_path):
                    handle = wait_for_key()
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


# -- keeping it ----------------------------------------------------------------


class LeaseKeeper(AutoRenewer):
    """Renews a ``lockd run`` lease and hears its loss the moment the daemon tells.

    ``client`` is the client that took the grant (listening for losses, see
    :func:`take_lease`); renewals go over a connection of the keeper's own,
    so a renewal never queues behind anything else. ``on_lost()`` is called
    once, from the keeper's thread, when the lease is lost: the daemon said
    so (``loss`` has its cause, ``lost_reason`` its words), a renewal was
    refused, or renewals kept failing until the lease was about to run out.

    The supervisor's side of the contract:

    * ``start()`` once COMMAND runs; ``stop()`` when it is over (always);
    * on ``on_lost``: act on the loss (``--on-lost``), reading ``lost_reason``;
    * ``work_stopped()`` once every process of COMMAND is gone: after a break
      the daemon then hands the key on at once. Harmless for other causes
      and when called twice; never raises (the connection closing when
      ``lockd run`` exits tells the daemon the same, only later).
    """

    def __init__(
        self, client: LockClient, grant: Grant, ttl_ms: int, on_lost: Callable[[], object]
    ) -> None:
        self._grant_client = client
        self._renew_client = LockClient(client.socket_path)
        self._told_stopped = False
        self._held = grant.handle
        super().__init__(
            self._renew_client,
            grant.handle,
            ttl_ms,
            lambda _handle: on_lost(),
            expires_at=grant.expires_at,
            events_from=client,
        )

    def stop(self) -> None:
        super().stop()
        self._renew_client.close()

    def work_stopped(self) -> None:
        """Tell the daemon the broken hold's work has stopped (after a break only)."""
        if self.lost_cause != "break" or self._told_stopped:
            return
        self._told_stopped = True
        client = self._grant_client
        client.request_timeout = _STOPPED_TIMEOUT
        try:
            client.stopped(self._held)
        except LockdError as exc:  # the close at exit says it too
            import logging  # here: lockd run does not load logging otherwise

            logging.getLogger("lockd.run").debug(
                "telling the daemon the work stopped failed: %s", exc
            )


def _report_error(report: Reporter, exc: LockdError, key: str) -> int:
    """Say a daemon/client error in one line; its exit code is every command's
    (docs/contract.md §9)."""
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
    from lockd.describe import who_holds  # here: only a busy key is described (start-up)

    client.request_timeout = _STATUS_TIMEOUT
    try:
        status = client.status(key)
    except LockdError:
        return ""
    return f" (held by {who_holds(status)})" if status.held else ""
