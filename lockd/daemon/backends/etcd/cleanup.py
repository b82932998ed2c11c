"""The clean-up list: etcd keys to delete and leases to revoke once etcd answers.

A write whose outcome is unknown (etcd did not answer in time), a grant
whose reply could not be written, a waiter that left while etcd was down:
each leaves something in etcd that nobody will use and that must not stay
-- an orphan hold outlives its TTL's promise, an orphan waiter key at the
head of its queue blocks the key for everyone (issue 23). Such keys and
leases go on this list, and one task deletes and revokes them, retrying
with a back-off until etcd takes them. It is separate from the backend
(:mod:`lockd.daemon.backends.etcd.backend`) because every part of it adds
to the list (the acquire path, the key queues, the reconciler) and none
of them should know how it is emptied.
"""

from __future__ import annotations

import contextlib
import logging

import trio

from lockd.daemon.backends import BackendUnavailable
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdGateway, LeaseNotFound
from lockd.daemon.backends.etcd.records import Layout
from lockd.daemon.backends.etcd.waiting import RETRY_INTERVAL
from lockd.daemon.backends.etcd.wire import DeleteOp
from lockd.logfmt import kv

log = logging.getLogger("lockd.etcd")

#: etcd keys one clean-up transaction deletes at most (etcd allows 128 ops).
CLEANUP_BATCH = 64
#: the longest pause between clean-up attempts while etcd does not take them.
CLEANUP_BACKOFF_CAP = 0.5


class CleanupList:
    """Doomed keys and leases, and the task that ends them."""

    def __init__(self, etcd: EtcdGateway, layout: Layout) -> None:
        self._etcd = etcd
        self._layout = layout
        self.keys: set[bytes] = set()
        self.leases: set[int] = set()
        self._wanted = trio.Event()
        #: session leases of ours that etcd ended (their keys are gone with them).
        self._ended_sessions: set[int] = set()

    @property
    def doomed_keys(self) -> frozenset[bytes]:
        """Keys on the clean-up list."""
        return frozenset(self.keys)

    def delete_later(self, etcd_key: bytes) -> None:
        self.keys.add(etcd_key)
        self._wanted.set()

    def revoke_later(self, lease: int) -> None:
        self.leases.add(lease)
        self._wanted.set()

    def session_ended(self, lease: int) -> None:
        """Session lease ``lease`` of ours is over: its waiter keys need no deleting."""
        self._ended_sessions.add(lease)
        self._wanted.set()

    def _order(self, etcd_key: bytes) -> tuple[bool, bytes]:
        return (not self._layout.is_waiter(etcd_key), etcd_key)

    async def run(self) -> None:
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
            await self._wanted.wait()
            self._wanted = trio.Event()
            try:
                self.keys.difference_update(
                    [key for key in self.keys if self._on_ended_session(key)]
                )
                while self.keys:
                    # Waiter keys first: once a waiter key is gone no grant of
                    # it can commit, so the hold a grant may have written is
                    # deleted after it, never before.
                    batch = sorted(self.keys, key=self._order)[:CLEANUP_BATCH]
                    await self._etcd.txn([], [DeleteOp(key) for key in batch])
                    self.keys.difference_update(batch)
                while self.leases:
                    lease = next(iter(self.leases))
                    with contextlib.suppress(LeaseNotFound):
                        await self._etcd.lease_revoke(lease)
                    self.leases.discard(lease)
                backoff = RETRY_INTERVAL
            except (BackendUnavailable, EtcdError) as exc:
                log.warning(
                    kv(
                        event="etcd_cleanup_retry",
                        keys=len(self.keys),
                        leases=len(self.leases),
                        error=exc,
                    )
                )
                self._wanted.set()
                await trio.sleep(backoff)
                backoff = min(2 * backoff, CLEANUP_BACKOFF_CAP)

    def _on_ended_session(self, etcd_key: bytes) -> bool:
        """True for a waiter key on a session lease of ours that is over (etcd deleted it)."""
        if not self._layout.is_waiter(etcd_key):
            return False
        try:
            lease = int(etcd_key.rsplit(b"/", 2)[1], 16)
        except ValueError:
            return False
        return lease in self._ended_sessions
