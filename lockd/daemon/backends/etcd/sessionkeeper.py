"""The daemon's etcd session kept in force: granted, claimed, replaced when lost.

Waiter keys, bindings and the node claim hang on one session lease per
daemon (:mod:`lockd.daemon.backends.etcd.session` keeps one alive).
:class:`SessionKeeper` grants it, claims the daemon's node name on it
before anything else goes on it (a second daemon with the same name must
not serve), and when it is lost grants the next one and tells the backend
(its waiters and bindings went with the lease). A request that learns
first that etcd ended the session (a key refused "lease not found") ends
it here too (:meth:`SessionKeeper.refused`). It is separate from the
backend (:mod:`lockd.daemon.backends.etcd.backend`) because the session's
life has its own task and its own failures, whatever the requests do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from lockd.config import BackendSettings
from lockd.daemon.backends.etcd.cleanup import CleanupList
from lockd.daemon.backends.etcd.gateway import EtcdGateway, EtcdUnavailable
from lockd.daemon.backends.etcd.nodeclaim import NodeTaken, claim_node
from lockd.daemon.backends.etcd.records import Layout
from lockd.daemon.backends.etcd.session import Session
from lockd.daemon.backends.etcd.waiting import RETRY_INTERVAL
from lockd.logfmt import kv

log = logging.getLogger("lockd.etcd")


class SessionKeeper:
    """The session lease in force (if any), and the task that keeps one."""

    def __init__(
        self,
        etcd: EtcdGateway,
        settings: BackendSettings,
        layout: Layout,
        cleanup: CleanupList,
        on_lost: Callable[[], None],
    ) -> None:
        self._etcd = etcd
        self._settings = settings
        self._layout = layout
        self._node = settings.node_name
        self._cleanup = cleanup
        #: called when a session in force was lost (a new one is on its way).
        self._on_lost = on_lost
        self.session: Session | None = None
        self._ready = trio.Event()
        #: set when a new session is in force: the reconciler looks at once.
        self.reconcile_wanted = trio.Event()
        #: set by close(): no new session for a daemon that stops.
        self.closing = False

    @property
    def lease(self) -> int | None:
        """The session lease in force, if any (None while etcd has granted none)."""
        return self.session.lease_id if self.session is not None else None

    async def wait(self) -> int:
        """The session lease, waiting for one within the etcd timeout."""
        if self.session is None:
            with trio.move_on_after(self._settings.etcd_timeout):
                await self._ready.wait()
            if self.session is None:
                raise EtcdUnavailable("no etcd session lease (etcd unreachable)")
        return self.session.lease_id

    async def close(self) -> None:
        """End the session now (a clean stop)."""
        self.closing = True
        if self.session is not None:
            await self.session.close()

    async def run(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Keep a session in force until cancelled; started once the first try is over."""
        started = False
        node = self._node
        while True:
            session = Session(self._etcd, self._settings.session_ttl)
            try:
                async with trio.open_nursery() as nursery:
                    try:
                        await nursery.start(session.run)
                        # Before anything goes on the lease: one daemon per node name
                        # (NodeTaken ends the daemon: it must not serve).
                        await claim_node(
                            self._etcd, self._layout.node(node), node, session.lease_id
                        )
                    except NodeTaken:
                        raise
                    except Exception as exc:  # EtcdUnavailable, or anything else: try again
                        log.warning(kv(event="etcd_unavailable", during="session", error=exc))
                    else:
                        self.session = session
                        self._ready.set()
                        self.reconcile_wanted.set()
                        log.info(kv(event="etcd_session", node=node, lease=f"{session.lease_id:x}"))
                    if not started:
                        started = True
                        task_status.started()
                    if self.session is session:
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
            if self.closing:
                return  # ended by close(): no new session for a daemon that stops
            if not session.lost.is_set():  # never granted, or its node name not claimed
                await trio.sleep(RETRY_INTERVAL * 4)
                continue
            # Lost: waiters and bindings went with it; queues re-queue their waiters.
            self._forget(session)
            self._on_lost()

    def _forget(self, session: Session) -> None:
        if session.lease_id:
            self._cleanup.session_ended(session.lease_id)  # its waiter keys: no deleting
        if self.session is session:
            self.session, self._ready = None, trio.Event()

    def refused(self, lease: int) -> None:
        """etcd refused a key on ``lease``, a session lease of ours: that session is over.

        A daemon stopped or cut off from etcd past the session TTL comes
        back with a session etcd has ended, and a request may learn it
        before the keeper does (it asks every third of the TTL): the
        transaction of a ``releaseOnClose`` acquire (its binding) or a
        blocking acquire (its waiter key) is refused "lease not found". End
        the session here, so the keeper grants the next one now and
        :meth:`wait` waits for it, rather than hand out the dead lease
        again. A lease that is no longer the session's (the keeper
        replaced it already) needs nothing.
        """
        session = self.session
        if session is not None and session.lease_id == lease:
            session.mark_lost()
            self._forget(session)
