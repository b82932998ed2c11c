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

import contextlib
import itertools
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import trio

from lockd import core
from lockd.config import BackendSettings
from lockd.core import Refused
from lockd.daemon.backends import BackendUnavailable, RemoteHold, RemoteStatus
from lockd.daemon.backends.etcd.gateway import (
    EtcdError,
    EtcdGateway,
    EtcdUnavailable,
    LeaseNotFound,
)
from lockd.daemon.backends.etcd.holdloss import BREAK_RECORD, break_record
from lockd.daemon.backends.etcd.holdwatch import HoldWatch
from lockd.daemon.backends.etcd.leases import HEADROOM_S, KeptLease, LeasePool, Refresh
from lockd.daemon.backends.etcd.nodeclaim import NodeTaken, claim_node, pid_place
from lockd.daemon.backends.etcd.reconcile import Reconciler
from lockd.daemon.backends.etcd.records import Directory, Hold, Layout, Waiter
from lockd.daemon.backends.etcd.session import Session
from lockd.daemon.backends.etcd.tasks import keep_running, logged
from lockd.daemon.backends.etcd.waiting import RETRY_INTERVAL, KeyQueue, LocalWaiter
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    KeyValue,
    Op,
    PutOp,
    RangeOp,
    RangeResult,
    prefix_end,
)
from lockd.daemon.clock import Clock
from lockd.daemon.engine import new_handle_id
from lockd.daemon.protocol import Acquire
from lockd.daemon.waiterview import MAX_LISTED_WAITERS
from lockd.identity import Caller
from lockd.logfmt import kv
from lockd.timefmt import format_epoch_ms

log = logging.getLogger("lockd.etcd")

#: etcd 3.4 grants no lease shorter than this; asking less gets this much.
MIN_LEASE_TTL = 2
#: etcd keys one clean-up transaction deletes at most (etcd allows 128 ops).
CLEANUP_BATCH = 64
#: records read per range while paging ``list``.
LIST_CHUNK = 512
#: the longest pause between clean-up attempts while etcd does not take them.
CLEANUP_BACKOFF_CAP = 0.5
#: failed releases remembered for their holders' retries (the oldest forgotten).
RELEASED_LATER_KEPT = 4096


def lease_seconds(ttl_ms: int) -> int:
    """``ttlMs`` rounded up to whole seconds, at least etcd's minimum lease."""
    return max(MIN_LEASE_TTL, math.ceil(ttl_ms / 1000))


def binding_of(hold_key: bytes) -> bytes:
    """The binding key of the hold at ``hold_key`` (``.../h/<handle>`` -> ``.../b/<handle>``)."""
    cut = hold_key.rindex(b"/h/")
    return hold_key[:cut] + b"/b/" + hold_key[cut + 3 :]


def kept_lease(hold: Hold) -> KeptLease:
    """The lease of a hold that ends, for the pool: it lives at least as its record says."""
    return KeptLease(hold.lease, hold.ttl_ms // 1000, max(hold.expires_at, hold.lease_end))


class EtcdBackend:
    """One daemon's side of the locks kept in etcd. Run it with ``await nursery.start(b.run)``."""

    def __init__(self, etcd: EtcdGateway, settings: BackendSettings, clock: Clock) -> None:
        self.etcd = etcd
        self.settings = settings
        self.clock = clock
        self.node = settings.node_name
        self.timeout = settings.etcd_timeout
        self.layout = Layout(settings.prefix)
        self._session: Session | None = None
        self._session_ready = trio.Event()
        self._seq = itertools.count(1)
        self.leases = LeasePool()
        self._granting: set[int] = set()  # TTLs with a lease being granted ahead
        #: the highest fence this daemon handed out (``stats``).
        self.last_fence = 0
        self._queues: dict[str, KeyQueue] = {}
        #: etcd keys to delete and leases to revoke once etcd answers (clean-up list).
        self._doomed_keys: set[bytes] = set()
        #: hold keys whose release failed and went to the clean-up list, oldest
        #: first: the holder's retry is answered as released (see release()).
        self._released_later: dict[bytes, None] = {}
        self._doomed_leases: set[int] = set()
        self._cleanup_wanted = trio.Event()
        #: session leases of ours that etcd ended (their keys are gone with them).
        self._ended_sessions: set[int] = set()
        #: set when a new session is in force: the reconciler looks at once.
        self.reconcile_wanted = trio.Event()
        #: releaseOnClose holds granted on each connection: conn -> hold keys.
        self._bound: dict[int, dict[bytes, Hold]] = defaultdict(dict)
        self._nursery: trio.Nursery | None = None
        self._closing = False
        #: told, once a session is lost, which bound holds of this daemon went with it.
        self.on_session_lost: Callable[[list[Hold]], None] = lambda holds: None
        #: losses of this daemon's holds made elsewhere, pushed (docs/contract.md §12.1).
        self.hold_watch = HoldWatch(self)
        #: where this daemon's pids mean something (holds record it, for ``alive``).
        self.pid_place = pid_place()

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
            self._nursery = nursery
            nursery.start_soon(keep_running, "clean_up", self._clean_up)
            nursery.start_soon(keep_running, "reconcile", Reconciler(self).run)
            await nursery.start(self._keep_session)
            task_status.started()

    async def close(self) -> None:
        """A clean stop: bound holds become TTL holds, then the session ends now.

        As with the embedded store, a stop is not the clients leaving: the
        ``releaseOnClose`` holds of this daemon's connections stay as plain
        TTL holds (their bindings would go with the session). Its waiters
        leave the queues at once with the session.
        """
        self._closing = True
        with trio.move_on_after(self.settings.etcd_timeout):
            for bound in self._bound.values():
                for hold in bound.values():
                    await self._unbind(hold)
            self._bound.clear()
            if self._session is not None:
                await self._session.close()

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

    async def _untie_txn(self, hold: Hold) -> bool:
        """Rewrite a tied hold untied, if it is unchanged and still live (its binding there).

        The binding must exist: once it is gone (the session ended) the hold
        is dead, and other daemons' decisions delete it; untying it then
        would bring back a hold they may be granting over.
        """
        hold_key = self.layout.hold(hold.key, hold.handle)
        binding_key = self.layout.binding(hold.key, hold.handle)
        result = await self.etcd.txn(
            [
                Compare(hold_key, "mod_revision", "==", hold.mod_revision),
                Compare(binding_key, "version", ">", 0),
            ],
            [
                PutOp(hold_key, replace(hold, tied=False).value(), lease=hold.lease),
                DeleteOp(binding_key),
            ],
            [RangeOp(hold_key)],
        )
        if result.succeeded:
            return True
        # An earlier attempt whose outcome was unknown may have untied it:
        # then the same grant (its create revision, the fence) is there untied.
        read = result.responses[0]
        assert isinstance(read, RangeResult)
        if read.kvs and read.kvs[0].create_revision == hold.fence:
            return not Hold.parse(hold.key, hold.handle, read.kvs[0]).needs_binding
        return False

    async def _confirm(self, hold: Hold, deadline: float) -> Hold | None:
        """Untie a tied hold before its grant is answered (docs/contract.md: an acknowledged hold
        lasts
        its TTL whichever daemon dies when).

        Until then it ends with this daemon's session, like any grant that was
        never delivered. Retried while etcd does not answer, up to the
        acquire's ``deadline``; None when that passed first (the caller then
        discards the grant and times out). ``EtcdUnavailable`` when the hold
        was dead already (this daemon's session ended under it).
        """
        with trio.move_on_at(deadline):
            while True:
                try:
                    if await self._untie_txn(hold):
                        return replace(hold, tied=False)
                except (EtcdUnavailable, EtcdError) as exc:
                    log.info(kv(event="untie_retry", key=hold.key, error=exc))
                    await trio.sleep(RETRY_INTERVAL)
                    continue
                raise EtcdUnavailable(
                    f"the grant of {hold.key!r} ended with this daemon's etcd session"
                )
        return None

    async def _keep_session(self, *, task_status: trio.TaskStatus[None]) -> None:
        started = False
        while True:
            session = Session(self.etcd, self.settings.session_ttl)
            try:
                async with trio.open_nursery() as nursery:
                    try:
                        await nursery.start(session.run)
                        # Before anything goes on the lease: one daemon per node name
                        # (NodeTaken ends the daemon: it must not serve).
                        await claim_node(
                            self.etcd, self.layout.node(self.node), self.node, session.lease_id
                        )
                    except NodeTaken:
                        raise
                    except Exception as exc:  # EtcdUnavailable, or anything else: try again
                        log.warning(kv(event="etcd_unavailable", during="session", error=exc))
                    else:
                        self._session = session
                        self._session_ready.set()
                        self.reconcile_wanted.set()
                        log.info(
                            kv(event="etcd_session", node=self.node, lease=f"{session.lease_id:x}")
                        )
                    if not started:
                        started = True
                        task_status.started()
                    if self._session is session:
                        await session.lost.wait()
                    nursery.cancel_scope.cancel()
            except Exception as exc:
                # The keeper failed (not by etcd's "lease not found"): a bug.
                # The daemon lives on with a new session; this one is let go.
                if isinstance(exc, NodeTaken) or (
                    isinstance(exc, BaseExceptionGroup) and exc.subgroup(NodeTaken) is not None
                ):
                    raise
                log.error(kv(event="task_failed", task="session", error=exc), exc_info=True)
                session.mark_lost()
            if self._closing:
                return  # ended by close(): no new session for a daemon that stops
            if not session.lost.is_set():  # never granted, or its node name not claimed
                await trio.sleep(RETRY_INTERVAL * 4)
                continue
            # Lost: waiters and bindings went with it; queues re-queue their waiters.
            self._forget(session)
            self.on_session_lost(
                [hold for bound in self._bound.values() for hold in bound.values()]
            )
            for key_queue in self._queues.values():
                key_queue.changed.set()

    def _forget(self, session: Session) -> None:
        if session.lease_id:
            self._ended_sessions.add(session.lease_id)
            self._cleanup_wanted.set()  # its waiter keys need no deleting any more
        if self._session is session:
            self._session, self._session_ready = None, trio.Event()

    def _session_refused(self, lease: int) -> None:
        """etcd refused a key on ``lease``, a session lease of ours: that session is over.

        A daemon stopped or cut off from etcd past the session TTL comes
        back with a session etcd has ended, and a request may learn it
        before the keeper does (it asks every third of the TTL): the
        transaction of a ``releaseOnClose`` acquire (its binding) or a
        blocking acquire (its waiter key) is refused "lease not found". End
        the session here, so the keeper grants the next one now and
        :meth:`_wait_session` waits for it, rather than hand out the dead
        lease again. A lease that is no longer the session's (the keeper
        replaced it already) needs nothing.
        """
        session = self._session
        if session is not None and session.lease_id == lease:
            session.mark_lost()
            self._forget(session)

    @property
    def session_lease(self) -> int | None:
        """The session lease in force, if any (None while etcd has granted none)."""
        return self._session.lease_id if self._session is not None else None

    async def _wait_session(self) -> int:
        """The session lease, waiting for one within the etcd timeout."""
        if self._session is None:
            with trio.move_on_after(self.settings.etcd_timeout):
                await self._session_ready.wait()
            if self._session is None:
                raise EtcdUnavailable("no etcd session lease (etcd unreachable)")
        return self._session.lease_id

    # -------------------------------------------------------------- helpers

    async def new_hold(
        self, template: Hold, ttl_s: int, *, reuse: bool = True
    ) -> tuple[Hold, Refresh | None]:
        """``template`` with a fresh handle and a lease of ``ttl_s``: a kept one, else a new one.

        A kept lease comes with the :class:`Refresh` running for it; pass
        both to :meth:`settle` once the hold is granted, or to
        :meth:`recycle` when it was not.
        """
        now_ms = self.clock.wall_ms()
        kept = self.leases.take(ttl_s, now_ms) if reuse else None
        if kept is not None:
            if kept.fresh(now_ms):
                refresh = Refresh.needless(kept)
            else:
                refresh = Refresh(kept)
                assert self._nursery is not None
                self._nursery.start_soon(logged, "lease_refresh", partial(self._refresh, refresh))
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
        sent = self.clock.wall_ms()
        grant = await self.etcd.lease_grant(ttl_s + HEADROOM_S)
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

    async def _refresh(self, refresh: Refresh) -> None:
        sent = self.clock.wall_ms()
        try:
            ttl = await self.etcd.lease_keepalive(refresh.lease.id)
            refresh.lease.alive_until = sent + ttl * 1000
            self.leases.note(refresh.lease.id, refresh.lease.alive_until)
        except (EtcdUnavailable, EtcdError):
            pass  # the grant's put fails on a lost lease; else the old bound stands
        finally:
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
        if ttl_s in self._granting or self.leases.has(ttl_s, self.clock.wall_ms()):
            return
        self._granting.add(ttl_s)
        assert self._nursery is not None
        self._nursery.start_soon(logged, "lease_ahead", partial(self._grant_ahead, ttl_s))

    async def _grant_ahead(self, ttl_s: int) -> None:
        try:
            sent = self.clock.wall_ms()
            grant = await self.etcd.lease_grant(ttl_s + HEADROOM_S)
            self.keep_lease(KeptLease(grant.id, ttl_s, sent + grant.ttl * 1000))
        except (EtcdUnavailable, EtcdError) as exc:
            log.debug(kv(event="lease_ahead_failed", error=exc))  # the grant takes one then
        finally:
            self._granting.discard(ttl_s)

    def keep_lease(self, lease: KeptLease) -> None:
        if not self.leases.keep(lease):
            self.revoke_later(lease.id)

    async def hold_puts(self, hold: Hold) -> list[Op]:
        ops: list[Op] = [
            PutOp(self.layout.hold(hold.key, hold.handle), hold.value(), lease=hold.lease)
        ]
        if hold.bound:
            session = await self._wait_session()
            ops.append(PutOp(self.layout.binding(hold.key, hold.handle), self.node, lease=session))
        return ops

    async def new_waiter_record(self, key: str, like: Waiter) -> Waiter:
        """A waiter record like ``like`` under a new key, on the current session lease."""
        session = await self._wait_session()
        etcd_key = self.layout.waiter(key, session, next(self._seq))
        return replace(like, etcd_key=etcd_key, create_revision=0, lease=session, node=self.node)

    async def _next_waiter_record(self, key: str, like: Waiter) -> Waiter:
        """A new waiter record, once a session is there (the caller's deadline bounds it)."""
        while True:
            try:
                return await self.new_waiter_record(key, like)
            except EtcdUnavailable:
                await trio.sleep(RETRY_INTERVAL)

    def track(self, hold: Hold, conn: int | None = None) -> None:
        """Note a grant: the last fence, and a bound hold's connection (released when it closes)."""
        self.last_fence = max(self.last_fence, hold.fence)
        if hold.bound and conn is not None:
            self._bound[conn][self.layout.hold(hold.key, hold.handle)] = hold

    @property
    def doomed_keys(self) -> frozenset[bytes]:
        """Keys on the clean-up list."""
        return frozenset(self._doomed_keys)

    def delete_later(self, etcd_key: bytes) -> None:
        self._doomed_keys.add(etcd_key)
        self._cleanup_wanted.set()

    def revoke_later(self, lease: int) -> None:
        self._doomed_leases.add(lease)
        self._cleanup_wanted.set()

    async def discard(self, hold: Hold) -> None:
        """Delete a grant nobody will get, before the caller answers (``cancel``: CANCELLED
        comes once the key is free of it). Shielded and bounded by the etcd timeout; the
        clean-up list takes it when etcd does not answer in time."""
        hold_key, binding_key = (
            self.layout.hold(hold.key, hold.handle),
            self.layout.binding(hold.key, hold.handle),
        )
        with trio.CancelScope(shield=True), trio.move_on_after(self.timeout):
            try:
                await self.etcd.txn([], [DeleteOp(hold_key), DeleteOp(binding_key)])
            except (BackendUnavailable, EtcdError) as exc:
                log.info(kv(event="discard_later", key=hold.key, error=exc))
            else:
                self.keep_lease(kept_lease(hold))
                return
        self.release_undelivered(hold)

    def release_undelivered(self, hold: RemoteHold) -> None:
        assert isinstance(hold, Hold)
        self.delete_later(self.layout.hold(hold.key, hold.handle))
        self.delete_later(self.layout.binding(hold.key, hold.handle))
        self.revoke_later(hold.lease)

    def _cleanup_order(self, etcd_key: bytes) -> tuple[bool, bytes]:
        return (not self.layout.is_waiter(etcd_key), etcd_key)

    async def _clean_up(self) -> None:
        """Delete doomed keys and revoke doomed leases, retrying until etcd takes them.

        Whatever the error (etcd unreachable, an unknown outcome, a refusal),
        the list stays as it is and is tried again after a back-off: a
        waiter key dropped here would stay at the head of its queue with
        nobody to serve it (issue 23's ghost waiter). A waiter key leaves
        the list unanswered only once its session is over (etcd deleted it
        with the lease); every other key is deleted, or was never written.
        """
        backoff = RETRY_INTERVAL
        while True:
            await self._cleanup_wanted.wait()
            self._cleanup_wanted = trio.Event()
            try:
                self._doomed_keys.difference_update(
                    [key for key in self._doomed_keys if self._on_ended_session(key)]
                )
                while self._doomed_keys:
                    # Waiter keys first: once a waiter key is gone no grant of
                    # it can commit, so the hold a grant may have written is
                    # deleted after it, never before.
                    batch = sorted(self._doomed_keys, key=self._cleanup_order)[:CLEANUP_BATCH]
                    await self.etcd.txn([], [DeleteOp(key) for key in batch])
                    self._doomed_keys.difference_update(batch)
                while self._doomed_leases:
                    lease = next(iter(self._doomed_leases))
                    with contextlib.suppress(LeaseNotFound):
                        await self.etcd.lease_revoke(lease)
                    self._doomed_leases.discard(lease)
                backoff = RETRY_INTERVAL
            except (BackendUnavailable, EtcdError) as exc:
                log.warning(
                    kv(
                        event="etcd_cleanup_retry",
                        keys=len(self._doomed_keys),
                        leases=len(self._doomed_leases),
                        error=exc,
                    )
                )
                self._cleanup_wanted.set()
                await trio.sleep(backoff)
                backoff = min(2 * backoff, CLEANUP_BACKOFF_CAP)

    def _on_ended_session(self, etcd_key: bytes) -> bool:
        """True for a waiter key on a session lease of ours that is over (etcd deleted it)."""
        if not self.layout.is_waiter(etcd_key):
            return False
        try:
            lease = int(etcd_key.rsplit(b"/", 2)[1], 16)
        except ValueError:
            return False
        return lease in self._ended_sessions

    def known_session_keys(self) -> set[bytes]:
        """Every key this daemon means to keep on its session lease (``reconcile.py``).

        Its node claim, the waiter keys of its queues and the bindings of the
        holds it knows: bound holds of its connections,
        holds granted to its waiters (delivered or not yet).
        """
        known = {self.layout.node(self.node)}
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
        result = await self.etcd.range(RangeOp(self.layout.directory(key), prefix=True))
        return Directory.parse(self.layout, key, result.kvs, result.header.revision)

    def _guard(self, key: str, revision: int) -> Compare:
        """Nothing in the key's directory was written after ``revision``."""
        return Compare(self.layout.directory(key), "mod_revision", "<", revision + 1, prefix=True)

    def _directory_of(self, key: str, read: object, revision: int) -> Directory:
        assert isinstance(read, RangeResult)
        return Directory.parse(self.layout, key, read.kvs, revision)

    # -------------------------------------------------------------- acquire

    async def acquire(
        self,
        req: Acquire,
        caller: Caller,
        conn: int,
        timeout: float | None,
        parked: trio.Event | None = None,
    ) -> Hold | Refused | None:
        template = Hold(
            key=req.key,
            handle="",
            principal=caller.principal,
            owner=req.owner,
            mode=req.mode,
            limit=req.limit,
            node=self.node,
            pid=caller.pid,
            process=caller.process,
            ttl_ms=0,
            expires_at=0,
            lease=0,
            bound=req.release_on_close,
            pid_start=caller.start if caller.pid > 0 else None,
            pid_place=self.pid_place or None,
        )
        ttl_s = lease_seconds(req.ttl_ms)
        if timeout is None:
            tried = await self._try(template, ttl_s, conn, waiting=False)
            assert not isinstance(tried, Directory)
            return tried
        # A blocking acquire tries once whatever its timeout (0 included), as
        # the embedded engine does; while etcd is down it keeps trying,
        # within its timeout.
        deadline = trio.current_time() + timeout
        parked = parked if parked is not None else trio.Event()
        outcome: Hold | Refused | Directory | None = None
        try:
            outcome = await self._try(template, ttl_s, conn, waiting=True)
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
        return outcome

    async def _try(
        self, template: Hold, ttl_s: int, conn: int, *, waiting: bool
    ) -> Hold | Refused | Directory | None:
        hold, refresh = await self.new_hold(template, ttl_s)
        for attempt in range(3):
            session = self.session_lease
            try:
                outcome = await self._take_now(hold, conn, waiting=waiting)
                break
            except LeaseNotFound:
                # A lease the transaction put a key on is gone. A kept lease
                # may have ended before its keepalive arrived: once more with
                # a new one. A new lease cannot be gone yet, so then it was
                # the session, for a bound hold's binding (_session_refused).
                # Either way the failed hold's lease is being revoked: the
                # next try gets a new one.
                if attempt == 2 or (refresh is None and not hold.bound):
                    raise
                if refresh is None and session is not None:
                    self._session_refused(session)
                hold, refresh = await self.new_hold(template, ttl_s, reuse=False)
        if isinstance(outcome, Hold):
            try:
                return await self.settle(outcome, refresh)
            except BaseException:  # cancelled after the commit: nobody gets the handle
                self.release_undelivered(outcome)
                raise
        self.recycle(hold, refresh)
        return outcome

    async def _take_now(
        self, hold: Hold, conn: int, *, waiting: bool
    ) -> Hold | Refused | Directory | None:
        """Take the key now if the rules allow; else busy (None) or the directory to queue on."""
        key, directory_key = hold.key, self.layout.directory(hold.key)
        # The fast path: what the core answers on a free key, committed only
        # if the key is free (its directory empty), in one transaction.
        verdict = core.admit_free(key, hold.mode, hold.limit)
        if isinstance(verdict, Refused):
            return verdict
        puts = await self.hold_puts(hold)
        compares = [Compare(directory_key, "create_revision", "==", 0, prefix=True)]
        ops: list[Op] = puts
        retaken: Hold | None = None  # the caller's own hold a re-take replaces
        while True:
            try:
                result = await self.etcd.txn(compares, ops, [RangeOp(directory_key, prefix=True)])
            except BaseException:
                self.release_undelivered(hold)
                raise
            if result.succeeded:
                if retaken is not None:  # only now: a failed guard leaves it held
                    self.revoke_later(retaken.lease)
                granted = replace(hold, fence=result.header.revision)
                self.track(granted, conn)
                return granted
            directory = self._directory_of(key, result.responses[0], result.header.revision)
            own = directory.own_hold(hold.principal, hold.owner)
            holds = directory.holds
            verdict = core.admit(
                key,
                hold.mode,
                hold.limit,
                held_mode=holds[0].mode if holds else None,
                held_count=len(holds),
                key_limit=directory.limit_in_force(),
                queued=len(directory.waiters),
                own_hold=own,
                blocking=waiting,
            )
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
                    DeleteOp(self.layout.hold(key, own.handle)),
                    DeleteOp(self.layout.binding(key, own.handle)),
                ]
                retaken = own
            ops += puts
            compares = [self._guard(key, directory.revision)]

    async def _wait(
        self,
        template: Hold,
        ttl_s: int,
        conn: int,
        directory: Directory,
        deadline: float,
        parked: trio.Event,
    ) -> Hold | None:
        """Queue behind the key's waiters until granted or the deadline (trio clock).

        ``parked`` is set once the waiter key is written and its queue knows it.
        """
        key = template.key
        waiter: LocalWaiter | None = None
        key_queue: KeyQueue | None = None
        # The record names the whole hold, so whichever daemon releases the
        # key can grant it (KeyQueue.hand_off).
        template = replace(template, handle=new_handle_id())
        like = Waiter(
            b"",
            0,
            template.principal,
            template.owner,
            template.mode,
            template.limit,
            self.node,
            handle=template.handle,
            ttl_ms=ttl_s * 1000,
            pid=template.pid,
            process=template.process,
            bound=template.bound,
            since=self.clock.wall_ms(),
            pid_start=template.pid_start,
            pid_place=template.pid_place,
        )
        try:
            with trio.move_on_at(deadline):
                record = await self.new_waiter_record(key, like)
                waiter, directory = await self._enqueue(key, record, template, ttl_s, parked)
                key_queue = self._queue(key, directory.revision)
                key_queue.join(waiter, directory)
                parked.set()
                self.prepare_lease(ttl_s)
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
                    await self.discard(crossed)
            raise
        if granted is not None and granted.tied:
            try:
                confirmed = await self._confirm(granted, max(deadline, trio.current_time() + 1))
            except BaseException:
                await self.discard(granted)
                raise
            if confirmed is None:
                await self.discard(granted)
                return None
            granted = confirmed
        if granted is not None:
            self.track(granted, conn)
        return granted

    async def _enqueue(
        self, key: str, record: Waiter, template: Hold, ttl_s: int, parked: trio.Event
    ) -> tuple[LocalWaiter, Directory]:
        """Write the waiter key (retrying while etcd is down) and read the queue after it."""
        directory_key = self.layout.directory(key)
        while True:
            put = PutOp(record.etcd_key, record.value(), lease=record.lease)
            try:
                result = await self.etcd.txn([], [put, RangeOp(directory_key, prefix=True)])
            except (EtcdUnavailable, LeaseNotFound) as exc:
                self.delete_later(record.etcd_key)
                log.debug(kv(event="enqueue_retry", key=key, error=exc))
                parked.set()  # it waits for etcd now: the connection goes on
                if isinstance(exc, LeaseNotFound):  # the session is over (its only lease)
                    self._session_refused(record.lease)
                else:
                    await trio.sleep(RETRY_INTERVAL)
                record = await self._next_waiter_record(key, record)
                continue
            except BaseException:
                self.delete_later(record.etcd_key)
                raise
            directory = self._directory_of(key, result.responses[1], result.header.revision)
            record = replace(record, create_revision=result.header.revision)
            return LocalWaiter(record, template, ttl_s), directory

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
            self.leases.note(hold.lease, sent + ttl * 1000)
            renewed = replace(
                hold,
                expires_at=sent + min(ttl, ttl_s) * 1000,
                lease_end=sent + ttl * 1000,
                tied=False,
            )
        else:
            grant = await self.etcd.lease_grant(ttl_s + HEADROOM_S)
            self.leases.note(grant.id, sent + grant.ttl * 1000)
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
            self.keep_lease(kept_lease(hold if result.succeeded else renewed))
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
        self.keep_lease(kept_lease(hold))
        for bound in self._bound.values():
            bound.pop(hold_key, None)
        # A bound (or tied) hold whose binding had gone was dead already: not the holder.
        return not hold.needs_binding or bool(getattr(bindings, "prev_kvs", None))

    async def status(self, key: str) -> RemoteStatus:
        directory = await self._read(key)
        return _remote_status(key, directory)

    async def list_held(
        self, prefix: str, limit: int, after: str | None
    ) -> tuple[list[RemoteStatus], str | None]:
        """Held keys under ``prefix`` in key order after ``after``, at most ``limit``.

        Reads the records from the first candidate key on, in chunks, all at
        the first chunk's revision, until it has ``limit`` + 1 held keys (to
        know whether more remain): a page costs its own records.
        """
        layout = self.layout
        low = layout.locks + prefix.encode().hex().encode()
        high = prefix_end(low)
        start = max(low, layout.after(after)) if after is not None else low
        revision = 0
        page: list[RemoteStatus] = []
        current: str | None = None
        records: list[KeyValue] = []

        def flush() -> None:
            if current is not None:
                directory = Directory.parse(layout, current, records, revision)
                if directory.holds:
                    page.append(_remote_status(current, directory))

        while len(page) <= limit:
            read = RangeOp(start, range_end=high, limit=LIST_CHUNK, revision=revision)
            result = await self.etcd.range(read)
            revision = revision or result.header.revision
            for record in result.kvs:
                key = layout.lock_key(record.key)
                if key != current:
                    flush()
                    current, records = key, []
                records.append(record)
            if not result.more:
                flush()
                break
            start = result.kvs[-1].key + b"\0"
        if len(page) > limit:
            return page[:limit], page[limit - 1].key
        return page, None

    async def break_lock(
        self, key: str, *, by: str | None = None, reason: str | None = None
    ) -> list[Hold]:
        """Delete every hold of ``key``; with ``by``, write who and why beside it.

        The break record (``<directory>x``, holdloss.py) is put in the same
        transaction, so the daemons whose holders lost a hold see it in the
        same watch event; it hangs on the session lease and is deleted right
        after (the clean-up list), since the watch has seen it by then.
        """
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
        directory = self._directory_of(key, result.responses[0], result.header.revision)
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


def _remote_status(key: str, directory: Directory) -> RemoteStatus:
    """status/list's view of a key: holders, the waiter count and the first waiters."""
    queued = [w.queued() for w in directory.waiters[:MAX_LISTED_WAITERS]]
    return RemoteStatus(key, directory.holds, len(directory.waiters), queued)
