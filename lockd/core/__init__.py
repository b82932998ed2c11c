"""The lock's decisions, pure: no I/O, no clock of its own, no state kept.

Every backend asks these functions who may hold a key; none of them keeps a
copy of the rules (docs/architecture.md, "The decision core"):

- :mod:`lockd.core.admission`: a request against a key's holders and queue
  -- refused, a re-take, granted now, parked, or busy (docs/contract.md §1, §10);
- :mod:`lockd.core.queue`: after holders or waiters leave, which waiters
  the key is handed to, head first, without overtaking;
- :mod:`lockd.core.deadlock`: would a parking acquire close a cycle of
  waits between connections (docs/contract.md §12; the engine asks it).

The embedded engine (``lockd.daemon.engine``) applies them to its
in-memory state; the etcd backend applies them to the records it read, and
commits the outcome in a transaction guarded by that read. The test
``tests/etcd/test_differential.py`` runs one sequence of operations through both
and through a model written in the test, and compares what they answer.
"""

from lockd.core.admission import (
    BUSY,
    EXCLUSIVE,
    GRANT,
    MAX_LIMIT,
    MODES,
    PARK,
    RETAKE,
    SHARED,
    Held,
    Refused,
    Verdict,
    admit,
    admit_free,
    fits,
    is_retake,
    refusal,
)
from lockd.core.queue import Queued, woken

__all__ = [
    "BUSY",
    "EXCLUSIVE",
    "GRANT",
    "MAX_LIMIT",
    "MODES",
    "PARK",
    "RETAKE",
    "SHARED",
    "Held",
    "Queued",
    "Refused",
    "Verdict",
    "admit",
    "admit_free",
    "fits",
    "is_retake",
    "refusal",
    "woken",
]
