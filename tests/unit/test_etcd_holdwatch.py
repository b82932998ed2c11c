"""HoldWatch's stream across etcd's failures, with a scripted etcd and trio's mock clock.

The real cluster tests (``test_loss_events_etcd``) show a loss pushed; here
the stream's own duties: it starts from the first watched hold's fence (and
ends with the last watched hold, to start again with the next), goes
on from where it stopped after etcd was away, reads every watched hold again
after compaction (a hold gone in the gap is told ``expired``), tells an
unexplained deletion by asking for the lease, and keeps the losses of holds
not yet watched for a grant whose watch starts late.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from lockd.daemon.backends.etcd.gateway import EtcdUnavailable, WatchCompacted
from lockd.daemon.backends.etcd.holdloss import break_record
from lockd.daemon.backends.etcd.holdwatch import HoldWatch
from lockd.daemon.backends.etcd.records import Layout
from lockd.daemon.backends.etcd.wire import (
    Event,
    Header,
    KeyValue,
    LeaseTimeToLive,
    WatchRequest,
    WatchResponse,
)
from lockd.daemon.events import BREAK, EXPIRED

LAYOUT = Layout("/lockd/")
NODE = "host-a"


def deleted(key: str, handle: str, revision: int, lease: int) -> Event:
    record = json.dumps({"principal": "u", "owner": None, "node": NODE}).encode()
    prev = KeyValue(LAYOUT.hold(key, handle), record, 3, 3, 1, lease)
    return Event("DELETE", KeyValue(LAYOUT.hold(key, handle), b"", 0, revision, 0, 0), prev)


@dataclass
class ScriptedEtcd:
    """Each watch opened plays the next step: an error to raise at its start, or
    responses (an error among them ends the stream there), then silence."""

    steps: list[BaseException | list[WatchResponse | BaseException]]
    starts: list[int] = field(default_factory=list)
    live_leases: set[int] = field(default_factory=set)

    @asynccontextmanager
    async def watch(self, request: WatchRequest) -> AsyncIterator[Any]:
        self.starts.append(request.start_revision)
        step = self.steps.pop(0) if self.steps else []
        if isinstance(step, BaseException):
            raise step
        yield _Stream(step, request.start_revision)

    async def lease_time_to_live(self, lease_id: int, *, keys: bool = False) -> LeaseTimeToLive:
        ttl = 5 if lease_id in self.live_leases else -1
        return LeaseTimeToLive(Header(1, 1, 1), lease_id, ttl, 5, [])


class _Stream:
    def __init__(self, responses: list[WatchResponse | BaseException], start: int) -> None:
        self.responses = responses
        self.next_revision = start

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> WatchResponse:
        if not self.responses:
            await trio.sleep_forever()
        response = self.responses.pop(0)
        if isinstance(response, BaseException):
            raise response
        self.next_revision = response.events[-1].kv.mod_revision + 1
        return response


@dataclass
class StubBackend:
    etcd: ScriptedEtcd
    nursery: trio.Nursery
    layout: Layout = LAYOUT
    node: str = NODE
    timeout: float = 5.0
    #: (key, handle) still in etcd.
    present: set[tuple[str, str]] = field(default_factory=set)

    async def find(self, key: str, handle: str) -> object | None:
        return object() if (key, handle) in self.present else None


def _wired(backend: StubBackend, watched: set[str]) -> tuple[HoldWatch, list[tuple[Any, ...]]]:
    told: list[tuple[Any, ...]] = []
    watch = HoldWatch(backend)  # type: ignore[arg-type]

    def on_loss(*loss: Any) -> None:
        told.append(loss)
        watched.discard(loss[1])

    def on_released(handle: str) -> None:
        told.append(("released", handle))
        watched.discard(handle)

    watch.on_loss = on_loss
    watch.on_released = on_released
    watch.is_watched = lambda handle: handle in watched
    watch.watched_holds = lambda: [("k", h) for h in sorted(watched)]
    watch.any_watched = lambda: bool(watched)
    return watch, told


def _response(*events: Event) -> WatchResponse:
    return WatchResponse(Header(events[-1].kv.mod_revision, 1, 1), list(events))


def test_the_stream_goes_on_after_an_outage_and_reads_again_after_compaction() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            etcd = ScriptedEtcd(
                [
                    EtcdUnavailable("no endpoint"),
                    [_response(deleted("k", "h1", 12, lease=7)), EtcdUnavailable("member gone")],
                    WatchCompacted(40),
                    [],
                ]
            )
            backend = StubBackend(etcd, nursery, present={("k", "h3")})
            watched = {"h1", "h2", "h3"}
            watch, told = _wired(backend, watched)
            watch.follow("h1", fence=10)
            watch.follow("h2", fence=11)  # the stream runs already: no second one
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(3):  # mock clock: each retry's pause passes at once
                await trio.sleep(1)
                await trio.testing.wait_all_tasks_blocked()
            # From the first fence; again from there after the outage; after
            # the first stream, from past what it delivered; after compaction
            # from the compaction's revision.
            assert etcd.starts[:2] == [11, 11]
            # h1's lease is gone: expired. Then the stream ended with
            # compaction: h2 is gone from etcd (told expired), h3 is still there.
            assert (("k", "h1", EXPIRED, None, None)) in told
            assert ("k", "h2", EXPIRED, None, None) in told
            assert all(loss[1] != "h3" for loss in told)
            assert etcd.starts[2:] == [13, 40]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_deletion_whose_lease_lives_is_a_release_elsewhere() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            etcd = ScriptedEtcd([[_response(deleted("k", "h1", 12, lease=7))]], live_leases={7})
            backend = StubBackend(etcd, nursery)
            watch, told = _wired(backend, {"h1"})
            watch.follow("h1", fence=10)
            await trio.testing.wait_all_tasks_blocked()
            assert told == [("released", "h1")]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_loss_seen_before_its_hold_was_watched_is_told_when_it_is() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            backend = StubBackend(ScriptedEtcd([[]]), nursery)
            watched: set[str] = set()
            watch, told = _wired(backend, watched)
            watch.follow("other", fence=5)
            await trio.testing.wait_all_tasks_blocked()
            # The stream passed revision 12 before the grant of h1 (fence 10)
            # was watched: kept, and told once h1 is.
            watch.take([deleted("k", "h1", 12, lease=7)])
            assert told == []
            watched.add("h1")
            watch.follow("h1", fence=10)
            await trio.testing.wait_all_tasks_blocked()
            assert told == [("k", "h1", EXPIRED, None, None)]
            # A loss older than the grant is another hold's business: ignored.
            watch.take([deleted("k", "h2", 4, lease=8)])
            watched.add("h2")
            watch.follow("h2", fence=6)
            await trio.testing.wait_all_tasks_blocked()
            assert len(told) == 1
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_stream_ends_with_the_last_watched_hold_and_starts_again_with_the_next() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            record = break_record("user:root", "swap", "t")
            breaking = Event(
                "PUT", KeyValue(LAYOUT.directory("k") + b"x", record, 12, 12, 1, 0), None
            )
            etcd = ScriptedEtcd([[_response(deleted("k", "h1", 12, lease=7), breaking)], []])
            backend = StubBackend(etcd, nursery)
            watched = {"h1"}
            watch, told = _wired(backend, watched)
            watch.follow("h1", fence=10)
            await trio.testing.wait_all_tasks_blocked()
            assert told == [("k", "h1", BREAK, "user:root", "swap")]
            assert etcd.starts == [11]
            watched.add("h5")
            watch.follow("h5", fence=50)
            await trio.testing.wait_all_tasks_blocked()
            assert etcd.starts == [11, 51]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
