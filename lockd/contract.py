"""The numbers of the wire contract (docs/contract.md §3) that every lockd program shares.

The daemon's parser (:mod:`lockd.daemon.protocol`) enforces these limits; the
commands (:mod:`lockd.cli`, ``lockd run``) check options against the same
ones, so a bad value is a usage error naming the option instead of a refusal
from the daemon; the ``--json`` error line of the commands uses the same
status for each wire error code. Shared at the top so that none of them has
to import another program's package.

``lockd_client`` keeps its own copy of the limits (it is a separate,
standard-library-only distribution): ``tests/live/test_contract.py`` fails if the
two ever differ.
"""

from __future__ import annotations

#: Longest lease (``ttlMs``) and longest wait (``timeoutMs``): 24 h. More is
#: refused, never cut.
MAX_TTL_MS = 86_400_000
MAX_TIMEOUT_MS = 86_400_000
#: A command's ``--wait forever`` (docs/contract.md §12: a blocking acquire without
#: limit); never sent: the client sends MAX_TIMEOUT_MS and parks again.
WAIT_FOREVER = -1
#: Keys are 1-1024 bytes of UTF-8 without control characters.
MAX_KEY_BYTES = 1024
MAX_OWNER_CHARS = 256
MAX_REASON_CHARS = 1024
MAX_HANDLE_CHARS = 256
#: The longest ``list`` page.
MAX_LIST_LIMIT = 10_000

#: Every error code the daemon answers with, and its HTTP-like status.
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
    "DEADLOCK": 409,
}

#: the fields of one holder entry in status and list (docs/contract.md §10,
#: §12.2); a key's singular fields repeat its oldest holder's.
HOLDER_FIELDS = (
    "heldBy",
    "owner",
    "fence",
    "leaseExpiresAt",
    "expiresInMs",
    "pid",
    "process",
    "alive",
)
