"""Lease-loss events and the waiting break, decided by the service (docs/contract.md §12).

No server and no sleeping: the service runs on a fake boot clock, the test
plays the server (``watch_grant`` when a grant reaches a listening
connection, ``break_ready`` / ``finish_break`` for a waiting break) and
moves the clock past ``break_grace`` by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockd.daemon.engine import Lease, LockEngine, Parked
from lockd.daemon.events import LossEvent, LossWatch, PendingBreak
from lockd.daemon.protocol import Acquire, Stopped
from lockd.daemon.service import LockService
from lockd.daemon.store import Store
from tests.unit.test_server import MEMBER, OWNER, FakeClock, FlakyStore, OpenPolicy, ScriptedLimiter

GRACE_MS = 5000
HOLDER, WAITER = 1, 2


class Harness:
    def __init__(self, store: Store) -> None:
        self.clock = FakeClock(now=0)
        self.store = store
        self.service = LockService(
            LockEngine(),
            store,
            OpenPolicy(),
            ScriptedLimiter(),
            self.clock,
            break_grace_ms=GRACE_MS,
        )
        #: what reached the wire, in order: loss events and grants to waiters.
        self.wire: list[tuple[str, Any]] = []
        self.service.on_lost = lambda event: self.wire.append(("lost", event))
        self.service.on_resolved = lambda w: self.wire.append(("granted", w.lease))
        self._ids = 0

    def take(self, key: str, conn: int = HOLDER, *, ttl_ms: int = 60_000, **opts: Any) -> Lease:
        """A tryAcquire on ``conn``, its grant delivered to a listening connection."""
        step = self.service.acquire(
            MEMBER, conn, self._acquire(key, ttl_ms, None, **opts), pending=0
        )
        lease = step.grant  # type: ignore[union-attr]
        assert isinstance(lease, Lease)
        self.service.commit()
        self.service.watch_grant(conn, lease)
        return lease

    def park(self, key: str, conn: int = WAITER) -> Parked:
        step = self.service.acquire(MEMBER, conn, self._acquire(key, 60_000, 60_000), pending=0)
        assert isinstance(step, Parked)
        return step

    def break_(self, key: str, reason: str = "maintenance") -> PendingBreak:
        pending = self.service.break_lock(OWNER, key, reason)
        assert isinstance(pending, PendingBreak)
        return pending

    def lost(self) -> list[LossEvent]:
        return [item for kind, item in self.wire if kind == "lost"]

    def _acquire(self, key: str, ttl_ms: int, timeout_ms: int | None, **opts: Any) -> Acquire:
        self._ids += 1
        op = "tryAcquire" if timeout_ms is None else "acquire"
        return Acquire(
            self._ids,
            op,
            key,
            ttl_ms,
            timeout_ms,
            opts.get("owner"),
            False,
            opts.get("mode", "exclusive"),
        )


@pytest.fixture
def h(short_tmp: Path) -> Iterator[Harness]:
    store = Store(short_tmp / "db", "boot-1")
    try:
        yield Harness(store)
    finally:
        store.close()


def test_a_break_tells_the_holder_and_waits_for_stopped(h: Harness) -> None:
    lease = h.take("k")
    parked = h.park("k")
    pending = h.break_("k", "disk swap")

    [event] = h.lost()
    assert event.wire() == {
        "event": "lost",
        "key": "k",
        "handle": lease.handle,
        "fence": lease.fence,
        "cause": "break",
        "reason": "disk swap",
        "by": OWNER.principal,
        "at": event.at,
    }
    assert event.conn == HOLDER
    # The hold stays until the holder stops: nobody else can get the key.
    assert not h.service.break_ready(pending)
    assert not parked.waiter.resolved
    assert h.service.status("k")["fence"] == lease.fence
    assert h.service.renew(MEMBER, "k", lease.handle, 1000) == {
        "renewed": False,
        "reason": "lease_lost",
    }

    woken: list[bool] = []
    pending.wake = lambda: woken.append(True)
    assert h.service.stopped(WAITER, Stopped(1, "stopped", lease.handle)) == {"stopped": False}
    assert h.service.stopped(HOLDER, Stopped(2, "stopped", lease.handle)) == {"stopped": True}
    assert woken == [True] and h.service.break_ready(pending)

    result = h.service.finish_break(OWNER, pending)
    assert result["broken"] is True and result["fence"] == lease.fence
    assert parked.waiter.lease is not None and parked.waiter.lease.fence > lease.fence
    assert [kind for kind, _ in h.wire] == ["lost", "granted"]


def test_break_grace_bounds_the_wait_for_a_hung_holder(h: Harness) -> None:
    h.take("k")
    parked = h.park("k")
    pending = h.break_("k")
    h.clock.now += GRACE_MS - 1
    assert not h.service.break_ready(pending)
    assert h.service.ms_until(pending.deadline) == 1
    h.clock.now += 1
    assert h.service.break_ready(pending)
    assert h.service.finish_break(OWNER, pending)["broken"] is True
    assert parked.waiter.lease is not None


def test_the_holder_closing_its_connection_counts_as_stopped(h: Harness) -> None:
    h.take("k")
    pending = h.break_("k")
    h.service.connection_closed(HOLDER)
    assert h.service.break_ready(pending)
    h.service.finish_break(OWNER, pending)
    assert h.service.status("k")["held"] is False


def test_an_expiry_during_the_grace_ends_the_wait(h: Harness) -> None:
    h.take("k", ttl_ms=100)
    pending = h.break_("k")
    woken: list[bool] = []
    pending.wake = lambda: woken.append(True)
    h.clock.now += 100
    h.service.tick()
    assert woken and h.service.break_ready(pending)
    # Told once: the break's event, not a second one for the expiry.
    assert [e.cause for e in h.lost()] == ["break"]
    assert h.service.finish_break(OWNER, pending)["broken"] is True


def test_a_silent_holder_is_broken_at_once(h: Harness) -> None:
    step = h.service.acquire(MEMBER, 3, h._acquire("k", 60_000, None), pending=0)
    assert step.grant is not None  # type: ignore[union-attr]
    h.service.commit()  # never watched: its connection did not ask for events
    result = h.service.break_lock(OWNER, "k", "r")
    assert isinstance(result, dict) and result["broken"] is True
    assert h.lost() == []


def test_break_of_shared_holds_releases_the_silent_ones_at_once(h: Harness) -> None:
    listening = h.take("s", mode="shared")
    step = h.service.acquire(MEMBER, 3, h._acquire("s", 60_000, None, mode="shared"), pending=0)
    silent = step.grant  # type: ignore[union-attr]
    h.service.commit()
    pending = h.break_("s")
    st = h.service.status("s")
    assert st["holderCount"] == 1 and st["fence"] == listening.fence
    h.service.stopped(HOLDER, Stopped(1, "stopped", listening.handle))
    result = h.service.finish_break(OWNER, pending)
    assert result["holders"] == 2 and result["fence"] == silent.fence - 1


def test_expiry_is_told_before_the_next_holder_is_granted(h: Harness) -> None:
    lease = h.take("k", ttl_ms=100)
    h.park("k")
    h.clock.now += 100
    h.service.tick()
    assert [kind for kind, _ in h.wire] == ["lost", "granted"]
    [event] = h.lost()
    assert (event.cause, event.handle, event.by, event.reason) == (
        "expired",
        lease.handle,
        None,
        None,
    )


def test_retake_is_told_after_its_commit_with_the_new_holder(h: Harness) -> None:
    first = h.take("job", owner="run-1")
    h.service.group_commit = True  # as in the daemon: the batch commits later
    step = h.service.acquire(MEMBER, 3, h._acquire("job", 60_000, None, owner="run-1"), pending=0)
    assert h.lost() == []  # not before the re-take is durable
    h.service.commit()
    [event] = h.lost()
    assert (event.cause, event.handle, event.by) == ("retake", first.handle, MEMBER.principal)
    assert step.grant.fence > first.fence  # type: ignore[union-attr]


def test_a_retake_undone_by_a_failed_commit_is_not_told(short_tmp: Path) -> None:
    store = FlakyStore(short_tmp / "db", "boot-1")
    h = Harness(store)
    try:
        first = h.take("job", owner="run-1")
        h.service.group_commit = True
        h.service.acquire(MEMBER, 3, h._acquire("job", 60_000, None, owner="run-1"), pending=0)
        store.armed = True
        with pytest.raises(Exception, match="full"):
            h.service.commit()
        assert h.lost() == []
        # The first hold is back and still watched: a later break tells it.
        h.service.group_commit = False
        h.break_("job")
        assert [e.handle for e in h.lost()] == [first.handle]
    finally:
        store.close()


def test_release_by_its_holder_is_not_a_loss(h: Harness) -> None:
    lease = h.take("k")
    assert h.service.release(MEMBER, "k", lease.handle) == {"released": True}
    assert len(h.service.losses) == 0
    assert h.service.break_lock(OWNER, "k", "r") == {"broken": False}
    assert h.lost() == []


def test_two_breaks_of_one_key_tell_the_holder_once() -> None:
    watch = LossWatch()

    class Hold:
        key, handle, fence, principal, owner = "k", "h1", 1, "user:a", None

    watch.watch(HOLDER, Hold())
    [listening] = watch.of_key("k")
    first, told = watch.begin_break("k", "r", "user:root", [listening], [], 100, "t")
    second, again = watch.begin_break("k", "r2", "user:root", [], [], 200, "t")
    assert len(told) == 1 and again == []
    assert second.waiting_for == {"h1"}
    assert watch.stopped(HOLDER, "h1")
    assert first.ready(0) and second.ready(0)
