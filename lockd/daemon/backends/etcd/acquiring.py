"""Taking a lock key on etcd: at once when the rules allow, else in the key's queue.

:meth:`Acquirer.acquire` first tries to take the key in one transaction:
a free key's directory must be empty (``lockd.core.admit_free``); else it
reads the directory, asks ``lockd.core.admit`` about what it shows, and
commits guarded by that read's revision, retrying when the guard fails. A
blocking acquire that must wait writes a waiter record (on the session
lease; on a key where this daemon's acquires parked lately, in the failure
branch of that first transaction, so parking costs one write) and joins
the key's :class:`~lockd.daemon.backends.etcd.waiting.KeyQueue` until it
is granted, its deadline passes or it is cancelled; a grant that crosses a
leave is discarded, never left behind. A tied grant (its record
ends with this daemon's session until delivered) is untied before it is
answered (:meth:`Acquirer._confirm`).

It is separate from the backend (:mod:`lockd.daemon.backends.etcd.backend`),
which answers the other ops and keeps the books of what it granted,
because the acquire is the one op with a queue, retries and a wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import trio

from lockd import core
from lockd.config import BackendSettings
from lockd.core import Refused
from lockd.daemon.backends.etcd.cleanup import CleanupList
from lockd.daemon.backends.etcd.delivery import Delivery
from lockd.daemon.backends.etcd.gateway import (
    EtcdGateway,
    EtcdUnavailable,
    LeaseNotFound,
)
from lockd.daemon.backends.etcd.records import Directory, Hold, Layout, Waiter
from lockd.daemon.backends.etcd.sessionkeeper import SessionKeeper
from lockd.daemon.backends.etcd.supply import HoldSupply, lease_seconds
from lockd.daemon.backends.etcd.waiting import RETRY_INTERVAL, KeyQueue, LocalWaiter
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    Op,
    PutOp,
    RangeOp,
    RangeResult,
)
from lockd.daemon.clock import Clock
from lockd.daemon.leases import new_handle_id
from lockd.daemon.protocol import Acquire
from lockd.identity import Caller
from lockd.logfmt import kv

log = logging.getLogger("lockd.etcd")

#: lock keys remembered as "a blocking acquire of this daemon parked on it
#: lately" (the oldest forgotten): the next one queues in its first write.
PARKED_KEYS_KEPT = 4096


@dataclass(frozen=True)
class Queued:
    """A blocking acquire queued by its first transaction: its waiter record, written
    in the failure branch of the take-if-free, and the directory read after it."""

    record: Waiter
    directory: Directory


@dataclass(frozen=True)
class Crossed:
    """A grant that came first: another daemon's hand-off granted the waiter record a
    first transaction wrote, before the acquire, which was not to wait, took it back."""

    hold: Hold


def guard(layout: Layout, key: str, revision: int) -> Compare:
    """Nothing in the key's directory was written after ``revision``."""
    return Compare(layout.directory(key), "mod_revision", "<", revision + 1, prefix=True)


def directory_of(layout: Layout, key: str, read: object, revision: int) -> Directory:
    """The key's directory from a range read over it in a transaction's results."""
    assert isinstance(read, RangeResult)
    return Directory.parse(layout, key, read.kvs, revision)


class Acquirer:
    """Acquires of one daemon: tried at once, queued, confirmed, or discarded."""

    def __init__(
        self,
        etcd: EtcdGateway,
        layout: Layout,
        clock: Clock,
        settings: BackendSettings,
        pid_place: str,
        sessions: SessionKeeper,
        supply: HoldSupply,
        cleanup: CleanupList,
        *,
        track: Callable[[Hold, int | None], None],
        queue_for: Callable[[str, int], KeyQueue],
    ) -> None:
        self._etcd = etcd
        self._layout = layout
        self._clock = clock
        self._node = settings.node_name
        self._timeout = settings.etcd_timeout
        self._pid_place = pid_place
        self._sessions = sessions
        self._supply = supply
        self._cleanup = cleanup
        #: the backend's books: a grant's fence, a bound hold's connection.
        self._track = track
        #: the key's queue on this daemon, made and started if it has none.
        self._queue_for = queue_for
        #: keys a blocking acquire parked on lately (oldest first): see :meth:`_try`.
        self._parked_keys: dict[str, None] = {}
        #: a grant's way to its caller: untied first, or discarded.
        self.delivery = Delivery(etcd, layout, settings.etcd_timeout, supply, cleanup, track)

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
        template = Hold(
            key=req.key,
            handle="",
            principal=caller.principal,
            owner=req.owner,
            mode=req.mode,
            limit=req.limit,
            node=self._node,
            pid=caller.pid,
            process=caller.process,
            ttl_ms=0,
            expires_at=0,
            lease=0,
            bound=req.release_on_close,
            pid_start=caller.start if caller.pid > 0 else None,
            pid_place=self._pid_place or None,
            listens=listens,
        )
        ttl_s = lease_seconds(req.ttl_ms)
        if timeout is None:
            tried = await self._try(template, ttl_s, conn, waiting=False)
            assert not isinstance(tried, (Directory, Queued, Crossed))  # it never queues
            return tried
        # A blocking acquire tries once whatever its timeout (0 included), as
        # the embedded engine does; while etcd is down it keeps trying,
        # within its timeout.
        deadline = trio.current_time() + timeout
        parked = parked if parked is not None else trio.Event()
        outcome: Hold | Refused | Directory | Queued | Crossed | None = None
        try:
            outcome = await self._try(template, ttl_s, conn, waiting=True, may_queue=True)
        except EtcdUnavailable as exc:
            log.debug(kv(event="acquire_retry", key=req.key, error=exc))
            parked.set()  # it waits for etcd now: the connection goes on
            with trio.move_on_at(deadline):
                while True:
                    await trio.sleep(RETRY_INTERVAL)
                    try:
                        outcome = await self._try(template, ttl_s, conn, waiting=True)
                        break
                    except EtcdUnavailable as again:
                        log.debug(kv(event="acquire_retry", key=req.key, error=again))
        if isinstance(outcome, Directory):  # must wait
            return await self._wait(template, ttl_s, conn, outcome, deadline, parked)
        if isinstance(outcome, Queued):  # waiting already
            template = replace(template, handle=outcome.record.handle or "")
            return await self._wait(template, ttl_s, conn, outcome, deadline, parked)
        if isinstance(outcome, Crossed):
            return await self.delivery.deliver(outcome.hold, conn, deadline)
        return outcome

    async def _try(
        self, template: Hold, ttl_s: int, conn: int, *, waiting: bool, may_queue: bool = False
    ) -> Hold | Refused | Directory | Queued | Crossed | None:
        """Take the key now if the rules allow (:meth:`_take_now`).

        ``may_queue``: a blocking acquire on a key where this daemon's
        acquires parked lately writes its waiter record in the failure
        branch of its first transaction, named after the hold it tries to
        take: parking then costs one raft write, not two (docs/etcd-design.md §3).
        """
        queue_as: Waiter | None = None
        if may_queue and template.key in self._parked_keys:
            template = replace(template, handle=new_handle_id())
            like = self._waiter_like(template, ttl_s)
            queue_as = await self._supply.new_waiter_record(template.key, like)
        hold, refresh = await self._supply.new_hold(template, ttl_s)
        for attempt in range(3):
            session = self._sessions.lease
            try:
                outcome = await self._take_now(hold, conn, waiting=waiting, queue_as=queue_as)
                break
            except LeaseNotFound:
                if queue_as is not None and attempt < 2:
                    # The waiter's lease (the session) or the hold's: nothing
                    # committed. Once more without the waiter, under a new handle.
                    queue_as = None
                    template = replace(template, handle="")
                    hold, refresh = await self._supply.new_hold(template, ttl_s, reuse=False)
                    continue
                # A lease the transaction put a key on is gone. A kept lease
                # may have ended before its keepalive arrived: once more with
                # a new one. A new lease cannot be gone yet, so then it was
                # the session, for a bound hold's binding (SessionKeeper.refused).
                # Either way the failed hold's lease is being revoked: the
                # next try gets a new one.
                if attempt == 2 or (refresh is None and not hold.bound):
                    raise
                if refresh is None and session is not None:
                    self._sessions.refused(session)
                hold, refresh = await self._supply.new_hold(template, ttl_s, reuse=False)
        if isinstance(outcome, Hold):
            try:
                return await self._supply.settle(outcome, refresh)
            except BaseException:  # cancelled after the commit: nobody gets the handle
                self.delivery.release_undelivered(outcome)
                raise
        self._supply.recycle(hold, refresh)
        return outcome

    async def _take_now(
        self, hold: Hold, conn: int, *, waiting: bool, queue_as: Waiter | None = None
    ) -> Hold | Refused | Directory | Queued | Crossed | None:
        """Take the key now if the rules allow; else busy (None) or the directory to queue on.

        With ``queue_as`` (a waiter record named after ``hold``) the first
        transaction writes it when the key is not free, and the outcome is
        :class:`Queued` when the rules say wait. When they say otherwise
        (take it now, or refuse) the record is taken back first, and a grant
        of it that came first is the outcome (:class:`Crossed`).
        """
        key, directory_key = hold.key, self._layout.directory(hold.key)
        # The fast path: what the core answers on a free key, committed only
        # if the key is free (its directory empty), in one transaction.
        verdict = core.admit_free(key, hold.mode, hold.limit)
        if isinstance(verdict, Refused):
            return verdict
        puts = await self._supply.hold_puts(hold)
        compares = [Compare(directory_key, "create_revision", "==", 0, prefix=True)]
        ops: list[Op] = puts
        read = RangeOp(directory_key, prefix=True)
        failure: list[Op] = [read]
        if queue_as is not None:  # the read comes after the put: it shows the waiter
            failure = [PutOp(queue_as.etcd_key, queue_as.value(), lease=queue_as.lease), read]
        retaken: Hold | None = None  # the caller's own hold a re-take replaces
        while True:
            try:
                result = await self._etcd.txn(compares, ops, failure)
            except BaseException:
                self.delivery.release_undelivered(hold)
                if queue_as is not None:  # maybe written: taken back once etcd answers
                    self._cleanup.delete_later(queue_as.etcd_key)
                raise
            if result.succeeded:
                if retaken is not None:  # only now: a failed guard leaves it held
                    self._cleanup.revoke_later(retaken.lease)
                granted = replace(hold, fence=result.header.revision)
                self._track(granted, conn)
                self._parked_keys.pop(key, None)
                return granted
            directory = directory_of(
                self._layout, key, result.responses[-1], result.header.revision
            )
            queued: Waiter | None = None
            if queue_as is not None:
                queued = replace(queue_as, create_revision=result.header.revision)
                queue_as, failure = None, [read]
            own = directory.own_hold(hold.principal, hold.owner)
            holds = directory.holds
            verdict = core.admit(
                key,
                hold.mode,
                hold.limit,
                held_mode=holds[0].mode if holds else None,
                held_count=len(holds),
                # Our own waiter is the newest claim: it changes no limit in force.
                key_limit=directory.limit_in_force(),
                queued=len(directory.waiters) - (0 if queued is None else 1),
                own_hold=own,
                blocking=waiting,
            )
            if queued is not None:
                if verdict == core.PARK:
                    return Queued(queued, directory)
                self._parked_keys.pop(key, None)
                crossed = await self._unqueue(key, queued)
                if crossed is not None:
                    if isinstance(verdict, Refused):
                        await self.delivery.discard(crossed)
                        return verdict
                    return Crossed(crossed)
                # Gone without a grant: the decision stands (the guard below
                # is the read's revision, and a deletion does not fail it).
            if isinstance(verdict, Refused):
                return verdict
            if verdict == core.BUSY:
                return None
            if verdict == core.PARK:
                return directory
            ops = [DeleteOp(dead) for dead in directory.dead]
            retaken = None
            if verdict == core.RETAKE:
                assert own is not None
                hold = replace(hold, retake=True)
                ops += [
                    DeleteOp(self._layout.hold(key, own.handle)),
                    DeleteOp(self._layout.binding(key, own.handle)),
                ]
                retaken = own
            ops += puts
            compares = [guard(self._layout, key, directory.revision)]

    def _waiter_like(self, template: Hold, ttl_s: int) -> Waiter:
        """The waiter record of ``template`` (etcd key and lease filled in later).

        It names the whole hold, so whichever daemon releases the key can
        grant it (KeyQueue.hand_off).
        """
        return Waiter(
            b"",
            0,
            template.principal,
            template.owner,
            template.mode,
            template.limit,
            self._node,
            handle=template.handle,
            ttl_ms=ttl_s * 1000,
            pid=template.pid,
            process=template.process,
            bound=template.bound,
            since=self._clock.wall_ms(),
            pid_start=template.pid_start,
            pid_place=template.pid_place,
            listens=template.listens,
        )

    def _note_parked(self, key: str) -> None:
        self._parked_keys.pop(key, None)
        self._parked_keys[key] = None
        if len(self._parked_keys) > PARKED_KEYS_KEPT:
            del self._parked_keys[next(iter(self._parked_keys))]

    async def _wait(
        self,
        template: Hold,
        ttl_s: int,
        conn: int,
        found: Directory | Queued,
        deadline: float,
        parked: trio.Event,
    ) -> Hold | None:
        """Queue behind the key's waiters until granted or the deadline (trio clock).

        ``found``: the directory to queue on (the waiter key is written
        here), or the waiter the first transaction wrote already
        (``template`` then carries its handle). ``parked`` is set once the
        waiter key is written and its queue knows it.
        """
        key = template.key
        waiter: LocalWaiter | None = None
        key_queue: KeyQueue | None = None
        try:
            with trio.move_on_at(deadline):
                if isinstance(found, Queued):
                    # No checkpoint since its transaction: nothing can have cancelled it.
                    waiter, directory = LocalWaiter(found.record, template, ttl_s), found.directory
                else:
                    template = replace(template, handle=new_handle_id())
                    like = self._waiter_like(template, ttl_s)
                    record = await self._supply.new_waiter_record(key, like)
                    waiter, directory = await self._enqueue(key, record, template, ttl_s, parked)
                key_queue = self._queue_for(key, directory.revision)
                key_queue.join(waiter, directory)
                parked.set()
                self._note_parked(key)
                self._supply.prepare_lease(ttl_s)
                await waiter.done.wait()
            granted = waiter.granted if waiter is not None else None
            if granted is None and waiter is not None and key_queue is not None:
                granted = await key_queue.leave(waiter)  # the grant may have come first
        except BaseException:
            # Cancelled (connection gone, cancel, stop): leave; a grant that
            # crossed is released, nobody will get its handle.
            if waiter is not None and key_queue is not None:
                crossed = await key_queue.leave(waiter)
                if crossed is not None:
                    await self.delivery.discard(crossed)
            raise
        if granted is None:
            return None
        return await self.delivery.deliver(granted, conn, deadline)

    async def _unqueue(self, key: str, record: Waiter) -> Hold | None:
        """Take back a waiter record the first transaction wrote; a grant of it that came
        first, if one did.

        As a leaving waiter does (``Departures._withdraw``): the deletion and a read
        of its hold in one transaction; once the key is gone no grant of it
        can commit. While etcd does not answer, the clean-up list deletes the
        key, then the hold and binding a grant may have written.
        """
        assert record.handle is not None
        hold_key = self._layout.hold(key, record.handle)
        try:
            result = await self._etcd.txn(
                [], [DeleteOp(record.etcd_key, prev_kv=True), RangeOp(hold_key)]
            )
        except BaseException:
            self._cleanup.delete_later(record.etcd_key)
            self._cleanup.delete_later(hold_key)
            self._cleanup.delete_later(self._layout.binding(key, record.handle))
            raise
        deleted, read = result.responses
        assert isinstance(read, RangeResult)
        if getattr(deleted, "prev_kvs", None) or not read.kvs:
            return None
        return Hold.parse(key, record.handle, read.kvs[0])

    async def _enqueue(
        self, key: str, record: Waiter, template: Hold, ttl_s: int, parked: trio.Event
    ) -> tuple[LocalWaiter, Directory]:
        """Write the waiter key (retrying while etcd is down) and read the queue after it."""
        directory_key = self._layout.directory(key)
        while True:
            put = PutOp(record.etcd_key, record.value(), lease=record.lease)
            try:
                result = await self._etcd.txn([], [put, RangeOp(directory_key, prefix=True)])
            except (EtcdUnavailable, LeaseNotFound) as exc:
                self._cleanup.delete_later(record.etcd_key)
                log.debug(kv(event="enqueue_retry", key=key, error=exc))
                parked.set()  # it waits for etcd now: the connection goes on
                if isinstance(exc, LeaseNotFound):  # the session is over (its only lease)
                    self._sessions.refused(record.lease)
                else:
                    await trio.sleep(RETRY_INTERVAL)
                record = await self._supply.next_waiter_record(key, record)
                continue
            except BaseException:
                self._cleanup.delete_later(record.etcd_key)
                raise
            directory = directory_of(self._layout, key, result.responses[1], result.header.revision)
            record = replace(record, create_revision=result.header.revision)
            return LocalWaiter(record, template, ttl_s), directory
