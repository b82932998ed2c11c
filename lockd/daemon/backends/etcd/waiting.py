"""The queue of one lock key, as this daemon takes part in it (docs/etcd-design.md §5).

A blocking acquire that cannot win at once writes a waiter key (on the
session lease) and joins the :class:`KeyQueue` of its lock key: one per key
with local waiters, one task and one watch each. The queue task

1. reads the key's directory, applies ``queue.decide`` to what it read, and
   grants those of *its own* waiters that the rules grant now, all in one
   transaction guarded by the revision it read (delete the waiter keys, put
   the holds); a failed guard hands back the directory as it is now, and it
   decides again;
2. then sleeps until the watch reports the deletion of a record one of its
   waiters waits for (``queue.decide``'s ``wake_on``: a hold blocking the
   head, or the binding that keeps it live; the waiter just before; its own
   waiter keys, which vanish when the session is lost). Other deletions only
   update what it knows of the directory. The watch runs from the revision
   after the first read and never stops while the queue lives, so no
   deletion between a read and the next wait can be missed.

Nothing is granted from memory: a grant is a transaction over what was read.
A waiter whose key vanished (the session lease ran out during an etcd
outage) is written again at the tail, as after a daemon restart.

A waiter record names the whole hold it asks for, so another daemon may
grant it: the daemon that releases the key grants the head in its
release's own transaction (:meth:`KeyQueue.hand_off`, one raft write per
hand-off). The waiter's daemon learns of its grant from the watch (or a
read): the hold key its waiter named appears. A waiter that leaves deletes
its key and reads that hold key in one transaction (:meth:`KeyQueue.leave`),
so a grant that crossed the leave is found, never left behind.

While a hold granted through the queue lives, the queue stays (and its
watch), so the daemon that releases that hold can decide from what the
watch shows without reading first.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends.etcd import queue
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdUnavailable, WatchCompacted
from lockd.daemon.backends.etcd.leases import Refresh
from lockd.daemon.backends.etcd.records import Directory, Hold, Layout, Waiter
from lockd.daemon.backends.etcd.tasks import keep_running
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    Event,
    KeyValue,
    Op,
    PutOp,
    RangeOp,
    RangeResult,
    TxnResult,
    WatchRequest,
)
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.backend import EtcdBackend

log = logging.getLogger("lockd.etcd")

#: seconds between attempts while etcd does not answer.
RETRY_INTERVAL = 0.25


@dataclass(eq=False)
class LocalWaiter:
    """One parked acquire of this daemon: its waiter record and, once granted, its hold."""

    record: Waiter
    #: the hold it will get, less what the grant fills in (lease, expiry, fence).
    hold: Hold
    ttl_s: int
    granted: Hold | None = None
    done: trio.Event = field(default_factory=trio.Event)


#: seconds a waiter of another daemon (or an orphan of ours) may stay granted-
#: able at the head of the queue, ungranted, before this daemon removes it:
#: etcd's default election timeout, the time the issue allows a free key to
#: stay blocked. A daemon that serves its waiter grants it within
#: milliseconds of the watch event (hand-off p99 ~0.2 s under load).
UNSERVED_AFTER = 1.0

#: a hand-off's transaction tried again at most this often when its guard
#: fails (each failure brings the directory as it is); then a plain release.
HAND_OFF_TRIES = 4


class KeyQueue:
    """One key's queue on this daemon: its waiters, its view of the directory, its task.

    It is given the backend's parts it uses, not the backend: the etcd
    client and key layout, the clean-up list, the hold supply (leases,
    holds and waiter records to write) and ``track`` (a grant's fence and
    binding for the backend's books).
    """

    def __init__(self, backend: EtcdBackend, key: str, revision: int) -> None:
        self.etcd = backend.etcd
        self.layout: Layout = backend.layout
        self.timeout: float = backend.timeout
        self.cleanup = backend.cleanup
        self.supply = backend.supply
        self.track = backend.track
        self.key = key
        self.directory_key = self.layout.directory(key)
        self.waiters: dict[bytes, LocalWaiter] = {}
        #: the hold key each waiter of ours will be granted under -> the waiter
        #: (until it has its hold or has left).
        self.expected: dict[bytes, LocalWaiter] = {}
        #: hold keys granted to our waiters that still exist: the queue (and its
        #: view) stays while they do, for their release's hand-off.
        self.holding: set[bytes] = set()
        #: held while deciding, and by a waiter that leaves: never both at once.
        self.lock = trio.Lock()
        self.changed = trio.Event()
        #: the directory's records as of ``revision``: the newest read, with
        #: the watch's later events applied (None: unknown, read first).
        self.records: dict[bytes, KeyValue] | None = None
        self.revision = 0
        #: the revision of this queue's last committed write: a hand-off
        #: decides only from a view that shows it (set when the view advances).
        self.own_revision = 0
        self._advanced = trio.Event()
        self._watch_from = revision + 1
        #: etcd keys whose deletion can let a waiter of ours move, as of the
        #: last decision that granted nothing (None: any deletion wakes).
        self.wake_keys: frozenset[bytes] | None = None
        #: decisions made (how often a deletion woke it: tests, debugging).
        self.decisions = 0
        #: waiters the rules grant now but that are not ours: etcd key ->
        #: (create revision, when first seen so, trio clock). See _sweep.
        self.unserved: dict[bytes, tuple[int, float]] = {}
        #: unserved waiters removed (tests, debugging).
        self.removed = 0

    def join(self, waiter: LocalWaiter, directory: Directory) -> None:
        """Take a waiter whose key is written; ``directory`` was read after it was."""
        self.waiters[waiter.record.etcd_key] = waiter
        self.expected[self._hold_key(waiter)] = waiter
        self._learn(directory)
        self.changed.set()

    def _hold_key(self, waiter: LocalWaiter) -> bytes:
        return self.layout.hold(self.key, waiter.hold.handle)

    def _granted_in(self, waiter: Waiter, released: bytes) -> bool:
        """True when the view shows the hold ``waiter`` asks for (or it is the one released)."""
        assert waiter.handle is not None and self.records is not None
        hold_key = self.layout.hold(self.key, waiter.handle)
        return hold_key == released or hold_key in self.records

    async def leave(self, waiter: LocalWaiter) -> Hold | None:
        """Withdraw ``waiter`` (timeout, cancel, connection gone) unless it was granted.

        Returns its hold when the grant came first, by this daemon or by
        another one. Shielded: a cancelled acquire must still leave the queue.
        """
        with trio.CancelScope(shield=True):
            async with self.lock:
                key = waiter.record.etcd_key
                if waiter.granted is None and key in self.waiters:
                    del self.waiters[key]
                    await self._withdraw(waiter)
                self.expected.pop(self._hold_key(waiter), None)
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
        key, hold_key = waiter.record.etcd_key, self._hold_key(waiter)
        with trio.move_on_after(self.timeout):
            try:
                result = await self.etcd.txn([], [DeleteOp(key, prev_kv=True), RangeOp(hold_key)])
            except (EtcdUnavailable, EtcdError):
                pass
            else:
                deleted, read = result.responses
                if not getattr(deleted, "prev_kvs", None) and getattr(read, "kvs", None):
                    self._granted(waiter, Hold.parse(self.key, waiter.hold.handle, read.kvs[0]))  # type: ignore[union-attr]
                return
        self.cleanup.delete_later(key)
        if waiter.granted is None:
            self.cleanup.delete_later(hold_key)
            self.cleanup.delete_later(self.layout.binding(self.key, waiter.hold.handle))

    def _granted(self, waiter: LocalWaiter, hold: Hold, *, seen: bool = False) -> None:
        """``waiter`` has its hold (granted by us or by another daemon): wake its acquire.

        ``seen``: the grant was seen in the view (a watch event, a read), not
        made by our own transaction. If the waiter's key is still in the view
        then, the grant went to an older key of the same waiter (an enqueue
        whose outcome was unknown, then written again: both name one hold),
        and this one must go too, or it stays in the queue unserved.
        """
        if waiter.granted is not None:
            return
        if seen and self.records is not None and waiter.record.etcd_key in self.records:
            self.cleanup.delete_later(waiter.record.etcd_key)
        waiter.granted = hold
        self.waiters.pop(waiter.record.etcd_key, None)
        hold_key = self._hold_key(waiter)
        self.expected.pop(hold_key, None)
        self.holding.add(hold_key)
        waiter.done.set()

    def _deliver_read(self) -> None:
        """Grants to our waiters that a read shows (a watch event shows them one by one).

        Whatever its revision: a handle is never reused, so a hold under the
        one a waiter named is its grant, also when it was granted under an
        older key of the waiter (an enqueue whose outcome was unknown, then
        written again) before the newer key was written. Skipping those left
        the hold tied to this daemon's session, undelivered, blocking the key.
        """
        assert self.records is not None
        for hold_key, waiter in list(self.expected.items()):
            record = self.records.get(hold_key)
            if record is not None:
                self._granted(waiter, Hold.parse(self.key, waiter.hold.handle, record), seen=True)
        self.holding.intersection_update(self.records)

    # ------------------------------------------------------------ the task

    async def run(self, retire: Callable[[], None]) -> None:
        """Serve the queue until no local waiter is left in it.

        ``retire`` is called the moment it finds none, before any await: a
        waiter arriving after that starts a new queue instead of joining
        one whose task is ending.
        """
        if self.decisions:  # started again after a failure: what it knew may be stale
            self.records = None
            self.changed.set()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_running, "watch", self._watch)
            while True:
                if not self.waiters and not self.holding:
                    retire()
                    break
                with trio.move_on_at(self._sweep_at()):
                    await self.changed.wait()
                self.changed = trio.Event()
                self.decisions += 1
                try:
                    async with self.lock:
                        await self._decide()
                except (EtcdUnavailable, EtcdError) as exc:
                    # EtcdError: a kept lease that ended under the grant, or
                    # a refusal; deciding again from a new read is safe.
                    log.info(kv(event="queue_retry", key=self.key, error=exc))
                    self.records = None
                    self.changed.set()
                    await trio.sleep(RETRY_INTERVAL)
            nursery.cancel_scope.cancel()

    def _learn(self, directory: Directory) -> None:
        """Take a read of the directory, unless what is known is newer.

        Either way, grants the view shows to waiters it holds now are
        delivered: a waiter joins after its enqueue's reply, and the watch
        may have shown its grant (by another daemon) before that.
        """
        if self.records is None or directory.revision > self.revision:
            self.records = {record.key: record for record in directory.records}
            self.revision = directory.revision
            self._advanced.set()
        self._deliver_read()

    def _apply(self, events: list[Event]) -> None:
        """Bring the known records up to the watch's events (older ones are in the read)."""
        if self.records is None:
            return
        for event in events:
            revision = event.kv.mod_revision
            if revision <= self.revision:
                continue
            if event.type == "DELETE":
                self.records.pop(event.kv.key, None)
                if event.kv.key in self.holding:
                    self.holding.discard(event.kv.key)
                    self.changed.set()  # the queue may have nothing left to serve
            else:
                self.records[event.kv.key] = event.kv
                waiter = self.expected.get(event.kv.key)
                if waiter is not None:  # a grant to one of ours, maybe by another daemon
                    hold = Hold.parse(self.key, waiter.hold.handle, event.kv)
                    self._granted(waiter, hold, seen=True)
        if events:
            self.revision = max(self.revision, events[-1].kv.mod_revision)
            self._advanced.set()

    def _view(self) -> Directory:
        assert self.records is not None
        records = list(self.records.values())
        return Directory.parse(self.layout, self.key, records, self.revision)

    async def _watch(self) -> None:
        """Follow the directory from the first read on; a deletion may let a waiter go."""
        request = WatchRequest(self.directory_key, prefix=True)
        while True:
            start = self._watch_from
            try:
                async with self.etcd.watch(replace(request, start_revision=start)) as w:
                    try:
                        async for response in w:
                            self._apply(response.events)
                            if any(self._wakes(e) for e in response.events):
                                self.changed.set()
                    finally:
                        # Kept on the queue: a watch started again (here, or
                        # after a failure) goes on from there, missing nothing.
                        self._watch_from = w.next_revision or start
            except WatchCompacted as exc:
                self._watch_from = exc.compact_revision
                self.records = None  # what was compacted away is read instead
                self.changed.set()
            except (EtcdUnavailable, EtcdError) as exc:
                # EtcdError: refused (rights, say) or a bug: try again later.
                log.info(kv(event="watch_retry", key=self.key, error=exc))
                await trio.sleep(RETRY_INTERVAL)

    def _wakes(self, event: Event) -> bool:
        """True for a deletion that can let one of our waiters move.

        A binding deleted while its hold lives on untied (its daemon untied
        a delivered hold, or a renew did) makes no room.
        """
        if event.type != "DELETE":
            return False  # a record written never makes room
        if self.wake_keys is not None and event.kv.key not in self.wake_keys:
            return False
        return not self._untied(event.kv.key)

    def _untied(self, binding_key: bytes) -> bool:
        """True when ``binding_key`` is a binding whose hold is known and needs none."""
        layout, directory = self.layout, self.directory_key
        if self.records is None or not binding_key.startswith(directory + b"b/"):
            return False
        handle = binding_key[len(directory) + 2 :].decode()
        record = self.records.get(layout.hold(self.key, handle))
        return record is not None and not Hold.parse(self.key, handle, record).needs_binding

    def _wake_keys(self, decision: queue.QueueDecision) -> frozenset[bytes]:
        """What our waiters wait for: ``wake_on``, the bindings of those holds, their own keys.

        A bound hold dies with its binding, so the binding's deletion can
        make room as much as the hold's; a waiter key of ours that vanishes
        means the session was lost (``_decide`` writes it again).

        What the waiters *ahead* of ours wait for counts too: when the head
        can go and its daemon does not serve it (an orphan), this daemon
        must see it to remove it (``_sweep``), or the queue stalls.
        """
        layout, keys = self.layout, set(self.waiters)
        holds = layout.directory(self.key) + b"h/"
        for blockers in decision.wake_on.values():
            for blocker in blockers:
                keys.add(blocker)
                if blocker.startswith(holds):
                    keys.add(layout.binding(self.key, blocker[len(holds) :].decode()))
        return frozenset(keys)

    async def _read(self) -> Directory:
        result = await self.etcd.range(RangeOp(self.directory_key, prefix=True))
        return Directory.parse(self.layout, self.key, result.kvs, result.header.revision)

    async def _decide(self) -> None:
        """Grant what the rules grant our waiters now; re-queue waiters that were lost."""
        # Until this decision settles what our waiters wait for, any deletion
        # (one that arrives while it awaits etcd, too) decides again.
        self.wake_keys = None
        if self.records is None:
            self._learn(await self._read())
        while self.waiters:
            # What the watch shows, as of its last event: a transaction
            # guarded by that revision commits only if it is still so.
            directory = self._view()
            lost = [w for w in self.waiters.values() if directory.lost(w.record)]
            if lost:
                self._learn(await self._requeue(lost))
                continue
            decision = queue.decide(
                directory.hold_claims(self.layout), [w.claim for w in directory.waiters]
            )
            mine = [
                self.waiters[c.etcd_key] for c in decision.granted if c.etcd_key in self.waiters
            ]
            await self._sweep(decision)
            if not mine:
                self.wake_keys = self._wake_keys(decision)
                return
            # One grant per transaction: every grant draws a fence of its own
            # (its revision, docs/contract.md §10), shared waiters granted together
            # included. The next one is decided once the watch shows this one.
            result = await self._grant(directory, mine[:1], decision.replaces)
            if result is None:
                return
            self._learn(result)

    def _sweep_at(self) -> float:
        """When the oldest unserved waiter's time is up (trio clock; inf: none)."""
        if not self.unserved:
            return math.inf
        return min(since for _, since in self.unserved.values()) + UNSERVED_AFTER

    async def _sweep(self, decision: queue.QueueDecision) -> None:
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
            if c.etcd_key not in self.waiters
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
                log.warning(kv(event="unserved_waiter_removed", key=self.key, waiter=key.decode()))

    async def _grant(
        self, directory: Directory, mine: list[LocalWaiter], replaces: dict[bytes, bytes]
    ) -> Directory | None:
        """One guarded transaction granting ``mine``; None when it committed, else the new read.

        A grant that takes back a hold of its principal and owner
        (``replaces``) deletes that hold in the same transaction.
        A grant that failed in any way may still have committed: its holds
        are then found by the next read (or the watch) and delivered, or by
        a leaving waiter's :meth:`_withdraw`; nothing is cleaned up here.
        """
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
                self.directory_key, "mod_revision", "<", directory.revision + 1, prefix=True
            )
            result = await self.etcd.txn([guard], ops, [RangeOp(self.directory_key, prefix=True)])
        except BaseException:
            self.records = None  # read again: the read shows what committed
            raise
        if not result.succeeded:
            for hold, refresh in zip(holds, refreshes, strict=True):
                self.supply.recycle(hold, refresh)
            return self._directory_of(result)
        for replaced in retaken:
            self.cleanup.revoke_later(replaced.lease)
        settled = [
            await self.supply.settle(replace(hold, fence=result.header.revision), refresh)
            for hold, refresh in zip(holds, refreshes, strict=True)
        ]
        self.own_revision = result.header.revision
        for waiter, hold in zip(mine, settled, strict=True):
            self._granted(waiter, hold)
        self._prepare_leases()
        return None

    def _retaken(
        self, directory: Directory, granted: list[bytes], replaces: dict[bytes, bytes]
    ) -> list[Hold]:
        """The holds that the grants of ``granted`` (waiter keys) take back."""
        layout = self.layout
        by_key = {layout.hold(self.key, h.handle): h for h in directory.holds}
        return [by_key[replaces[w]] for w in granted if w in replaces]

    def _deletes_of(self, hold: Hold) -> list[Op]:
        """Delete a hold taken back, and its binding (the lease is revoked once committed)."""
        layout = self.layout
        return [
            DeleteOp(layout.hold(self.key, hold.handle)),
            DeleteOp(layout.binding(self.key, hold.handle)),
        ]

    def _prepare_leases(self) -> None:
        for waiter in self.waiters.values():  # the next hand-off's lease, ahead
            self.supply.prepare_lease(waiter.ttl_s)

    def _directory_of(self, result: TxnResult) -> Directory:
        """The directory a transaction read (its last response)."""
        read = result.responses[-1]
        assert isinstance(read, RangeResult)
        return Directory.parse(self.layout, self.key, read.kvs, result.header.revision)

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
        layout = self.layout
        async with self.lock:
            for _ in range(HAND_OFF_TRIES):
                if not await self._caught_up():
                    return None
                directory = self._view()
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
                    if not waiter.grantable or self._granted_in(waiter, hold_key):
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
                self._learn(self._directory_of(result))
        return None

    async def _caught_up(self) -> bool:
        """Wait (within the etcd timeout) until the view shows this queue's last write.

        A hold this queue granted may be released before the watch showed
        the grant; a view without it would grant its waiter again.
        """
        with trio.move_on_after(self.timeout):
            while self.records is None or self.revision < self.own_revision:
                if self.records is None:
                    self._learn(await self._read())
                    continue
                self._advanced = trio.Event()
                await self._advanced.wait()
            return True
        return False

    async def _hand_off(
        self, directory: Directory, hold_key: bytes, heads: list[Waiter], retaken: list[Hold]
    ) -> TxnResult | None:
        """The hand-off's transaction; None when etcd refused it (nothing committed).

        ``retaken``: holds the grants take back (deleted in the same transaction).
        """
        layout = self.layout
        binding_key = layout.binding(self.key, hold_key[len(layout.holds(self.key)) :].decode())
        # No hold *created* since the view: a rewrite (renew, untie, unbind)
        # keeps a hold's mode, limit and place, so it does not change who fits.
        holds = layout.holds(self.key)
        compares = [Compare(holds, "create_revision", "<", directory.revision + 1, prefix=True)]
        ops: list[Op] = [DeleteOp(hold_key, prev_kv=True), DeleteOp(binding_key, prev_kv=True)]
        ops += [DeleteOp(dead) for dead in directory.dead if dead != hold_key]
        for replaced in retaken:
            ops += self._deletes_of(replaced)
        granted: list[tuple[LocalWaiter | None, Hold, Refresh | None]] = []
        try:
            for head in heads:
                mine = self.waiters.get(head.etcd_key)
                template = mine.hold if mine is not None else head.hold(self.key)
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
                    PutOp(layout.hold(self.key, hold.handle), hold.value(), lease=hold.lease),
                    PutOp(layout.binding(self.key, hold.handle), head.node, lease=head.lease),
                ]
            result = await self.etcd.txn(compares, ops, [RangeOp(self.directory_key, prefix=True)])
        except EtcdError as exc:
            # Refused, so not committed (a kept lease that ended under the
            # grant): the caller releases plainly, the waiters' daemons grant.
            # The leases are not kept (one of them is gone); they end alone.
            log.info(kv(event="hand_off_refused", key=self.key, error=exc))
            return None
        except BaseException:
            # Maybe committed: our waiters' holds are delivered by the next
            # read; another daemon's by its own watch. Leases are not reused.
            self.records = None
            self.changed.set()
            raise
        if not result.succeeded:
            for _mine, hold, refresh in granted:
                self.supply.recycle(hold, refresh)
            return result
        self.own_revision = result.header.revision
        for replaced in retaken:
            self.cleanup.revoke_later(replaced.lease)
        for mine, hold, refresh in granted:
            hold = replace(hold, fence=result.header.revision)
            self.track(hold)
            if mine is not None:
                self._granted(mine, await self.supply.settle(hold, refresh))
        self._prepare_leases()
        return result

    async def _requeue(self, lost: list[LocalWaiter]) -> Directory:
        """Write lost waiters again, at the tail (their session ended under them).

        Only while the hold each was to get does not exist: a waiter key is
        also gone when another daemon granted it, and then the read that a
        failed guard returns delivers the grant instead.
        """
        ops: list[Op] = []
        compares: list[Compare] = []
        renewed: list[Waiter] = []
        for waiter in lost:
            record = await self.supply.new_waiter_record(self.key, waiter.record)
            renewed.append(record)
            compares.append(Compare(self._hold_key(waiter), "create_revision", "==", 0))
            # Deleting the old key too: a queue must never keep a waiter nobody serves.
            ops += [
                DeleteOp(waiter.record.etcd_key),
                PutOp(record.etcd_key, record.value(), lease=record.lease),
            ]
        read = RangeOp(self.directory_key, prefix=True)
        try:
            result = await self.etcd.txn(compares, [*ops, read], [read])
        except BaseException:
            for record in renewed:
                # Maybe written: deleted later (the old key is lost already).
                self.cleanup.delete_later(record.etcd_key)
            self.records = None  # read again: a hold granted meanwhile is delivered
            raise
        if result.succeeded:
            for waiter, record in zip(lost, renewed, strict=True):
                del self.waiters[waiter.record.etcd_key]
                waiter.record = replace(record, create_revision=result.header.revision)
                self.waiters[waiter.record.etcd_key] = waiter
                log.info(kv(event="waiter_requeued", key=self.key))
        return self._directory_of(result)
