"""The embedded backend: the engine decides in memory, SQLite keeps it (the default).

Its requests are answered at once by :class:`~lockd.daemon.service.LockService`
(``acquire``, ``answer``) from the engine's state, and committed by the
server's group commit (``store.py``), so it awaits nothing: the synchronous
path stays one call deep. What the server and service ask of every backend
(:class:`~lockd.daemon.backends.LockBackend`) it answers from the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import trio

from lockd.daemon.backends import RemoteHold
from lockd.daemon.leases import Lease
from lockd.daemon.protocol import Request
from lockd.identity import Caller

if TYPE_CHECKING:
    from lockd.daemon.service import LockService


class EmbeddedBackend:
    def __init__(self, service: LockService) -> None:
        self.service = service

    def awaits(self, request: Request) -> bool:
        return False  # decided in memory: answered at once, committed by the group commit

    async def answer(
        self,
        caller: Caller,
        conn: int,
        request: Request,
        *,
        pending: int,
        parked: trio.Event | None = None,
        listens: bool = False,
    ) -> NoReturn:
        raise AssertionError(f"the embedded backend answers {request.op} at once (awaits False)")

    def release_undelivered(self, grant: Lease | RemoteHold) -> None:
        assert isinstance(grant, Lease), "the embedded backend grants engine leases"
        self.service.release_undelivered(grant)

    def connection_closed(self, conn: int, *, release_bound: bool) -> None:
        self.service.close_in_engine(conn, release_bound=release_bound)

    def gauges(self) -> dict[str, object]:
        engine = self.service.engine
        return {
            "held": engine.held_count,
            "waiters": engine.waiter_count,
            "fence": engine.fence,
            "node": None,  # one host: the etcd backend names each host's node
        }
