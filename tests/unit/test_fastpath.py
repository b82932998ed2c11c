"""The fast path answers exactly as the usual path does (lockd.daemon.fastpath).

Two services, each with its own engine and store, on clocks moved alike:
one with its fast path, one with ``service.fast = None`` (every request the
usual way). A hypothesis state machine sends both the same requests --
tryAcquires (free keys, busy keys, re-takes by owner, shared holds,
semaphores, another process named), blocking acquires that park or run
out, releases of live, stale and bogus handles, renews, connections
closing -- from members (rate-limited, one of them denied a key by the
rules) and an owner, lets time pass so that leases and waits run out,
and commits the group commit's batch, sometimes failing it. After every
step both must have answered the same wire document (errors included),
and hold the same state: every key's holders (handle, fence, deadline,
owner, process, binding), queues, the fence, counters, the rows in the
store and the waiters resolved. A run where the fast path was never taken
would prove nothing: the machine counts its answers, and the fixed tests
below check that it is taken in the cases it exists for, and through the
real server.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lockd.daemon.engine import Changes, LockEngine, Waiter
from lockd.daemon.fastpath import FastPath
from lockd.daemon.keytable import holders, queued
from lockd.daemon.protocol import (
    ProtocolError,
    encode_protocol_error,
    encode_result,
    parse_request,
)
from lockd.daemon.ratelimit import RateLimiter
from lockd.daemon.service import LockService, Reply
from lockd.daemon.store import StorageUnavailable, Store
from lockd.identity import Caller
from lockd.testing.clock import FakeClock
from tests.unit.test_server import Harness, Peer, running, try_acquire, until

ALICE = Caller("user", "alice", "member", 1000, 1000, 4242, frozenset({"alice"}), "sh", 77)
BOB = Caller("user", "bob", "member", 1001, 1001, 4343, frozenset({"bob"}), "py", 78)
ROOT = Caller("user", "root", "owner", 0, 0, 1, frozenset({"root"}), "init", 1)
#: a peer in a pid namespace the daemon cannot see into (pid 0)
HIDDEN = Caller("user", "carol", "member", 1002, 1002, 0, frozenset({"carol"}))
CALLERS = (ALICE, BOB, ROOT, HIDDEN)
KEYS = ("a", "b", "c")


@dataclass(frozen=True)
class _Verdict:
    allowed: bool
    reason: str
    cpu_s: float = 0.0


class BobNotOnB:
    """Every caller may do everything, except that bob may not acquire key "b"."""

    def decide(
        self, caller: Caller, op: str, key: str, mode: str = "exclusive", limit: int = 1
    ) -> _Verdict:
        if caller.name == "bob" and key == "b" and op in ("acquire", "tryAcquire"):
            return _Verdict(False, "test: bob not on b")
        return _Verdict(True, "test: open")

    def rules_result(self) -> dict[str, Any]:
        return {"policy": None, "lastError": None}


class FailingStore(Store):
    """Fails its next ``apply`` when armed (a full disk)."""

    fail_next = False

    def apply(self, changes: Changes) -> None:
        if self.fail_next:
            self.fail_next = False
            raise StorageUnavailable("test: disk full")
        super().apply(changes)


class Side:
    """One service answering requests as the server would, with or without its fast path."""

    def __init__(self, folder: Path, clock: FakeClock, *, fast: bool) -> None:
        counter = itertools.count(1)
        self.engine = LockEngine(handle_factory=lambda: f"h{next(counter)}")
        self.store = FailingStore(folder / "lockd.db", "boot-1")
        self.service = LockService(
            self.engine, self.store, BobNotOnB(), RateLimiter(6, window_ms=5_000), clock
        )
        self.service.group_commit = True
        if not fast:
            self.service.fast = None
        self.resolved: list[tuple[int, int | None, bool]] = []
        self.service.on_resolved = self._resolved
        #: requests the fast path answered.
        self.fast_answers = 0
        self.parked: dict[int, Waiter] = {}

    def _resolved(self, waiter: Waiter) -> None:
        fence = waiter.lease.fence if waiter.lease is not None else None
        self.resolved.append((waiter.id, fence, waiter.timed_out))

    def send(self, caller: Caller, conn: int, request: dict[str, Any]) -> bytes:
        """The reply line the server would write for ``request`` (``_handle_line``'s order)."""
        service = self.service
        line = json.dumps(request, separators=(",", ":")).encode()
        parsed = None
        try:
            parsed = parse_request(line)
            fast = service.fast
            if fast is not None:
                reply = fast.answer(caller, conn, parsed)
                if reply is not None:
                    self.fast_answers += 1
                    return encode_result(parsed.id, reply.result)
            if parsed.op in ("acquire", "tryAcquire"):
                step = service.acquire(caller, conn, parsed, pending=0)  # type: ignore[arg-type]
                if isinstance(step, Reply):
                    return encode_result(parsed.id, step.result)
                if hasattr(step, "waiter"):
                    self.parked[step.waiter.id] = step.waiter
                    return b"parked %d" % step.waiter.id
                return b"waits for room"
            return encode_result(parsed.id, service.answer(caller, parsed))
        except ProtocolError as exc:
            if parsed is not None and exc.request_id is None:
                exc.request_id = parsed.id
            return encode_protocol_error(exc)

    def state(self) -> dict[str, Any]:
        """Everything either path could have changed."""
        table = self.engine._table
        keys = {}
        for key, st_ in table.keys.items():
            keys[key] = (
                st_.mode,
                st_.limit,
                [
                    (
                        lease.handle,
                        lease.fence,
                        lease.owner,
                        lease.principal,
                        lease.ttl_ms,
                        lease.expires_at,
                        lease.conn,
                        lease.taken_by,
                        lease.slot,
                        lease.pid,
                        lease.process,
                        lease.pid_start,
                    )
                    for lease in holders(st_)
                ],
                [(w.id, w.principal, w.deadline) for w in queued(st_)],
            )
        return {
            "keys": keys,
            "sorted": list(table.sorted_keys),
            "owned": sorted((k, v.handle) for k, v in table.owned.items()),
            "conn_leases": {
                c: sorted(lease.handle for lease in s) for c, s in table.conn_leases.items()
            },
            "fence": self.engine.fence,
            "lease_count": self.engine.lease_count,
            "counters": dict(self.service.stats.counters),
            "resolved": list(self.resolved),
            "batch_open": self.service.batch_open,
            "rows": self.rows(),
        }

    def rows(self) -> list[tuple[Any, ...]]:
        """The leases table as committed (read on the store's own connection: it locks the file)."""
        rows: list[tuple[Any, ...]] = self.store._db.execute(
            "SELECT key, slot, handle, fence, owner, principal, ttl_ms, expires_at, "
            "mode, hold_limit, pid, process, pid_start FROM leases ORDER BY key, slot"
        ).fetchall()
        return rows


class FastAndSlow(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"lockd-fastpath-{os.getpid()}"
        self.folder.mkdir(mode=0o700, exist_ok=True)
        self.clock = FakeClock()
        self.run = next(_RUNS)
        (self.folder / f"{self.run}-fast").mkdir(mode=0o700)
        (self.folder / f"{self.run}-slow").mkdir(mode=0o700)
        self.fast = Side(self.folder / f"{self.run}-fast", self.clock, fast=True)
        self.slow = Side(self.folder / f"{self.run}-slow", self.clock, fast=False)
        self.rid = 0
        #: handles handed out so far, by key (both sides hand out the same).
        self.handles: dict[str, list[str]] = {key: [] for key in KEYS}

    def teardown(self) -> None:
        for side in (self.fast, self.slow):
            side.store.close()

    def both(self, caller: Caller, conn: int, request: dict[str, Any]) -> None:
        self.rid += 1
        request = {"id": self.rid, **request}
        slow = self.slow.send(caller, conn, request)
        fast = self.fast.send(caller, conn, request)
        assert fast == slow, f"{request}: fast path {fast!r}, usual path {slow!r}"
        if fast.startswith(b"{"):
            reply = json.loads(fast)
            result = reply.get("result")
            if isinstance(result, dict) and "handle" in result:
                self.handles[result["key"]].append(result["handle"])

    @rule(
        caller=st.sampled_from(CALLERS),
        conn=st.integers(1, 3),
        key=st.sampled_from(KEYS),
        ttl=st.sampled_from([50, 1_000, 60_000]),
        owner=st.sampled_from([None, None, "o1", "o2"]),
        shared=st.booleans(),
        limit=st.sampled_from([None, None, 1, 2]),
        pid=st.sampled_from([None, None, "own", 1, 999_999]),
        release_on_close=st.booleans(),
    )
    def try_acquire(
        self,
        caller: Caller,
        conn: int,
        key: str,
        ttl: int,
        owner: str | None,
        shared: bool,
        limit: int | None,
        pid: int | str | None,
        release_on_close: bool,
    ) -> None:
        request: dict[str, Any] = {"op": "tryAcquire", "key": key, "ttlMs": ttl}
        if owner is not None:
            request["owner"] = owner
        if shared:
            request["mode"] = "shared"
        if limit is not None:
            request["limit"] = limit
        if pid is not None:
            request["pid"] = caller.pid if pid == "own" and caller.pid > 0 else 1
        if release_on_close:
            request["releaseOnClose"] = True
        self.both(caller, conn, request)

    @rule(
        caller=st.sampled_from(CALLERS),
        conn=st.integers(1, 3),
        key=st.sampled_from(KEYS),
        timeout=st.sampled_from([0, 100, 5_000]),
    )
    def acquire(self, caller: Caller, conn: int, key: str, timeout: int) -> None:
        self.both(caller, conn, {"op": "acquire", "key": key, "ttlMs": 1_000, "timeoutMs": timeout})

    @rule(
        caller=st.sampled_from(CALLERS),
        key=st.sampled_from(KEYS),
        which=st.integers(-3, 3),
        on_key=st.sampled_from(KEYS),
    )
    def release(self, caller: Caller, key: str, which: int, on_key: str) -> None:
        handles = self.handles[key]
        handle = handles[which % len(handles)] if handles else "nobody-has-this"
        self.both(caller, 1, {"op": "release", "key": on_key, "handle": handle})

    @rule(key=st.sampled_from(KEYS), which=st.integers(-2, 2))
    def renew(self, key: str, which: int) -> None:
        handles = self.handles[key]
        if handles:
            handle = handles[which % len(handles)]
            self.both(ROOT, 1, {"op": "renew", "key": key, "handle": handle, "ttlMs": 2_000})

    @rule(key=st.sampled_from(KEYS))
    def status(self, key: str) -> None:
        self.both(ALICE, 2, {"op": "status", "key": key})

    @rule(ms=st.sampled_from([1, 49, 60, 500, 1_500, 70_000]))
    def time_passes(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule()
    def tick(self) -> None:
        assert self.fast.service.tick() == self.slow.service.tick()

    @rule(fail=st.booleans())
    def commit(self, fail: bool) -> None:
        self.fast.store.fail_next = self.slow.store.fail_next = fail
        assert self.fast.service.commit_fact("test") == self.slow.service.commit_fact("test")

    @precondition(lambda self: self.rid > 0)
    @rule(conn=st.integers(1, 3))
    def connection_closes(self, conn: int) -> None:
        for side in (self.fast, self.slow):
            side.service.connection_closed(conn)

    @invariant()
    def same_state(self) -> None:
        if self.rid == 0:
            return
        fast, slow = self.fast.state(), self.slow.state()
        assert fast == slow
        self.fast.engine.check_invariants()

    @invariant()
    def fast_path_only_on_its_side(self) -> None:
        assert self.slow.fast_answers == 0


_RUNS = itertools.count()

FastAndSlow.TestCase.settings = settings(
    max_examples=int(os.environ.get("LOCKD_FASTPATH_EXAMPLES", "50")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_fast_and_usual_paths_answer_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    taken = 0
    original = FastAndSlow.teardown

    def count_then_teardown(self: FastAndSlow) -> None:
        nonlocal taken
        taken += self.fast.fast_answers
        original(self)

    monkeypatch.setattr(FastAndSlow, "teardown", count_then_teardown)
    FastAndSlow.TestCase().runTest()
    assert taken > 0, "the fast path was never taken: the comparison proved nothing"


# ------------------------------------------------------------ fixed cases


def sides(tmp_path: Path) -> tuple[Side, Side, FakeClock]:
    clock = FakeClock()
    (tmp_path / "fast").mkdir(mode=0o700)
    (tmp_path / "slow").mkdir(mode=0o700)
    return (
        Side(tmp_path / "fast", clock, fast=True),
        Side(tmp_path / "slow", clock, fast=False),
        clock,
    )


def test_the_common_case_takes_the_fast_path(tmp_path: Path) -> None:
    fast, slow, _ = sides(tmp_path)
    for side in (fast, slow):
        grant = json.loads(
            side.send(ROOT, 1, {"id": 1, "op": "tryAcquire", "key": "k", "ttlMs": 1000})
        )
        handle = grant["result"]["handle"]
        released = side.send(ROOT, 1, {"id": 2, "op": "release", "key": "k", "handle": handle})
        assert json.loads(released)["result"] == {"released": True}
        side.service.commit_fact("test")
    assert fast.fast_answers == 2 and slow.fast_answers == 0
    assert fast.state() == slow.state()
    assert fast.state()["counters"]["grants"] == 1 and fast.state()["counters"]["releases"] == 1


@pytest.mark.parametrize(
    ("setup", "request_"),
    [
        # a held key: busy is the usual path's answer
        (
            [{"op": "tryAcquire", "key": "k", "ttlMs": 1000}],
            {"op": "tryAcquire", "key": "k", "ttlMs": 1000},
        ),
        # a blocking acquire, even of a free key
        ([], {"op": "acquire", "key": "k", "ttlMs": 1000, "timeoutMs": 0}),
        # another process named: the daemon verifies it
        ([], {"op": "tryAcquire", "key": "k", "ttlMs": 1000, "pid": 1}),
        # a release of a handle that does not hold the key
        (
            [{"op": "tryAcquire", "key": "k", "ttlMs": 1000}],
            {"op": "release", "key": "k", "handle": "x"},
        ),
        # a release of one of two shared holders
        (
            [
                {"op": "tryAcquire", "key": "k", "ttlMs": 1000, "mode": "shared"},
                {"op": "tryAcquire", "key": "k", "ttlMs": 1000, "mode": "shared"},
            ],
            {"op": "release", "key": "k", "handle": "h1"},
        ),
    ],
)
def test_everything_else_takes_the_usual_path(
    tmp_path: Path, setup: list[dict[str, Any]], request_: dict[str, Any]
) -> None:
    fast, slow, _ = sides(tmp_path)
    replies = []
    for side in (fast, slow):
        for i, request in enumerate(setup):
            side.send(ALICE, 1, {"id": i, **request})
        taken = side.fast_answers
        replies.append(side.send(ALICE, 1, {"id": 99, **request_}))
        assert side.fast_answers == taken, request_
    assert replies[0] == replies[1]
    assert fast.state() == slow.state()


def test_a_due_deadline_sends_the_request_the_usual_way(tmp_path: Path) -> None:
    """Time is applied first: the expired hold's key is granted the usual way."""
    fast, slow, clock = sides(tmp_path)
    for side in (fast, slow):
        side.send(ALICE, 1, {"id": 1, "op": "tryAcquire", "key": "old", "ttlMs": 10})
        side.service.commit_fact("test")
    clock.advance(11)
    for side in (fast, slow):
        taken = side.fast_answers
        side.send(BOB, 2, {"id": 2, "op": "tryAcquire", "key": "new", "ttlMs": 1000})
        assert side.fast_answers == taken  # "old" ran out: applied first, the usual way
        side.service.commit_fact("test")
    assert fast.state() == slow.state()
    assert fast.state()["counters"]["expiries"] == 1
    # Once applied, the next free key goes the fast way again.
    taken = fast.fast_answers
    for side in (fast, slow):
        side.send(BOB, 2, {"id": 3, "op": "tryAcquire", "key": "next", "ttlMs": 1000})
    assert fast.fast_answers == taken + 1
    assert fast.state() == slow.state()


def test_a_failed_commit_undoes_fast_answers_too(tmp_path: Path) -> None:
    fast, slow, _ = sides(tmp_path)
    for side in (fast, slow):
        side.send(ALICE, 1, {"id": 1, "op": "tryAcquire", "key": "kept", "ttlMs": 1000})
        assert side.service.commit_fact("test")
        handle = side.engine._table.keys["kept"].first.handle  # type: ignore[union-attr]
        side.send(ALICE, 1, {"id": 2, "op": "tryAcquire", "key": "undone", "ttlMs": 1000})
        side.send(ALICE, 1, {"id": 3, "op": "release", "key": "kept", "handle": handle})
        side.store.fail_next = True
        assert not side.service.commit_fact("test")
        side.engine.check_invariants()
    assert fast.fast_answers == 3
    assert fast.state() == slow.state()
    keys = fast.state()["keys"]
    assert "kept" in keys and "undone" not in keys


def test_no_fast_path_without_a_store_or_with_a_remote_backend(tmp_path: Path) -> None:
    service = LockService(LockEngine(), None, BobNotOnB(), RateLimiter(6), FakeClock())
    assert service.fast is None
    side = Side(tmp_path, FakeClock(), fast=True)
    assert isinstance(side.service.fast, FastPath)


def test_outside_the_group_commit_the_service_answers(tmp_path: Path) -> None:
    """Only a reply that waits for its batch's commit may come from the fast path."""
    side = Side(tmp_path, FakeClock(), fast=True)
    side.service.group_commit = False
    reply = side.send(ROOT, 1, {"id": 1, "op": "tryAcquire", "key": "k", "ttlMs": 1000})
    assert json.loads(reply)["ok"] and side.fast_answers == 0
    assert side.rows()  # committed by the request itself


# ------------------------------------------------------- through the server


async def _pairs(h: Harness, peer: Peer, count: int) -> list[dict[str, Any]]:
    replies = []
    for i in range(count):
        grant = await peer.call(try_acquire(2 * i, "k", ttlMs=60_000))
        replies.append(grant)
        handle = grant["result"]["handle"]
        replies.append(
            await peer.call({"id": 2 * i + 1, "op": "release", "key": "k", "handle": handle})
        )
    return replies


def _shape(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply without what differs between two grants (handle, fence, deadline)."""
    result = reply.get("result")
    if isinstance(result, dict) and "handle" in result:
        result = {**result, "handle": "*", "fence": "*", "leaseExpiresAt": "*"}
    return {**reply, "result": result}


async def test_the_server_answers_alike_with_and_without_its_fast_path(short_tmp: Path) -> None:
    async with running(short_tmp, caller=lambda: ROOT) as h:
        fast = h.service.fast
        assert fast is not None
        peer = await h.connect()
        with_fast = await _pairs(h, peer, 20)
        h.service.fast = None
        without = await _pairs(h, peer, 20)
        h.service.fast = fast
        assert [_shape(r) for r in with_fast] == [_shape(r) for r in without]
        fences = [r["result"]["fence"] for r in with_fast + without if "fence" in r["result"]]
        assert fences == list(range(1, 41))
        counters = h.service.stats.counters
        assert counters["grants"] == 40 and counters["releases"] == 40
        # Every request counted; only some timed (stats.SAMPLE_EVERY).
        latency = h.service.stats.latency
        assert latency["tryAcquire"].count == 40 and latency["release"].count == 40
        peer.close()


async def test_a_lease_the_fast_path_granted_runs_out_by_the_timer(short_tmp: Path) -> None:
    """The fast path moves the expiry timer itself: nothing else comes to apply the expiry."""
    async with running(short_tmp, caller=lambda: ROOT) as h:
        peer = await h.connect()
        # A long lease first: the timer's target is then a minute away.
        assert (await peer.call(try_acquire(1, "long", ttlMs=60_000)))["ok"]
        taken = h.service.stats.latency["tryAcquire"].count
        assert (await peer.call(try_acquire(2, "short", ttlMs=50)))["ok"]
        assert h.service.stats.latency["tryAcquire"].count == taken + 1
        short = h.engine._table.keys["short"].first
        assert short is not None
        # The timer points at the new lease's deadline (it sleeps at most
        # TIMER_MAX_SLEEP, so the expiry alone would not tell).
        assert h.server._timer._target == short.expires_at
        assert await until(lambda: h.service.stats.counters["expiries"] == 1)
        assert "short" not in h.engine._table.keys and "long" in h.engine._table.keys
        peer.close()
