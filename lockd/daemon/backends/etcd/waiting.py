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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends.etcd import queue
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdUnavailable, WatchCompacted
from lockd.daemon.backends.etcd.leases import Refresh
from lockd.daemon.backends.etcd.records import Directory, Hold, Waiter
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    Event,
    KeyValue,
    Op,
    PutOp,
    RangeOp,
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


class KeyQueue:
    def __init__(self, backend: EtcdBackend, key: str, revision: int) -> None:
        self.backend = backend
        self.key = key
        self.directory_key = backend.layout.directory(key)
        self.waiters: dict[bytes, LocalWaiter] = {}
        #: held while deciding, and by a waiter that leaves: never both at once.
        self.lock = trio.Lock()
        self.changed = trio.Event()
        #: the directory's records as of ``revision``: the newest read, with
        #: the watch's later events applied (None: unknown, read first).
        self.records: dict[bytes, KeyValue] | None = None
        self.revision = 0
        self._watch_from = revision + 1
        #: etcd keys whose deletion can let a waiter of ours move, as of the
        #: last decision that granted nothing (None: any deletion wakes).
        self.wake_keys: frozenset[bytes] | None = None
        #: decisions made (how often a deletion woke it: tests, debugging).
        self.decisions = 0

    def join(self, waiter: LocalWaiter, directory: Directory) -> None:
        """Take a waiter whose key is written; ``directory`` was read after it was."""
        self.waiters[waiter.record.etcd_key] = waiter
        self._learn(directory)
        self.changed.set()

    async def leave(self, waiter: LocalWaiter) -> Hold | None:
        """Withdraw ``waiter`` (timeout, cancel, connection gone) unless it was granted.

        Returns its hold when the grant came first. Shielded: a cancelled
        acquire must still leave the queue.
        """
        with trio.CancelScope(shield=True):
            async with self.lock:
                key = waiter.record.etcd_key
                if waiter.granted is None and key in self.waiters:
                    del self.waiters[key]
                    await self._delete(key)
        return waiter.granted

    async def _delete(self, key: bytes) -> None:
        """Delete a waiter key now, so the answer that follows is true at once.

        While etcd does not answer, the clean-up list deletes it later.
        """
        deleted = False
        with trio.move_on_after(self.backend.timeout):
            try:
                await self.backend.etcd.txn([], [DeleteOp(key)])
                deleted = True
            except (EtcdUnavailable, EtcdError):
                pass
        if not deleted:
            self.backend.delete_later(key)

    # ------------------------------------------------------------ the task

    async def run(self, retire: Callable[[], None]) -> None:
        """Serve the queue until no local waiter is left in it.

        ``retire`` is called the moment it finds none, before any await: a
        waiter arriving after that starts a new queue instead of joining
        one whose task is ending.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch)
            while True:
                if not self.waiters:
                    retire()
                    break
                await self.changed.wait()
                self.changed = trio.Event()
                self.decisions += 1
                try:
                    async with self.lock:
                        await self._decide()
                except (EtcdUnavailable, EtcdError) as exc:
                    # EtcdError: a kept lease that ended under the grant, or
                    # a refusal; deciding again from a new read is safe.
                    log.debug(kv(event="queue_retry", key=self.key, error=exc))
                    self.records = None
                    self.changed.set()
                    await trio.sleep(RETRY_INTERVAL)
            nursery.cancel_scope.cancel()

    def _learn(self, directory: Directory) -> None:
        """Take a read of the directory, unless what is known is newer."""
        if self.records is None or directory.revision > self.revision:
            self.records = {record.key: record for record in directory.records}
            self.revision = directory.revision

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
            else:
                self.records[event.kv.key] = event.kv
        if events:
            self.revision = max(self.revision, events[-1].kv.mod_revision)

    def _view(self) -> Directory:
        assert self.records is not None
        records = list(self.records.values())
        return Directory.parse(self.backend.layout, self.key, records, self.revision)

    async def _watch(self) -> None:
        """Follow the directory from the first read on; a deletion may let a waiter go."""
        start = self._watch_from
        request = WatchRequest(self.directory_key, prefix=True)
        while True:
            try:
                async with self.backend.etcd.watch(replace(request, start_revision=start)) as w:
                    try:
                        async for response in w:
                            self._apply(response.events)
                            if any(self._wakes(e) for e in response.events):
                                self.changed.set()
                    finally:
                        start = w.next_revision or start
            except WatchCompacted as exc:
                start = exc.compact_revision
                self.records = None  # what was compacted away is read instead
                self.changed.set()
            except EtcdUnavailable:
                await trio.sleep(RETRY_INTERVAL)

    def _wakes(self, event: Event) -> bool:
        """True for a deletion that can let one of our waiters move."""
        if event.type != "DELETE":
            return False  # a record written never makes room
        return self.wake_keys is None or event.kv.key in self.wake_keys

    def _wake_keys(self, decision: queue.QueueDecision) -> frozenset[bytes]:
        """What our waiters wait for: ``wake_on``, the bindings of those holds, their own keys.

        A bound hold dies with its binding, so the binding's deletion can
        make room as much as the hold's; a waiter key of ours that vanishes
        means the session was lost (``_decide`` writes it again).
        """
        layout, keys = self.backend.layout, set(self.waiters)
        holds = layout.directory(self.key) + b"h/"
        for waiter_key in self.waiters:
            for blocker in decision.wake_on.get(waiter_key, ()):
                keys.add(blocker)
                if blocker.startswith(holds):
                    keys.add(layout.binding(self.key, blocker[len(holds) :].decode()))
        return frozenset(keys)

    async def _read(self) -> Directory:
        backend = self.backend
        result = await backend.etcd.range(RangeOp(self.directory_key, prefix=True))
        return Directory.parse(backend.layout, self.key, result.kvs, result.header.revision)

    async def _decide(self) -> None:
        """Grant what the rules grant our waiters now; re-queue waiters that were lost."""
        backend = self.backend
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
                directory.hold_claims(backend.layout), [w.claim for w in directory.waiters]
            )
            mine = [
                self.waiters[c.etcd_key] for c in decision.granted if c.etcd_key in self.waiters
            ]
            if not mine:
                self.wake_keys = self._wake_keys(decision)
                return
            result = await self._grant(directory, mine)
            if result is None:
                return
            self._learn(result)

    async def _grant(self, directory: Directory, mine: list[LocalWaiter]) -> Directory | None:
        """One guarded transaction granting ``mine``; None when it committed, else the new read."""
        backend = self.backend
        holds: list[Hold] = []
        refreshes: list[Refresh | None] = []
        ops: list[Op] = [DeleteOp(key) for key in directory.dead]
        with self._unless_committed(holds):
            for waiter in mine:
                hold, refresh = await backend.new_hold(waiter.hold, waiter.ttl_s)
                holds.append(hold)
                refreshes.append(refresh)
                ops.append(DeleteOp(waiter.record.etcd_key))
                ops += await backend.hold_puts(hold)
            guard = Compare(
                self.directory_key, "mod_revision", "<", directory.revision + 1, prefix=True
            )
            result = await backend.etcd.txn(
                [guard], ops, [RangeOp(self.directory_key, prefix=True)]
            )
        if not result.succeeded:
            for hold, refresh in zip(holds, refreshes, strict=True):
                backend.recycle(hold, refresh)
            read = result.responses[0]
            assert hasattr(read, "kvs")
            return Directory.parse(backend.layout, self.key, read.kvs, result.header.revision)
        # Granted now, before any await: a waiter that leaves meanwhile gets
        # its hold (and releases it); settling only refines the expiry.
        for waiter, hold in zip(mine, holds, strict=True):
            del self.waiters[waiter.record.etcd_key]
            waiter.granted = replace(hold, fence=result.header.revision)
        try:
            for waiter, refresh in zip(mine, refreshes, strict=True):
                assert waiter.granted is not None
                waiter.granted = await backend.settle(waiter.granted, refresh)
        finally:
            for waiter in mine:
                waiter.done.set()
        for waiter in self.waiters.values():  # the next hand-off's lease, ahead
            backend.prepare_lease(waiter.ttl_s)
        return None

    @contextmanager
    def _unless_committed(self, holds: list[Hold]) -> Iterator[None]:
        """A grant that failed in any way may still have committed: clean its holds up."""
        try:
            yield
        except BaseException:
            for hold in holds:
                self.backend.release_undelivered(hold)
            raise

    async def _requeue(self, lost: list[LocalWaiter]) -> Directory:
        """Write lost waiters again, at the tail (their session ended under them)."""
        backend = self.backend
        ops: list[Op] = []
        for waiter in lost:
            old = waiter.record.etcd_key
            del self.waiters[old]
            waiter.record = await backend.new_waiter_record(self.key, waiter.record)
            self.waiters[waiter.record.etcd_key] = waiter
            record = waiter.record
            # Deleting the old key too: a queue must never keep a waiter nobody serves.
            ops += [DeleteOp(old), PutOp(record.etcd_key, record.value(), lease=record.lease)]
            log.info(kv(event="waiter_requeued", key=self.key))
        try:
            result = await backend.etcd.txn([], [*ops, RangeOp(self.directory_key, prefix=True)])
        except BaseException:
            for waiter in lost:
                # Maybe written: deleted later, then found lost and written again.
                waiter.record = replace(waiter.record, create_revision=1)
                backend.delete_later(waiter.record.etcd_key)
            raise
        for waiter in lost:
            waiter.record = replace(waiter.record, create_revision=result.header.revision)
        read = result.responses[-1]
        assert hasattr(read, "kvs")
        return Directory.parse(backend.layout, self.key, read.kvs, result.header.revision)
