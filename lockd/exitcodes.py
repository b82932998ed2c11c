"""Exit statuses of every ``lockd`` command (docs/contract.md §9), in one place.

The numbers, what they mean (:data:`EXIT_CODE_MEANINGS`: ``lockd --help``,
``lockd run --help`` and README's table all say this), which client error
exits with which (:func:`exit_code_for`: every command and ``lockd run``),
and the ``--json`` error line. Kept free of click so ``lockd.run`` (the logic
of ``lockd run``) can use them without the command-line layer.
"""

from __future__ import annotations

from lockd_client import (
    DeadlockError,
    InvalidRequestError,
    LockAccessDeniedError,
    LockdError,
    LockLostError,
    LockTimeoutError,
    RateLimitedError,
)

from lockd import contract

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

EXIT_OK = 0
#: The key is busy (one attempt found it held) or ``--wait`` ran out;
#: ``lockd run --conflict-exit-code N`` replaces it.
EXIT_BUSY = 1
#: Bad command line (click's own code) or ``INVALID_REQUEST`` from the daemon.
EXIT_USAGE = 2
EXIT_DENIED = 3
EXIT_RATE_LIMITED = 4
#: Daemon unreachable, stopping (``SHUTTING_DOWN``) or failing (``INTERNAL``).
EXIT_UNAVAILABLE = 5
#: Lease lost or not the holder (renew/release with a stale handle).
EXIT_LOST = 6
#: A blocking acquire refused because it would close a cycle of waits (docs/contract.md §12).
EXIT_DEADLOCK = 7
#: A bug in lockd itself (sysexits' EX_SOFTWARE); never expected.
EXIT_BUG = 70
#: ``lockd run``: COMMAND found but not executable (as a shell says it).
EXIT_CANNOT_EXECUTE = 126
#: ``lockd run``: no such COMMAND (as a shell says it).
EXIT_NOT_FOUND = 127
#: Interrupted by Ctrl-C (the shell's convention: 128 + SIGINT).
EXIT_INTERRUPTED = 130
#: Whoever read stdout went away (``lockd locks list | head -1``): what a shell
#: reports for a tool that SIGPIPE ended (128 + SIGPIPE), and nothing printed.
EXIT_PIPE_CLOSED = 141

#: What the statuses every command shares mean, for help texts and README
#: (``tests/test_exitcodes.py`` holds README's table to this).
EXIT_CODE_MEANINGS: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "done"),
    (EXIT_BUSY, "key busy, or the wait timed out"),
    (EXIT_USAGE, "usage error (also a request the daemon refused as invalid)"),
    (EXIT_DENIED, "access denied (also: this user may not open the socket)"),
    (EXIT_RATE_LIMITED, "rate limited"),
    (EXIT_UNAVAILABLE, "daemon unreachable, shutting down, or failing (internal error)"),
    (EXIT_LOST, "lease lost, or not the holder"),
    (EXIT_DEADLOCK, "deadlock: the wait would close a cycle of waits"),
)


#: The same, looked up by status.
MEANING = dict(EXIT_CODE_MEANINGS)


def exit_codes_help(rows: Sequence[tuple[int | str, str]] = EXIT_CODE_MEANINGS) -> str:
    """An ``Exit codes:`` block for a click epilog (``\\b`` keeps its lines)."""
    width = max(len(str(code)) for code, _ in rows)
    lines = "".join(f"  {str(code).ljust(width)}  {meaning}\n" for code, meaning in rows)
    return f"\b\nExit codes:\n{lines}"


def exit_code_for(exc: LockdError) -> int:
    """The exit status for a client error (docs/contract.md §9, plus the decisions below).

    ``SHUTTING_DOWN`` and ``INTERNAL`` exit 5 like an unreachable daemon: in
    all three the daemon cannot serve the request now and a script should
    retry later or alert, never treat the key as busy (1) or itself as
    wrong (2). Client-side protocol errors (a garbled reply) are the same.
    A socket this user may not open is access denied (3).
    """
    if isinstance(exc, LockTimeoutError):
        return EXIT_BUSY
    if isinstance(exc, InvalidRequestError):
        return EXIT_USAGE
    if isinstance(exc, LockAccessDeniedError):  # SocketPermissionError too
        return EXIT_DENIED
    if isinstance(exc, RateLimitedError):
        return EXIT_RATE_LIMITED
    if isinstance(exc, LockLostError):
        return EXIT_LOST
    if isinstance(exc, DeadlockError):
        return EXIT_DEADLOCK
    return EXIT_UNAVAILABLE


# -- the --json error line (docs/contract.md §9) ---------------------------------------------------

#: Codes for failures the daemon has no wire code for, with their HTTP-like status.
KEY_BUSY = "KEY_BUSY"  # one attempt found the key held (409 Conflict)
DAEMON_UNAVAILABLE = "DAEMON_UNAVAILABLE"  # cannot reach the daemon (503)
USAGE = "USAGE"  # the command line, a local file or COMMAND is wrong (400)
LEASE_LOST = "LEASE_LOST"  # the hold is gone: renew/release refused, lost mid-run (410 Gone)

#: Status of every code a ``--json`` error line may carry: the wire codes (docs/contract.md §3)
#: and the four CLI-side ones above.
ERROR_STATUS = {
    **contract.ERROR_STATUS,
    KEY_BUSY: 409,
    DAEMON_UNAVAILABLE: 503,
    USAGE: 400,
    LEASE_LOST: 410,
}


def error_document(code: str, message: str, details: dict[str, Any] | None = None) -> str:
    """The one stderr line of a ``--json`` failure: ``{"error": {code, status, message, details}}``.

    A code outside :data:`ERROR_STATUS` (a client-side one such as a garbled
    reply) is reported as ``INTERNAL``: scripts see only documented codes.
    """
    if code not in ERROR_STATUS:
        details = {**(details or {}), "clientCode": code}
        code = "INTERNAL"
    body = {
        "code": code,
        "status": ERROR_STATUS[code],
        "message": message,
        "details": details or {},
    }
    import json  # here: only a failure under --json writes it (start-up, issue 24)

    return json.dumps({"error": body}, ensure_ascii=False, separators=(",", ":"))
