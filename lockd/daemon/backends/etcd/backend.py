"""The etcd backend: every lock decision is one etcd transaction (docs/contract.md §11).

Layout and records: ``records.py``; the queue of a key: ``waiting.py``; the
design and why: docs/etcd-design.md. In short:

- a grant puts ``h/<handle>`` on a lease of its own (the TTL, whole seconds)
  and, for ``releaseOnClose``, ``b/<handle>`` on the daemon's session lease;
  its fence is the key's create revision;
- every decision reads the key's directory at revision R and commits only
  if nothing in it was written after R (one compare over the directory); a
  free key is taken in one transaction ("directory empty");
- a write whose outcome is unknown, or a grant whose reply could not be
  written, puts the hold on the clean-up list: it is deleted (and its lease
  revoked) as soon as etcd answers again, so no late commit leaves an
  orphan hold.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial

import trio

from lockd.config import BackendSettings
from lockd.core import Refused
from lockd.daemon.backends import RemoteHold, RemoteStatus
from lockd.daemon.backends.etcd.acquiring import Acquirer, directory_of
from lockd.daemon.backends.etcd.cleanup import CleanupList
from lockd.daemon.backends.etcd.crossbreak import break_waiting
from lockd.daemon.backends.etcd.gateway import (
    EtcdGateway,
    LeaseNotFound,
)
from lockd.daemon.backends.etcd.holdloss import BREAK_RECORD, break_record
from lockd.daemon.backends.etcd.holdwatch import HoldWatch
from lockd.daemon.backends.etcd.leases import HEADROOM_S, LeasePool
from lockd.daemon.backends.etcd.nodeclaim import pid_place
from lockd.daemon.backends.etcd.reading import DirectoryReader
from lockd.daemon.backends.etcd.reconcile import Reconciler
from lockd.daemon.backends.etcd.records import Directory, Hold, Layout
from lockd.daemon.backends.etcd.session import Session
from lockd.daemon.backends.etcd.sessionkeeper import SessionKeeper
from lockd.daemon.backends.etcd.supply import HoldSupply, kept_lease, lease_seconds
from lockd.daemon.backends.etcd.tasks import keep_running
from lockd.daemon.backends.etcd.waiting import KeyQueue
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    Op,
    PutOp,
    RangeOp,
    RangeResult,
)
from lockd.daemon.clock import Clock
from lockd.daemon.protocol import Acquire
from lockd.identity import Caller
from lockd.timefmt import format_epoch_ms

log = logging.getLogger("lockd.etcd")

#: failed releases remembered for their holders' retries (the oldest forgotten).
RELEASED_LATER_KEPT = 4096


def binding_of(hold_key: bytes) -> bytes:
    """The binding key of the hold at ``hold_key`` (``.../h/<handle>`` -> ``.../b/<handle>``)."""
    cut = hold_key.rindex(b"/h/")
    return hold_key[:cut] + b"/b/" + hold_key[cut + 3 :]


class EtcdBackend:
    """One daemon's side of the locks kept in etcd. Run it with ``await nursery.start(b.run)``."""

    def __init__(self, etcd: EtcdGateway, settings: BackendSettings, clock: Clock) -> None:
        self.etcd = etcd
        self.settings = settings
        self.clock = clock
        self.node = settings.node_name
        self.timeout = settings.etcd_timeout
        self.layout = Layout(settings.prefix)
        #: the highest fence this daemon handed out (``stats``).
        self.last_fence = 0
        self._queues: dict[str, KeyQueue] = {}
        #: status and list: a key's directory, held keys a page at a time.
        self.reader = DirectoryReader(etcd, self.layout)
        #: etcd keys to delete and leases to revoke once etcd answers.
        self.cleanup = CleanupList(etcd, self.layout)
        #: hold keys whose release failed and went to the clean-up list, oldest
        #: first: the holder's retry is answered as released (see release()).
        self._released_later: dict[bytes, None] = {}
        self.sessions = SessionKeeper(etcd, settings, self.layout, self.cleanup, self._session_lost)
        #: holds and waiter records to write, with leases kept and granted ahead.
        self.supply = HoldSupply(etcd, clock, self.layout, self.node, self.sessions, self.cleanup)
        place = pid_place()
        self.acquirer = Acquirer(
            etcd,
            self.layout,
            clock,
            settings,
            place,
            self.sessions,
            self.supply,
            self.cleanup,
            track=self.track,
            queue_for=self._queue,
        )
        #: releaseOnClose holds granted on each connection: conn -> hold keys.
        self._bound: dict[int, dict[bytes, Hold]] = defaultdict(dict)
        self._nursery: trio.Nursery | None = None
        #: told, once a session is lost, which bound holds of this daemon went with it.
        self.on_session_lost: Callable[[list[Hold]], None] = lambda holds: None
        #: losses of this daemon's holds made elsewhere, pushed (docs/contract.md §12.1).
        self.hold_watch = HoldWatch(self)
        #: where this daemon's pids mean something (holds record it, for ``alive``).
        self.pid_place = place
        #: stop requests of breaks this daemon is waiting out (crossbreak.py).
        self.stop_requests: set[bytes] = set()

    @property
    def nursery(self) -> trio.Nursery | None:
        """Where the backend's background tasks run (None until :meth:`run` started)."""
        return self._nursery

    # ------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the session and the clean-up list going until cancelled.

        Starts even while etcd is down (``hello`` must answer): requests
        then fail with BACKEND_UNAVAILABLE until a session is granted.
        """
        async with trio.open_nursery() as nursery:
            self._nursery = self.supply.nursery = nursery
            nursery.start_soon(keep_running, "clean_up", self.cleanup.run)
            nursery.start_soon(keep_running, "reconcile", Reconciler(self).run)
            await nursery.start(self.sessions.run)
            task_status.started()

    async def close(self) -> None:
        """A clean stop: bound holds become TTL holds, then the session ends now.

        As with the embedded store, a stop is not the clients leaving: the
        ``releaseOnClose`` holds of this daemon's connections stay as plain
        TTL holds (their bindings would go with the session). Its waiters
        leave the queues at once with the session.
        """
        self.sessions.closing = True
        with trio.move_on_after(self.settings.etcd_timeout):
            for bound in self._bound.values():
                for hold in bound.values():
                    await self._unbind(hold)
            self._bound.clear()
            await self.sessions.close()

    async def _unbind(self, hold: Hold) -> None:
        """Rewrite a bound hold as a TTL hold (same lease, same fence), if it still holds."""
        current = await self.find(hold.key, hold.handle)
        if current is None or not current.bound:
            return
        hold_key = self.layout.hold(hold.key, hold.handle)
        await self.etcd.txn(
            [Compare(hold_key, "mod_revision", "==", current.mod_revision)],
            [
                PutOp(hold_key, replace(current, bound=False).value(), lease=current.lease),
                DeleteOp(self.layout.binding(hold.key, hold.handle)),
            ],
        )

    def _session_lost(self) -> None:
        """The session in force was lost: its bindings and waiter keys went with it."""
        self.on_session_lost([hold for bound in self._bound.values() for hold in bound.values()])
        for key_queue in self._queues.values():
            key_queue.changed.set()

    @property
    def session_lease(self) -> int | None:
        """The session lease in force, if any (None while etcd has granted none)."""
        return self.sessions.lease

    @property
    def leases(self) -> LeasePool:
        """The leases kept for the next grants (:class:`HoldSupply`)."""
        return self.supply.leases

    @property
    def _granting(self) -> set[int]:  # tests read it by this name
        return self.supply.granting

    @property
    def _session(self) -> Session | None:  # tests read it by this name
        return self.sessions.session

    @property
    def reconcile_wanted(self) -> trio.Event:
        """Set when a new session is in force: the reconciler looks at once."""
        return self.sessions.reconcile_wanted

    @reconcile_wanted.setter
    def reconcile_wanted(self, event: trio.Event) -> None:
        self.sessions.reconcile_wanted = event

    # -------------------------------------------------------------- helpers

    def track(self, hold: Hold, conn: int | None = None) -> None:
        """Note a grant: the last fence, and a bound hold's connection (released when it closes)."""
        self.last_fence = max(self.last_fence, hold.fence)
        if hold.bound and conn is not None:
            self._bound[conn][self.layout.hold(hold.key, hold.handle)] = hold

    @property
    def doomed_keys(self) -> frozenset[bytes]:
        """Keys on the clean-up list."""
        return self.cleanup.doomed_keys

    @property
    def _doomed_keys(self) -> set[bytes]:  # tests read the list by these names
        return self.cleanup.keys

    @property
    def _doomed_leases(self) -> set[int]:
        return self.cleanup.leases

    def delete_later(self, etcd_key: bytes) -> None:
        self.cleanup.delete_later(etcd_key)

    def revoke_later(self, lease: int) -> None:
        self.cleanup.revoke_later(lease)

    async def discard(self, hold: Hold) -> None:
        """Delete a grant nobody will get, before the caller answers (:class:`Acquirer`)."""
        await self.acquirer.delivery.discard(hold)

    def release_undelivered(self, hold: RemoteHold) -> None:
        assert isinstance(hold, Hold)
        self.acquirer.delivery.release_undelivered(hold)

    def known_session_keys(self) -> set[bytes]:
        """Every key this daemon means to keep on its session lease (``reconcile.py``).

        Its node claim, the waiter keys of its queues, the stop requests of
        its breaks under way and the bindings of the holds it knows: bound
        holds of its connections, holds granted to its waiters (delivered or
        not yet).
        """
        known = {self.layout.node(self.node), *self.stop_requests}
        holds: set[bytes] = set()
        for bound in self._bound.values():
            holds.update(bound)
        for key_queue in self._queues.values():
            known.update(key_queue.waiters)
            holds.update(key_queue.expected)
            holds.update(key_queue.holding)
        known.update(binding_of(hold_key) for hold_key in holds)
        return known

    async def _read(self, key: str) -> Directory:
        return await self.reader.read(key)

    # -------------------------------------------------------------- acquire

    async def acquire(
        self,
        req: Acquire,
        caller: Caller,
        conn: int,
        timeout: float | None,
        parked: trio.Event | None = None,
        *,
        listens: bool = False,
    ) -> Hold | Refused | None:
        """Take ``req.key`` now, or (with ``timeout``) wait in its queue (:class:`Acquirer`)."""
        return await self.acquirer.acquire(req, caller, conn, timeout, parked, listens=listens)

    def _queue(self, key: str, revision: int) -> KeyQueue:
        key_queue = self._queues.get(key)
        if key_queue is None:
            key_queue = self._queues[key] = KeyQueue(self, key, revision)
            assert self._nursery is not None
            self._nursery.start_soon(self._serve_queue, key_queue)
        return key_queue

    async def _serve_queue(self, key_queue: KeyQueue) -> None:
        def retire() -> None:
            if self._queues.get(key_queue.key) is key_queue:
                del self._queues[key_queue.key]

        try:
            await keep_running("queue", partial(key_queue.run, retire))
        finally:
            retire()

    # ----------------------------------------------------- the other ops

    async def find(self, key: str, handle: str) -> Hold | None:
        hold_key, binding_key = self.layout.hold(key, handle), self.layout.binding(key, handle)
        result = await self.etcd.txn([], [RangeOp(hold_key), RangeOp(binding_key)])
        holds, bindings = result.responses
        assert isinstance(holds, RangeResult) and isinstance(bindings, RangeResult)
        if not holds.kvs:
            return None
        hold = Hold.parse(key, handle, holds.kvs[0])
        if hold.needs_binding and not bindings.kvs:
            self.delete_later(hold_key)  # its daemon's session ended: the hold is dead
            return None
        return hold

    async def renew(self, hold: RemoteHold, ttl_ms: int) -> Hold | None:
        assert isinstance(hold, Hold)
        hold_key = self.layout.hold(hold.key, hold.handle)
        ttl_s = lease_seconds(ttl_ms)
        sent = self.clock.wall_ms()
        if ttl_s * 1000 == hold.ttl_ms:
            try:
                ttl = await self.etcd.lease_keepalive(hold.lease)
            except LeaseNotFound:
                return None
            self.supply.leases.note(hold.lease, sent + ttl * 1000)
            renewed = replace(
                hold,
                expires_at=sent + min(ttl, ttl_s) * 1000,
                lease_end=sent + ttl * 1000,
                tied=False,
            )
        else:
            grant = await self.etcd.lease_grant(ttl_s + HEADROOM_S)
            self.supply.leases.note(grant.id, sent + grant.ttl * 1000)
            renewed = replace(
                hold,
                lease=grant.id,
                ttl_ms=ttl_s * 1000,
                expires_at=sent + ttl_s * 1000,
                lease_end=sent + grant.ttl * 1000,
                tied=False,
            )
        # Rewrite the record (its expiry), unless it changed since it was read;
        # a tied hold is untied on the way (its holder has it).
        ops: list[Op] = [PutOp(hold_key, renewed.value(), lease=renewed.lease)]
        if hold.tied:
            ops.append(DeleteOp(self.layout.binding(hold.key, hold.handle)))
        result = await self.etcd.txn(
            [Compare(hold_key, "mod_revision", "==", hold.mod_revision)], ops
        )
        if renewed.lease != hold.lease:
            self.supply.keep_lease(kept_lease(hold if result.succeeded else renewed))
        return renewed if result.succeeded else None

    async def release(self, key: str, handle: str) -> bool:
        """Delete the hold; with waiters queued, grant them in the same transaction.

        The hand-off needs a view of the key's queue: this daemon has one
        while it has waiters on the key or holds granted through its queue
        (``KeyQueue.hand_off``). Without one, or with nothing to grant, the
        release is a plain deletion and each waiter's daemon grants it.
        """
        hold_key, binding_key = self.layout.hold(key, handle), self.layout.binding(key, handle)
        key_queue = self._queues.get(key)
        try:
            result = await key_queue.hand_off(hold_key) if key_queue is not None else None
            if result is None:
                result = await self.etcd.txn(
                    [],
                    [DeleteOp(hold_key, prev_kv=True), DeleteOp(binding_key, prev_kv=True)],
                )
        except BaseException:
            # Its holder asked for its end: whatever answer it gets now
            # (BACKEND_UNAVAILABLE, or none), the clean-up list ends it once
            # etcd answers. Left to its lease it could outlive its TTL by
            # far: etcd extends every lease at each new leader, so quorum
            # losses closer together than a TTL kept an abandoned 4 s hold
            # for a minute (issue 23, bench/etcd_chaos.py).
            self.delete_later(hold_key)
            self.delete_later(binding_key)
            self._released_later[hold_key] = None
            if len(self._released_later) > RELEASED_LATER_KEPT:
                del self._released_later[next(iter(self._released_later))]
            raise
        holds, bindings = result.responses[:2]
        if not getattr(holds, "prev_kvs", None):
            # The clean-up list ended it after this release failed: what the
            # holder asked for is done, so its retry is not "not_holder".
            if hold_key in self._released_later:
                del self._released_later[hold_key]
                return True
            return False
        self._released_later.pop(hold_key, None)
        hold = Hold.parse(key, handle, holds.prev_kvs[0])  # type: ignore[union-attr]
        self.supply.keep_lease(kept_lease(hold))
        for bound in self._bound.values():
            bound.pop(hold_key, None)
        # A bound (or tied) hold whose binding had gone was dead already: not the holder.
        return not hold.needs_binding or bool(getattr(bindings, "prev_kvs", None))

    async def status(self, key: str) -> RemoteStatus:
        return await self.reader.status(key)

    async def list_held(
        self, prefix: str, limit: int, after: str | None
    ) -> tuple[list[RemoteStatus], str | None]:
        """Held keys under ``prefix`` in key order after ``after`` (:class:`DirectoryReader`)."""
        return await self.reader.list_held(prefix, limit, after)

    async def break_lock(
        self,
        key: str,
        *,
        by: str | None = None,
        reason: str | None = None,
        grace_ms: int = 0,
        keep: frozenset[str] = frozenset(),
        stop_local: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> list[Hold]:
        """Delete every hold of ``key``; with ``by``, write who and why beside it.

        The break record (``<directory>x``, holdloss.py) is put in the same
        transaction, so the daemons whose holders lost a hold see it in the
        same watch event; it hangs on the session lease and is deleted right
        after (the clean-up list), since the watch has seen it by then.
        With ``grace_ms``, the holders of ``keep`` (this daemon's listening
        connections) are told and waited for by ``stop_local``, and holds
        other daemons granted to listening connections are asked to stop
        through etcd; both within the grace (crossbreak.py).
        """
        if grace_ms > 0 and by is not None:
            if stop_local is None:
                return await break_waiting(self, key, by, reason or "", grace_ms, keep=keep)
            return await break_waiting(
                self, key, by, reason or "", grace_ms, keep=keep, stop_local=stop_local
            )
        directory_key = self.layout.directory(key)
        ops: list[Op] = [
            RangeOp(directory_key, prefix=True),
            DeleteOp(directory_key + b"h/", prefix=True),
            DeleteOp(directory_key + b"b/", prefix=True),
        ]
        record_key = directory_key + BREAK_RECORD
        if by is not None:
            at = format_epoch_ms(self.clock.wall_ms())
            value = break_record(by, reason or "", at)
            ops.append(PutOp(record_key, value, lease=self.session_lease or 0))
        result = await self.etcd.txn([], ops)
        if by is not None:
            self.delete_later(record_key)
        directory = directory_of(self.layout, key, result.responses[0], result.header.revision)
        for hold in directory.holds:
            self.revoke_later(hold.lease)
        return directory.holds

    def connection_closed(self, conn: int) -> None:
        bound = self._bound.pop(conn, None)
        for hold in (bound or {}).values():
            self.release_undelivered(hold)

    def gauges(self) -> dict[str, object]:
        """``stats`` gauges: this daemon's own (counting every host's keys would need a scan)."""
        waiters = sum(len(q.waiters) for q in self._queues.values())
        return {"held": None, "waiters": waiters, "fence": self.last_fence, "node": self.node}
