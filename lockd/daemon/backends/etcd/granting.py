"""Deciding one key's queue and granting from it (docs/etcd-design.md §5, §5a).

:meth:`Granter.decide` applies ``queue.decide`` to what the queue's view
shows and grants those of *its own* waiters that the rules grant now, one
per transaction guarded by the revision it read (a failed guard hands back
the directory as it is now, and it decides again); waiters whose key
vanished are written again at the tail. :meth:`Granter.hand_off` is the
one-write hand-off: a release that grants the head of the queue, whichever
daemon's waiter it is, in the release's own transaction.

Nothing is granted from memory: a grant is a transaction over what was read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from lockd.daemon.backends.etcd import queue
from lockd.daemon.backends.etcd.gateway import EtcdError
from lockd.daemon.backends.etcd.leases import Refresh
from lockd.daemon.backends.etcd.queueview import LocalWaiter, QueueView
from lockd.daemon.backends.etcd.records import Directory, Hold, Waiter
from lockd.daemon.backends.etcd.wire import Compare, DeleteOp, Op, PutOp, RangeOp, TxnResult
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.cleanup import CleanupList
    from lockd.daemon.backends.etcd.departures import Departures
    from lockd.daemon.backends.etcd.gateway import EtcdGateway
    from lockd.daemon.backends.etcd.queuewatch import DirectoryWatch
    from lockd.daemon.backends.etcd.supply import HoldSupply

log = logging.getLogger("lockd.etcd")

#: a hand-off's transaction tried again at most this often when its guard
#: fails (each failure brings the directory as it is); then a plain release.
HAND_OFF_TRIES = 4


class Granter:
    """Grants from one key's queue: its own waiters as the rules let them go, and hand-offs.

    Given the parts it uses: the etcd client, the queue's view, its watch
    (reads, wake keys), its departures (the sweep), the clean-up list, the
    hold supply (leases, holds and waiter records to write) and ``track``
    (a grant's fence and binding for the backend's books).
    """

    def __init__(
        self,
        etcd: EtcdGateway,
        view: QueueView,
        watch: DirectoryWatch,
        departures: Departures,
        cleanup: CleanupList,
        supply: HoldSupply,
        track: Callable[[Hold], None],
    ) -> None:
        self.etcd = etcd
        self.view = view
        self.watch = watch
        self.departures = departures
        self.cleanup = cleanup
        self.supply = supply
        self.track = track

    async def decide(self) -> None:
        """Grant what the rules grant our waiters now; re-queue waiters that were lost."""
        view = self.view
        # Until this decision settles what our waiters wait for, any deletion
        # (one that arrives while it awaits etcd, too) decides again.
        view.wake_keys = None
        if view.records is None:
            view.learn(await self.watch.read())
        while view.waiters:
            # What the watch shows, as of its last event: a transaction
            # guarded by that revision commits only if it is still so.
            directory = view.directory()
            lost = [w for w in view.waiters.values() if directory.lost(w.record)]
            if lost:
                view.learn(await self._requeue(lost))
                continue
            decision = queue.decide(
                directory.hold_claims(view.layout), [w.claim for w in directory.waiters]
            )
            mine = [
                view.waiters[c.etcd_key] for c in decision.granted if c.etcd_key in view.waiters
            ]
            await self.departures.sweep(decision)
            if not mine:
                view.wake_keys = self.watch.wake_keys(decision)
                return
            # One grant per transaction: every grant draws a fence of its own
            # (its revision, docs/contract.md §10), shared waiters granted together
            # included. The next one is decided once the watch shows this one.
            result = await self._grant(directory, mine[:1], decision.replaces)
            if result is None:
                return
            view.learn(result)

    async def _grant(
        self, directory: Directory, mine: list[LocalWaiter], replaces: dict[bytes, bytes]
    ) -> Directory | None:
        """One guarded transaction granting ``mine``; None when it committed, else the new read.

        A grant that takes back a hold of its principal and owner
        (``replaces``) deletes that hold in the same transaction.
        A grant that failed in any way may still have committed: its holds
        are then found by the next read (or the watch) and delivered, or by
        a leaving waiter's withdrawal; nothing is cleaned up here.
        """
        view = self.view
        holds: list[Hold] = []
        refreshes: list[Refresh | None] = []
        ops: list[Op] = [DeleteOp(key) for key in directory.dead]
        retaken = self._retaken(directory, [w.record.etcd_key for w in mine], replaces)
        for replaced in retaken:
            ops += self._deletes_of(replaced)
        try:
            for waiter in mine:
                hold, refresh = await self.supply.new_hold(waiter.hold, waiter.ttl_s)
                holds.append(hold)
                refreshes.append(refresh)
                ops.append(DeleteOp(waiter.record.etcd_key))
                ops += await self.supply.hold_puts(hold)
            guard = Compare(
                view.directory_key, "mod_revision", "<", directory.revision + 1, prefix=True
            )
            result = await self.etcd.txn([guard], ops, [RangeOp(view.directory_key, prefix=True)])
        except BaseException:
            view.records = None  # read again: the read shows what committed
            raise
        if not result.succeeded:
            for hold, refresh in zip(holds, refreshes, strict=True):
                self.supply.recycle(hold, refresh)
            return view.directory_of(result)
        for replaced in retaken:
            self.cleanup.revoke_later(replaced.lease)
        settled = [
            await self.supply.settle(replace(hold, fence=result.header.revision), refresh)
            for hold, refresh in zip(holds, refreshes, strict=True)
        ]
        view.own_revision = result.header.revision
        for waiter, hold in zip(mine, settled, strict=True):
            view.granted(waiter, hold)
        self._prepare_leases()
        return None

    def _retaken(
        self, directory: Directory, granted: list[bytes], replaces: dict[bytes, bytes]
    ) -> list[Hold]:
        """The holds that the grants of ``granted`` (waiter keys) take back."""
        layout = self.view.layout
        by_key = {layout.hold(self.view.key, h.handle): h for h in directory.holds}
        return [by_key[replaces[w]] for w in granted if w in replaces]

    def _deletes_of(self, hold: Hold) -> list[Op]:
        """Delete a hold taken back, and its binding (the lease is revoked once committed)."""
        layout = self.view.layout
        return [
            DeleteOp(layout.hold(self.view.key, hold.handle)),
            DeleteOp(layout.binding(self.view.key, hold.handle)),
        ]

    def _prepare_leases(self) -> None:
        for waiter in self.view.waiters.values():  # the next hand-off's lease, ahead
            self.supply.prepare_lease(waiter.ttl_s)

    # --------------------------------------------------- the one-write hand-off

    async def hand_off(self, hold_key: bytes) -> TxnResult | None:
        """Release ``hold_key`` and grant the waiters its end lets go, in one transaction.

        Decided from what the watch shows (no read), for every daemon's
        waiters alike: ``queue.decide`` over the holds without this one
        grants the head of the queue, then each next head that fits. The
        transaction is guarded by the revision of that view for the holds
        (no hold created since) and by each granted waiter's own key (still
        queued, same create revision); a waiter queued after the view is
        behind every granted one, so it does not matter. A waiter of another
        daemon gets its binding on that daemon's session lease: a TTL hold
        is *tied* to it until that daemon has seen the grant, so a grant to
        a daemon that died ends with its session. The grants stop at the
        first waiter whose record does not name its hold (written by an
        older daemon, which grants it itself).

        Returns the committed transaction (its first two responses: the
        hold's and its binding's deletions), or None when there is nothing
        to grant or no view yet: then the caller releases plainly.
        """
        view = self.view
        layout = view.layout
        async with view.lock:
            for _ in range(HAND_OFF_TRIES):
                if not await self.watch.caught_up():
                    return None
                directory = view.directory()
                holds = [c for c in directory.hold_claims(layout) if c.etcd_key != hold_key]
                decision = queue.decide(holds, [w.claim for w in directory.waiters])
                by_key = {w.etcd_key: w for w in directory.waiters}
                heads: list[Waiter] = []
                # The head alone: every grant draws a fence of its own (its
                # revision, docs/contract.md §10), so the waiters granted beside it
                # (shared heads, free slots) are granted by their own daemons,
                # which the release wakes, each in a transaction of its own.
                for claim in decision.granted[:1]:
                    waiter = by_key[claim.etcd_key]
                    if not waiter.grantable or view.granted_in(waiter, hold_key):
                        break  # an older daemon's record; or granted already (a stale view)
                    heads.append(waiter)
                if not heads:
                    return None
                retaken = self._retaken(
                    directory, [head.etcd_key for head in heads], decision.replaces
                )
                result = await self._hand_off(directory, hold_key, heads, retaken)
                if result is None or result.succeeded:
                    return result
                view.learn(view.directory_of(result))
        return None

    async def _hand_off(
        self, directory: Directory, hold_key: bytes, heads: list[Waiter], retaken: list[Hold]
    ) -> TxnResult | None:
        """The hand-off's transaction; None when etcd refused it (nothing committed).

        ``retaken``: holds the grants take back (deleted in the same transaction).
        """
        view = self.view
        layout = view.layout
        binding_key = layout.binding(view.key, hold_key[len(layout.holds(view.key)) :].decode())
        # No hold *created* since the view: a rewrite (renew, untie, unbind)
        # keeps a hold's mode, limit and place, so it does not change who fits.
        holds = layout.holds(view.key)
        compares = [Compare(holds, "create_revision", "<", directory.revision + 1, prefix=True)]
        ops: list[Op] = [DeleteOp(hold_key, prev_kv=True), DeleteOp(binding_key, prev_kv=True)]
        ops += [DeleteOp(dead) for dead in directory.dead if dead != hold_key]
        for replaced in retaken:
            ops += self._deletes_of(replaced)
        granted: list[tuple[LocalWaiter | None, Hold, Refresh | None]] = []
        try:
            for head in heads:
                mine = view.waiters.get(head.etcd_key)
                template = mine.hold if mine is not None else head.hold(view.key)
                hold, refresh = await self.supply.new_hold(template, head.ttl_ms // 1000)
                granted.append((mine, hold, refresh))
                compares.append(
                    Compare(head.etcd_key, "create_revision", "==", head.create_revision)
                )
                ops.append(DeleteOp(head.etcd_key))
                if mine is not None:
                    ops += await self.supply.hold_puts(hold)
                    continue
                # Another daemon's waiter: its record must say the TTL's true
                # end, so a kept lease's keepalive answers first (no raft write).
                hold = await self.supply.settle(hold, refresh)
                granted[-1] = (None, hold, None)
                hold = replace(hold, tied=not hold.bound)
                ops += [
                    PutOp(layout.hold(view.key, hold.handle), hold.value(), lease=hold.lease),
                    PutOp(layout.binding(view.key, hold.handle), head.node, lease=head.lease),
                ]
            result = await self.etcd.txn(compares, ops, [RangeOp(view.directory_key, prefix=True)])
        except EtcdError as exc:
            # Refused, so not committed (a kept lease that ended under the
            # grant): the caller releases plainly, the waiters' daemons grant.
            # The leases are not kept (one of them is gone); they end alone.
            log.info(kv(event="hand_off_refused", key=view.key, error=exc))
            return None
        except BaseException:
            # Maybe committed: our waiters' holds are delivered by the next
            # read; another daemon's by its own watch. Leases are not reused.
            view.records = None
            view.changed.set()
            raise
        if not result.succeeded:
            for _mine, hold, refresh in granted:
                self.supply.recycle(hold, refresh)
            return result
        view.own_revision = result.header.revision
        for replaced in retaken:
            self.cleanup.revoke_later(replaced.lease)
        for mine, hold, refresh in granted:
            hold = replace(hold, fence=result.header.revision)
            self.track(hold)
            if mine is not None:
                view.granted(mine, await self.supply.settle(hold, refresh))
        self._prepare_leases()
        return result

    async def _requeue(self, lost: list[LocalWaiter]) -> Directory:
        """Write lost waiters again, at the tail (their session ended under them).

        Only while the hold each was to get does not exist: a waiter key is
        also gone when another daemon granted it, and then the read that a
        failed guard returns delivers the grant instead.
        """
        view = self.view
        ops: list[Op] = []
        compares: list[Compare] = []
        renewed: list[Waiter] = []
        for waiter in lost:
            record = await self.supply.new_waiter_record(view.key, waiter.record)
            renewed.append(record)
            compares.append(Compare(view.hold_key(waiter), "create_revision", "==", 0))
            # Deleting the old key too: a queue must never keep a waiter nobody serves.
            ops += [
                DeleteOp(waiter.record.etcd_key),
                PutOp(record.etcd_key, record.value(), lease=record.lease),
            ]
        read = RangeOp(view.directory_key, prefix=True)
        try:
            result = await self.etcd.txn(compares, [*ops, read], [read])
        except BaseException:
            for record in renewed:
                # Maybe written: deleted later (the old key is lost already).
                self.cleanup.delete_later(record.etcd_key)
            view.records = None  # read again: a hold granted meanwhile is delivered
            raise
        if result.succeeded:
            for waiter, record in zip(lost, renewed, strict=True):
                del view.waiters[waiter.record.etcd_key]
                waiter.record = replace(record, create_revision=result.header.revision)
                view.waiters[waiter.record.etcd_key] = waiter
                log.info(kv(event="waiter_requeued", key=view.key))
        return view.directory_of(result)
