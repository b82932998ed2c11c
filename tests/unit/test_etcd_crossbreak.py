"""A break across hosts that waits for the holder to stop (docs/etcd-design.md §6a).

Two ``EtcdBackend`` objects on one in-memory etcd (tests/fake_etcd.py) stand
for host A (where the holder listens) and host B (where the break is sent),
under trio's mock clock: the grace and the takeover bound are driven by the
clock, never slept for. The holder's side of the daemon (telling it, hearing
``stopped``) is scripted here through ``HoldWatch.await_stop``; the daemons
themselves are tested on a real cluster in ``test_loss_events_etcd``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from lockd.config import BackendSettings
from lockd.daemon.backends.etcd.backend import EtcdBackend
from lockd.daemon.backends.etcd.gateway import EtcdUnavailable, WatchCompacted
from lockd.daemon.backends.etcd.holdloss import BREAK_RECORD
from lockd.daemon.backends.etcd.holdstop import (
    TAKEOVER_MARGIN_MS,
    StopAsked,
    hold_keys_gone,
    must_wait_for,
    stop_key,
    stop_record,
    stops_asked,
    takeover_at,
)
from lockd.daemon.backends.etcd.records import Hold, Layout, Waiter
from lockd.daemon.backends.etcd.wire import Event, KeyValue, RangeOp, WatchRequest
from lockd.daemon.protocol import Acquire
from lockd.identity import Caller
from tests.fake_etcd import FakeEtcd

PREFIX = "/xb/"
LAYOUT = Layout(PREFIX)
ALICE = Caller("user", "alice", "member", 1000, 1000, 4242, frozenset(), "job")
BOB = Caller("user", "bob", "member", 1001, 1001, 4343, frozenset(), "other")
GRACE_MS = 5000
_ids = itertools.count(1)


def run(main: Callable[[], Awaitable[None]]) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def hold(handle: str, node: str, *, listens: bool) -> Hold:
    return Hold(
        key="k",
        handle=handle,
        principal="user:alice",
        owner=None,
        mode="exclusive",
        limit=1,
        node=node,
        pid=1,
        process="p",
        ttl_ms=30_000,
        expires_at=0,
        lease=7,
        bound=False,
        listens=listens,
    )


# ------------------------------------------------------------------ pure


def test_only_listening_holds_of_other_nodes_are_waited_for() -> None:
    holds = [
        hold("a1", "host-a", listens=True),
        hold("a2", "host-a", listens=False),
        hold("b1", "host-b", listens=True),  # the breaking daemon's own: waited in its memory
    ]
    assert [h.handle for h in must_wait_for(holds, "host-b")] == ["a1"]


def test_the_listens_flag_survives_the_records_and_old_records_do_not_wait() -> None:
    listening = hold("a1", "host-a", listens=True)
    kv = KeyValue(LAYOUT.hold("k", "a1"), listening.value(), 5, 5, 1, 7)
    assert Hold.parse("k", "a1", kv).listens is True
    old = json.loads(listening.value())
    del old["listens"]
    kv_old = KeyValue(LAYOUT.hold("k", "a1"), json.dumps(old).encode(), 5, 5, 1, 7)
    assert Hold.parse("k", "a1", kv_old).listens is False
    waiter = Waiter(b"w", 3, "user:alice", None, "exclusive", 1, "host-a", handle="h", listens=True)
    parsed = Waiter.parse(KeyValue(b"w", waiter.value(), 3, 3, 1, 9))
    assert parsed.listens is True and parsed.hold("k").listens is True


def test_a_stop_request_is_read_for_its_node_only() -> None:
    mine = stop_record("host-a", "user:root", "disk swap", "2026-12-03T13:00:00.000Z", 1500)
    theirs = stop_record("host-c", "user:root", "x", "2026-12-03T13:00:00.000Z", 1500)
    events = [
        Event("PUT", KeyValue(stop_key(LAYOUT, "k/1", "h1"), mine, 9, 9, 1, 3), None),
        Event("PUT", KeyValue(stop_key(LAYOUT, "k/1", "h2"), theirs, 9, 9, 1, 3), None),
        Event("PUT", KeyValue(stop_key(LAYOUT, "k/1", "h3"), b"not json", 9, 9, 1, 3), None),
        Event("DELETE", KeyValue(stop_key(LAYOUT, "k/1", "h4"), b"", 0, 10, 0, 0), None),
    ]
    assert stops_asked(LAYOUT, "host-a", events) == [
        StopAsked("k/1", "h1", "user:root", "disk swap", 1500)
    ]


@given(
    key=st.text(min_size=1, max_size=20),
    handle=st.text(
        alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_",
        min_size=1,
        max_size=22,
    ),
    node=st.sampled_from(["host-a", "host-b"]),
    by=st.text(max_size=30),
    reason=st.text(max_size=200),
    grace_ms=st.integers(min_value=0, max_value=600_000),
)
def test_a_stop_request_reads_back_as_written(
    key: str, handle: str, node: str, by: str, reason: str, grace_ms: int
) -> None:
    value = stop_record(node, by, reason, "2026-12-03T13:00:00.000Z", grace_ms)
    event = Event("PUT", KeyValue(stop_key(LAYOUT, key, handle), value, 9, 9, 1, 3), None)
    asked = stops_asked(LAYOUT, "host-a", [event])
    expected = [StopAsked(key, handle, by, reason, grace_ms)] if node == "host-a" else []
    assert asked == expected


@given(value=st.binary(max_size=200), name=st.binary(max_size=30))
def test_any_bytes_under_s_are_read_without_failing(value: bytes, name: bytes) -> None:
    event = Event("PUT", KeyValue(LAYOUT.directory("k") + b"s/" + name, value, 9, 9, 1, 3), None)
    for ask in stops_asked(LAYOUT, "host-a", [event]):
        assert ask.grace_ms >= 0 and ask.key == "k"


def test_the_takeover_bound_is_the_grace_plus_the_margin() -> None:
    assert takeover_at(1000, GRACE_MS) == 1000 + GRACE_MS + TAKEOVER_MARGIN_MS


def test_only_deletions_of_waited_holds_count() -> None:
    events = [
        Event("DELETE", KeyValue(LAYOUT.hold("k", "h1"), b"", 0, 10, 0, 0), None),
        Event("DELETE", KeyValue(LAYOUT.binding("k", "h2"), b"", 0, 10, 0, 0), None),
        Event("DELETE", KeyValue(LAYOUT.hold("k", "h9"), b"", 0, 10, 0, 0), None),
        Event("PUT", KeyValue(LAYOUT.hold("k", "h2"), b"{}", 4, 10, 2, 0), None),
    ]
    assert hold_keys_gone(LAYOUT, "k", {"h1", "h2"}, events) == {"h1"}


# ------------------------------------------------- two hosts, one etcd


class TrioClock:
    """The backends' clock: trio's (mock) clock."""

    def boot_ms(self) -> int:
        return int(trio.current_time() * 1000)

    def wall_ms(self) -> int:
        return 1_900_000_000_000 + self.boot_ms()


@dataclass
class HolderSide:
    """Host A's daemon as far as the hold watch sees it: which holds listen, and when
    their holder says ``stopped`` (the test sets ``stopped``)."""

    watched: set[str] = field(default_factory=set)
    asked: list[StopAsked] = field(default_factory=list)
    stopped: trio.Event = field(default_factory=trio.Event)
    #: what happened, in order (the test asserts the order, not the timing).
    log: list[str] = field(default_factory=list)

    async def await_stop(self, ask: Any) -> bool:
        if ask.handle not in self.watched:
            return False
        self.watched.discard(ask.handle)
        self.asked.append(ask)
        self.log.append("told")
        await self.stopped.wait()
        self.log.append("stopped")
        return True


def request(
    key: str, *, timeout_ms: int | None = None, owner: str | None = None, mode: str = "exclusive"
) -> Acquire:
    op = "tryAcquire" if timeout_ms is None else "acquire"
    return Acquire(next(_ids), op, key, 30_000, timeout_ms, owner, False, mode, 1)


@asynccontextmanager
async def two_hosts(
    etcd: FakeEtcd | None = None,
) -> AsyncIterator[tuple[EtcdBackend, EtcdBackend, HolderSide, FakeEtcd]]:
    etcd = etcd if etcd is not None else FakeEtcd()
    side = HolderSide()
    async with trio.open_nursery() as nursery:
        backends = []
        for node in ("host-a", "host-b"):
            settings = BackendSettings(
                kind="etcd", endpoints=("test",), prefix=PREFIX, node=node, etcd_timeout=5.0
            )
            backend = EtcdBackend(etcd, settings, TrioClock())  # type: ignore[arg-type]
            await nursery.start(backend.run)
            backends.append(backend)
        a, b = backends
        watch = a.hold_watch
        watch.is_watched = lambda handle: handle in side.watched
        watch.any_watched = lambda: True
        watch.await_stop = side.await_stop
        yield a, b, side, etcd
        nursery.cancel_scope.cancel()


async def listening_hold(a: EtcdBackend, side: HolderSide, key: str) -> Hold:
    granted = await a.acquire(request(key), ALICE, 1, None, listens=True)
    assert isinstance(granted, Hold) and granted.listens
    side.watched.add(granted.handle)
    a.hold_watch.follow(granted.handle, granted.fence)
    return granted


async def present(etcd: FakeEtcd, key: bytes) -> bool:
    return bool((await etcd.range(RangeOp(key))).kvs)


def test_the_key_moves_on_only_after_the_holder_stopped() -> None:
    async def main() -> None:
        async with two_hosts() as (a, b, side, etcd):
            held = await listening_hold(a, side, "k")
            outcomes: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:

                async def waiter() -> None:
                    outcomes["grant"] = await b.acquire(request("k", timeout_ms=60_000), BOB, 2, 60)
                    side.log.append("granted")

                async def breaker() -> None:
                    outcomes["broken"] = await b.break_lock(
                        "k", by="user:root", reason="disk swap", grace_ms=GRACE_MS
                    )
                    side.log.append("break answered")

                nursery.start_soon(waiter)
                await trio.sleep(0.5)  # mock clock: lets the waiter queue up
                nursery.start_soon(breaker)
                await trio.sleep(GRACE_MS / 2000)  # half the grace, mock clock
                assert side.log == ["told"]
                assert side.asked == [StopAsked("k", held.handle, "user:root", "disk swap", 5000)]
                assert await present(etcd, LAYOUT.hold("k", held.handle))
                # the request is the breaking daemon's own while it waits: no orphan
                request_key = stop_key(LAYOUT, "k", held.handle)
                assert await present(etcd, request_key)
                assert request_key in b.known_session_keys()
                side.stopped.set()
            assert side.log[:2] == ["told", "stopped"]
            assert set(side.log[2:]) == {"granted", "break answered"}
            assert [h.handle for h in outcomes["broken"]] == [held.handle]
            grant = outcomes["grant"]
            assert isinstance(grant, Hold) and grant.fence > held.fence
            assert not await present(etcd, request_key)
            assert request_key not in b.known_session_keys()
            # ended well before the bound: the holder's stop ended it
            assert trio.current_time() < 0.5 + (GRACE_MS + TAKEOVER_MARGIN_MS) / 1000

    run(main)


def test_a_holder_whose_daemon_never_answers_loses_the_key_at_the_bound() -> None:
    async def main() -> None:
        async with two_hosts() as (a, b, side, etcd):
            held = await listening_hold(a, side, "k")
            side.watched.clear()  # host A is gone: nobody ends the hold there
            started = trio.current_time()
            broken = await b.break_lock("k", by="user:root", reason="hung", grace_ms=GRACE_MS)
            took = trio.current_time() - started
            assert [h.handle for h in broken] == [held.handle]
            assert (
                (GRACE_MS + TAKEOVER_MARGIN_MS) / 1000
                <= took
                < (GRACE_MS + TAKEOVER_MARGIN_MS) / 1000 + 1
            )
            assert not await present(etcd, LAYOUT.hold("k", held.handle))
            granted = await b.acquire(request("k"), BOB, 2, None)
            assert isinstance(granted, Hold) and granted.fence > held.fence

    run(main)


def test_holds_nobody_listens_for_and_own_holds_end_at_once() -> None:
    async def main() -> None:
        async with two_hosts() as (a, b, side, etcd):
            quiet = await a.acquire(request("q"), ALICE, 1, None)  # listens=False
            assert isinstance(quiet, Hold) and not quiet.listens
            own = await b.acquire(request("o"), ALICE, 1, None, listens=True)
            assert isinstance(own, Hold)
            started = trio.current_time()
            assert [h.handle for h in await b.break_lock("q", by="r", grace_ms=GRACE_MS)] == [
                quiet.handle
            ]
            assert [h.handle for h in await b.break_lock("o", by="r", grace_ms=GRACE_MS)] == [
                own.handle
            ]
            assert trio.current_time() - started < 1
            assert side.asked == []
            # the break record names who broke them (for holders on older watches)
            record = await etcd.range(RangeOp(LAYOUT.directory("q") + BREAK_RECORD))
            assert not record.kvs or b'"by":"r"' in record.kvs[0].value

    run(main)


def test_a_retake_while_the_holder_stops_is_immediate_and_ends_the_wait() -> None:
    async def main() -> None:
        async with two_hosts() as (a, b, side, etcd):
            granted = await a.acquire(request("r", owner="job-1"), ALICE, 1, None, listens=True)
            assert isinstance(granted, Hold)
            side.watched.add(granted.handle)
            a.hold_watch.follow(granted.handle, granted.fence)
            outcome: list[Any] = []
            async with trio.open_nursery() as nursery:

                async def breaker() -> None:
                    outcome.append(await b.break_lock("r", by="root", grace_ms=GRACE_MS))

                nursery.start_soon(breaker)
                await trio.sleep(0.5)  # mock clock: the stop request is out
                assert side.log == ["told"]
                again = await b.acquire(request("r", owner="job-1"), ALICE, 3, None)
                assert isinstance(again, Hold) and again.retake and again.fence > granted.fence
            assert [h.handle for h in outcome[0]] == [granted.handle]
            assert trio.current_time() < 0.5 + 1  # not the bound: the re-take ended it
            assert await present(etcd, LAYOUT.hold("r", again.handle))
            side.stopped.set()

    run(main)


def test_a_stop_request_seen_before_the_grant_is_watched_is_acted_on_once_it_is() -> None:
    """The grant's reply (and its watch) comes after its commit: a break may be faster."""

    async def main() -> None:
        async with two_hosts() as (a, b, side, etcd):
            await listening_hold(a, side, "other")  # the hold watch is running
            late = await a.acquire(request("late"), ALICE, 1, None, listens=True)
            assert isinstance(late, Hold)
            outcome: list[Any] = []
            async with trio.open_nursery() as nursery:

                async def breaker() -> None:
                    outcome.append(await b.break_lock("late", by="root", grace_ms=GRACE_MS))

                nursery.start_soon(breaker)
                await trio.sleep(0.5)  # mock clock: the request is out and seen
                assert await present(etcd, stop_key(LAYOUT, "late", late.handle))
                assert side.log == []  # not watched yet: kept, not acted on
                side.watched.add(late.handle)
                a.hold_watch.follow(late.handle, late.fence)
                await trio.sleep(0.1)  # mock clock: the stop task runs
                assert side.log == ["told"] and side.asked[0].handle == late.handle
                side.stopped.set()
            assert [h.handle for h in outcome[0]] == [late.handle]
            assert trio.current_time() < 0.6 + (GRACE_MS + TAKEOVER_MARGIN_MS) / 1000

    run(main)


def test_own_and_other_hosts_listeners_are_waited_for_at_once_and_silent_holds_end_first() -> None:
    """Shared holds: one listening on A, one listening on B itself, one nobody listens for."""

    async def main() -> None:
        async with two_hosts() as (a, b, side, etcd):
            shared = request("m", mode="shared")
            there = await a.acquire(shared, ALICE, 1, None, listens=True)
            silent = await a.acquire(request("m", mode="shared"), BOB, 2, None)
            own = await b.acquire(request("m", mode="shared"), BOB, 3, None, listens=True)
            assert isinstance(there, Hold) and isinstance(silent, Hold) and isinstance(own, Hold)
            side.watched.add(there.handle)
            a.hold_watch.follow(there.handle, there.fence)
            told_here: list[list[str]] = []

            async def stop_local(handles: list[str]) -> None:
                told_here.append(handles)
                await trio.sleep(GRACE_MS / 1000)  # mock clock: B's own holder never answers

            outcome: list[Any] = []
            async with trio.open_nursery() as nursery:

                async def breaker() -> None:
                    outcome.append(
                        await b.break_lock(
                            "m",
                            by="root",
                            reason="r",
                            grace_ms=GRACE_MS,
                            keep=frozenset({own.handle}),
                            stop_local=stop_local,
                        )
                    )

                started = trio.current_time()
                nursery.start_soon(breaker)
                await trio.sleep(0.5)  # mock clock: the first transaction is in
                assert told_here == [[own.handle]] and side.log == ["told"]
                assert not await present(etcd, LAYOUT.hold("m", silent.handle))
                assert await present(etcd, LAYOUT.hold("m", own.handle))
                assert await present(etcd, LAYOUT.hold("m", there.handle))
            took = trio.current_time() - started
            assert sorted(h.handle for h in outcome[0]) == sorted(
                [there.handle, silent.handle, own.handle]
            )
            # neither holder answered: both waits ran together, one bound in all
            assert took < (GRACE_MS + TAKEOVER_MARGIN_MS) / 1000 + 0.5
            for hold_ in (there, own):
                assert not await present(etcd, LAYOUT.hold("m", hold_.handle))
            side.stopped.set()

    run(main)


class FlakyDirectoryWatch(FakeEtcd):
    """A FakeEtcd whose watches of one directory fail as scripted, then work."""

    def __init__(self, directory: bytes, failures: list[BaseException]) -> None:
        super().__init__()
        self.directory = directory
        self.failures = failures

    @asynccontextmanager
    async def watch(self, request: WatchRequest) -> AsyncIterator[Any]:
        if request.key == self.directory and self.failures:
            raise self.failures.pop(0)
        async with super().watch(request) as watch:
            yield watch


def test_the_breaking_daemon_s_wait_survives_etcd_away_and_compaction() -> None:
    async def main() -> None:
        etcd = FlakyDirectoryWatch(
            LAYOUT.directory("f"),
            [EtcdUnavailable("no endpoint answered"), WatchCompacted(1)],
        )
        async with two_hosts(etcd) as (a, b, side, _etcd):
            held = await listening_hold(a, side, "f")
            side.stopped.set()  # the holder stops as soon as it is told
            broken = await b.break_lock("f", by="root", grace_ms=GRACE_MS)
            assert [h.handle for h in broken] == [held.handle]
            assert side.log == ["told", "stopped"] and etcd.failures == []
            assert trio.current_time() < (GRACE_MS + TAKEOVER_MARGIN_MS) / 1000

    run(main)
