"""Operations, observations and the embedded engine's run of the differential test.

``tests/etcd/test_differential.py`` holds the reference model and the tests; this
module holds what every run shares: the operations hypothesis generates
(:data:`operations`), what a step shows (:class:`Seen`), and the embedded
engine's run (:class:`EngineRun`). The etcd backend's run is in
``tests/differential_etcd.py``.

Time is the test's: every run starts at 0 and moves only by ``Advance``.
Deadlines are chosen so they are told apart by time alone: TTLs and
advances are whole multiples of 5 s, a waiter's wait is ``n`` x 10 s + 500
ms + its request number. When two deadlines still fall on the same
millisecond, every run applies them in the engine's order: lease expiries
first (oldest fence first), then waiter timeouts (oldest request first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from hypothesis import strategies as st

from lockd.daemon.engine import Busy, LockEngine, Parked, Refused, TimedOut, Waiter
from lockd.daemon.leases import Lease

#: (principal, connection) of each client: two connections of one user (a
#: re-take across them is allowed), another user, and a service.
CLIENTS = [("user:alice", 1), ("user:alice", 2), ("user:bob", 3), ("service:cron", 4)]
KEYS = ["a", "b"]


@dataclass(frozen=True)
class Acquire:
    client: int
    key: str
    mode: str
    limit: int
    owner: str | None
    ttl_s: int
    #: None: tryAcquire; else a blocking acquire waiting that many seconds (+ see wait_ms).
    wait_s: int | None

    def wait_ms(self, req: int) -> int | None:
        """The request's own wait: its number makes every waiter's deadline unique."""
        return None if self.wait_s is None else self.wait_s * 1000 + 500 + req


@dataclass(frozen=True)
class Release:
    grant: int  # picks a request holding now (live), or any granted so far (stale too)
    live: bool = True


@dataclass(frozen=True)
class Renew:
    grant: int
    ttl_s: int
    live: bool = True


@dataclass(frozen=True)
class Break:
    key: str


@dataclass(frozen=True)
class Cancel:
    waiter: int  # picks a request waiting now (live), or any that parked so far
    live: bool = True


@dataclass(frozen=True)
class Advance:
    seconds: int


Op = Acquire | Release | Renew | Break | Cancel | Advance

ttls = st.sampled_from([20, 30, 50])
keys = st.sampled_from(KEYS)


@st.composite
def acquires(draw: st.DrawFn) -> Acquire:
    key = draw(keys)
    # Key "a" is mostly a plain lock, "b" mostly a semaphore of 2; now and
    # then a request names another limit (refused while the key is in use).
    usual = 1 if key == "a" else 2
    limit = draw(st.sampled_from([usual, usual, usual, usual, 3 - usual]))
    mode = (
        draw(st.sampled_from(["exclusive", "shared"]))
        if limit == 1 or draw(st.booleans())
        else "exclusive"
    )
    return Acquire(
        client=draw(st.integers(0, len(CLIENTS) - 1)),
        key=key,
        mode=mode,
        limit=limit,
        owner=draw(st.sampled_from([None, None, "j1", "j2"])),
        ttl_s=draw(ttls),
        wait_s=draw(st.sampled_from([None, None, 10, 10, 20, 40])),
    )


#: one operation, acquires most often (the weights are the repeats).
operation: st.SearchStrategy[Op] = st.sampled_from(
    [
        *[acquires()] * 7,
        st.builds(Release, st.integers(0, 40), st.booleans()),
        st.builds(Release, st.integers(0, 40)),
        st.builds(Renew, st.integers(0, 40), ttls, st.booleans()),
        st.builds(Break, keys),
        st.builds(Cancel, st.integers(0, 40), st.booleans()),
        st.builds(Advance, st.sampled_from([5, 10, 15, 20, 30, 60])),
        st.builds(Advance, st.sampled_from([5, 10, 15])),
    ]
).flatmap(lambda strategy: strategy)
operations = st.lists(operation, min_size=6, max_size=30)


@dataclass
class Seen:
    """What one step shows, in a form every run can produce.

    ``result`` is the operation's own answer; ``grants`` every request
    granted during the step (the operation's own too), in fence order, each
    with its fence; ``expired`` and ``timed_out`` the requests whose hold
    ran out / whose wait ended; ``status`` each key's (mode, limit, holders
    oldest first, number of waiters) after the step.
    """

    result: Any = None
    grants: list[tuple[int, int]] = field(default_factory=list)  # (fence, request)
    expired: list[int] = field(default_factory=list)
    timed_out: list[int] = field(default_factory=list)
    status: dict[str, tuple[str | None, int | None, list[int], int]] = field(default_factory=dict)

    def comparable(self, *, ordered: bool = True) -> tuple[Any, ...]:
        """Everything but the fences' values (runs number them differently): their order stays.

        ``ordered=False`` compares the grants of the step, and each key's
        holders, as sets: two hosts grant their own waiters of one hand-out
        each in a transaction of its own, in either order (their fences say
        which committed first, not which came first in the queue).
        """
        grants = [req for _, req in sorted(self.grants)]
        status = self.status
        if not ordered:
            grants.sort()
            status = {k: (m, n, sorted(h), w) for k, (m, n, h, w) in status.items()}
        return (self.result, grants, sorted(self.expired), sorted(self.timed_out), status)


def pick(items: list[int], index: int) -> int | None:
    return items[index % len(items)] if items else None


class Picker(Protocol):
    """Which request an operation names: the model says, the same for every run."""

    def grant_named(self, op: Release | Renew) -> int | None: ...

    def wait_named(self, op: Cancel) -> int | None: ...


class EngineRun:
    """The embedded engine (lockd/daemon/engine.py) driven by the test's clock."""

    name = "engine"

    def __init__(self) -> None:
        self.engine = LockEngine()
        self.now = 0
        self.leases: dict[int, Lease] = {}  # request -> its hold
        self.waiters: dict[int, Waiter] = {}
        self.request_of: dict[str, int] = {}  # handle -> request

    def step(self, req: int, op: Op, names: Picker) -> Seen:
        """Apply ``op`` (request number ``req``); ``names`` says which request it names."""
        seen = Seen()
        engine, now = self.engine, self.now
        if isinstance(op, Acquire):
            principal, _ = CLIENTS[op.client]
            # Each request on a connection of its own: the engine alone looks
            # for cycles of waits between connections (docs/protocol.md,
            # "Errors"; tests/unit/test_engine_properties.py checks that against
            # a model), and a fresh connection never closes one.
            conn = 1_000_000 + req
            answer = engine.acquire(
                now,
                op.key,
                ttl_ms=op.ttl_s * 1000,
                principal=principal,
                owner=op.owner,
                conn=conn,
                wait_ms=op.wait_ms(req),
                mode=op.mode,
                limit=op.limit,
            )
            retakes = engine.pending().retakes
            if isinstance(answer, Lease):
                self._granted(req, answer, seen)
                seen.result = "retake" if retakes else "granted"
            elif isinstance(answer, Busy):
                seen.result = "busy"
            elif isinstance(answer, Refused):
                seen.result = f"refused:{answer.field}"
            elif isinstance(answer, Parked):
                self.waiters[req] = answer.waiter
                seen.result = "parked"
            else:
                assert isinstance(answer, TimedOut)
                seen.result = "timeout"
        elif isinstance(op, Release | Renew):
            target = names.grant_named(op)
            lease = self.leases.get(target) if target is not None else None
            if lease is None:
                seen.result = None
            elif isinstance(op, Release):
                seen.result = engine.release(now, lease.key, lease.handle)
            else:
                seen.result = (
                    engine.renew(now, lease.key, lease.handle, op.ttl_s * 1000) is not None
                )
        elif isinstance(op, Break):
            broken = engine.break_lock(now, op.key)
            seen.result = sorted(self.request_of[lease.handle] for lease in broken)
        elif isinstance(op, Cancel):
            target = names.wait_named(op)
            waiter = self.waiters.get(target) if target is not None else None
            seen.result = waiter is not None and not waiter.resolved
            if waiter is not None:
                engine.cancel_waiter(now, waiter)
        else:
            self._advance(now + op.seconds * 1000, seen)
        self._collect(seen)
        for key in KEYS:
            status = engine.status(self.now, key)
            holders = [self.request_of[lease.handle] for lease in status.holders]
            seen.status[key] = (status.mode, status.limit, holders, status.waiters)
        engine.drain()
        return seen

    def _advance(self, until: int, seen: Seen) -> None:
        while (deadline := self.engine.next_deadline()) is not None and deadline <= until:
            self.now = deadline
            self.engine.advance(deadline)
            self._collect(seen)
        self.now = until

    def _collect(self, seen: Seen) -> None:
        changes = self.engine.drain()
        for lease in changes.expired:
            seen.expired.append(self.request_of[lease.handle])
        for waiter in changes.resolved:
            req = next(r for r, w in self.waiters.items() if w is waiter)
            if waiter.lease is not None:
                self._granted(req, waiter.lease, seen)
            elif waiter.timed_out:
                seen.timed_out.append(req)

    def _granted(self, req: int, lease: Lease, seen: Seen) -> None:
        self.leases[req] = lease
        self.request_of[lease.handle] = req
        seen.grants.append((lease.fence, req))
