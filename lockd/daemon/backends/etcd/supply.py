"""What a grant or a wait writes to etcd: holds on leases ready for them, waiter records.

A grant costs one etcd transaction, not a lease grant too: leases of the
holds that ended are kept for the next grant of the same TTL
(:class:`~lockd.daemon.backends.etcd.leases.LeasePool`), and a lease is
granted ahead for a waiter's TTL so its hand-off skips the grant
(:meth:`HoldSupply.prepare_lease`). :class:`HoldSupply` makes the hold a
grant will write (a fresh handle, a lease and its true end), the puts of
it (with the binding of a ``releaseOnClose`` hold, on the session lease)
and the waiter records of blocking acquires (on the session lease, under
keys of this daemon). It is separate from the backend
(:mod:`lockd.daemon.backends.etcd.backend`) and the key queues
(:mod:`lockd.daemon.backends.etcd.waiting`) because both grant, and both
need exactly this and nothing else of each other.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import replace
from functools import partial

import trio

from lockd.daemon.backends.etcd.cleanup import CleanupList
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdGateway, EtcdUnavailable
from lockd.daemon.backends.etcd.leases import HEADROOM_S, KeptLease, LeasePool, Refresh
from lockd.daemon.backends.etcd.records import Hold, Layout, Waiter
from lockd.daemon.backends.etcd.sessionkeeper import SessionKeeper
from lockd.daemon.backends.etcd.tasks import logged
from lockd.daemon.backends.etcd.waiting import RETRY_INTERVAL
from lockd.daemon.backends.etcd.wire import Op, PutOp
from lockd.daemon.clock import Clock
from lockd.daemon.leases import new_handle_id
from lockd.logfmt import kv

log = logging.getLogger("lockd.etcd")


#: etcd 3.4 grants no lease shorter than this; asking less gets this much.
MIN_LEASE_TTL = 2


def lease_seconds(ttl_ms: int) -> int:
    """``ttlMs`` rounded up to whole seconds, at least etcd's minimum lease."""
    return max(MIN_LEASE_TTL, math.ceil(ttl_ms / 1000))


def kept_lease(hold: Hold) -> KeptLease:
    """The lease of a hold that ends, for the pool: it lives at least as its record says."""
    return KeptLease(hold.lease, hold.ttl_ms // 1000, max(hold.expires_at, hold.lease_end))


class HoldSupply:
    """Leases kept and granted ahead, the holds and waiter records made from them."""

    def __init__(
        self,
        etcd: EtcdGateway,
        clock: Clock,
        layout: Layout,
        node: str,
        sessions: SessionKeeper,
        cleanup: CleanupList,
    ) -> None:
        self._etcd = etcd
        self._clock = clock
        self._layout = layout
        self._node = node
        self._sessions = sessions
        self._cleanup = cleanup
        self.leases = LeasePool()
        #: TTLs with a lease being granted ahead.
        self.granting: set[int] = set()
        self._seq = itertools.count(1)
        #: keepalives under way for kept leases, by lease id: a grant that takes
        #: one of them waits for it rather than sending another.
        self._refreshing: dict[int, Refresh] = {}
        #: where lease refreshes and grants ahead run (the backend's, once it runs).
        self.nursery: trio.Nursery | None = None

    async def new_hold(
        self, template: Hold, ttl_s: int, *, reuse: bool = True
    ) -> tuple[Hold, Refresh | None]:
        """``template`` with a fresh handle and a lease of ``ttl_s``: a kept one, else a new one.

        A kept lease comes with the :class:`Refresh` running for it; pass
        both to :meth:`settle` once the hold is granted, or to
        :meth:`recycle` when it was not.
        """
        now_ms = self._clock.wall_ms()
        kept = self.leases.take(ttl_s, now_ms) if reuse else None
        if kept is not None:
            if kept.fresh(now_ms):
                refresh = Refresh.needless(kept)
            else:
                refresh = self._refreshing.get(kept.id) or self._start_refresh(kept)
            # Its true end, for when the hold gives it back.
            self.leases.note(kept.id, kept.alive_until)
            hold = replace(
                template,
                handle=template.handle or new_handle_id(),
                lease=kept.id,
                ttl_ms=ttl_s * 1000,
                # The TTL's end (a fresh lease lives at least that long); a
                # stale one's is raised by settle() once its keepalive answered.
                expires_at=min(kept.alive_until, now_ms + ttl_s * 1000),
                lease_end=kept.alive_until,
            )
            return hold, refresh
        sent = self._clock.wall_ms()
        grant = await self._etcd.lease_grant(ttl_s + HEADROOM_S)
        self.leases.note(grant.id, sent + grant.ttl * 1000)
        hold = replace(
            template,
            handle=template.handle or new_handle_id(),
            lease=grant.id,
            ttl_ms=ttl_s * 1000,
            expires_at=sent + ttl_s * 1000,
            lease_end=sent + grant.ttl * 1000,
        )
        return hold, None

    def _start_refresh(self, lease: KeptLease) -> Refresh:
        """A keepalive of ``lease``, in the background."""
        refresh = self._refreshing[lease.id] = Refresh(lease)
        assert self.nursery is not None
        self.nursery.start_soon(logged, "lease_refresh", partial(self._refresh, refresh))
        return refresh

    async def _refresh(self, refresh: Refresh) -> None:
        sent = self._clock.wall_ms()
        try:
            ttl = await self._etcd.lease_keepalive(refresh.lease.id)
            refresh.lease.alive_until = sent + ttl * 1000
            self.leases.note(refresh.lease.id, refresh.lease.alive_until)
        except (EtcdUnavailable, EtcdError):
            pass  # the grant's put fails on a lost lease; else the old bound stands
        finally:
            if self._refreshing.get(refresh.lease.id) is refresh:
                del self._refreshing[refresh.lease.id]
            refresh.done.set()

    async def settle(self, hold: Hold, refresh: Refresh | None) -> Hold:
        """A granted hold's expiry, once the keepalive of its reused lease answered."""
        if refresh is None:
            return hold
        # The lease lives HEADROOM_S past the TTL counted from its keepalive.
        alive_until = await refresh.wait()
        refreshed = alive_until - HEADROOM_S * 1000
        return replace(
            hold,
            expires_at=max(hold.expires_at, refreshed),
            lease_end=max(hold.lease_end, alive_until),
        )

    def recycle(self, hold: Hold, refresh: Refresh | None) -> None:
        """Keep the lease of a hold that was not granted, for the next grant."""
        self.keep_lease(refresh.lease if refresh is not None else kept_lease(hold))

    def prepare_lease(self, ttl_s: int) -> None:
        """Have a lease of ``ttl_s`` kept for a waiter's grant: its hand-off skips the grant."""
        if ttl_s in self.granting or self.leases.has(ttl_s, self._clock.wall_ms()):
            return
        self.granting.add(ttl_s)
        assert self.nursery is not None
        self.nursery.start_soon(logged, "lease_ahead", partial(self._grant_ahead, ttl_s))

    async def _grant_ahead(self, ttl_s: int) -> None:
        try:
            sent = self._clock.wall_ms()
            grant = await self._etcd.lease_grant(ttl_s + HEADROOM_S)
            self.keep_lease(KeptLease(grant.id, ttl_s, sent + grant.ttl * 1000))
        except (EtcdUnavailable, EtcdError) as exc:
            log.debug(kv(event="lease_ahead_failed", error=exc))  # the grant takes one then
        finally:
            self.granting.discard(ttl_s)

    def keep_lease(self, lease: KeptLease) -> None:
        """Keep the lease of a hold that ended (no key on it any more) for the next grant.

        One that comes back with less than half its headroom left beyond a
        full TTL is refreshed now, in the background (its keys are gone, so
        the keepalive lengthens no hold): the grant that takes it next,
        often a hand-off to another daemon's waiter, which must wait for a
        stale lease's keepalive before its transaction (granting.py), then
        finds it fresh. Leases rotate through the pool within milliseconds
        under steady use, so few go stale between their return and their
        next grant.
        """
        if not self.leases.keep(lease):
            self._cleanup.revoke_later(lease.id)
            return
        if (
            lease.ageing(self._clock.wall_ms())
            and lease.id not in self._refreshing
            and self.nursery is not None
        ):
            self._start_refresh(lease)

    async def hold_puts(self, hold: Hold) -> list[Op]:
        ops: list[Op] = [
            PutOp(self._layout.hold(hold.key, hold.handle), hold.value(), lease=hold.lease)
        ]
        if hold.bound:
            session = await self._sessions.wait()
            ops.append(
                PutOp(self._layout.binding(hold.key, hold.handle), self._node, lease=session)
            )
        return ops

    async def new_waiter_record(self, key: str, like: Waiter) -> Waiter:
        """A waiter record like ``like`` under a new key, on the current session lease."""
        session = await self._sessions.wait()
        etcd_key = self._layout.waiter(key, session, next(self._seq))
        return replace(like, etcd_key=etcd_key, create_revision=0, lease=session, node=self._node)

    async def next_waiter_record(self, key: str, like: Waiter) -> Waiter:
        """A new waiter record, once a session is there (the caller's deadline bounds it)."""
        while True:
            try:
                return await self.new_waiter_record(key, like)
            except EtcdUnavailable:
                await trio.sleep(RETRY_INTERVAL)
