"""The watch on one key's directory, which keeps a queue's view current (docs/etcd-design.md §5).

It runs from the revision after the queue's first read and never stops
while the queue lives, so no deletion between a read and the next wait can
be missed; it wakes the queue only for a deletion one of its waiters waits
for (``queue.decide``'s ``wake_on``, the bindings of those holds, its own
waiter keys). Reading the directory, and waiting until the view shows the
queue's own last write, are here too.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends.etcd import queue
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdUnavailable, WatchCompacted
from lockd.daemon.backends.etcd.queueview import RETRY_INTERVAL, QueueView
from lockd.daemon.backends.etcd.records import Directory, Hold
from lockd.daemon.backends.etcd.wire import Event, RangeOp, WatchRequest
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.gateway import EtcdGateway

log = logging.getLogger("lockd.etcd")


class DirectoryWatch:
    """Follows one key's directory into its queue's view; reads it when the view is unknown."""

    def __init__(self, etcd: EtcdGateway, view: QueueView, timeout: float) -> None:
        self.etcd = etcd
        self.view = view
        self.timeout = timeout

    async def run(self) -> None:
        """Follow the directory from the first read on; a deletion may let a waiter go."""
        view = self.view
        request = WatchRequest(view.directory_key, prefix=True)
        while True:
            start = view.watch_from
            try:
                async with self.etcd.watch(replace(request, start_revision=start)) as w:
                    try:
                        async for response in w:
                            view.apply(response.events)
                            if any(self._wakes(e) for e in response.events):
                                view.changed.set()
                    finally:
                        # Kept on the queue: a watch started again (here, or
                        # after a failure) goes on from there, missing nothing.
                        view.watch_from = w.next_revision or start
            except WatchCompacted as exc:
                view.watch_from = exc.compact_revision
                view.records = None  # what was compacted away is read instead
                view.changed.set()
            except (EtcdUnavailable, EtcdError) as exc:
                # EtcdError: refused (rights, say) or a bug: try again later.
                log.info(kv(event="watch_retry", key=view.key, error=exc))
                await trio.sleep(RETRY_INTERVAL)

    def _wakes(self, event: Event) -> bool:
        """True for a deletion that can let one of our waiters move.

        A binding deleted while its hold lives on untied (its daemon untied
        a delivered hold, or a renew did) makes no room.
        """
        if event.type != "DELETE":
            return False  # a record written never makes room
        if self.view.wake_keys is not None and event.kv.key not in self.view.wake_keys:
            return False
        return not self._untied(event.kv.key)

    def _untied(self, binding_key: bytes) -> bool:
        """True when ``binding_key`` is a binding whose hold is known and needs none."""
        view = self.view
        layout, directory = view.layout, view.directory_key
        if view.records is None or not binding_key.startswith(directory + b"b/"):
            return False
        handle = binding_key[len(directory) + 2 :].decode()
        record = view.records.get(layout.hold(view.key, handle))
        return record is not None and not Hold.parse(view.key, handle, record).needs_binding

    def wake_keys(self, decision: queue.QueueDecision) -> frozenset[bytes]:
        """What our waiters wait for: ``wake_on``, the bindings of those holds, their own keys.

        A bound hold dies with its binding, so the binding's deletion can
        make room as much as the hold's; a waiter key of ours that vanishes
        means the session was lost (``Granter.decide`` writes it again).

        What the waiters *ahead* of ours wait for counts too: when the head
        can go and its daemon does not serve it (an orphan), this daemon
        must see it to remove it (``Departures.sweep``), or the queue stalls.
        """
        view = self.view
        layout, keys = view.layout, set(view.waiters)
        holds = layout.directory(view.key) + b"h/"
        for blockers in decision.wake_on.values():
            for blocker in blockers:
                keys.add(blocker)
                if blocker.startswith(holds):
                    keys.add(layout.binding(view.key, blocker[len(holds) :].decode()))
        return frozenset(keys)

    async def read(self) -> Directory:
        view = self.view
        result = await self.etcd.range(RangeOp(view.directory_key, prefix=True))
        return Directory.parse(view.layout, view.key, result.kvs, result.header.revision)

    async def caught_up(self) -> bool:
        """Wait (within the etcd timeout) until the view shows this queue's last write.

        A hold this queue granted may be released before the watch showed
        the grant; a view without it would grant its waiter again.
        """
        view = self.view
        with trio.move_on_after(self.timeout):
            while view.records is None or view.revision < view.own_revision:
                if view.records is None:
                    view.learn(await self.read())
                    continue
                view.advanced = trio.Event()
                await view.advanced.wait()
            return True
        return False
