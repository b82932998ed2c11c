"""Exit statuses of every ``lockd`` command (SPEC §9), in one place.

Kept free of click so ``lockd.runner`` (the logic of ``lockd run``) can use
them without the command-line layer.
"""

import json
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
#: A bug in lockd itself (sysexits' EX_SOFTWARE); never expected.
EXIT_BUG = 70
#: ``lockd run``: COMMAND found but not executable (as a shell says it).
EXIT_CANNOT_EXECUTE = 126
#: ``lockd run``: no such COMMAND (as a shell says it).
EXIT_NOT_FOUND = 127
#: Interrupted by Ctrl-C (the shell's convention: 128 + SIGINT).
EXIT_INTERRUPTED = 130


# -- the --json error line (SPEC §9) ---------------------------------------------------

#: Codes for failures the daemon has no wire code for, with their HTTP-like status.
KEY_BUSY = "KEY_BUSY"  # one attempt found the key held (409 Conflict)
DAEMON_UNAVAILABLE = "DAEMON_UNAVAILABLE"  # cannot reach the daemon (503)
USAGE = "USAGE"  # the command line, a local file or COMMAND is wrong (400)
LEASE_LOST = "LEASE_LOST"  # the hold is gone: renew/release refused, lost mid-run (410 Gone)

#: Status of every code a ``--json`` error line may carry: the wire codes (SPEC §3)
#: and the four CLI-side ones above.
ERROR_STATUS = {
    "INVALID_REQUEST": 400,
    "LOCK_ACCESS_DENIED": 403,
    "LOCK_TIMEOUT": 408,
    "RATE_LIMITED": 429,
    "CANCELLED": 499,
    "INTERNAL": 500,
    "SHUTTING_DOWN": 503,
    "STORAGE_UNAVAILABLE": 503,
    "BACKEND_UNAVAILABLE": 503,
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
    return json.dumps({"error": body}, ensure_ascii=False, separators=(",", ":"))
