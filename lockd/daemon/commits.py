"""Committing what the engine decided: one request, a group commit's batch, or a fact.

The engine (:mod:`lockd.daemon.engine`) decides in memory and gathers its
effects; nothing it decided may be told before it is in the store
(:mod:`lockd.daemon.store`). :class:`Commits` writes them and only then
lets the consequences out -- loss events, woken waiters, counters, log
lines -- or, when the write fails, rolls the engine back so no ghost hold
survives. Requests may leave their effects to the server's group commit
(:attr:`Commits.group_commit`); time passing and clients leaving are facts,
committed whenever a commit succeeds. It is separate from the service
(:mod:`lockd.daemon.service`) because every request path and the timer go
through it, whatever they decided.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lockd.daemon.clock import Clock
from lockd.daemon.engine import EXPIRY_CHUNK, Lease, LockEngine, Waiter
from lockd.daemon.lossnotice import LossNotices
from lockd.daemon.protocol import ProtocolError
from lockd.daemon.replies import storage_unavailable
from lockd.daemon.stats import StatsRecorder
from lockd.daemon.store import StorageUnavailable, Store
from lockd.logfmt import kv

# The service's logger: these lines were logged there before this module
# was split out of it, and log filters may name it.
log = logging.getLogger("lockd.daemon.service")


class Commits:
    """The engine's pending effects to the store, then out to whoever waits on them."""

    def __init__(
        self,
        engine: LockEngine,
        store: Store | None,
        clock: Clock,
        stats: StatsRecorder,
        notices: LossNotices,
    ) -> None:
        self._engine = engine
        self._store = store
        self._clock = clock
        self._stats = stats
        self._notices = notices
        #: called for each waiter the engine resolved, after the commit.
        self.on_resolved: Callable[[Waiter], None] = lambda waiter: None
        #: group commit: requests leave their effects pending (see
        #: :meth:`commit_request`) and the server commits them together.
        self.group_commit = False
        #: set by :meth:`commit_request` when it left the request's effects
        #: to the group commit; the server reads and clears it per request.
        self.deferred = False
        #: called after every commit with its outcome (None: committed, once
        #: its waiters were woken; else the error it was rolled back for):
        #: the server sends or fails the replies of the group commit's batch.
        self.on_batch_end: Callable[[BaseException | None], None] = lambda error: None

    def commit(self) -> None:
        """Persist the engine's pending effects, then wake resolved waiters.

        When the write fails, the request that was running is undone in the
        engine (:meth:`LockEngine.rollback`: no ghost holds) and the error
        propagates; what time and departed clients did before it stays
        pending, its woken waiters still parked, until a commit succeeds.
        """
        engine = self._engine
        changes = engine.pending()
        if not changes:
            engine.drain()
            self.on_batch_end(None)
            return
        assert self._store is not None, "a remote backend never changes the engine"
        try:
            self._store.apply(changes)
        except BaseException as exc:
            engine.rollback()
            self._notices.rewatch_retaken()
            self.on_batch_end(exc)
            raise
        engine.drain()
        self._notices.announce(changes.expired)
        # The rows are in the store now: settled keys may leave memory.
        engine.demote(self._clock.boot_ms())
        stats = self._stats
        if changes.grants:
            stats.count("grants", changes.grants)
        if changes.retakes:
            stats.count("retakes", changes.retakes)
        if changes.expired:
            stats.count("expiries", len(changes.expired))
            self._log_expired(changes.expired)
        for waiter in changes.resolved:
            if waiter.timed_out:
                stats.count("timeouts")
            elif waiter.lease is not None:
                stats.count("handoffs")
                if log.isEnabledFor(logging.DEBUG):
                    lease = waiter.lease
                    log.debug(
                        kv(
                            event="granted",
                            key=lease.key,
                            principal=lease.principal,
                            fence=lease.fence,
                        )
                    )
            self.on_resolved(waiter)
        self.on_batch_end(None)

    def _log_expired(self, expired: list[Lease]) -> None:
        """One info line per commit however many leases ran out; each at debug.

        A line per lease cost ~75 % of the loop time when 100,000 leases ran
        out together (issue 10). A lone expiry, the usual case, keeps its key
        on the info line.
        """
        if len(expired) == 1:
            lease = expired[0]
            log.info(
                kv(event="expired", key=lease.key, principal=lease.principal, fence=lease.fence)
            )
            return
        log.info(kv(event="expired", count=len(expired), more_due=self._engine.behind))
        if log.isEnabledFor(logging.DEBUG):
            for lease in expired:
                log.debug(
                    kv(event="expired", key=lease.key, principal=lease.principal, fence=lease.fence)
                )

    def commit_request(self, *, now: bool = False) -> None:
        """Commit a request's effects; a storage failure becomes its error reply.

        Under :attr:`group_commit` the effects stay pending (unless ``now``)
        and :attr:`deferred` says so: the server commits the batch before
        it sends any reply of it, and answers STORAGE_UNAVAILABLE to each
        of the batch's requests when that commit fails.
        """
        if self.group_commit and not now:
            self.deferred = True
            return
        try:
            self.commit()
        except StorageUnavailable as exc:
            self._stats.count("storageErrors")
            log.warning(kv(event="storage_unavailable", error=exc))
            raise storage_unavailable() from None

    def commit_fact(self, what: str) -> bool:
        """Commit what time or a departed client did; on failure it stays pending.

        Used where no request can be refused: reads answer from memory and
        the batch goes out with the next commit that succeeds. False when
        the write failed, or was not tried because the store's integrity
        check is not in yet (``Store.check_pending``: a write would wait for
        the check on the event loop); the daemon commits once it passed.
        """
        store = self._store
        if store is not None and store.check_pending and not self._engine.requests_pending:
            # Only facts wait (requests that write wait for the check before
            # they reach the engine: LockServer.integrity_checked), so no
            # reply of this batch needs the commit: they go out now.
            self.on_batch_end(None)
            return False
        try:
            self.commit()
        except StorageUnavailable as exc:
            self._stats.count("storageErrors")
            log.warning(kv(event="storage_unavailable", during=what, error=exc))
            return False
        return True

    def now(self) -> int:
        """The boot clock for a call into the engine.

        Time passing is a fact the engine does not undo, so when a deadline
        has come, the batch of requests before it is committed first.
        """
        now = self._clock.boot_ms()
        if self._engine.requests_pending and self._engine.due(now):
            self.end_batch("time")
        return now

    def end_batch(self, what: str) -> None:
        """Commit the group commit's batch before a fact the engine never undoes.

        The engine keeps no undo record across such a fact, so the batch's
        requests must be committed (or rolled back) before it.
        """
        if self._engine.requests_pending:
            self.commit_fact(what)

    def read_failed(self, what: str, exc: StorageUnavailable) -> ProtocolError:
        """A cold key's rows could not be read (lockd.daemon.cold): a storage failure.

        The engine read them before taking the key out of the cold index,
        so the key stays cold and none of its leases is lost.
        """
        self._stats.count("storageErrors")
        log.warning(kv(event="storage_unavailable", during=what, error=exc))
        return storage_unavailable()

    def tick(self) -> bool:
        """Let time pass in the engine (the expiry timer calls this).

        False when the commit failed, or a due cold key's rows could not be
        read: the expiries and hand-offs stay pending and the timer retries
        shortly.
        """
        try:
            self._engine.advance(self.now(), EXPIRY_CHUNK)
        except StorageUnavailable as exc:
            self.read_failed("tick", exc)
            self.commit_fact("tick")  # what passed before the failed read
            return False
        return self.commit_fact("tick")

    def restore_all(self, what: str) -> None:
        """A restore in chunks is under way: read the rest now (this answer counts every key).

        Between commits only (:meth:`LockEngine.restore_step`), so what is
        pending is committed first; a failed commit or read fails the request.
        """
        engine = self._engine
        if not engine.restoring:
            return
        if engine.pending() and not self.commit_fact(what):
            raise storage_unavailable()
        try:
            engine.finish_restore(self.now())
        except StorageUnavailable as exc:
            raise self.read_failed(what, exc) from None
