"""The etcd backend through faults injected under its gateway (tests/etcd_faults.py).

Every call goes to a real cluster, but the transport can answer like a
member that shuts down gracefully (gRPC code 1, "the client connection is
closing"), and hide that a write was applied. These pin issue 23's findings:
no background task ends the daemon, an unknown outcome is
BACKEND_UNAVAILABLE, and nothing the daemon wrote is forgotten.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio
import trio.testing

from lockd.config import BackendSettings
from lockd.daemon.backends import BackendUnavailable
from lockd.daemon.backends.etcd.backend import EtcdBackend
from lockd.daemon.backends.etcd.gateway import (
    EtcdError,
    EtcdGateway,
    EtcdRefused,
    Failure,
    GatewaySettings,
    LeaseNotFound,
    classify,
)
from lockd.daemon.backends.etcd.reconcile import Reconciler
from lockd.daemon.backends.etcd.records import Hold
from lockd.daemon.clock import SystemClock
from lockd.testing.etcd_cluster import EtcdCluster
from tests.etcd.test_etcd_backend import ALICE, BOB, acquired, queued, records, request, until
from tests.etcd_faults import FaultyPool, inject

Start = Callable[..., Awaitable[tuple[EtcdBackend, FaultyPool]]]
_scopes: dict[int, trio.CancelScope] = {}


async def kill(backend: EtcdBackend, survivor: EtcdBackend) -> None:
    """``backend``'s daemon dies: its tasks stop, and its session ends as etcd would end it
    a TTL later (revoked now by ``survivor``: no test sleeps for a lease to run out)."""
    lease = backend.session_lease
    _scopes[id(backend)].cancel()
    assert lease is not None
    await survivor.etcd.lease_revoke(lease)


#: where the daemon calls etcd from its background tasks (keepalives, watches).
BACKGROUND = ("/v3/lease/keepalive", "/v3/watch")


@pytest.fixture
def real_speed_clock() -> trio.testing.MockClock:
    """trio's clock for the test (pytest-trio runs it on any Clock fixture): real time,
    which the test may jump ahead. etcd keeps its own time."""
    return trio.testing.MockClock(rate=1)


@pytest.fixture
async def start(etcd_cluster: EtcdCluster) -> AsyncIterator[Start]:
    """``await start(node)``: a running backend whose transport can inject faults."""
    prefix = f"/test-faults/{time.monotonic_ns()}/"
    async with trio.open_nursery() as nursery:

        async def begin(node: str, session_ttl: int = 5) -> tuple[EtcdBackend, FaultyPool]:
            settings = BackendSettings(
                kind="etcd",
                endpoints=tuple(etcd_cluster.endpoints),
                prefix=prefix,
                node=node,
                etcd_timeout=5.0,
                session_ttl=session_ttl,
            )
            gateway = EtcdGateway(GatewaySettings(settings.endpoints, timeout=5.0))
            pool = inject(gateway)
            backend = EtcdBackend(gateway, settings, SystemClock())
            scope = _scopes[id(backend)] = trio.CancelScope()

            async def run(*, task_status: trio.TaskStatus[None]) -> None:
                with scope:
                    await backend.run(task_status=task_status)

            await nursery.start(run)
            return backend, pool

        yield begin
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("code", "message", "status", "kind"),
    [
        (1, "grpc: the client connection is closing", 408, Failure.OUTCOME_UNKNOWN),
        (14, "etcdserver: request timed out", 503, Failure.OUTCOME_UNKNOWN),
        (14, "etcdserver: leader changed", 503, Failure.OUTCOME_UNKNOWN),
        (4, "context deadline exceeded", 504, Failure.OUTCOME_UNKNOWN),
        (0, "", 502, Failure.OUTCOME_UNKNOWN),
        (14, "etcdserver: no leader", 503, Failure.NOT_PROPOSED),
        (8, "etcdserver: too many requests", 429, Failure.NOT_PROPOSED),
        (3, "etcdserver: invalid auth token", 400, Failure.NOT_PROPOSED),
        (5, "etcdserver: requested lease not found", 404, Failure.REFUSED),
        (7, "etcdserver: permission denied", 403, Failure.REFUSED),
        (8, "etcdserver: mvcc: database space exceeded", 429, Failure.REFUSED),
        (3, "etcdserver: duplicate key given in txn request", 400, Failure.BUG),
        (12, "unknown method", 501, Failure.BUG),
    ],
)
def test_every_etcd_error_is_classified_in_one_place(
    code: int, message: str, status: int, kind: Failure
) -> None:
    assert classify(code, message, status) is kind


def test_refusals_are_backend_unavailable_and_only_bugs_are_not() -> None:
    assert issubclass(EtcdRefused, BackendUnavailable) and issubclass(LeaseNotFound, EtcdRefused)
    assert not issubclass(EtcdError, BackendUnavailable)


async def test_code_1_at_every_background_call_site_and_the_daemon_lives(start: Start) -> None:
    """The faults that crashed a daemon in 3 of 10 rolling etcd restarts (issue 23)."""
    a, faults = await start("a")
    b, _ = await start("b")
    held = await acquired(b, request("k", ttl_ms=30_000), BOB)
    waiting: list[object] = []
    async with trio.open_nursery() as nursery:

        async def wait_for_k() -> None:
            waiting.append(await a.acquire(request("k", timeout_ms=30_000), ALICE, 1, 30.0))

        nursery.start_soon(wait_for_k)
        await until(lambda: queued(a, "k"))
        doomed = await acquired(a, request("c", ttl_ms=30_000))
        session = a._session
        assert session is not None
        keepalives = session.keepalives

        # Phase 1: every call fails, for longer than a keepalive interval.
        faults.fail()
        a.release_undelivered(doomed)  # the clean-up list meets the fault
        with pytest.raises(BackendUnavailable):  # a write whose outcome is unknown
            await a.acquire(request("x"), ALICE, 2, None)
        assert await b.release("k", held.handle)  # the queue's watch is interrupted
        # Until every background call site has met the fault (a keepalive comes after
        # its interval, about 1.7 s).
        await until(lambda: all(faults.hits[path] > 0 for path in BACKGROUND), timeout=15)
        faults.fail(False)
        # Writes met it too: sent (a transaction) or, once a write's outcome
        # was unknown, held at the status read that asks who leads. The
        # clean-up's transactions meet it in the ghost test below.
        assert faults.hits["/v3/kv/txn"] + faults.hits["/v3/maintenance/status"] > 0

        # Every task lived through it: the waiter is granted from the watch,
        # the clean-up deleted the undelivered hold, the session is kept.
        await until(lambda: waiting)
        granted = waiting[0]
        assert isinstance(granted, Hold)
        await until(lambda: not a._doomed_keys)
        assert (await a.status("c")).holds == []
        await until(lambda: session.keepalives > keepalives, timeout=5)
        assert a._session is session and not session.lost.is_set()
    assert await a.release("k", granted.handle)


async def test_a_tied_grant_is_answered_once_untied_and_code_1_delays_it(start: Start) -> None:
    """A hold another daemon granted (tied to a's session) is answered only once untied:
    while a's transactions meet code 1 the acquire waits, then answers untied."""
    a, faults = await start("a")
    b, _ = await start("b")
    first = await acquired(b, request("t"), BOB, conn=1)
    results: list[object] = []
    async with trio.open_nursery() as nursery:

        async def wait(backend: EtcdBackend, conn: int) -> None:
            results.append(await backend.acquire(request("t", timeout_ms=30_000), ALICE, conn, 30))

        nursery.start_soon(wait, b, 2)  # b gets a queue (and so a view) of "t"
        await until(lambda: queued(b, "t"))
        nursery.start_soon(wait, a, 3)
        await until(lambda: queued(a, "t"))
        assert await b.release("t", first.handle)  # hand-off to b's own waiter
        await until(lambda: len(results) == 1)
        second = results[0]
        assert isinstance(second, Hold)
        # From here a's transactions fail (its watch and reads do not): the
        # grant reaches it by the watch, its untie meets the fault.
        faults.only = lambda target, body: target == "/v3/kv/txn"
        faults.fail()
        assert await b.release("t", second.handle)  # hand-off to a's waiter: tied
        [tied] = [h for h in (await b.status("t")).holds]
        assert isinstance(tied, Hold) and tied.tied
        binding = a.layout.binding("t", tied.handle)
        # a has seen the grant and tried to untie it, twice, and failed both times.
        await until(lambda: faults.hits["/v3/kv/txn"] >= 2)
        assert len(results) == 1  # not answered while still tied
        assert binding in await records(a, "t")
        faults.fail(False)
        await until(lambda: len(results) == 2)
        third = results[1]
        assert isinstance(third, Hold) and not third.tied and third.handle == tied.handle
        assert binding not in await records(a, "t")
        assert await a.release("t", third.handle)


def _enqueue_then_cleanups(target: str, body: bytes, state: dict[str, int]) -> bool:
    """Fail the first enqueue (a txn without compares that puts) and every delete-only txn."""
    if target != "/v3/kv/txn":
        return False
    if body.startswith(b'{"compare":[],') and b"request_put" in body:
        state["enqueues"] += 1
        return state["enqueues"] == 1
    return b"request_put" not in body and b"request_delete_range" in body


async def test_a_ghost_waiter_does_not_block_a_free_key(start: Start) -> None:
    """Issue 23's ghost: an enqueue whose outcome is unknown, a clean-up that fails."""
    a, faults = await start("a")
    b, _ = await start("b")
    c, _ = await start("c")
    held = await acquired(c, request("g"), BOB)  # c has no queue: its release is plain
    state = {"enqueues": 0}
    faults.only = lambda target, body: _enqueue_then_cleanups(target, body, state)
    # The enqueue commits, its reply says code 1; a's clean-up does not commit.
    faults.apply = lambda target, body: b"request_put" in body
    faults.fail()
    results: list[tuple[str, object, float]] = []
    async with trio.open_nursery() as nursery:

        async def wait(name: str, backend: EtcdBackend, caller: object) -> None:
            outcome = await backend.acquire(request("g", timeout_ms=30_000), caller, 9, 30)  # type: ignore[arg-type]
            results.append((name, outcome, trio.current_time()))

        nursery.start_soon(wait, "a", a, ALICE)
        await until(lambda: queued(a, "g"))
        waiters = [key for key in await records(a, "g") if a.layout.is_waiter(key)]
        assert len(waiters) == 2 and state["enqueues"] == 2  # the ghost, then the real one
        ghost = waiters[0]
        assert ghost not in a._queues["g"].waiters and ghost in a.doomed_keys
        nursery.start_soon(wait, "b", b, BOB)
        await until(lambda: queued(b, "g"))
        await until(lambda: faults.hits["/v3/kv/txn"] >= 2)  # the enqueue and a's clean-up failed
        assert ghost in await records(a, "g")
        released = trio.current_time()
        assert await c.release("g", held.handle)
        await until(lambda: len(results) >= 1, timeout=10)
        name, outcome, at = results[0]
        # The next waiter (a's real one) has the key within one election
        # timeout (1 s) of the release, plus the box's scheduling slack.
        assert name == "a" and isinstance(outcome, Hold)
        assert at - released < 2.5, at - released
        assert ghost not in await records(a, "g")
        assert b._queues["g"].removed + a._queues["g"].removed == 1  # b, since a's deletes fail
        faults.fail(False)
        await until(lambda: not a.doomed_keys)
        assert await a.release("g", outcome.handle)
        await until(lambda: len(results) == 2)
        assert isinstance(results[1][1], Hold)
        assert await b.release("g", results[1][1].handle)  # type: ignore[union-attr]


async def test_an_orphan_on_the_session_is_found_and_deleted(
    start: Start, real_speed_clock: trio.testing.MockClock
) -> None:
    """A waiter key on our session that no queue knows (a late commit) is deleted."""
    a, _ = await start("a")
    lease = a.session_lease
    assert lease is not None
    orphan = a.layout.waiter("o", lease, 999_999)
    binding = a.layout.binding("o", "nobody-knows-me")
    for key in (orphan, binding):
        await a.etcd.put(key, b"{}", lease=lease)
    reconciler = Reconciler(a)
    assert await reconciler.look() == []  # once unknown is not enough: it may be in flight
    real_speed_clock.jump(a.timeout)  # unknown for a whole etcd timeout, on trio's clock
    assert sorted(await reconciler.look()) == sorted([orphan, binding])
    await until(lambda: not a.doomed_keys)
    assert await records(a, "o") == []
    node = await a.etcd.get(a.layout.node("a"))
    assert node.kvs  # the node claim is known: never an orphan


async def test_a_cancelled_waiter_answers_once_the_grant_it_discards_is_gone(
    start: Start,
) -> None:
    """A grant that crossed the cancel (its daemon had not seen it yet) is deleted first."""
    a, faults = await start("a")
    b, _ = await start("b")
    first = await acquired(b, request("cx"), BOB, conn=1)
    results: list[object] = []
    after_cancel: list[list[bytes]] = []
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def wait(backend: EtcdBackend, conn: int, cancel: trio.CancelScope | None) -> None:
            if cancel is None:
                cancel = trio.CancelScope()
            with cancel:
                results.append(
                    await backend.acquire(request("cx", timeout_ms=30_000), ALICE, conn, 30)
                )
            if cancel.cancelled_caught:  # what the key holds the moment CANCELLED goes out
                after_cancel.append(await records(backend, "cx"))

        nursery.start_soon(wait, b, 2, None)  # b gets a view of "cx": it hands off
        await until(lambda: queued(b, "cx"))
        nursery.start_soon(wait, a, 3, scope)
        await until(lambda: queued(a, "cx"))
        assert await b.release("cx", first.handle)  # to b's own waiter
        await until(lambda: len(results) == 1)
        second = results[0]
        assert isinstance(second, Hold)
        # a's watch goes blind, so a does not know of the grant b makes next.
        faults.only = lambda target, body: target == "/v3/watch"
        faults.fail()
        # Blind once its stream has met the fault, not after some scheduler
        # passes: the release below commits without one of its own.
        await until(lambda: faults.hits["/v3/watch"] > 0)
        assert await b.release("cx", second.handle)  # hands off to a's waiter
        granted = [k for k in await records(b, "cx") if b"/h/" in k]
        assert len(granted) == 1 and len(results) == 1
        scope.cancel()  # the cancel crosses the grant
        await until(lambda: bool(after_cancel))
        # Answered: the hold it discarded is gone already, not later.
        assert not any(b"/h/" in k for k in after_cancel[0]), after_cancel
        assert len(results) == 1
        faults.fail(False)


async def test_shared_waiters_granted_together_each_draw_a_fence(start: Start) -> None:
    a, _ = await start("a")
    writer = await acquired(a, request("sf"), BOB)
    results: list[object] = []
    async with trio.open_nursery() as nursery:

        async def wait() -> None:
            outcome = await a.acquire(request("sf", timeout_ms=30_000, mode="shared"), ALICE, 1, 30)
            results.append(outcome)

        def queued(count: int) -> Callable[[], bool]:
            return lambda: "sf" in a._queues and len(a._queues["sf"].waiters) == count

        for count in range(1, 4):
            nursery.start_soon(wait)
            await until(queued(count))
        assert await a.release("sf", writer.handle)
        await until(lambda: len(results) == 3)
    fences = [r.fence for r in results if isinstance(r, Hold)]
    assert len(set(fences)) == 3 and writer.fence < min(fences)
    for r in results:
        assert isinstance(r, Hold) and await a.release("sf", r.handle)


async def test_a_grant_to_the_older_key_of_a_waiter_written_again_is_delivered(
    start: Start,
) -> None:
    """The 30 s stall after leader changes: an enqueue's outcome unknown, the waiter
    written again, and another daemon's hand-off granting the older key before the
    newer one was written. The grant is the waiter's (its handle): delivered at once."""
    a, faults = await start("a")
    b, _ = await start("b")
    first = await acquired(b, request("gs"), BOB, conn=1)
    results: list[tuple[str, object]] = []
    state = {"enqueues": 0}
    faults.only = lambda target, body: _enqueue_then_cleanups(target, body, state)
    faults.apply = lambda target, body: b"request_put" in body
    faults.fail()
    second_enqueue = trio.Event()

    async def hold_back(target: str, body: bytes) -> None:
        if body.startswith(b'{"compare":[],') and b"request_put" in body and state["enqueues"]:
            await second_enqueue.wait()

    faults.gate = hold_back
    async with trio.open_nursery() as nursery:

        async def wait(name: str, backend: EtcdBackend, conn: int) -> None:
            outcome = await backend.acquire(request("gs", timeout_ms=30_000), ALICE, conn, 30)
            results.append((name, outcome))

        nursery.start_soon(wait, "b", b, 2)  # b's view of "gs": it hands off
        await until(lambda: queued(b, "gs"))
        nursery.start_soon(wait, "a", a, 3)
        await until(lambda: state["enqueues"] == 1)  # the older key is in etcd, a was told code 1
        await until(lambda: sum(a.layout.is_waiter(k) for k in b._queues["gs"].records or ()) == 2)
        assert await b.release("gs", first.handle)  # to b's own waiter
        await until(lambda: len(results) == 1)
        mine = results[0][1]
        assert isinstance(mine, Hold)
        assert await b.release("gs", mine.handle)  # to a's older key: tied to a's session
        await until(lambda: any(b"/h/" in k for k in b._queues["gs"].records or ()))
        granted = trio.current_time()
        second_enqueue.set()  # now a writes its waiter again, behind that hold
        await until(lambda: len(results) == 2, timeout=10)
        name, outcome = results[1]
        assert name == "a" and isinstance(outcome, Hold)
        assert trio.current_time() - granted < 2.0
        faults.fail(False)
        await until(lambda: not a.doomed_keys)
        assert [k for k in await records(a, "gs") if a.layout.is_waiter(k)] == []
        assert await a.release("gs", outcome.handle)


def _untie_of(body: bytes) -> bool:
    """The untie's transaction: guarded by the hold's mod revision and its binding's version."""
    return b'"target":"MOD"' in body and b'"target":"VERSION"' in body


async def test_a_daemon_killed_between_grant_and_untie_never_answered_the_grant(
    start: Start,
) -> None:
    """Killed with the untie under way: the grant was never acknowledged, so it may end
    with the session (it does), and the key moves on."""
    a, faults = await start("a", session_ttl=2)
    b, _ = await start("b")
    c, _ = await start("c")
    first = await acquired(b, request("kt"), BOB, conn=1)
    results: list[object] = []
    untie_sent = trio.Event()
    never = trio.Event()

    dead = False

    async def pause_untie(target: str, body: bytes) -> None:
        if dead or (target == "/v3/kv/txn" and _untie_of(body)):
            untie_sent.set()
            await never.wait()  # the daemon dies here: nothing of it reaches etcd again

    faults.gate = pause_untie
    a_waits = trio.CancelScope()
    async with trio.open_nursery() as nursery:

        async def wait(backend: EtcdBackend, conn: int) -> None:
            with a_waits if backend is a else trio.CancelScope():
                outcome = await backend.acquire(request("kt", timeout_ms=30_000), ALICE, conn, 30)
                results.append(outcome)

        nursery.start_soon(wait, b, 2)
        await until(lambda: queued(b, "kt"))
        nursery.start_soon(wait, a, 3)
        await until(lambda: queued(a, "kt"))
        nursery.start_soon(wait, c, 4)
        await until(lambda: queued(c, "kt"))
        assert await b.release("kt", first.handle)
        await until(lambda: len(results) == 1)
        second = results[0]
        assert isinstance(second, Hold)
        assert await b.release("kt", second.handle)  # to a's waiter, tied to a's session
        with trio.fail_after(10):
            await untie_sent.wait()
        dead = True
        a_waits.cancel()
        await kill(a, b)
        # c's waiter gets the key: a's grant, never answered, ended with a's session.
        await until(lambda: len(results) == 2, timeout=10)
        third = results[1]
        assert isinstance(third, Hold) and third.node == "c"
        assert await c.release("kt", third.handle)


async def test_a_hold_answered_outlives_its_daemon_killed_right_after(start: Start) -> None:
    """Acknowledged, then the daemon dies before anything else: the hold lasts its TTL."""
    a, _ = await start("a", session_ttl=2)
    b, _ = await start("b")
    first = await acquired(b, request("ka"), BOB, conn=1)
    results: list[object] = []
    async with trio.open_nursery() as nursery:

        async def wait(backend: EtcdBackend, conn: int) -> None:
            outcome = await backend.acquire(
                request("ka", timeout_ms=30_000, ttl_ms=30_000), ALICE, conn, 30
            )
            results.append(outcome)
            if backend is a:
                await kill(a, b)  # the moment after the reply went out

        nursery.start_soon(wait, b, 2)
        await until(lambda: queued(b, "ka"))
        nursery.start_soon(wait, a, 3)
        await until(lambda: queued(a, "ka"))
        assert await b.release("ka", first.handle)
        await until(lambda: len(results) == 1)
        second = results[0]
        assert isinstance(second, Hold)
        assert await b.release("ka", second.handle)  # hand-off to a's waiter (tied)
        await until(lambda: len(results) == 2)
    held = results[1]
    assert isinstance(held, Hold) and held.node == "a" and not held.tied
    # a is dead and its session gone; the hold stands on its own lease.
    [live] = (await b.status("ka")).holds
    assert live.handle == held.handle and not live.needs_binding
    lease = await b.etcd.lease_time_to_live(held.lease)
    assert lease.ttl >= 25
    assert await b.acquire(request("ka"), BOB, 9, None) is None  # busy: held
    assert await b.release("ka", held.handle)


async def test_an_untie_that_committed_behind_an_unknown_outcome_is_the_grant(
    start: Start,
) -> None:
    """The untie's first attempt commits but answers code 1: its retry finds the hold
    untied (same fence) and answers the grant, not BACKEND_UNAVAILABLE."""
    a, faults = await start("a")
    b, _ = await start("b")
    first = await acquired(b, request("uu"), BOB, conn=1)
    results: list[object] = []
    state = {"unties": 0}

    def first_untie(target: str, body: bytes) -> bool:
        if target == "/v3/kv/txn" and _untie_of(body):
            state["unties"] += 1
            return state["unties"] == 1
        return False

    faults.only = first_untie
    faults.apply = lambda target, body: True
    faults.fail()
    async with trio.open_nursery() as nursery:

        async def wait(backend: EtcdBackend, conn: int) -> None:
            results.append(await backend.acquire(request("uu", timeout_ms=30_000), ALICE, conn, 30))

        nursery.start_soon(wait, b, 2)
        await until(lambda: queued(b, "uu"))
        nursery.start_soon(wait, a, 3)
        await until(lambda: queued(a, "uu"))
        assert await b.release("uu", first.handle)
        await until(lambda: len(results) == 1)
        second = results[0]
        assert isinstance(second, Hold)
        assert await b.release("uu", second.handle)  # to a's waiter, tied
        await until(lambda: len(results) == 2)
    third = results[1]
    assert state["unties"] == 2 and isinstance(third, Hold) and not third.tied
    assert a.layout.binding("uu", third.handle) not in await records(a, "uu")
    assert await a.release("uu", third.handle)


async def test_a_release_that_failed_is_finished_once_etcd_answers(start: Start) -> None:
    """A release answered BACKEND_UNAVAILABLE still ends the hold when etcd is back, without
    the holder asking again: left to its lease, the hold could outlive its TTL by far, as
    etcd extends every lease at each new leader (back-to-back quorum losses in
    bench/etcd_chaos.py kept an abandoned 4 s hold for a minute, blocking its waiters)."""
    a, faults = await start("a")
    b, _ = await start("b")
    held = await acquired(a, request("r", ttl_ms=30_000), ALICE)
    waiting: list[object] = []
    async with trio.open_nursery() as nursery:

        async def wait_for_r() -> None:
            waiting.append(await b.acquire(request("r", timeout_ms=30_000), BOB, 1, 30.0))

        nursery.start_soon(wait_for_r)
        await until(lambda: queued(b, "r"))
        faults.fail()
        with pytest.raises(BackendUnavailable):
            await a.release("r", held.handle)
        assert faults.hits["/v3/kv/txn"] > 0
        faults.fail(False)
        # Nobody releases again: a's clean-up list deletes the hold, and b's
        # waiter is granted long before the hold's 30 s TTL.
        await until(lambda: waiting)
    granted = waiting[0]
    assert isinstance(granted, Hold) and granted.fence > held.fence
    assert not a._doomed_keys
    # The holder's retry of its release is answered as what it asked for, done.
    assert await a.release("r", held.handle)
    assert not await a.release("r", held.handle)  # once: a second retry finds nothing
    assert await b.release("r", granted.handle)
