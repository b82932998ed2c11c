"""The backend seam (lockd/daemon/backends/__init__.py: LockBackend).

The server and the service call ``service.backend`` whichever backend is
behind it; the service builds it once, from what it is given: the embedded
engine and store by default, a RemoteService over a remote backend (etcd)
when one is passed. These pin what each answers through the seam.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from lockd.daemon.backends import BackendUnavailable, LockBackend, RemoteHold, RemoteStatus
from lockd.daemon.backends.embedded import EmbeddedBackend
from lockd.daemon.clock import SystemClock
from lockd.daemon.engine import LockEngine
from lockd.daemon.events import LossEvent
from lockd.daemon.leases import Lease
from lockd.daemon.protocol import Acquire, ProtocolError, Request, parse_request
from lockd.daemon.remote import RemoteService
from lockd.daemon.service import LockService
from lockd.daemon.store import Store
from lockd.identity import Caller
from tests.unit.test_server import MEMBER, OpenPolicy, ScriptedLimiter

REQUESTS = [
    b'{"id":1,"op":"hello"}',
    b'{"id":2,"op":"rules"}',
    b'{"id":3,"op":"stats"}',
    b'{"id":4,"op":"tryAcquire","key":"k","ttlMs":1000}',
    b'{"id":5,"op":"acquire","key":"k","ttlMs":1000,"timeoutMs":10}',
    b'{"id":6,"op":"status","key":"k"}',
    b'{"id":7,"op":"release","key":"k","handle":"AAAAAAAAAAAAAAAAAAAAAA"}',
    b'{"id":8,"op":"break","key":"k","reason":"r"}',
]


def requests() -> list[Request]:
    return [parse_request(line) for line in REQUESTS]


class RecordingRemote:
    """A remote backend that records what the seam hands it (no lock state)."""

    node = "n1"
    timeout = 5.0

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def acquire(
        self,
        req: Acquire,
        caller: Caller,
        conn: int,
        timeout: float | None,
        parked: Any = None,
        *,
        listens: bool = False,
    ) -> None:
        return None

    async def find(self, key: str, handle: str) -> None:
        return None

    async def renew(self, hold: RemoteHold, ttl_ms: int) -> None:
        return None

    async def release(self, key: str, handle: str) -> bool:
        return False

    async def status(self, key: str) -> RemoteStatus:
        return RemoteStatus(key, [], 0)

    async def list_held(
        self, prefix: str, limit: int, after: str | None
    ) -> tuple[list[RemoteStatus], str | None]:
        return [], None

    async def break_lock(
        self,
        key: str,
        *,
        by: str | None = None,
        reason: str | None = None,
        grace_ms: int = 0,
        keep: frozenset[str] = frozenset(),
        stop_local: Any = None,
    ) -> list[RemoteHold]:
        return []

    def release_undelivered(self, hold: RemoteHold) -> None:
        self.calls.append(("release_undelivered", hold))

    def connection_closed(self, conn: int) -> None:
        self.calls.append(("connection_closed", conn))

    def gauges(self) -> dict[str, object]:
        return {"held": None, "waiters": 3, "fence": 7, "node": "n1"}


def service(tmp_path: Path, remote: RecordingRemote | None = None) -> LockService:
    store = Store(tmp_path / "db", "boot-1") if remote is None else None
    return LockService(
        LockEngine(), store, OpenPolicy(), ScriptedLimiter(), SystemClock(), remote=remote
    )


def test_the_embedded_backend_answers_every_request_at_once(tmp_path: Path) -> None:
    svc = service(tmp_path)
    backend: LockBackend = svc.backend
    assert isinstance(backend, EmbeddedBackend)
    assert not any(backend.awaits(request) for request in requests())
    lease = svc.engine.acquire(
        1, "k", ttl_ms=60_000, principal=MEMBER.principal, conn=9, release_on_close=True
    )
    assert isinstance(lease, Lease)
    svc.commit()
    assert svc.gauges() == {"held": 1, "waiters": 0, "fence": 1, "node": None}
    svc.connection_closed(9)  # through the seam: the bound hold ends
    assert svc.gauges()["held"] == 0
    assert svc.engine.find("k", lease.handle) is None


def test_a_remote_backend_is_awaited_for_all_but_hello_rules_and_stats(tmp_path: Path) -> None:
    remote = RecordingRemote()
    svc = service(tmp_path, remote)
    backend: LockBackend = svc.backend
    assert isinstance(backend, RemoteService) and backend.backend is remote
    assert [backend.awaits(request) for request in requests()] == [False] * 3 + [True] * 5
    assert svc.gauges() == remote.gauges()
    svc.connection_closed(4, release_bound=False)  # a stop: bound holds stay
    svc.connection_closed(5)
    assert remote.calls == [("connection_closed", 5)]


async def test_a_remote_backends_answer_is_awaited_through_the_seam(tmp_path: Path) -> None:
    svc = service(tmp_path, RecordingRemote())
    tried = parse_request(REQUESTS[3])
    reply = await svc.backend.answer(MEMBER, 1, tried, pending=0)
    assert reply.result is None and reply.grant is None  # busy, as the backend said
    with trio.fail_after(5):
        status = await svc.backend.answer(MEMBER, 1, parse_request(REQUESTS[5]), pending=0)
    assert status.result["held"] is False


@dataclass(frozen=True)
class WatchedHold:
    key: str
    handle: str
    fence: int
    principal: str
    owner: str | None


class FailingRelease(RecordingRemote):
    """A remote backend whose release does not get an answer from its store."""

    async def release(self, key: str, handle: str) -> bool:
        raise BackendUnavailable("no answer")


async def test_a_failed_release_is_no_loss_when_the_backend_ends_the_hold_later(
    tmp_path: Path,
) -> None:
    """The etcd backend finishes a failed release from its clean-up list; the watch of the
    holds then sees the hold go. The holder asked for that: it must not be told a loss."""
    svc = service(tmp_path, FailingRelease())
    backend = svc.backend
    assert isinstance(backend, RemoteService)
    hold = WatchedHold("k", "AAAAAAAAAAAAAAAAAAAAAA", 3, MEMBER.principal, None)
    svc.losses.watch(1, hold)
    told: list[LossEvent] = []
    svc.on_lost = told.append
    release = parse_request(REQUESTS[6])
    with pytest.raises(ProtocolError) as refused:
        await backend.answer(MEMBER, 1, release, pending=0)
    assert refused.value.code == "BACKEND_UNAVAILABLE"
    backend.hold_lost("k", hold.handle, "expired", None, None)  # the clean-up's deletion
    assert told == []
