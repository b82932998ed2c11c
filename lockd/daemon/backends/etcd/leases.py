"""Leases kept for reuse, so a grant costs one etcd transaction, not a lease grant too.

A hold needs a lease of its own (its TTL) before the transaction that puts
it. Granting one per acquire is one more raft write on the reply's path,
and revoking it at release one more in the background. Instead the backend
keeps the leases that releases free (and the ones a busy ``tryAcquire`` did
not use), per TTL, and hands one to the next grant of that TTL. The grant
refreshes it with a keepalive sent alongside its transaction (keepalives
are not raft writes on etcd 3.4), so the hold gets the full TTL from the
keepalive's sending on.

A parked waiter has a lease granted ahead for it (``prepare`` in the
backend), so its hand-off is one transaction too.

Each kept lease carries ``alive_until``: the earliest moment it can end
(epoch ms; the TTL counted from its last grant or keepalive *sent*). One
that would end within :data:`MARGIN_MS` is not handed out: the keepalive
must reach etcd before the lease ends, or the grant's put fails with
"lease not found" (then the caller takes a freshly granted lease).

A hold's lease is granted :data:`HEADROOM_S` longer than the TTL asked
(rounded up to whole seconds), so a lease refreshed a moment ago needs no
keepalive (:meth:`KeptLease.fresh`): while it still has a full TTL ahead of
it, the hold it carries lasts at least that TTL. Under steady use a lease
comes back within milliseconds of its last keepalive, and another one would
add a request to etcd (a fifth of the daemon's CPU per uncontended pair,
measured) and, in a hand-off, a wait before the grant's reply (its p90 was
5 ms) for nothing. The hold reports the TTL asked and its end
(``leaseExpiresAt``, never after the lease's true end); the lease may live
up to :data:`HEADROOM_S` longer, as etcd's own slack allows (it looks for
expired leases every 500 ms and extends them across a leader change). The
pool remembers each lease's true end while a hold uses it (:meth:`note`),
so a lease given back right after a grant counts as fresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

#: leases kept per TTL; more are revoked.
MAX_PER_TTL = 16
#: true ends remembered for leases in use (the oldest are forgotten).
MAX_NOTED = 16384
#: a lease kept must live at least this much longer to be handed out.
MARGIN_MS = 1000
#: a hold's etcd lease lives this much longer than the TTL it reports: a kept
#: lease refreshed less than this long ago is handed out without a keepalive.
HEADROOM_S = 1


@dataclass
class KeptLease:
    id: int
    ttl: int  # seconds, as asked by its holds (granted HEADROOM_S more)
    alive_until: int  # epoch ms, a lower bound of its end

    def fresh(self, now_ms: int) -> bool:
        """True when it still has a full TTL ahead (its last keepalive or grant was sent
        less than :data:`HEADROOM_S` ago), so a hold given it now needs no keepalive."""
        return self.alive_until - now_ms >= self.ttl * 1000

    def ageing(self, now_ms: int) -> bool:
        """True when it has less than half its headroom left beyond a full TTL: a
        keepalive now keeps it fresh for its next grant (``HoldSupply.keep_lease``)."""
        return self.alive_until - now_ms < self.ttl * 1000 + HEADROOM_S * 500


@dataclass(eq=False)
class Refresh:
    """A keepalive of a reused lease, running beside the grant's transaction."""

    lease: KeptLease
    done: trio.Event = field(default_factory=trio.Event)

    @classmethod
    def needless(cls, lease: KeptLease) -> Refresh:
        """The refresh of a fresh lease: done, without a keepalive."""
        refresh = cls(lease)
        refresh.done.set()
        return refresh

    async def wait(self) -> int:
        """The lease's new ``alive_until`` (unchanged when the keepalive failed).

        No checkpoint when it is done already (a fresh lease): a grant's
        reply must not wait for the other tasks of a busy daemon for nothing.
        """
        if not self.done.is_set():
            await self.done.wait()
        return self.lease.alive_until


class LeasePool:
    def __init__(self) -> None:
        self._kept: dict[int, list[KeptLease]] = {}
        # The true ends of leases that holds use (a hold's record has its
        # TTL's end, up to HEADROOM_S earlier, or an older bound when a
        # keepalive answered after the record was written).
        self._noted: dict[int, int] = {}

    def note(self, lease_id: int, alive_until: int) -> None:
        """Remember a lease's true end for when its hold gives it back."""
        self._noted[lease_id] = max(alive_until, self._noted.get(lease_id, 0))
        if len(self._noted) > MAX_NOTED:
            del self._noted[next(iter(self._noted))]

    def take(self, ttl: int, now_ms: int) -> KeptLease | None:
        """A kept lease of ``ttl`` seconds that lives long enough, newest first."""
        kept = self._kept.get(ttl)
        while kept:
            lease = kept.pop()
            if lease.alive_until - now_ms > MARGIN_MS:
                return lease
        return None  # the ones left behind end by themselves

    def keep(self, lease: KeptLease) -> bool:
        """Keep ``lease`` for a later grant; False when the pool is full (revoke it)."""
        lease.alive_until = max(lease.alive_until, self._noted.pop(lease.id, 0))
        kept = self._kept.setdefault(lease.ttl, [])
        if len(kept) >= MAX_PER_TTL:
            return False
        kept.append(lease)
        return True

    def has(self, ttl: int, now_ms: int) -> bool:
        """True when a lease of ``ttl`` seconds that lives long enough is kept."""
        return any(lease.alive_until - now_ms > MARGIN_MS for lease in self._kept.get(ttl, ()))

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())
