"""The documents the embedded backend answers with, and the errors every backend shares.

The engine keeps deadlines on the boot clock (:mod:`lockd.daemon.clock`);
a reply shows them on the wall clock, in RFC 3339 (docs/contract.md §3).
:class:`Replies` turns the engine's leases and key statuses into the wire
documents of ``acquire``, ``status`` and ``list``; the remote path builds
its own from a remote backend's holds (:mod:`lockd.daemon.remote`). The
refusals both paths raise (timed out, storage unavailable, shutting down,
deadlock) and the ``break`` answer are here too, once. It is separate from
the service (:mod:`lockd.daemon.service`) because a reply's shape changes
for other reasons than a request's decisions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from lockd.contract import HOLDER_FIELDS
from lockd.daemon.clock import Clock
from lockd.daemon.holder import holder_fields
from lockd.daemon.leases import KeyStatus, Lease
from lockd.daemon.protocol import Acquire, ProtocolError, RequestId
from lockd.daemon.stats import StatsRecorder
from lockd.daemon.waiterview import QueuedWaiter, concerns, waiter_list
from lockd.identity import Caller
from lockd.logfmt import kv
from lockd.rules.policy import PASS_ROLES
from lockd.timefmt import format_epoch_ms

# The service's logger: these lines were logged there before this module
# was split out of it, and log filters may name it.
log = logging.getLogger("lockd.daemon.service")


class BrokenHold(Protocol):
    """What a break reports of a hold it ended (an engine lease or a remote hold)."""

    @property
    def principal(self) -> str: ...
    @property
    def owner(self) -> str | None: ...
    @property
    def fence(self) -> int: ...


def timed_out(req: Acquire) -> ProtocolError:
    return ProtocolError(
        "LOCK_TIMEOUT",
        f"key {req.key!r} was not granted within {req.timeout_ms} ms",
        details={"key": req.key, "timeoutMs": req.timeout_ms},
    )


def storage_unavailable(request_id: RequestId | None = None) -> ProtocolError:
    return ProtocolError(
        "STORAGE_UNAVAILABLE",
        "the lock database cannot be written (disk full or I/O error); "
        "nothing of the request took effect, retry later",
        request_id=request_id,
    )


def shutting_down() -> ProtocolError:
    return ProtocolError("SHUTTING_DOWN", "lockd is stopping")


def deadlock(caller: Caller, conn: int, req: Acquire, cycle: list[str]) -> ProtocolError:
    """DEADLOCK for the acquire that would close ``cycle`` (docs/contract.md §12), logged."""
    log.warning(
        kv(
            event="deadlock",
            key=req.key,
            principal=caller.principal,
            conn=conn,
            cycle=" -> ".join([*cycle, cycle[0]]),
        )
    )
    path = " -> ".join(repr(key) for key in [*cycle, cycle[0]])
    return ProtocolError(
        "DEADLOCK",
        f"waiting for {req.key!r} would close a cycle of waits: {path}",
        details={"cycle": cycle},
    )


def visible_locks(caller: Caller, entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """What ``list`` shows ``caller`` (docs/contract.md §12): everything to owners, admins and
    services; to a member only the keys it holds or waits for (a page may then
    hold fewer entries than ``limit``; ``next`` still goes on)."""
    if caller.role in PASS_ROLES:
        return list(entries)
    return [entry for entry in entries if concerns(entry, caller.principal)]


def break_result(
    stats: StatsRecorder, caller: Caller, key: str, reason: str, broken: Sequence[BrokenHold]
) -> dict[str, Any]:
    """Log, count and answer a break that ended ``broken`` (oldest first), any backend."""
    if not broken:
        log.info(kv(event="break_free_key", key=key, by=caller.principal, reason=reason))
        return {"broken": False}
    stats.count("breaks")
    oldest = broken[0]
    log.warning(
        kv(
            event="broken",
            key=key,
            by=caller.principal,
            holder=oldest.principal,
            fence=oldest.fence,
            holders=len(broken),
            reason=reason,
        )
    )
    return {
        "broken": True,
        "holders": len(broken),
        "heldBy": oldest.principal,
        "owner": oldest.owner,
        "fence": oldest.fence,
    }


class Replies:
    """The engine's leases and statuses as wire documents, on the wall clock."""

    __slots__ = ("clock",)

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def wall(self, boot_deadline: int, boot_now: int | None = None) -> str:
        """A boot-clock deadline as the wall-clock time it falls on.

        ``boot_now``: the boot clock as the caller just read it (spares a read).
        """
        clock = self.clock
        if boot_now is None:
            boot_now = clock.boot_ms()
        return format_epoch_ms(clock.wall_ms() + boot_deadline - boot_now)

    def lease_view(self, lease: Lease, boot_now: int | None = None) -> dict[str, Any]:
        return {
            "key": lease.key,
            "handle": lease.handle,
            "fence": lease.fence,
            "owner": lease.owner,
            "ttlMs": lease.ttl_ms,
            "leaseExpiresAt": self.wall(lease.expires_at, boot_now),
        }

    def holder_view(self, lease: Lease) -> dict[str, Any]:
        """One holder as status shows it: never its handle id."""
        return {
            "heldBy": lease.principal,
            "owner": lease.owner,
            "fence": lease.fence,
            "leaseExpiresAt": self.wall(lease.expires_at),
            "expiresInMs": max(0, lease.expires_at - self.clock.boot_ms()),
            **holder_fields(lease.pid, lease.process, lease.pid_start),
        }

    def status_view(self, st: KeyStatus) -> dict[str, Any]:
        """docs/contract.md §3 and §10: the singular fields describe the oldest grant."""
        holders = [self.holder_view(lease) for lease in st.holders]
        oldest = holders[0] if holders else dict.fromkeys(HOLDER_FIELDS)
        return {
            "key": st.key,
            "held": bool(holders),
            **oldest,
            "waiters": st.waiters,
            "waiterList": self.waiter_list_view(st),
            "mode": st.mode,
            "limit": st.limit,
            "holderCount": st.holder_count,
            "holders": holders,
        }

    def waiter_list_view(self, st: KeyStatus) -> list[dict[str, Any]]:
        """docs/contract.md §12 ``waiterList``: the engine's queue on the wall clock."""
        wall, boot = self.clock.wall_ms(), self.clock.boot_ms()
        queued = (
            QueuedWaiter(w.principal, w.pid, w.process, w.mode, w.limit, wall + w.since - boot)
            for w in st.queue
            if not w.resolved
        )
        return waiter_list(queued, wall)
