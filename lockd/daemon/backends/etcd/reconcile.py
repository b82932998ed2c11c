"""What a daemon left on its session lease and no longer knows: found and deleted.

Waiter keys and bindings hang on the daemon's session lease. The daemon
writes each one for something it serves (a parked acquire, a
``releaseOnClose`` hold, a tied hold to deliver), and deletes it when that
ends. A write whose outcome is unknown breaks that: the enqueue that timed
out may have committed, and the acquire has moved on with a new waiter key.
The clean-up list deletes such keys, but a key written after the failure
was reported (a late commit) is on no list. Left alone, such an *orphan*
waiter sits in its queue until the session ends, and at the head of the
queue it blocks the key for everyone (issue 23).

So the reconciler asks etcd which keys are on the session lease (one
``LeaseTimeToLive`` with ``keys``, no raft write) and compares them with what
the daemon knows (``EtcdBackend.known_session_keys``): at start, whenever a
new session is granted, and every :data:`INTERVAL` seconds (which covers a
reconnect after an outage, when late commits surface). A key is an orphan
once it was unknown at two looks at least ``etcd_timeout`` apart: a write
whose reply is on its way is known within that bound (every etcd call ends
within it), so a key being written right now is never taken for one. Orphans
go on the clean-up list.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends import BackendUnavailable
from lockd.daemon.backends.etcd.gateway import EtcdError
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.backend import EtcdBackend

log = logging.getLogger("lockd.etcd")

#: seconds between looks at the session's keys.
INTERVAL = 2.0


class Reconciler:
    def __init__(self, backend: EtcdBackend) -> None:
        self.backend = backend
        #: unknown keys -> when they were first seen unknown (trio clock).
        self.suspects: dict[bytes, float] = {}
        self.session = 0
        #: orphans found so far (tests, debugging).
        self.orphans = 0

    async def run(self) -> None:
        backend = self.backend
        while True:
            with trio.move_on_after(INTERVAL):
                await backend.reconcile_wanted.wait()
            backend.reconcile_wanted = trio.Event()
            try:
                await self.look()
            except (BackendUnavailable, EtcdError) as exc:
                log.info(kv(event="reconcile_retry", error=exc))

    async def look(self) -> list[bytes]:
        """One look at the session's keys; returns the orphans it sent to the clean-up list."""
        backend = self.backend
        lease = backend.session_lease
        if lease is None:
            return []
        if lease != self.session:  # another session: what was suspected went with the old one
            self.session, self.suspects = lease, {}
        found = await backend.etcd.lease_time_to_live(lease, keys=True)
        now = trio.current_time()
        known = backend.known_session_keys()
        layout = backend.layout
        unknown = {
            key
            for key in found.keys
            if key.startswith(layout.locks) and key not in known and key not in backend.doomed_keys
        }
        self.suspects = {key: self.suspects.get(key, now) for key in unknown}
        orphans = [key for key, since in self.suspects.items() if now - since >= backend.timeout]
        for key in orphans:
            del self.suspects[key]
            log.warning(kv(event="orphan_deleted", etcd_key=key.decode(errors="replace")))
            backend.delete_later(key)
        self.orphans += len(orphans)
        return orphans
