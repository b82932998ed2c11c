"""The daemon's own etcd session: one lease, kept alive while the daemon lives.

Waiter keys and ``releaseOnClose`` holds are attached to this lease (docs/contract.md
§11). When the daemon or its host dies, nobody keeps the lease alive and etcd
deletes every key on it within the TTL: the dead host's waiters leave the
queues and its ``releaseOnClose`` holds end, while TTL holds (on leases of
their own) live on.

The keeper refreshes the lease every third of its TTL. While etcd cannot be
reached it keeps trying; the lease may well survive (etcd even extends
leases across a leader change), so only etcd's own answer "lease not found"
counts as the loss. Then ``lost`` is set and ``run`` returns: the keys that
hung on the lease are gone, and the backend must start a new session and
put its local waiters back in the queues.
"""

from __future__ import annotations

import contextlib
import logging

import trio

from lockd.daemon.backends.etcd.gateway import (
    EtcdError,
    EtcdGateway,
    EtcdUnavailable,
    LeaseNotFound,
)
from lockd.logfmt import kv

log = logging.getLogger("lockd.etcd")

MIN_TTL = 2  # etcd 3.4 grants no lease shorter than 2 s
MAX_TTL = 10  # docs/contract.md: a dead host's waiters and releaseOnClose holds go within 10 s
DEFAULT_TTL = 5
RETRY_INTERVAL = 0.25  # between keepalives while etcd does not answer


class Session:
    """Keeps one etcd lease alive: ``await nursery.start(session.run)``, then use ``lease_id``.

    ``lost`` is set when etcd says the lease no longer exists; ``expires_at``
    (trio clock) is the latest moment the lease surely lasts without another
    keepalive, for deciding whether a keepalive is overdue.
    """

    def __init__(self, gateway: EtcdGateway, ttl: int = DEFAULT_TTL) -> None:
        if not MIN_TTL <= ttl <= MAX_TTL:
            raise ValueError(f"session TTL must be {MIN_TTL}-{MAX_TTL} s, not {ttl}")
        self._gateway = gateway
        self.requested_ttl = ttl
        self.ttl = ttl  # what etcd granted
        self.lease_id = 0
        self.expires_at = 0.0
        self.lost = trio.Event()
        self.keepalives = 0

    async def run(
        self, *, task_status: trio.TaskStatus[Session] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Grant the lease (``EtcdUnavailable`` if etcd is down), then keep it alive until lost.

        Cancelling ``run`` stops the keepalives without revoking: the lease
        then ends by itself within its TTL, as it would if the host died.
        Call ``close`` for a prompt end.
        """
        sent = trio.current_time()
        grant = await self._gateway.lease_grant(self.requested_ttl)
        self.lease_id, self.ttl = grant.id, grant.ttl
        self.expires_at = sent + grant.ttl
        log.info(kv(event="etcd_session_granted", lease=f"{self.lease_id:x}", ttl_s=self.ttl))
        task_status.started(self)
        try:
            await self._keep_alive()
        except LeaseNotFound:
            self.mark_lost()

    def mark_lost(self) -> None:
        """etcd said the lease is gone (to the keeper, or to a request that used it)."""
        if not self.lost.is_set():
            log.warning(
                kv(
                    event="etcd_session_lost",
                    lease=f"{self.lease_id:x}",
                    hint="its waiters and releaseOnClose holds are gone with it",
                )
            )
            self.lost.set()

    async def _keep_alive(self) -> None:
        interval = self.ttl / 3
        while True:
            await trio.sleep_until(self.expires_at - 2 * interval)
            while True:
                sent = trio.current_time()
                try:
                    # Bounded by the interval too: a keepalive that comes back
                    # late is worth less than a new one sent now.
                    with trio.fail_after(max(interval, RETRY_INTERVAL)):
                        ttl = await self._gateway.lease_keepalive(self.lease_id)
                except LeaseNotFound:
                    raise
                except (EtcdUnavailable, EtcdError, trio.TooSlowError) as failure:
                    # Not an answer about the lease (etcd refused the request,
                    # or could not serve it): the lease may well live on.
                    overdue = trio.current_time() - self.expires_at
                    if overdue > 0:
                        log.warning(
                            kv(
                                event="etcd_session_overdue",
                                lease=f"{self.lease_id:x}",
                                overdue_s=f"{overdue:.1f}",
                                error=failure,
                            )
                        )
                    await trio.sleep(RETRY_INTERVAL)
                    continue
                self.expires_at = sent + ttl
                self.keepalives += 1
                break

    async def close(self) -> None:
        """Revoke the lease: every key on it is deleted now (a clean shutdown)."""
        if self.lease_id and not self.lost.is_set():
            # Gone already, or unreachable: then it ends by itself within its TTL.
            with contextlib.suppress(LeaseNotFound, EtcdUnavailable):
                await self._gateway.lease_revoke(self.lease_id)
            self.lost.set()
