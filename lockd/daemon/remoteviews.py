"""The wire documents of a remote backend's holds: a grant's handle, status and list entries.

As the embedded backend's (``replies.py``), plus what a remote backend
adds: ``node`` on each holder, and ``pid``/``process``/``alive`` only for
holds whose pids this daemon shares (docs/contract.md §12.2).
"""

from __future__ import annotations

from typing import Any

from lockd.contract import HOLDER_FIELDS as SHARED_HOLDER_FIELDS
from lockd.daemon.backends import RemoteHold, RemoteStatus
from lockd.daemon.clock import Clock
from lockd.daemon.holder import holder_fields
from lockd.daemon.waiterview import waiter_list
from lockd.timefmt import format_epoch_ms

#: holders listed per key by status and list (docs/contract.md §10).
MAX_LISTED_HOLDERS = 100
HOLDER_FIELDS = (*SHARED_HOLDER_FIELDS, "node")


class RemoteViews:
    """Renders holds and statuses of a remote backend as the protocol's documents."""

    def __init__(self, clock: Clock, node: str, pid_place: str | None) -> None:
        self.clock = clock
        #: this daemon's node name: a hold of another node has no pid we can look at.
        self.node = node
        #: where this daemon's pids mean something (``alive`` of its own holds).
        self._pid_place = pid_place

    def handle_view(self, hold: RemoteHold) -> dict[str, Any]:
        """The handle of a grant; ``ttlMs`` is the effective TTL (whole seconds)."""
        return {
            "key": hold.key,
            "handle": hold.handle,
            "fence": hold.fence,
            "owner": hold.owner,
            "ttlMs": hold.ttl_ms,
            "leaseExpiresAt": format_epoch_ms(hold.expires_at),
        }

    def holder_view(self, hold: RemoteHold, now: int) -> dict[str, Any]:
        return {
            "heldBy": hold.principal,
            "owner": hold.owner,
            "fence": hold.fence,
            "leaseExpiresAt": format_epoch_ms(hold.expires_at),
            "expiresInMs": max(0, hold.expires_at - now),
            **self._holder_process(hold),
            "node": hold.node,
        }

    def _holder_process(self, hold: RemoteHold) -> dict[str, Any]:
        """``pid``, ``process``, ``alive``: known for holds of this node whose pids we share.

        A hold granted through this daemon records its holder's start time
        and where its pid means something (boot and pid namespace); only a
        daemon of that node seeing the same pids can look (docs/contract.md
        §12.2). Holds of other nodes, and records without a start time
        (older daemons), say null.
        """
        start = getattr(hold, "pid_start", None)
        place = getattr(hold, "pid_place", None)
        mine = hold.node == self.node and place and place == self._pid_place
        return holder_fields(hold.pid, hold.process, start if mine else None)

    def status_view(self, st: RemoteStatus) -> dict[str, Any]:
        """docs/contract.md §3, §10, §11: as the embedded status, plus ``node`` on each holder."""
        now = self.clock.wall_ms()
        holders = [self.holder_view(hold, now) for hold in st.holds[:MAX_LISTED_HOLDERS]]
        first = st.holds[0] if st.holds else None
        return {
            "key": st.key,
            "held": bool(holders),
            **(holders[0] if holders else dict.fromkeys(HOLDER_FIELDS)),
            "waiters": st.waiters,
            "waiterList": waiter_list(st.queue, now),
            "mode": first.mode if first else None,
            "limit": first.limit if first else None,
            "holderCount": len(st.holds),
            "holders": holders,
        }
