"""Who waits for a key, as ``status`` and ``list`` show it (docs/contract.md §12), on any backend.

``waiters`` stays the count; ``waiterList`` names up to
:data:`MAX_LISTED_WAITERS` of them in queue order (``position`` 1 is next),
never with a handle id: principal, pid and process (as the daemon saw them
when the request came), mode and limit asked for, ``since`` (the request's
arrival, RFC 3339) and ``waitingMs``. With the etcd backend a waiter also
carries ``node``, the host it waits on.

Both backends describe their queue as :class:`QueuedWaiter` values with
wall-clock arrival times, so one function makes the document. The same
module decides which entries a member may see in ``list``: those where the
member holds or waits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lockd.timefmt import format_epoch_ms

#: waiters listed per key by status and list (the count is always whole).
MAX_LISTED_WAITERS = 100


@dataclass(frozen=True, slots=True)
class QueuedWaiter:
    principal: str
    pid: int | None
    process: str | None
    mode: str
    limit: int
    #: wall-clock epoch milliseconds of the request's arrival; None when unknown
    #: (an etcd waiter record written by an older daemon).
    since_ms: int | None
    #: the host it waits on (etcd backend only).
    node: str | None = None


def waiter_list(waiters: Iterable[QueuedWaiter], now_ms: int) -> list[dict[str, Any]]:
    """The ``waiterList`` entries, in the order given (queue order)."""
    entries: list[dict[str, Any]] = []
    for position, waiter in enumerate(waiters, start=1):
        if position > MAX_LISTED_WAITERS:
            break
        since = waiter.since_ms
        entry: dict[str, Any] = {
            "principal": waiter.principal,
            "pid": waiter.pid,
            "process": waiter.process,
            "mode": waiter.mode,
            "limit": waiter.limit,
            "since": format_epoch_ms(since) if since is not None else None,
            "waitingMs": max(0, now_ms - since) if since is not None else None,
            "position": position,
        }
        if waiter.node is not None:
            entry["node"] = waiter.node
        entries.append(entry)
    return entries


def concerns(entry: dict[str, Any], principal: str) -> bool:
    """Does this ``status``/``list`` entry show ``principal`` holding or waiting?

    What a member's ``list`` keeps (docs/contract.md §12). Judged on the listed holders
    and waiters (up to 100 each).
    """
    holders = entry.get("holders") or ()
    if any(h.get("heldBy") == principal for h in holders) or entry.get("heldBy") == principal:
        return True
    return any(w.get("principal") == principal for w in entry.get("waiterList") or ())
