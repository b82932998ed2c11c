"""What one key's queue knows: its waiters, their grants, its view of the directory.

The state a :class:`~lockd.daemon.backends.etcd.waiting.KeyQueue` shares
with its parts (the watch, the granter, the departures), and the
bookkeeping on it that does no I/O: a read or the watch's events brought
into the view, a grant delivered to the waiter it was for. Each part is
given this object, never the queue or the backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends.etcd.records import Directory, Hold, Layout, Waiter
from lockd.daemon.backends.etcd.wire import Event, KeyValue, RangeResult, TxnResult

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.cleanup import CleanupList

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


class QueueView:
    """One key's queue on this daemon as it knows it: its waiters and the directory's records."""

    def __init__(self, layout: Layout, cleanup: CleanupList, key: str, revision: int) -> None:
        self.layout = layout
        self.cleanup = cleanup
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
        self.advanced = trio.Event()
        self.watch_from = revision + 1
        #: etcd keys whose deletion can let a waiter of ours move, as of the
        #: last decision that granted nothing (None: any deletion wakes).
        self.wake_keys: frozenset[bytes] | None = None
        #: decisions made (how often a deletion woke it: tests, debugging).
        self.decisions = 0

    def hold_key(self, waiter: LocalWaiter) -> bytes:
        return self.layout.hold(self.key, waiter.hold.handle)

    def granted_in(self, waiter: Waiter, released: bytes) -> bool:
        """True when the view shows the hold ``waiter`` asks for (or it is the one released)."""
        assert waiter.handle is not None and self.records is not None
        hold_key = self.layout.hold(self.key, waiter.handle)
        return hold_key == released or hold_key in self.records

    def granted(self, waiter: LocalWaiter, hold: Hold, *, seen: bool = False) -> None:
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
        hold_key = self.hold_key(waiter)
        self.expected.pop(hold_key, None)
        self.holding.add(hold_key)
        waiter.done.set()

    def deliver_read(self) -> None:
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
                self.granted(waiter, Hold.parse(self.key, waiter.hold.handle, record), seen=True)
        self.holding.intersection_update(self.records)

    def learn(self, directory: Directory) -> None:
        """Take a read of the directory, unless what is known is newer.

        Either way, grants the view shows to waiters it holds now are
        delivered: a waiter joins after its enqueue's reply, and the watch
        may have shown its grant (by another daemon) before that.
        """
        if self.records is None or directory.revision > self.revision:
            self.records = {record.key: record for record in directory.records}
            self.revision = directory.revision
            self.advanced.set()
        self.deliver_read()

    def apply(self, events: list[Event]) -> None:
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
                    self.granted(waiter, hold, seen=True)
        if events:
            self.revision = max(self.revision, events[-1].kv.mod_revision)
            self.advanced.set()

    def directory(self) -> Directory:
        """The directory as the view shows it now."""
        assert self.records is not None
        records = list(self.records.values())
        return Directory.parse(self.layout, self.key, records, self.revision)

    def directory_of(self, result: TxnResult) -> Directory:
        """The directory a transaction read (its last response)."""
        read = result.responses[-1]
        assert isinstance(read, RangeResult)
        return Directory.parse(self.layout, self.key, read.kvs, result.header.revision)
