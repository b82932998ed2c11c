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

The queue is made of parts that share its :class:`QueueView` (its waiters,
what it knows of the directory; ``queueview.py``): the
:class:`DirectoryWatch` (``queuewatch.py``), the :class:`Granter` that
decides and grants (``granting.py``), and the :class:`Departures`
(``departures.py``) that withdraw our waiters and sweep unserved ones out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends.etcd.departures import Departures
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdUnavailable
from lockd.daemon.backends.etcd.granting import Granter
from lockd.daemon.backends.etcd.queueview import RETRY_INTERVAL, LocalWaiter, QueueView
from lockd.daemon.backends.etcd.queuewatch import DirectoryWatch
from lockd.daemon.backends.etcd.records import Directory, Hold
from lockd.daemon.backends.etcd.tasks import keep_running
from lockd.daemon.backends.etcd.wire import KeyValue, TxnResult
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.backend import EtcdBackend

__all__ = ["RETRY_INTERVAL", "KeyQueue", "LocalWaiter"]

log = logging.getLogger("lockd.etcd")


class KeyQueue:
    """One key's queue on this daemon: its waiters, its view of the directory, its task.

    It is given the backend's parts it uses, not the backend: the etcd
    client and key layout, the clean-up list, the hold supply (leases,
    holds and waiter records to write) and ``track`` (a grant's fence and
    binding for the backend's books); it hands each of its own parts the
    :class:`QueueView` they share.
    """

    def __init__(self, backend: EtcdBackend, key: str, revision: int) -> None:
        self.key = key
        self.view = QueueView(backend.layout, backend.cleanup, key, revision)
        self.watch = DirectoryWatch(backend.etcd, self.view, backend.timeout)
        self.departures = Departures(backend.etcd, self.view, backend.cleanup, backend.timeout)
        self.granter = Granter(
            backend.etcd,
            self.view,
            self.watch,
            self.departures,
            backend.cleanup,
            backend.supply,
            backend.track,
        )

    # What the backend and the tests read of the queue's state.

    @property
    def directory_key(self) -> bytes:
        return self.view.directory_key

    @property
    def waiters(self) -> dict[bytes, LocalWaiter]:
        return self.view.waiters

    @property
    def expected(self) -> dict[bytes, LocalWaiter]:
        return self.view.expected

    @property
    def holding(self) -> set[bytes]:
        return self.view.holding

    @property
    def lock(self) -> trio.Lock:
        return self.view.lock

    @property
    def changed(self) -> trio.Event:
        return self.view.changed

    @property
    def records(self) -> dict[bytes, KeyValue] | None:
        return self.view.records

    @property
    def revision(self) -> int:
        return self.view.revision

    @property
    def wake_keys(self) -> frozenset[bytes] | None:
        return self.view.wake_keys

    @property
    def decisions(self) -> int:
        return self.view.decisions

    @property
    def removed(self) -> int:
        return self.departures.removed

    def join(self, waiter: LocalWaiter, directory: Directory) -> None:
        """Take a waiter whose key is written; ``directory`` was read after it was."""
        view = self.view
        view.waiters[waiter.record.etcd_key] = waiter
        view.expected[view.hold_key(waiter)] = waiter
        view.learn(directory)
        view.changed.set()

    async def leave(self, waiter: LocalWaiter) -> Hold | None:
        """Withdraw ``waiter`` unless it was granted (:meth:`Departures.leave`)."""
        return await self.departures.leave(waiter)

    async def hand_off(self, hold_key: bytes) -> TxnResult | None:
        """Release ``hold_key`` and grant the head it lets go, in one transaction
        (:meth:`Granter.hand_off`)."""
        return await self.granter.hand_off(hold_key)

    async def run(self, retire: Callable[[], None]) -> None:
        """Serve the queue until no local waiter is left in it.

        ``retire`` is called the moment it finds none, before any await: a
        waiter arriving after that starts a new queue instead of joining
        one whose task is ending.
        """
        view = self.view
        if view.decisions:  # started again after a failure: what it knew may be stale
            view.records = None
            view.changed.set()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_running, "watch", self.watch.run)
            while True:
                if not view.waiters and not view.holding:
                    retire()
                    break
                with trio.move_on_at(self.departures.sweep_at()):
                    await view.changed.wait()
                view.changed = trio.Event()
                view.decisions += 1
                try:
                    async with view.lock:
                        await self.granter.decide()
                except (EtcdUnavailable, EtcdError) as exc:
                    # EtcdError: a kept lease that ended under the grant, or
                    # a refusal; deciding again from a new read is safe.
                    log.info(kv(event="queue_retry", key=self.key, error=exc))
                    view.records = None
                    view.changed.set()
                    await trio.sleep(RETRY_INTERVAL)
            nursery.cancel_scope.cancel()
