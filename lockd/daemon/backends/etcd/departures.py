"""Waiter keys that leave one key's queue: ours withdrawn, others' that nobody serves.

A waiter of ours that leaves (timeout, cancel, connection gone) deletes its
key and reads the hold it was to get in one transaction, so a grant that
crossed the leave is found, never left behind (:meth:`Departures.leave`).
A waiter of any daemon that the rules grant now and that stays ungranted
for :data:`UNSERVED_AFTER` is removed by any daemon with a waiter behind
it (:meth:`Departures.sweep`, docs/etcd-design.md §5).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends.etcd import queue
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdUnavailable
from lockd.daemon.backends.etcd.queueview import LocalWaiter, QueueView
from lockd.daemon.backends.etcd.records import Hold
from lockd.daemon.backends.etcd.wire import Compare, DeleteOp, RangeOp
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.cleanup import CleanupList
    from lockd.daemon.backends.etcd.gateway import EtcdGateway

log = logging.getLogger("lockd.etcd")

#: seconds a waiter of another daemon (or an orphan of ours) may stay granted-
#: able at the head of the queue, ungranted, before this daemon removes it:
#: etcd's default election timeout, the time the issue allows a free key to
#: stay blocked. A daemon that serves its waiter grants it within
#: milliseconds of the watch event (hand-off p99 ~0.2 s under load).
UNSERVED_AFTER = 1.0


class Departures:
    """Withdraws this daemon's waiters from one key's queue and sweeps unserved ones out."""

    def __init__(
        self, etcd: EtcdGateway, view: QueueView, cleanup: CleanupList, timeout: float
    ) -> None:
        self.etcd = etcd
        self.view = view
        self.cleanup = cleanup
        self.timeout = timeout
        #: waiters the rules grant now but that are not ours: etcd key ->
        #: (create revision, when first seen so, trio clock). See sweep.
        self.unserved: dict[bytes, tuple[int, float]] = {}
        #: unserved waiters removed (tests, debugging).
        self.removed = 0

    async def leave(self, waiter: LocalWaiter) -> Hold | None:
        """Withdraw ``waiter`` (timeout, cancel, connection gone) unless it was granted.

        Returns its hold when the grant came first, by this daemon or by
        another one. Shielded: a cancelled acquire must still leave the queue.
        """
        view = self.view
        with trio.CancelScope(shield=True):
            async with view.lock:
                key = waiter.record.etcd_key
                if waiter.granted is None and key in view.waiters:
                    del view.waiters[key]
                    await self._withdraw(waiter)
                view.expected.pop(view.hold_key(waiter), None)
        return waiter.granted

    async def _withdraw(self, waiter: LocalWaiter) -> None:
        """Delete the waiter key and, in the same transaction, read the hold it was to get.

        Another daemon may grant the waiter until its key is gone: when the
        key was gone already and the hold is there, the grant came first
        (``waiter.granted`` is set). While etcd does not answer, the
        clean-up list deletes the waiter key, then the hold and binding a
        grant may have written (waiter keys go first: no grant commits
        after its waiter key is gone).
        """
        view = self.view
        key, hold_key = waiter.record.etcd_key, view.hold_key(waiter)
        with trio.move_on_after(self.timeout):
            try:
                result = await self.etcd.txn([], [DeleteOp(key, prev_kv=True), RangeOp(hold_key)])
            except (EtcdUnavailable, EtcdError):
                pass
            else:
                deleted, read = result.responses
                if not getattr(deleted, "prev_kvs", None) and getattr(read, "kvs", None):
                    view.granted(waiter, Hold.parse(view.key, waiter.hold.handle, read.kvs[0]))  # type: ignore[union-attr]
                return
        self.cleanup.delete_later(key)
        if waiter.granted is None:
            self.cleanup.delete_later(hold_key)
            self.cleanup.delete_later(view.layout.binding(view.key, waiter.hold.handle))

    def sweep_at(self) -> float:
        """When the oldest unserved waiter's time is up (trio clock; inf: none)."""
        if not self.unserved:
            return math.inf
        return min(since for _, since in self.unserved.values()) + UNSERVED_AFTER

    async def sweep(self, decision: queue.QueueDecision) -> None:
        """Remove waiters at the head that the rules grant now and nobody serves.

        The daemon that owns a waiter grants it within milliseconds of
        seeing it fit. One still ungranted :data:`UNSERVED_AFTER` after this
        daemon first saw it fit is an orphan (its daemon does not know it: an
        enqueue whose outcome was unknown, issue 23's ghost), or its daemon
        is cut off or stopped. Either way it blocks every waiter behind it,
        so any daemon with a waiter behind it deletes it, guarded by its
        create revision (a grant that came first deleted it already). Safe
        whatever the case: a waiter whose key vanishes is written again at
        the tail by its own daemon, if that daemon still serves it; a
        stopped daemon's waiter would have gone with its session anyway.
        """
        now = trio.current_time()
        others = {
            c.etcd_key: c.create_revision
            for c in decision.granted
            if c.etcd_key not in self.view.waiters
        }
        self.unserved = {
            key: (revision, self.unserved.get(key, (revision, now))[1])
            for key, revision in others.items()
        }
        due = [
            (key, revision)
            for key, (revision, since) in self.unserved.items()
            if now - since >= UNSERVED_AFTER
        ]
        for key, revision in due:
            result = await self.etcd.txn(
                [Compare(key, "create_revision", "==", revision)], [DeleteOp(key)]
            )
            del self.unserved[key]
            if result.succeeded:
                self.removed += 1
                log.warning(
                    kv(event="unserved_waiter_removed", key=self.view.key, waiter=key.decode())
                )
