"""One sequence of lock operations, three deciders, the same answers
(docs/contract.md §1, §2, §10, §11).

Hypothesis generates sequences of operations (``tests/differential.py``:
try and blocking acquires, shared holds, semaphores, limits that clash,
re-takes by owner across connections of one user, releases and renewals of
current and stale handles, breaks, cancelled waiters, and time passing so
leases run out and waits end) over four clients and two keys. Each runs
through

- the reference model below, written here from the contract and sharing no
  code with lockd;
- the embedded engine (``LockEngine``) on the test's clock;
- the etcd backend (``EtcdBackend``) with its decision path whole (every
  grant, queue hand-off and re-take is its own etcd transaction): on the
  in-memory etcd of ``tests/fake_etcd.py`` here, and on a real 3-member
  cluster in the slow variant at the end (a few examples: < 60 s).

After every step, each run's answer, the requests granted (in fence order),
the holds that ran out, the waits that ended and every key's holders and
waiters must be the model's. Fences must strictly increase in grant order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio
from hypothesis import HealthCheck, example, given, settings

from lockd.daemon.backends.etcd.gateway import EtcdGateway, GatewaySettings
from lockd.testing.etcd_cluster import EtcdCluster
from tests.depth import examples
from tests.differential import (
    CLIENTS,
    KEYS,
    Acquire,
    Advance,
    Break,
    Cancel,
    EngineRun,
    Op,
    Release,
    Renew,
    Seen,
    operations,
    pick,
)
from tests.differential_etcd import EtcdRun
from tests.fake_etcd import FakeEtcd

# ------------------------------------------------------------------ the model


@dataclass
class Hold:
    req: int
    key: str
    principal: str
    owner: str | None
    mode: str
    limit: int
    fence: int
    expires_at: int


@dataclass
class Wait:
    req: int
    key: str
    principal: str
    owner: str | None
    mode: str
    limit: int
    ttl_ms: int
    deadline: int


@dataclass
class Model:
    """The contract as plain lists: a key's holders in grant order, its waiters in arrival order."""

    now: int = 0
    fence: int = 0
    holders: dict[str, list[Hold]] = field(default_factory=lambda: {k: [] for k in KEYS})
    queue: dict[str, list[Wait]] = field(default_factory=lambda: {k: [] for k in KEYS})
    granted: list[int] = field(default_factory=list)  # every request ever granted
    parked: list[int] = field(default_factory=list)  # every request that ever parked

    def room_for(self, mode: str, key: str) -> bool:
        """Exclusive (limit 1) alone, shared beside shared, a semaphore to its limit (§10)."""
        held = self.holders[key]
        if not held:
            return True
        if held[0].mode != mode:
            return False
        return mode == "shared" or len(held) < held[0].limit

    def grant(self, seen: Seen, req: int, key: str, who: Acquire | Wait, principal: str) -> None:
        # The same principal's hold with the same owner is taken back (docs/contract.md §1).
        held = self.holders[key]
        if who.owner is not None:
            held[:] = [h for h in held if (h.principal, h.owner) != (principal, who.owner)]
        ttl_ms = who.ttl_s * 1000 if isinstance(who, Acquire) else who.ttl_ms
        self.fence += 1
        held.append(
            Hold(req, key, principal, who.owner, who.mode, who.limit, self.fence, self.now + ttl_ms)
        )
        self.granted.append(req)
        seen.grants.append((self.fence, req))

    def hand_out(self, seen: Seen, key: str) -> None:
        """Grant the head of the queue while it fits; the first that does not fit stops it."""
        queue = self.queue[key]
        while queue and self.room_for(queue[0].mode, key):
            wait = queue.pop(0)
            self.grant(seen, wait.req, key, wait, wait.principal)

    def acquire(self, seen: Seen, req: int, op: Acquire) -> str:
        principal = CLIENTS[op.client][0]
        held, queue = self.holders[op.key], self.queue[op.key]
        if op.mode == "shared" and op.limit > 1:
            return "refused:limit"
        in_force = held[0].limit if held else (queue[0].limit if queue else None)
        if in_force is not None and op.limit != in_force:
            return "refused:limit"
        own = [
            h
            for h in held
            if op.owner is not None and (h.principal, h.owner) == (principal, op.owner)
        ]
        if own and own[0].mode != op.mode:
            return "refused:mode"
        if own:  # a re-take wins at once, waiters or not
            self.grant(seen, req, op.key, op, principal)
            return "retake"
        if not queue and self.room_for(op.mode, op.key):
            self.grant(seen, req, op.key, op, principal)
            return "granted"
        wait_ms = op.wait_ms(req)
        if wait_ms is None:
            return "busy"
        queue.append(
            Wait(
                req,
                op.key,
                principal,
                op.owner,
                op.mode,
                op.limit,
                op.ttl_s * 1000,
                self.now + wait_ms,
            )
        )
        self.parked.append(req)
        return "parked"

    def grant_named(self, op: Release | Renew) -> int | None:
        if op.live:
            return pick(sorted(h.req for held in self.holders.values() for h in held), op.grant)
        return pick(self.granted, op.grant)

    def wait_named(self, op: Cancel) -> int | None:
        if op.live:
            return pick(sorted(w.req for q in self.queue.values() for w in q), op.waiter)
        return pick(self.parked, op.waiter)

    def find(self, req: int | None) -> Hold | None:
        return next((h for held in self.holders.values() for h in held if h.req == req), None)

    def step(self, req: int, op: Op) -> Seen:
        seen = Seen()
        if isinstance(op, Acquire):
            seen.result = self.acquire(seen, req, op)
        elif isinstance(op, Release | Renew):
            target = self.grant_named(op)
            hold = self.find(target)
            if target is None:
                seen.result = None
            elif isinstance(op, Release):
                seen.result = hold is not None
                if hold is not None:
                    self.holders[hold.key].remove(hold)
                    self.hand_out(seen, hold.key)
            else:
                seen.result = hold is not None
                if hold is not None:
                    hold.expires_at = self.now + op.ttl_s * 1000
        elif isinstance(op, Break):
            seen.result = sorted(h.req for h in self.holders[op.key])
            self.holders[op.key] = []
            self.hand_out(seen, op.key)
        elif isinstance(op, Cancel):
            target = self.wait_named(op)
            wait = next((w for q in self.queue.values() for w in q if w.req == target), None)
            seen.result = wait is not None
            if wait is not None:
                queue = self.queue[wait.key]
                was_head = queue[0] is wait
                queue.remove(wait)
                if was_head:
                    self.hand_out(seen, wait.key)
        else:
            self.advance(seen, self.now + op.seconds * 1000)
        for key in KEYS:
            held = self.holders[key]
            mode, limit = (held[0].mode, held[0].limit) if held else (None, None)
            seen.status[key] = (mode, limit, [h.req for h in held], len(self.queue[key]))
        return seen

    def advance(self, seen: Seen, until: int) -> None:
        """Time passes: each deadline in its turn (leases before waits on the same millisecond)."""
        while True:
            holds = [h for held in self.holders.values() for h in held if h.expires_at <= until]
            waits = [w for q in self.queue.values() for w in q if w.deadline <= until]
            first_hold = min(holds, key=lambda h: (h.expires_at, h.fence), default=None)
            first_wait = min(waits, key=lambda w: (w.deadline, w.req), default=None)
            if first_hold is not None and (
                first_wait is None or first_hold.expires_at <= first_wait.deadline
            ):
                self.now = first_hold.expires_at
                self.holders[first_hold.key].remove(first_hold)
                seen.expired.append(first_hold.req)
                self.hand_out(seen, first_hold.key)
            elif first_wait is not None:
                self.now = first_wait.deadline
                queue = self.queue[first_wait.key]
                was_head = queue[0] is first_wait
                queue.remove(first_wait)
                seen.timed_out.append(first_wait.req)
                if was_head:
                    self.hand_out(seen, first_wait.key)
            else:
                break
        self.now = until


# --------------------------------------------------------------- comparing


def check_fences(run: str, steps: list[Seen], *, ties_allowed: bool) -> list[str]:
    """Fences strictly increase with the grant order; ties only within one step, if allowed."""
    ties: list[str] = []
    last = 0
    for index, seen in enumerate(steps):
        fences = sorted(fence for fence, _ in seen.grants)
        if fences:
            assert fences[0] > last, f"{run}: step {index} granted fence {fences[0]} <= {last}"
            last = fences[-1]
        if len(set(fences)) != len(fences):
            assert ties_allowed, f"{run}: step {index} gave two grants one fence: {seen.grants}"
            ties.append(f"step {index}: {sorted(seen.grants)}")
    return ties


def describe(ops: list[Op]) -> str:
    return "\n".join(f"  {req}: {op}" for req, op in enumerate(ops))


def compare(
    ops: list[Op], model: list[Seen], run: str, steps: list[Seen], *, ordered: bool = True
) -> None:
    for index, (want, got) in enumerate(zip(model, steps, strict=True)):
        expected, seen = want.comparable(ordered=ordered), got.comparable(ordered=ordered)
        assert seen == expected, (
            f"{run} differs from the model at step {index} ({ops[index]}):\n"
            f"  model: {expected}\n  {run}: {seen}\nsequence:\n{describe(ops)}"
        )


def run_model(ops: list[Op]) -> tuple[Model, list[Seen]]:
    model = Model()
    return model, [model.step(req, op) for req, op in enumerate(ops)]


def run_engine(ops: list[Op]) -> list[Seen]:
    # A replay of the model says which request each operation names.
    engine = EngineRun()
    replay = Model()
    steps = []
    for req, op in enumerate(ops):
        steps.append(engine.step(req, op, replay))
        replay.step(req, op)
    return steps


async def run_etcd(ops: list[Op], etcd: object, prefix: str, nodes: int = 1) -> list[Seen]:
    replay = Model()
    steps = []
    async with EtcdRun.started(etcd, prefix, nodes) as run:
        for req, op in enumerate(ops):
            steps.append(await run.step(req, op, replay))
            replay.step(req, op)
    return steps


async def run_etcd_cluster(ops: list[Op], endpoints: list[str], nodes: int = 1) -> list[Seen]:
    prefix = f"/test-diff/{time.monotonic_ns()}/"
    async with EtcdGateway(GatewaySettings(endpoints, timeout=5.0)) as gateway:
        return await run_etcd(ops, gateway, prefix, nodes)


# ------------------------------------------------------------------- tests

FAST = settings(
    max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def semaphore(client: int, owner: str | None = None, wait_s: int | None = 40) -> Acquire:
    return Acquire(client, "b", "exclusive", 2, owner, 30, wait_s)


#: Queued twice with one owner (alice, two connections): the second grant
#: takes the first back, so the waiter behind it gets the slot left free.
TAKEN_BACK_FROM_THE_QUEUE: list[Op] = [
    semaphore(2, wait_s=None),
    semaphore(3, wait_s=None),
    semaphore(0, "j1"),
    semaphore(1, "j1"),
    semaphore(2),
    Release(0, live=False),
    Release(1, live=False),
    Advance(30),
]
#: Readers behind a writer go together when it leaves; the writer behind them waits.
SHARED_GROUP: list[Op] = [
    Acquire(0, "a", "exclusive", 1, None, 20, None),
    *[Acquire(c, "a", "shared", 1, None, 20, 20) for c in (1, 2, 3)],
    Acquire(0, "a", "exclusive", 1, None, 20, 40),
    Acquire(2, "a", "shared", 1, None, 20, 40),
    Release(0, live=False),
    Advance(20),
]


@FAST
@example(TAKEN_BACK_FROM_THE_QUEUE)
@example(SHARED_GROUP)
@given(operations)
def test_the_engine_and_the_etcd_backend_decide_as_the_model(ops: list[Op]) -> None:
    _, want = run_model(ops)
    check_fences("model", want, ties_allowed=False)
    engine = run_engine(ops)
    compare(ops, want, "engine", engine)
    check_fences("engine", engine, ties_allowed=False)
    etcd = trio.run(run_etcd, ops, FakeEtcd(), "/diff/")
    compare(ops, want, "etcd (fake)", etcd)
    check_fences("etcd (fake)", etcd, ties_allowed=False)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(TAKEN_BACK_FROM_THE_QUEUE)
@example(SHARED_GROUP)
@given(operations)
def test_two_etcd_hosts_decide_as_the_model(ops: list[Op]) -> None:
    """Clients on two hosts: hand-offs across hosts, re-takes from the other host."""
    _, want = run_model(ops)
    etcd = trio.run(run_etcd, ops, FakeEtcd(), "/diff/", 2)
    compare(ops, want, "etcd (fake, two hosts)", etcd, ordered=False)
    check_fences("etcd (fake, two hosts)", etcd, ties_allowed=False)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))
@given(operations)
def test_the_etcd_backend_on_a_real_cluster_decides_as_the_model(
    etcd_cluster: EtcdCluster, ops: list[Op]
) -> None:
    """The slow variant: the etcd run on the session's real cluster, a few examples."""
    _, want = run_model(ops)
    etcd = trio.run(run_etcd_cluster, ops, etcd_cluster.endpoints)
    compare(ops, want, "etcd (real)", etcd)
    check_fences("etcd (real)", etcd, ties_allowed=False)


@settings(max_examples=examples(20), deadline=None, suppress_health_check=list(HealthCheck))
@given(operations)
def test_two_etcd_hosts_on_a_real_cluster_decide_as_the_model(
    etcd_cluster: EtcdCluster, ops: list[Op]
) -> None:
    """The slow variant with clients on two hosts sharing the real cluster."""
    _, want = run_model(ops)
    etcd = trio.run(run_etcd_cluster, ops, etcd_cluster.endpoints, 2)
    compare(ops, want, "etcd (real, two hosts)", etcd, ordered=False)
    check_fences("etcd (real, two hosts)", etcd, ties_allowed=False)
