"""The server and the service together, in-process: waiting, hand-offs and failures.

These run a real :class:`~lockd.daemon.server.LockServer` over a real
:class:`~lockd.daemon.service.LockService` in-process, on a real Unix socket,
with stubs for what is beside the point (policy, rate limiter, identity)
and, where timing matters, a fake boot clock: the expiry timer sleeps on
trio's clock, so moving the fake clock makes "the lease has run out but the
timer has not fired yet" deterministic instead of a race. What they pin
down: a parked or rate-waiting acquire is always answered exactly once (grant,
timeout, SHUTTING_DOWN, INTERNAL) and never leaves a grant nobody can use; a
connection's own requests are never blocked by its waiting acquires; a failed
commit neither crashes the daemon nor strands a waiter.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket as stdsocket
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from lockd.daemon import sockio
from lockd.daemon.clock import Clock, SystemClock
from lockd.daemon.cold import ColdLeases
from lockd.daemon.engine import Changes, Lease, LockEngine, Parked
from lockd.daemon.listener import bind_socket
from lockd.daemon.protocol import Acquire
from lockd.daemon.server import INLINE_READS, Limits, LockServer
from lockd.daemon.service import LockService
from lockd.daemon.store import StorageUnavailable, Store
from lockd.identity import Caller, IdentityConfig, IdentityUnavailable
from lockd.testing.clock import FakeClock
from lockd.testing.polling import wait_for_trio
from lockd.testing.wire import RawConn

MEMBER = Caller("user", "alice", "member", 1000, 1000, 4242, frozenset({"alice"}))
OWNER = Caller("user", "root", "owner", 0, 0, 1, frozenset({"root"}))


@dataclass(frozen=True)
class _Allow:
    allowed: bool = True
    reason: str = "test: open"


class OpenPolicy:
    """Every caller may do everything: the policy is not under review here."""

    def decide(
        self, caller: Caller, op: str, key: str, mode: str = "exclusive", limit: int = 1
    ) -> _Allow:
        return _Allow()

    def rules_result(self) -> dict[str, Any]:
        return {"policy": None, "lastError": None}


class ScriptedLimiter:
    """Answers ``try_take`` from a script (None = counted); None once it runs out."""

    limit = 5

    def __init__(self, answers: list[int | None] | None = None) -> None:
        self.answers = list(answers or [])

    def try_take(self, principal: str, now_ms: int) -> int | None:
        return self.answers.pop(0) if self.answers else None


class FlakyStore(Store):
    """A store whose next ``apply`` fails once when armed (disk full, I/O error)."""

    armed = False

    def apply(self, changes: Changes) -> None:
        if self.armed:
            self.armed = False
            raise sqlite3.OperationalError("database or disk is full")
        super().apply(changes)


@dataclass
class Harness:
    server: LockServer
    service: LockService
    engine: LockEngine
    socket: Path

    async def connect(self) -> Peer:
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.connect(str(self.socket))
        return Peer(sock)


class Peer:
    """A raw JSON-lines client on a trio socket."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self._buf = b""

    async def send(self, *requests: dict[str, Any]) -> None:
        data = b"".join(json.dumps(r).encode() + b"\n" for r in requests)
        await self.sock.send(data)

    async def recv(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """The next reply, or None when none came within ``timeout`` s."""
        with trio.move_on_after(timeout):
            while b"\n" not in self._buf:
                chunk = await self.sock.recv(65536)
                if not chunk:
                    return None
                self._buf += chunk
            line, self._buf = self._buf.split(b"\n", 1)
            reply: dict[str, Any] = json.loads(line)
            return reply
        return None

    async def call(self, request: dict[str, Any], timeout: float = 2.0) -> dict[str, Any]:
        await self.send(request)
        reply = await self.recv(timeout)
        assert reply is not None, f"no reply to {request}"
        return reply

    def close(self) -> None:
        self.sock.close()


@asynccontextmanager
async def running(
    tmp: Path,
    *,
    clock: Clock | None = None,
    limiter: ScriptedLimiter | None = None,
    store: Store | None = None,
    limits: Limits | None = None,
    max_pending_per_connection: int = 1024,
    caller: Callable[[], Caller] = lambda: MEMBER,
    engine: LockEngine | None = None,
) -> AsyncIterator[Harness]:
    """A LockServer serving on ``tmp/s.sock`` until the block ends."""
    engine = engine or LockEngine()
    store = store or Store(tmp / "db", "boot-1")
    service = LockService(
        engine,
        store,
        OpenPolicy(),
        limiter or ScriptedLimiter(),
        clock or SystemClock(),
        max_pending_per_connection=max_pending_per_connection,
    )
    server = LockServer(
        service,
        IdentityConfig(daemon_uid=os.getuid()),
        limits or Limits(),
        resolve=lambda sock: caller(),
    )
    path = tmp / "s.sock"
    listen = bind_socket(path, 0o600)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, listen)
            try:
                yield Harness(server, service, engine, path)
            finally:
                server.shutdown()
    finally:
        listen.close()
        store.close()


async def until(predicate: Callable[[], bool], timeout: float = 2.0) -> bool:
    """Poll ``predicate`` until true or ``timeout`` s passed; its last value."""
    with contextlib.suppress(TimeoutError):
        await wait_for_trio(predicate, timeout)
    return bool(predicate())


def acquire(rid: int, key: str, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "op": "acquire", "key": key, "ttlMs": 60_000, **extra}


def try_acquire(rid: int, key: str, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "op": "tryAcquire", "key": key, "ttlMs": 60_000, **extra}


# ------------------------------------------------------- parked acquires


async def park_behind_a_lapsed_holder(h: Harness, clock: FakeClock) -> tuple[Peer, Peer]:
    """(holder, waiter): the waiter parked on "k" behind the holder, whose lease
    has run out on the boot clock while the timer (on trio's clock, ~60 s
    away) has not handed the key over yet."""
    holder, waiter = await h.connect(), await h.connect()
    assert (await holder.call(try_acquire(1, "k")))["ok"]
    await waiter.send(acquire(2, "k", timeoutMs=600_000))
    assert await until(lambda: h.engine.waiter_count == 1)
    clock.now += 61_000
    return holder, waiter


async def test_waiter_granted_while_its_connection_closes_is_released(short_tmp: Path) -> None:
    clock = FakeClock()
    async with running(short_tmp, clock=clock) as h:
        _holder, waiter = await park_behind_a_lapsed_holder(h, clock)
        waiter.close()
        assert await until(lambda: len(h.server.connections) == 1)
        status = h.service.status("k")
        # Nobody can ever present the waiter's handle: the key must be free.
        assert status["held"] is False, status


async def test_rate_waited_acquire_times_out_on_time(short_tmp: Path) -> None:
    # alice's tryAcquire is counted; her acquire is over the limit for 50 ms.
    limiter = ScriptedLimiter([None, 50, None])
    async with running(short_tmp, limiter=limiter) as h:
        holder, waiter = await h.connect(), await h.connect()
        assert (await holder.call(try_acquire(1, "k")))["ok"]
        await waiter.send(acquire(2, "k", timeoutMs=300))
        reply = await waiter.recv(timeout=2.0)
        assert reply is not None, "no LOCK_TIMEOUT 1.7 s after a 300 ms timeout"
        assert reply["error"]["code"] == "LOCK_TIMEOUT"


async def test_close_noticed_while_pending_limit_reached(short_tmp: Path) -> None:
    async with running(short_tmp, max_pending_per_connection=2) as h:
        other, client = await h.connect(), await h.connect()
        assert (await other.call(try_acquire(1, "busy")))["ok"]
        assert (await client.call(try_acquire(1, "mine", releaseOnClose=True)))["result"]
        # Three parked acquires in one write: the third waits for a pending slot.
        await client.send(*(acquire(i, "busy", timeoutMs=600_000) for i in (2, 3, 4)))
        assert await until(lambda: h.engine.waiter_count == 2)

        def state() -> tuple[int, bool]:
            return h.engine.waiter_count, h.service.status("mine")["held"]

        client.close()
        # docs/contract.md §2/§3: a waiter whose connection closes leaves the queue, and a
        # releaseOnClose lease is released at once when its connection closes. Both are
        # waited for: the waiters leave as the connection's tasks end, and the lease goes
        # a scheduling step later, when the connection's teardown runs.
        await until(lambda: state() == (0, False), timeout=1.0)
        waiters, mine = state()
    assert (waiters, mine) == (0, False)


async def test_parked_acquires_do_not_block_the_connections_release(short_tmp: Path) -> None:
    async with running(short_tmp, max_pending_per_connection=2) as h:
        client = await h.connect()
        handle = (await client.call(try_acquire(1, "k")))["result"]["handle"]
        # Two more threads of the same program wait for k on the shared
        # connection; then the holder releases it on that connection.
        release = {"id": 4, "op": "release", "key": "k", "handle": handle}
        await client.send(acquire(2, "k", timeoutMs=600_000), acquire(3, "k", timeoutMs=600_000))
        await client.send(release)
        replies = [await client.recv(timeout=1.0) for _ in range(2)]
    # docs/contract.md §3: a parked acquire does not block the connection's other requests.
    assert sorted(r["id"] for r in replies if r is not None) == [2, 4]


async def test_waiter_hears_of_its_grant_before_the_releaser(short_tmp: Path) -> None:
    """The grant goes out inside the commit that hands the key over, before the
    release's own reply (one connection, so the order on the wire is the order)."""
    async with running(short_tmp) as h:
        client = await h.connect()
        handle = (await client.call(try_acquire(1, "k")))["result"]["handle"]
        await client.send(acquire(2, "k", timeoutMs=600_000))
        assert await until(lambda: h.engine.waiter_count == 1)
        await client.send({"id": 3, "op": "release", "key": "k", "handle": handle})
        replies = [await client.recv(), await client.recv()]
    assert [r["id"] for r in replies if r is not None] == [2, 3], replies
    assert replies[0] is not None and replies[0]["result"]["fence"] == 2


async def test_a_peer_that_reads_no_replies_is_read_no_further(short_tmp: Path) -> None:
    """Replies wait in the connection's writer only up to what one read brought in."""
    async with running(short_tmp) as h:
        raw = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        raw.setsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_RCVBUF, 4096)
        raw.connect(str(h.socket))
        raw.setblocking(False)
        line = json.dumps({"id": 1, "op": "status", "key": "k"}).encode() + b"\n"
        sent = 0
        with trio.move_on_after(1):
            while True:
                await trio.lowlevel.wait_writable(raw)
                sent += raw.send(line * 100)
        (conn,) = h.server.connections.values()
        assert conn.writer is not None and conn.writer.backlogged
        # The daemon stopped reading: requests are left in the socket, and
        # the replies queued are at most those of one read.
        answered = h.service.stats.latency["status"].count
        assert answered < sent // len(line)
        assert conn.writer.queued <= sockio.RECV_BYTES // len(line) + 1
        raw.close()


async def test_failed_commit_does_not_strand_parked_waiter(short_tmp: Path) -> None:
    store = FlakyStore(short_tmp / "db", "boot-1")
    async with running(short_tmp, store=store) as h:
        holder, waiter = await h.connect(), await h.connect()
        handle = (await holder.call(try_acquire(1, "k")))["result"]["handle"]
        await waiter.send(acquire(2, "k", timeoutMs=500))
        assert await until(lambda: h.engine.waiter_count == 1)
        store.armed = True
        release = await holder.call({"id": 3, "op": "release", "key": "k", "handle": handle})
        assert release["error"]["code"] == "INTERNAL"
        # The daemon lives on (docs/contract.md §3): the waiter must get an answer -- its
        # grant, an error, or at worst its LOCK_TIMEOUT after 500 ms.
        reply = await waiter.recv(timeout=1.5)
    assert reply is not None, "parked acquire never answered after a failed commit"


def test_fence_of_a_grant_broken_in_the_same_batch_survives_restart(short_tmp: Path) -> None:
    db = short_tmp / "db"
    clock = FakeClock(now=0)
    store = Store(db, "boot-1")
    seen: list[int] = []
    service = LockService(LockEngine(), store, OpenPolicy(), ScriptedLimiter(), clock)
    service.on_resolved = lambda w: seen.append(w.lease.fence) if w.lease else None
    opts: dict[str, Any] = {"op": "acquire", "key": "k", "owner": None, "release_on_close": False}
    service.acquire(
        MEMBER, 1, Acquire(1, ttl_ms=100, timeout_ms=None, **opts), pending=0
    )  # fence 1
    parked = service.acquire(
        MEMBER, 2, Acquire(2, ttl_ms=1000, timeout_ms=60_000, **opts), pending=0
    )
    assert isinstance(parked, Parked)
    # The lease ran out at 100; before the timer ticks, an admin breaks the
    # key: the same engine call hands it to the waiter (fence 2) and breaks that.
    clock.now = 150
    broken = service.break_lock(OWNER, "k", "stuck")
    assert broken["fence"] == 2 and seen == [2]  # both the breaker and the waiter saw 2
    store.close()
    _, fence = Store(db, "boot-1").load()
    # docs/contract.md §1/§4: fences strictly increase across all grants, restarts included.
    assert fence >= 2


async def test_waiter_told_shutting_down_is_not_left_holding(short_tmp: Path) -> None:
    clock = FakeClock()
    async with running(short_tmp, clock=clock) as h:
        _holder, waiter = await park_behind_a_lapsed_holder(h, clock)
        h.server.shutdown()
        reply = await waiter.recv()
        engine = h.engine
    assert reply is not None and reply["error"]["code"] == "SHUTTING_DOWN"
    holder_now = engine.status(clock.now, "k").holder
    # The waiter was refused; a lease kept for it is held by nobody (and it is
    # committed, so it outlives the restart too).
    assert holder_now is None or holder_now.fence == 1, holder_now


async def test_store_error_after_rate_wait_is_internal_not_a_crash(short_tmp: Path) -> None:
    store = FlakyStore(short_tmp / "db", "boot-1")
    outcome: dict[str, Any] = {}
    try:
        async with running(short_tmp, store=store, limiter=ScriptedLimiter([50, None])) as h:
            client = await h.connect()
            store.armed = True  # the grant after the 50 ms rate wait fails to commit
            outcome["reply"] = await client.call(acquire(1, "k", timeoutMs=5_000))
            outcome["hello"] = await (await h.connect()).call({"id": 2, "op": "hello"})
    except BaseExceptionGroup as group:
        outcome["crash"] = group
    assert "crash" not in outcome, f"daemon stopped: {outcome['crash'].exceptions!r}"
    assert outcome["reply"]["error"]["code"] == "INTERNAL"
    assert outcome["hello"]["ok"]


class FailingReads:
    """A store's connection whose reads of lease rows fail while armed (an I/O error)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.armed = db, True

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if self.armed and sql.startswith("SELECT") and "FROM leases" in sql:
            raise sqlite3.OperationalError("disk I/O error")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


async def test_a_cold_key_that_cannot_be_read_is_storage_unavailable_and_kept(
    short_tmp: Path,
) -> None:
    """Leases found at start are read when first needed; a failed read loses none of them."""
    clock = FakeClock()
    store = Store(short_tmp / "db", "boot-1")
    stored = Lease("cold", "h-cold-stored-xxxxxxxxx", 1, None, "user:alice", 60_000, 0)
    due = Lease("due", "h-due-stored-xxxxxxxxxx", 2, None, "user:alice", 60_000, 0)
    stored.expires_at, due.expires_at = clock.now + 60_000, clock.now + 1_000
    store.apply(Changes(rows={("cold", 0): stored, ("due", 0): due}, fence=2))
    engine = LockEngine(fence=2)
    engine.restore_cold(ColdLeases.build(store.deadlines()), store.leases_of, clock.now)
    reads = FailingReads(store._db)
    store.reads._db = reads  # type: ignore[assignment]
    async with running(short_tmp, clock=clock, store=store, engine=engine) as h:
        client = await h.connect()
        for request in (
            {"id": 1, "op": "status", "key": "cold"},
            try_acquire(2, "cold"),
            {"id": 3, "op": "release", "key": "cold", "handle": stored.handle},
        ):
            reply = await client.call(request)
            assert reply["error"]["code"] == "STORAGE_UNAVAILABLE", reply
        # The timer meets the same failure: it retries later, nothing is lost.
        clock.now += 2_000
        assert not h.service.tick()
        counters = h.service.stats.counters
        assert (counters["storageErrors"], counters["internalErrors"]) == (4, 0)
        reads.armed = False
        assert h.service.tick()
        assert engine.held_count == 1  # "due" expired now that it could be read
        status = await client.call({"id": 4, "op": "status", "key": "cold"})
        assert status["result"]["held"] and status["result"]["fence"] == 1, status
        released = await client.call(
            {"id": 5, "op": "release", "key": "cold", "handle": stored.handle}
        )
        assert released["result"] == {"released": True}, released


# ---------------------------------------------------------- group commit


class CountingStore(Store):
    """Counts commits and their rows; fails the next one when armed."""

    commits: list[int]
    fail_next = False

    def apply(self, changes: Changes) -> None:
        if self.fail_next:
            self.fail_next = False
            raise StorageUnavailable("test: disk full")
        super().apply(changes)
        if changes.rows:
            self.commits.append(len(changes.rows))


async def peers_in_one_pass(h: Harness, count: int) -> list[tuple[stdsocket.socket, Peer]]:
    """``count`` connections, each served (a hello answered) so its task waits to read."""
    peers = []
    for _ in range(count):
        raw = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        raw.connect(str(h.socket))
        peer = Peer(trio.socket.from_stdlib_socket(raw))
        assert (await peer.call({"id": 0, "op": "hello"}))["ok"]
        peers.append((raw, peer))
    return peers


def send_now(raw: stdsocket.socket, request: dict[str, Any]) -> None:
    """Write a request without yielding to trio: the server sees them all in one pass."""
    raw.send(json.dumps(request).encode() + b"\n")


async def test_requests_of_several_connections_share_one_commit(short_tmp: Path) -> None:
    store = CountingStore(short_tmp / "db", "boot-1")
    store.commits = []
    async with running(short_tmp, store=store) as h:
        peers = await peers_in_one_pass(h, 3)
        for i, (raw, _) in enumerate(peers):
            send_now(raw, try_acquire(1, f"k{i}"))
        replies = [await peer.recv() for _, peer in peers]
        assert all(r is not None and r["ok"] and r["result"] for r in replies), replies
        # One transaction for the three grants, each acknowledged after it.
        assert store.commits == [3]
        fences = sorted(r["result"]["fence"] for r in replies if r is not None)
    assert fences == [1, 2, 3]
    _, fence = Store(short_tmp / "db", "boot-1").load()
    assert fence == 3


async def test_failed_group_commit_answers_each_request_of_the_batch(short_tmp: Path) -> None:
    store = CountingStore(short_tmp / "db", "boot-1")
    store.commits = []
    async with running(short_tmp, store=store) as h:
        peers = await peers_in_one_pass(h, 3)
        held = (await peers[0][1].call(try_acquire(1, "held")))["result"]["handle"]
        store.fail_next = True
        send_now(peers[0][0], {"id": 2, "op": "release", "key": "held", "handle": held})
        send_now(peers[1][0], try_acquire(2, "new"))
        send_now(peers[2][0], {"id": 2, "op": "hello"})
        replies = [await peer.recv() for _, peer in peers]
        codes = [r["error"]["code"] if r and not r["ok"] else "ok" for r in replies]
        # The release and the grant are undone, each told so; hello is answered.
        assert codes == ["STORAGE_UNAVAILABLE", "STORAGE_UNAVAILABLE", "ok"], replies
        assert h.service.status("held")["held"] and not h.service.status("new")["held"]
        h.engine.check_invariants()
        # The next batch commits as usual.
        assert (await peers[1][1].call(try_acquire(3, "new")))["ok"]
        assert h.service.status("new")["held"]


def test_a_deadline_commits_the_batch_before_it(short_tmp: Path) -> None:
    """Time is a fact the engine never undoes: requests before it are committed first."""
    clock = FakeClock(now=0)
    store = CountingStore(short_tmp / "db", "boot-1")
    store.commits = []
    service = LockService(LockEngine(), store, OpenPolicy(), ScriptedLimiter(), clock)
    service.group_commit = True
    opts: dict[str, Any] = {"op": "tryAcquire", "owner": None, "release_on_close": False}
    short = Acquire(1, key="short", ttl_ms=10, timeout_ms=None, **opts)
    service.acquire(MEMBER, 1, short, pending=0)
    service.commit_fact("test")
    service.acquire(MEMBER, 1, Acquire(2, key="a", ttl_ms=1000, timeout_ms=None, **opts), pending=0)
    assert service.batch_open and store.commits == [1]
    clock.now = 20  # "short" has run out
    service.acquire(MEMBER, 1, Acquire(3, key="b", ttl_ms=1000, timeout_ms=None, **opts), pending=0)
    assert store.commits == [1, 1]  # "a", before the expiry was applied
    store.fail_next = True
    assert not service.commit_fact("test")  # undoes "b" only
    assert service.status("a")["held"] and not service.status("b")["held"]
    assert not service.status("short")["held"]
    store.close()


# ------------------------------------------- reading without a scheduler pass


@dataclass
class ReadyStream:
    """A client on ``raw`` that always has its next request ready.

    Each time the server has handled one of its lines, the next ``hello`` is
    written at once -- as a client does that sends as soon as it has its
    reply, before the daemon is back from ``send`` -- ``count`` in all.
    ``then`` is called once, after its first line. ``seen`` records, per
    line another connection sent, how many of the stream's were sent by then.
    """

    raw: stdsocket.socket
    count: int
    then: Callable[[], None] = lambda: None
    sent: int = 0
    seen: list[int] = field(default_factory=list)

    def install(self, h: Harness) -> None:
        handle_line = h.server._handle_line
        ours = min(h.server.connections)  # raw's: the first one made

        def handle_and_send_next(conn: Any, line: bytes, nursery: trio.Nursery) -> None:
            handle_line(conn, line, nursery)
            if conn.id != ours:
                self.seen.append(self.sent)
            elif self.sent < self.count:
                self.sent += 1
                send_now(self.raw, {"id": self.sent + 1, "op": "hello"})
                if self.sent == 1:
                    self.then()

        h.server._handle_line = handle_and_send_next  # type: ignore[method-assign]


class ConnectionSteps(trio.abc.Instrument):
    """Counts the scheduler's steps of connection tasks."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("_serve_connection"):
            self.steps += 1


async def test_a_stream_of_ready_requests_is_read_without_a_pass_each_but_yields(
    short_tmp: Path,
) -> None:
    async with running(short_tmp) as h:
        ((raw, peer),) = await peers_in_one_pass(h, 1)
        ReadyStream(raw, 60).install(h)
        counter = ConnectionSteps()
        trio.lowlevel.add_instrument(counter)
        try:
            send_now(raw, {"id": 1, "op": "hello"})
            ids = [r["id"] for r in [await peer.recv() for _ in range(61)] if r is not None]
        finally:
            trio.lowlevel.remove_instrument(counter)
    assert ids == list(range(1, 62))
    # Up to INLINE_READS requests read after one pass (61 passes without
    # it), and a pass at least that often (1 pass without the cap): the
    # expiry timer, parked waiters and new connections get their turn.
    assert 61 // (INLINE_READS + 1) <= counter.steps <= 2 * (61 // INLINE_READS), counter.steps


async def test_a_stream_of_ready_requests_lets_another_connection_in(short_tmp: Path) -> None:
    async with running(short_tmp) as h:
        (raw_a, peer_a), (raw_b, peer_b) = await peers_in_one_pass(h, 2)
        stream = ReadyStream(raw_a, 60, then=lambda: send_now(raw_b, {"id": 99, "op": "hello"}))
        stream.install(h)
        send_now(raw_a, {"id": 1, "op": "hello"})
        reply = await peer_b.recv()
        ids = [r["id"] for r in [await peer_a.recv() for _ in range(61)] if r is not None]
    assert reply is not None and reply["id"] == 99
    # b's request came while a's stream ran: a let it in at once (the
    # scheduler may run a's task first once more), not after INLINE_READS.
    assert len(stream.seen) == 1 and stream.seen[0] <= 2, stream.seen
    assert ids == list(range(1, 62))


# ---------------------------------------------------------- busy polling

#: A budget no test waits out: if polling did not end when it should, the
#: clients' 10 s socket timeouts fail the test.
LONG_POLL_NS = 60 * 10**9


async def test_a_lone_connection_polls_for_its_next_request_instead_of_parking(
    short_tmp: Path,
) -> None:
    async with running(short_tmp, limits=Limits(busy_poll_ns=LONG_POLL_NS)) as h:
        counter = ConnectionSteps()

        def five_hellos() -> list[int]:
            with contextlib.closing(RawConn(h.socket, timeout=10)) as raw:
                return [raw.call({"id": i, "op": "hello"})["id"] for i in range(5)]

        trio.lowlevel.add_instrument(counter)
        try:
            ids = await trio.to_thread.run_sync(five_hellos)
        finally:
            trio.lowlevel.remove_instrument(counter)
    assert ids == list(range(5))
    # Each request came after the previous reply, from another thread: with
    # no polling, nearly each would cost the task a scheduler pass.
    assert counter.steps <= 3, counter.steps


async def test_a_polling_connection_lets_new_connections_and_other_requests_in(
    short_tmp: Path,
) -> None:
    async with running(short_tmp, limits=Limits(busy_poll_ns=LONG_POLL_NS)) as h:

        def two_clients() -> list[dict[str, Any]]:
            with contextlib.closing(RawConn(h.socket, timeout=10)) as a:
                replies = [a.call({"id": 1, "op": "hello"})]
                # a's task polls now: a new connection ends it ...
                with contextlib.closing(RawConn(h.socket, timeout=10)) as b:
                    replies.append(b.call({"id": 2, "op": "hello"}))
                    # ... b's task polls now: a request of a ends it ...
                    replies.append(a.call({"id": 3, "op": "hello"}))
                    # ... and a's again: a request of b ends that.
                    replies.append(b.call({"id": 4, "op": "hello"}))
                return replies

        replies = await trio.to_thread.run_sync(two_clients)
    assert [r["id"] for r in replies] == [1, 2, 3, 4]
    assert all(r["ok"] for r in replies)


async def test_a_connection_with_an_acquire_waiting_does_not_poll(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    polled_while_waiting: list[int] = []
    polls = 0
    async with running(short_tmp, limits=Limits(busy_poll_ns=10**6)) as h:
        next_bytes = sockio.BusyPoll.next_bytes

        def recording(poll: sockio.BusyPoll, *args: Any, **kwargs: Any) -> bytes | None:
            nonlocal polls
            polls += 1
            conn = next(c for c in h.server.connections.values() if c.busy is poll)
            if conn.waiting:
                polled_while_waiting.append(conn.id)
            return next_bytes(poll, *args, **kwargs)

        monkeypatch.setattr(sockio.BusyPoll, "next_bytes", recording)
        (_, holder), (_, waiter) = await peers_in_one_pass(h, 2)
        granted = await holder.call(try_acquire(1, "k"))
        await waiter.send(acquire(2, "k", timeoutMs=30_000))
        assert await until(lambda: h.engine.waiter_count == 1)
        await holder.call(
            {"id": 3, "op": "release", "key": "k", "handle": granted["result"]["handle"]}
        )
        handed = await waiter.recv()
    assert handed is not None and handed["ok"] and handed["result"]["handle"]
    assert polls > 0  # the connections did poll between requests ...
    assert polled_while_waiting == []  # ... but not while an acquire of theirs waited


async def test_while_several_clients_are_busy_no_connection_looks_for_its_next_request(
    short_tmp: Path,
) -> None:
    """With the poll gate closed, ``_read_now`` leaves even a waiting request to trio.

    The epoll call it would make (is another connection's request
    waiting?) nearly always says yes under many busy clients (B3), so it
    is not made; with the gate open the same ready request is read at once.
    """
    async with running(short_tmp) as h:  # no busy-poll: the gate is what is tested
        (raw_a, _), _ = await peers_in_one_pass(h, 2)
        await trio.testing.wait_all_tasks_blocked()
        conn_a = min(h.server.connections.values(), key=lambda conn: conn.id)
        raw_a.send(json.dumps({"id": 1, "op": "hello"}).encode() + b"\n")
        gate = h.server._poll_gate
        gate.closed_until = time.perf_counter_ns() + LONG_POLL_NS
        polls: list[int] = []
        readable = h.server._readable

        class CountingEpoll:
            def poll(self, timeout: float = -1, maxevents: int = -1) -> list[tuple[int, int]]:
                polls.append(maxevents)
                return readable.poll(timeout, maxevents)

        h.server._readable = CountingEpoll()  # type: ignore[assignment]
        try:
            assert h.server._read_now(conn_a) is None
            assert polls == []
            gate.closed_until = 0
            assert h.server._read_now(conn_a) == b'{"id": 1, "op": "hello"}\n'
            assert polls == [2]
        finally:
            h.server._readable = readable


# ---------------------------------------------------- shutdown and framing


async def test_sigterm_answers_rate_waiting_acquire_with_shutting_down(short_tmp: Path) -> None:
    """A blocking acquire waiting for rate-limit room is a parked acquire too
    (docs/contract.md §7)."""
    limiter = ScriptedLimiter([60_000] * 3)
    async with running(short_tmp, limiter=limiter) as h:
        client = await h.connect()
        await client.send(acquire(1, "k", timeoutMs=120_000))
        # Shut down only once the acquire waits for room (a request that came during
        # the shutdown would be answered SHUTTING_DOWN too: the test would prove nothing):
        # the limiter was asked, and every task, its wait's too, is blocked.
        assert await until(lambda: len(limiter.answers) < 3)
        await trio.testing.wait_all_tasks_blocked()
        h.server.shutdown()
        reply = await client.recv()
    assert reply is not None and reply["error"]["code"] == "SHUTTING_DOWN"


@pytest.mark.parametrize("attempt", range(10))
async def test_sigterm_as_an_acquire_starts_waiting_for_room_still_answers_it(
    short_tmp: Path, attempt: int
) -> None:
    """The stop comes right after the limiter was asked, when the task that waits for room
    may not have run yet: the daemon must wait for it to answer, not close the connection
    under it (before the fix, 6 of 10 such stops sent no reply at all)."""
    limiter = ScriptedLimiter([60_000] * 3)
    async with running(short_tmp, limiter=limiter) as h:
        client = await h.connect()
        await client.send(acquire(1, "k", timeoutMs=120_000))
        assert await until(lambda: len(limiter.answers) < 3)
        h.server.shutdown()
        reply = await client.recv()
    assert reply is not None and reply["error"]["code"] == "SHUTTING_DOWN"


async def test_overlong_line_reply_names_limit_and_closes(short_tmp: Path) -> None:
    async with running(short_tmp, limits=Limits(max_line_bytes=1024)) as h:
        client = await h.connect()
        await client.sock.send(b'{"id":1,"op":"hello"}\n' + b"x" * 1025 + b"\n")
        first, second, eof = await client.recv(), await client.recv(), await client.recv()
    assert first is not None and first["ok"]
    assert second is not None and second["id"] is None
    assert second["error"]["code"] == "INVALID_REQUEST"
    assert second["error"]["details"]["limit"] == 1024
    assert eof is None


async def test_blank_lines_get_no_reply_and_cost_no_request(short_tmp: Path) -> None:
    """A bare newline is no request: no parse, no reply, no counter (issue 21, item 7)."""
    async with running(short_tmp) as h:
        client = await h.connect()
        await client.sock.send(b"\n" * 500 + b"\r\n  \n" + b'{"id":1,"op":"hello"}\n' + b"\n" * 5)
        first = await client.recv()
        more = await client.recv(timeout=0.3)
        counters = dict(h.service.stats.counters)
    assert first is not None and first["id"] == 1 and first["ok"]
    assert more is None
    assert counters.get("invalidRequests", 0) == 0


async def test_a_trickled_line_is_closed_a_bound_after_its_first_byte(
    short_tmp: Path, autojump_clock: trio.abc.Clock
) -> None:
    """One byte every 8 s must not keep a line (and its buffer) open (issue 21, item 8)."""
    async with running(short_tmp, limits=Limits(partial_line_timeout=10.0)) as h:
        client = await h.connect()
        started = trio.current_time()

        async def trickle() -> None:
            with contextlib.suppress(OSError):
                for byte in b'{"id":1,"op":"hello"':
                    await client.sock.send(bytes([byte]))
                    await trio.sleep(8)  # the behaviour under test; autojump_clock: no real time

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            reply = await client.recv(timeout=120)
            closed_after = trio.current_time() - started
            eof = await client.recv(timeout=120)
            nursery.cancel_scope.cancel()
        buffered = h.server._buffered
    assert reply is not None and reply["error"]["code"] == "INVALID_REQUEST"
    assert reply["error"]["details"]["reason"] == "partial_line_timeout"
    assert 10.0 <= closed_after < 11.0, closed_after
    assert eof is None
    assert buffered == 0


async def test_a_caller_that_cannot_be_identified_is_answered_and_kept(short_tmp: Path) -> None:
    """Issue 21, item 10: BACKEND_UNAVAILABLE per request, then served once a lookup works."""
    failures = [IdentityUnavailable(errno.EMFILE, "Too many open files")] * 3

    def flaky_lookup() -> Caller:
        if failures:
            raise failures.pop()
        return MEMBER

    async with running(short_tmp, caller=flaky_lookup) as h:
        client = await h.connect()
        # The lookup at accept and those before requests 1 and 2 fail ...
        first = await client.call({"id": 1, "op": "hello"})
        await client.sock.send(b"\n")  # a blank line is no request: no lookup
        second = await client.call(try_acquire(2, "k"))
        # ... then the lookups work: the same connection is served.
        await client.send({"id": 3, "op": "hello"}, try_acquire(4, "k"))
        third, fourth = await client.recv(), await client.recv()
    for reply, rid in ((first, 1), (second, 2)):
        assert reply["id"] == rid and reply["ok"] is False
        assert reply["error"]["code"] == "BACKEND_UNAVAILABLE"
        assert reply["error"]["details"]["reason"] == "identity_unavailable"
    assert third is not None and third["id"] == 3 and third["result"]["principal"] == "user:alice"
    assert fourth is not None and fourth["id"] == 4 and fourth["ok"] and fourth["result"]["fence"]


async def test_internal_errors_of_one_caller_are_logged_once_per_interval(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 21, item 5: a caller who can trigger a bug cannot fill the log with tracebacks."""
    async with running(short_tmp) as h:

        def broken(caller: Caller) -> dict[str, Any]:
            raise RuntimeError("a bug")

        h.service.hello = broken  # type: ignore[method-assign]
        client = await h.connect()
        with caplog.at_level("ERROR", logger="lockd.daemon.server"):
            for rid in range(50):
                reply = await client.call({"id": rid, "op": "hello"})
                assert reply["error"]["code"] == "INTERNAL"
        internal = dict(h.service.stats.counters)["internalErrors"]
    lines = [r for r in caplog.records if "event=internal_error" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is not None
    assert internal == 50


async def test_a_member_past_its_rule_share_is_read_no_further_until_it_is_back(
    short_tmp: Path,
) -> None:
    """Issue 21, item 3: its requests wait behind everyone else's, not served at full speed."""
    from lockd.daemon.ratelimit import RuleCpuBudget

    from .test_fairness import CostlyPolicy

    callers = iter([MEMBER, OWNER])
    async with running(short_tmp, caller=lambda: next(callers)) as h:
        h.service.policy = CostlyPolicy(cost_s=0.2)  # 200 ms of CPU per evaluation
        h.service.rule_cpu = RuleCpuBudget(200, burst_ms=100)  # one evaluation: 0.5 s to pay back
        member = await h.connect()
        started = trio.current_time()
        await member.send(try_acquire(1, "k1"), try_acquire(2, "k2"))
        first = await member.recv()
        refused = await member.recv()
        await member.send(try_acquire(3, "k3"))
        owner = await h.connect()
        owner_started = trio.current_time()
        assert (await owner.call({"id": 9, "op": "hello"}))["ok"]
        owner_waited = trio.current_time() - owner_started
        third = await member.recv(timeout=5)
        member_waited = trio.current_time() - started
    assert first is not None and first["ok"]
    # read in the same batch: refused without evaluation
    assert refused is not None and refused["error"]["code"] == "RATE_LIMITED"
    assert refused["error"]["details"]["reason"] == "rule_cpu"
    # the next one was read only once the share was back, then evaluated and granted
    assert third is not None and third["id"] == 3 and third["ok"]
    assert member_waited >= 0.4, member_waited
    assert owner_waited < 0.4, owner_waited  # nobody else waited for it
