"""How the CLI and ``lockd run`` name who holds a key, in one line or a table
(docs/contract.md §9, §10): principal, owner, process id and name, as lslocks does for
flock; every holder of a shared key or semaphore. No click here: ``lockd
run`` uses it too.
"""

from __future__ import annotations

from lockd_client import Holder, LockStatus, Waiter

from lockd.textsafe import visible
from lockd.timefmt import format_duration_ms

__all__ = [
    "HOLDER_COLUMNS",
    "WAITER_COLUMNS",
    "holder_cells",
    "mode_text",
    "pid_cell",
    "waiter_cells",
    "who_holds",
]

#: The columns of one holder in ``locks list`` and ``locks status``.
HOLDER_COLUMNS = ("HELD BY", "OWNER", "PID", "PROCESS", "FENCE")

#: The columns of one waiter in ``locks status`` and ``locks top`` (queue order).
WAITER_COLUMNS = ("POS", "WAITER", "PID", "PROCESS", "MODE", "WAITING")


def mode_text(status: LockStatus) -> str | None:
    """``exclusive``, ``shared`` or ``N slots`` (a semaphore); None when free."""
    if not status.held:
        return None
    if status.limit is not None and status.limit > 1:
        return f"{status.limit} slots"
    return status.mode or "exclusive"


def _one(holder: Holder) -> str:
    """``user:alice (owner run-7, pid 1234 python3)``."""
    extra = []
    if holder.owner:
        extra.append(f"owner {visible(holder.owner)}")
    if holder.pid is not None:
        process = f" {visible(holder.process)}" if holder.process else ""
        extra.append(f"pid {pid_cell(holder)}{process}")
    if holder.node:
        extra.append(f"node {visible(holder.node)}")
    name = visible(holder.held_by or "?")
    return f"{name} ({', '.join(extra)})" if extra else name


def who_holds(status: LockStatus, most: int = 3) -> str:
    """Every holder in one phrase, the oldest first; at most ``most`` named."""
    holders = status.holders
    if not holders:
        return visible(status.held_by or "?")
    named = ", ".join(_one(h) for h in holders[:most])
    count = max(status.holder_count, len(holders))
    more = f" and {count - most} more" if count > most else ""
    if count == 1:
        return named
    return f"{count} holders ({mode_text(status)}): {named}{more}"


def holder_cells(holder: Holder) -> tuple[object, ...]:
    """One holder's cells under :data:`HOLDER_COLUMNS`."""
    return (holder.held_by, holder.owner, pid_cell(holder), holder.process, holder.fence)


def waiter_cells(waiter: Waiter) -> tuple[object, ...]:
    """One waiter's cells under :data:`WAITER_COLUMNS`; a semaphore waiter wants one slot."""
    if waiter.limit is not None and waiter.limit > 1:
        mode = f"1 of {waiter.limit} slots"
    else:
        mode = waiter.mode or "exclusive"
    waiting = format_duration_ms(waiter.waiting_ms) if waiter.waiting_ms is not None else None
    return (waiter.position, waiter.principal, waiter.pid, waiter.process, mode, waiting)


def pid_cell(entry: Holder | LockStatus) -> object:
    """The PID cell: ``4242``, or ``4242 (gone)`` once the daemon sees it has exited.

    ``alive`` (docs/contract.md §12.2) is read from the daemon's JSON: null (cannot know)
    shows the bare pid.
    """
    if entry.pid is not None and entry.raw.get("alive") is False:
        return f"{entry.pid} (gone)"
    return entry.pid
