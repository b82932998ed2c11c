"""The etcd backend's run of the differential test (tests/etcd/test_differential.py).

One :class:`~lockd.daemon.backends.etcd.backend.EtcdBackend` (node ``n1``),
or two sharing one etcd as two hosts do (``n1`` serves clients 0 and 2,
``n2`` clients 1 and 3), whole: its acquire, queue, hand-off, re-take,
renew, release and break paths run as in the daemon, against the in-memory
etcd (``tests/fake_etcd.py``) or a real cluster's gateway. What the test
supplies is time:

- the backend's wall clock is the test's (records' ``expiresAt`` follow it);
- a hold runs out when the test's time passes its TTL, counted from its
  grant or last renew: the run revokes its lease, which is what etcd does
  when a lease ends (its keys deleted in one revision, the watches see it).
  The backend's lease lives HEADROOM_S longer than that, and the
  ``leaseExpiresAt`` it reports may be earlier (it is a lower bound: a
  reused lease's refresh may answer after the record was written, and the
  watch can deliver the grant from that record); the run checks that the
  reported moment is never later than the TTL's end. etcd's own lease
  timers never fire within a run: TTLs are 20 s or more of real time, a run
  takes a few seconds at most;
- a waiter's wait ends when the test's time passes its deadline: the run
  cancels its acquire, the path a client's cancel or a closed connection
  takes too (a blocking acquire waits in the backend with a timeout of an
  hour). In the daemon the deadline is a trio deadline around the same
  wait; the two differ only for a grant that crosses the deadline, which
  cannot happen here: the run applies a deadline only once the backend is
  settled.

**Settled** means nothing is left in flight: every acquire is answered or
parked, every key queue has decided from a view that shows every change of
its key's directory, the clean-up list is empty, and no lease is being
granted ahead. The run checks it by writing a barrier key and reading its
own watch up to the barrier's revision (so it knows the last change of each
directory), twice, with no change between. No sleeping for time to pass.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from lockd.config import BackendSettings
from lockd.daemon.backends.etcd.backend import EtcdBackend
from lockd.daemon.backends.etcd.records import Hold, Layout
from lockd.daemon.backends.etcd.wire import PutOp, RangeOp, WatchRequest
from lockd.daemon.holds import Refused
from lockd.daemon.protocol import Acquire as AcquireRequest
from lockd.identity import Caller
from lockd.testing.clock import FakeClock
from lockd.testing.polling import wait_for_trio
from tests.differential import (
    CLIENTS,
    KEYS,
    Acquire,
    Break,
    Cancel,
    Op,
    Picker,
    Release,
    Renew,
    Seen,
)

#: a blocking acquire's own timeout in the backend: never reached (see the docstring).
NO_TIMEOUT_S = 3600.0
#: the test's time 0 on the backend's wall clock (any fixed epoch would do).
EPOCH_MS = 1_900_000_000_000


def caller(client: int) -> Caller:
    principal, conn = CLIENTS[client]
    kind, name = principal.split(":")
    role = "service" if kind == "service" else "member"
    return Caller(kind, name, role, 1000 + conn, 1000, 4000 + conn, frozenset(), "job")  # type: ignore[arg-type]


@dataclass(eq=False)
class Pending:
    """A blocking acquire running in the background."""

    key: str
    deadline: int
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    parked: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    outcome: Any = None
    reported: bool = False


class EtcdRun:
    name = "etcd"

    def __init__(self, etcd: Any, prefix: str, nursery: trio.Nursery, nodes: int = 1) -> None:
        self.etcd = etcd
        self.prefix = prefix.encode()
        self.layout = Layout(prefix)
        self.nursery = nursery
        self.clock = FakeClock(now=0, epoch_ms=EPOCH_MS)  # the test's time, moved by the run
        self.backends = [
            EtcdBackend(
                etcd,
                BackendSettings(
                    kind="etcd", endpoints=("test",), prefix=prefix, node=f"n{n}", etcd_timeout=5.0
                ),
                self.clock,
            )
            for n in range(1, nodes + 1)
        ]
        #: the host that answers break and status (any host would do).
        self.backend = self.backends[0]
        #: request -> the client that made it (its host renews and releases it).
        self.client_of: dict[int, int] = {}
        self.pending: dict[int, Pending] = {}
        self.holds: dict[int, Hold] = {}  # request -> its hold as granted
        #: request -> when its hold runs out (test time; see the docstring).
        self.expires: dict[int, int] = {}
        self.request_of: dict[str, int] = {}  # handle -> request
        #: the last revision of a change in each etcd "directory" (and of any change).
        self.last_change: dict[bytes, int] = {}
        self.last_any = 0
        self.seen_revision = 0
        self._seen = trio.Event()
        self.barrier_key = self.prefix + b"x/barrier"

    @classmethod
    @asynccontextmanager
    async def started(cls, etcd: Any, prefix: str, nodes: int = 1) -> AsyncIterator[EtcdRun]:
        async with trio.open_nursery() as nursery:
            run = cls(etcd, prefix, nursery, nodes)
            start = (await etcd.range(RangeOp(run.prefix, prefix=True))).header.revision + 1
            nursery.start_soon(run._follow, start)
            for backend in run.backends:
                await nursery.start(backend.run)
            await run.settle()
            yield run
            nursery.cancel_scope.cancel()

    # ----------------------------------------------------------- settling

    async def _follow(self, start: int) -> None:
        """The run's own watch of everything under the prefix: the last change per directory."""
        request = WatchRequest(self.prefix, prefix=True, start_revision=start)
        async with self.etcd.watch(request) as watch:
            async for response in watch:
                for event in response.events:
                    revision = event.kv.mod_revision
                    key = event.kv.key
                    if key.startswith(self.layout.locks):
                        directory = key[: key.index(b"/", len(self.layout.locks)) + 1]
                        self.last_change[directory] = revision
                    if key != self.barrier_key:
                        self.last_any = revision
                    self.seen_revision = max(self.seen_revision, revision)
                self._seen.set()
                self._seen = trio.Event()

    def _quiet(self) -> bool:
        if any(not p.done.is_set() and not p.parked.is_set() for p in self.pending.values()):
            return False
        return all(self._backend_quiet(backend) for backend in self.backends)

    def _backend_quiet(self, backend: EtcdBackend) -> bool:
        for queue in backend._queues.values():
            if queue.records is None or queue.lock.locked() or queue.changed.is_set():
                return False
            if queue.revision < self.last_change.get(queue.directory_key, 0):
                return False
        return not (backend._doomed_keys or backend._doomed_leases or backend._granting)

    async def _barrier(self) -> int:
        revision = (await self.etcd.txn([], [PutOp(self.barrier_key, b"")])).header.revision
        with trio.fail_after(30):
            while self.seen_revision < revision:
                await self._seen.wait()
        return revision

    async def settle(self) -> None:
        """Until nothing is in flight (see the module docstring)."""
        with trio.fail_after(60):
            quiet_since: int | None = None
            while True:
                await trio.testing.wait_all_tasks_blocked()
                if not self._quiet():
                    quiet_since = None
                    # etcd's replies are in flight: until they have come and been seen.
                    await wait_for_trio(self._quiet, 60, "nothing in flight", interval=0.001)
                    continue
                barrier = await self._barrier()
                if not self._quiet():
                    quiet_since = None
                    continue
                if quiet_since is not None and self.last_any < quiet_since:
                    return
                quiet_since = barrier

    # ----------------------------------------------------------- the steps

    async def step(self, req: int, op: Op, names: Picker) -> Seen:
        seen = Seen()
        backend = self.backend
        if isinstance(op, Acquire):
            seen.result = await self._acquire(req, op, seen)
        elif isinstance(op, Release | Renew):
            target = names.grant_named(op)
            hold = self.holds.get(target) if target is not None else None
            if hold is None:
                seen.result = None
            elif isinstance(op, Release):
                assert target is not None
                holder = self.host_of(self.client_of[target])
                seen.result = await holder.release(hold.key, hold.handle)
            else:
                assert target is not None
                holder = self.host_of(self.client_of[target])
                current = await holder.find(hold.key, hold.handle)
                renewed = await holder.renew(current, op.ttl_s * 1000) if current else None
                seen.result = renewed is not None
                if renewed is not None:
                    assert target is not None
                    self._lasts(target, renewed)
        elif isinstance(op, Break):
            broken = await backend.break_lock(op.key)
            seen.result = sorted(self.request_of[h.handle] for h in broken)
        elif isinstance(op, Cancel):
            target = names.wait_named(op)
            pending = self.pending.get(target) if target is not None else None
            seen.result = pending is not None and not pending.done.is_set()
            if pending is not None and seen.result:
                await self._cancel(pending)
        else:
            await self._advance(self.clock.now + op.seconds * 1000, seen)
        await self.settle()
        self._collect(seen)
        for key in KEYS:
            status = await backend.status(key)
            holds = [h for h in status.holds if isinstance(h, Hold)]
            # Oldest grant first, as the backend lists them (every grant has a
            # fence of its own since issue 23; the request breaks no tie now).
            holds.sort(key=lambda h: (h.fence, self.request_of[h.handle]))
            mode, limit = (holds[0].mode, holds[0].limit) if holds else (None, None)
            seen.status[key] = (
                mode,
                limit,
                [self.request_of[h.handle] for h in holds],
                status.waiters,
            )
        return seen

    async def _acquire(self, req: int, op: Acquire, seen: Seen) -> str:
        wait_ms = op.wait_ms(req)
        request = AcquireRequest(
            req,
            "tryAcquire" if wait_ms is None else "acquire",
            op.key,
            op.ttl_s * 1000,
            wait_ms,
            op.owner,
            False,
            op.mode,
            op.limit,
        )
        conn = CLIENTS[op.client][1]
        self.client_of[req] = op.client
        host = self.host_of(op.client)
        if wait_ms is None:
            outcome = await host.acquire(request, caller(op.client), conn, None)
            return self._answer(req, outcome, seen)
        pending = Pending(op.key, self.clock.now + wait_ms)
        self.pending[req] = pending

        async def wait() -> None:
            try:
                with pending.scope:
                    pending.outcome = await host.acquire(
                        request, caller(op.client), conn, NO_TIMEOUT_S, pending.parked
                    )
            finally:
                pending.done.set()

        self.nursery.start_soon(wait)
        await self.settle()
        if not pending.done.is_set():
            return "parked"
        pending.reported = True
        return self._answer(req, pending.outcome, seen)

    def host_of(self, client: int) -> EtcdBackend:
        return self.backends[client % len(self.backends)]

    def _answer(self, req: int, outcome: object, seen: Seen) -> str:
        if isinstance(outcome, Hold):
            self._granted(req, outcome, seen)
            return "retake" if outcome.retake else "granted"
        if isinstance(outcome, Refused):
            return f"refused:{outcome.field}"
        return "busy" if outcome is None else f"unexpected {outcome!r}"

    def _granted(self, req: int, hold: Hold, seen: Seen) -> None:
        self.holds[req] = hold
        self._lasts(req, hold)
        self.request_of[hold.handle] = req
        seen.grants.append((hold.fence, req))

    def _lasts(self, req: int, hold: Hold) -> None:
        """A hold granted or renewed now: it runs out a TTL from now (see the docstring)."""
        ends = self.clock.now + hold.ttl_ms
        reported = hold.expires_at - EPOCH_MS
        assert reported <= ends, f"request {req}: leaseExpiresAt {reported} after its TTL {ends}"
        self.expires[req] = ends

    def _collect(self, seen: Seen) -> None:
        """Grants that parked acquires received during the step."""
        for req, pending in self.pending.items():
            if pending.done.is_set() and not pending.reported:
                pending.reported = True
                if isinstance(pending.outcome, Hold):
                    self._granted(req, pending.outcome, seen)

    async def _cancel(self, pending: Pending) -> None:
        pending.scope.cancel()
        await pending.done.wait()
        pending.reported = True

    async def _advance(self, until: int, seen: Seen) -> None:
        """Each deadline in its turn, leases before waits on the same millisecond."""
        while True:
            await self.settle()
            self._collect(seen)
            holds = await self._live_holds()
            expiring = min(
                holds,
                key=lambda h: (self.expires[self.request_of[h.handle]], h.fence),
                default=None,
            )
            waits = [(p.deadline, req, p) for req, p in self.pending.items() if not p.done.is_set()]
            ending = min(waits, key=lambda w: (w[0], w[1]), default=None)
            hold_at = (
                self.expires[self.request_of[expiring.handle]] if expiring is not None else math.inf
            )
            wait_at = ending[0] if ending is not None else math.inf
            if min(hold_at, wait_at) > until:
                break
            if hold_at <= wait_at:
                assert expiring is not None
                self.clock.now = int(hold_at)
                await self.etcd.lease_revoke(expiring.lease)  # etcd ends the lease
                seen.expired.append(self.request_of[expiring.handle])
            else:
                assert ending is not None
                self.clock.now = ending[0]
                await self._cancel(ending[2])
                seen.timed_out.append(ending[1])
        self.clock.now = until

    async def _live_holds(self) -> list[Hold]:
        holds = []
        for key in KEYS:
            holds += [h for h in (await self.backend.status(key)).holds if isinstance(h, Hold)]
        return holds
