"""One member cannot make the daemon work or write for it at everyone's cost (issue 21).

Items 3, 4 and 5, decided by plain code with clocks the tests move:

- rule evaluations are charged to the caller's own share of CPU
  (:class:`~lockd.daemon.ratelimit.RuleCpuBudget`): past it, its gated
  requests are not evaluated -- ``tryAcquire`` gets ``RATE_LIMITED``, a
  blocking acquire waits -- while everyone else is served as before;
- a denial counts against the caller's rate limit;
- a principal has at most ``max_pending_per_user`` blocking acquires
  waiting, over all its connections;
- denials are logged once per principal per interval, with counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lockd.daemon.engine import LockEngine, Parked
from lockd.daemon.memory import TrimAfterDrop
from lockd.daemon.protocol import Acquire, ProtocolError, Renew
from lockd.daemon.ratelimit import RateLimiter, RuleCpuBudget
from lockd.daemon.service import LockService, Reply, WaitForRoom
from lockd.daemon.store import Store
from lockd.identity import Caller
from lockd.logfmt import LogThrottle
from lockd.rules.policy import Decision
from lockd.testing.clock import FakeClock

ALICE = Caller("user", "alice", "member", 1001, 1001, 11, frozenset({"alice"}))
BOB = Caller("user", "bob", "member", 1002, 1002, 12, frozenset({"bob"}))
ROOT = Caller("user", "root", "owner", 0, 0, 1, frozenset({"root"}))


@dataclass
class CostlyPolicy:
    """Every member evaluation costs ``cost_s`` of CPU; keys starting ``no:`` are denied."""

    cost_s: float = 0.020
    evaluations: dict[str, int] = field(default_factory=dict)

    def decide(
        self, caller: Caller, op: str, key: str, mode: str = "exclusive", limit: int = 1
    ) -> Decision:
        if caller.role != "member":
            return Decision(True, "privileged")
        self.evaluations[caller.principal] = self.evaluations.get(caller.principal, 0) + 1
        return Decision(not key.startswith("no:"), "test rule", self.cost_s)

    def rules_result(self) -> dict[str, object]:
        return {"policy": None, "lastError": None}


@dataclass
class World:
    service: LockService
    clock: FakeClock
    policy: CostlyPolicy
    limiter: RateLimiter


@pytest.fixture
def world(tmp_path: Path) -> World:
    clock = FakeClock()
    policy = CostlyPolicy()
    limiter = RateLimiter(1_000_000)
    service = LockService(
        LockEngine(),
        Store(tmp_path / "db", "boot-1"),
        policy,
        limiter,
        clock,
        rule_cpu=RuleCpuBudget(100, burst_ms=100),
        max_pending_per_user=3,
    )
    return World(service, clock, policy, limiter)


def try_acquire(rid: int, key: str) -> Acquire:
    return Acquire(rid, "tryAcquire", key, 60_000, None, None, False)


def blocking(rid: int, key: str, timeout_ms: int = 60_000) -> Acquire:
    return Acquire(rid, "acquire", key, 60_000, timeout_ms, None, False)


def refusal(world: World, caller: Caller, req: Acquire) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        world.service.acquire(caller, 1, req, pending=0)
    return caught.value


# ----------------------------------------------------------- the CPU bucket


def test_the_bucket_lets_a_second_of_share_through_then_refills_at_its_rate() -> None:
    bucket = RuleCpuBudget(100, burst_ms=100)
    now = 0
    assert bucket.wait_ms("a", now) == 0
    for _ in range(5):
        bucket.charge("a", 20, now)
    assert bucket.wait_ms("a", now) > 0  # 100 ms spent at once: none left
    assert bucket.wait_ms("b", now) == 0  # another principal's share is its own
    bucket.charge("a", 45, now)  # an evaluation may overdraw, by what it used
    wait = bucket.wait_ms("a", now)
    assert 450 <= wait <= 451  # 45 ms of debt at 100 ms per second
    assert bucket.wait_ms("a", now + wait) == 0
    assert bucket.tracked == 1
    assert bucket.wait_ms("a", now + 5_000) == 0 and bucket.tracked == 0  # full again: forgotten


def test_the_default_bank_holds_a_first_costly_evaluation() -> None:
    """A caller's first evaluation (cel-python warming up) may cost 100 ms or more."""
    bucket = RuleCpuBudget(100)
    bucket.charge("a", 150, 0)
    assert bucket.wait_ms("a", 0) == 0
    bucket.charge("a", 150, 0)
    assert bucket.wait_ms("a", 0) == 501  # 50 ms of debt at 100 ms per second


# ------------------------------------------------- item 3: rule CPU per caller


def test_a_member_past_its_rule_cpu_is_rate_limited_and_the_others_are_not(world: World) -> None:
    served = 0
    error: ProtocolError | None = None
    for n in range(100):
        try:
            world.service.acquire(ALICE, 1, try_acquire(n, f"flood:{n}"), pending=0)
            served += 1
        except ProtocolError as exc:
            error = exc
            break
    # 100 ms of share at 20 ms per evaluation: 5 evaluations, then refused unevaluated.
    assert served == 5 and world.policy.evaluations["user:alice"] == 5
    assert error is not None and error.code == "RATE_LIMITED"
    assert error.details["reason"] == "rule_cpu" and error.details["retryAfterMs"] > 0
    assert world.policy.evaluations["user:alice"] == 5
    # Nobody else pays for it: bob's rules run, root passes, hello is open.
    assert isinstance(world.service.acquire(BOB, 2, try_acquire(1, "bob:1"), pending=0), Reply)
    assert isinstance(world.service.acquire(ROOT, 3, try_acquire(1, "root:1"), pending=0), Reply)
    # A renew of alice's is gated too (its rule would run) ...
    with pytest.raises(ProtocolError) as renew:
        world.service.answer(ALICE, Renew(9, "renew", "flood:0", "h", 1000))
    assert renew.value.code == "RATE_LIMITED"
    # ... until her share has come back.
    world.clock.now += error.details["retryAfterMs"]
    again = world.service.acquire(ALICE, 1, try_acquire(99, "flood:99"), pending=0)
    assert isinstance(again, Reply)


def test_a_blocking_acquire_past_its_rule_cpu_waits_then_is_decided(world: World) -> None:
    world.service.rule_cpu = RuleCpuBudget(10, burst_ms=10)  # one evaluation spends it
    assert isinstance(world.service.acquire(ALICE, 1, try_acquire(1, "k1"), pending=0), Reply)
    step = world.service.acquire(ALICE, 1, blocking(2, "k2"), pending=0)
    assert isinstance(step, WaitForRoom) and not step.authorized
    assert world.policy.evaluations["user:alice"] == 1  # not evaluated while waiting
    world.clock.now += step.delay_ms
    after = world.service.acquire_after_wait(ALICE, 1, blocking(2, "k2"), step)
    assert isinstance(after, Reply) and after.grant is not None
    assert world.policy.evaluations["user:alice"] == 2


def test_a_denied_attempt_counts_against_the_callers_rate_limit(world: World) -> None:
    world.service.rule_cpu = None
    world.service.ratelimiter = limiter = RateLimiter(3)
    for n in range(3):
        assert refusal(world, ALICE, try_acquire(n, f"no:{n}")).code == "LOCK_ACCESS_DENIED"
    assert limiter.used("user:alice", world.clock.now) == 3
    assert refusal(world, ALICE, try_acquire(9, "ok:1")).code == "RATE_LIMITED"
    assert isinstance(world.service.acquire(BOB, 2, try_acquire(1, "ok:2"), pending=0), Reply)


# ----------------------------------------- item 4: pending acquires per user


def test_a_user_has_at_most_max_pending_per_user_waiting_over_all_connections(
    world: World,
) -> None:
    service = world.service
    service.rule_cpu = None  # the rules' share is not under test here
    assert isinstance(service.acquire(ROOT, 9, try_acquire(1, "held"), pending=0), Reply)
    for conn in range(3):  # one each on three connections: the per-connection limit is far
        step = service.acquire(ALICE, conn, blocking(conn, "held"), pending=0)
        assert isinstance(step, Parked)
        service.wait_started(ALICE)
    error = refusal(world, ALICE, blocking(7, "held"))
    assert error.code == "RATE_LIMITED"
    assert error.details == {"retryAfterMs": 1000, "limit": 3, "reason": "max_pending_per_user"}
    # Others wait as before; root is not counted.
    assert isinstance(service.acquire(BOB, 5, blocking(1, "held"), pending=0), Parked)
    for _ in range(5):
        assert isinstance(service.acquire(ROOT, 6, blocking(1, "held"), pending=0), Parked)
        service.wait_started(ROOT)
    # A tryAcquire never waits: not counted, not refused.
    assert isinstance(service.acquire(ALICE, 1, try_acquire(8, "held"), pending=0), Reply)
    service.wait_ended(ALICE)  # one of hers ended: room for one more
    assert isinstance(service.acquire(ALICE, 4, blocking(8, "held"), pending=0), Parked)


# ------------------------------------------------- item 5: denials in the log


def test_the_log_throttle_counts_what_it_leaves_out() -> None:
    now = [0.0]
    throttle = LogThrottle(10.0, clock=lambda: now[0], max_keys=2)
    assert throttle.admit("alice") == 0
    assert [throttle.admit("alice") for _ in range(500)] == [None] * 500
    assert throttle.admit("bob") == 0  # bob's lines are his own
    now[0] = 10.0
    assert throttle.admit("alice") == 500  # the next line says how many were left out
    assert throttle.admit("alice") is None
    throttle.admit("carol")  # a third key: the one written longest ago is forgotten
    assert throttle.admit("bob") == 0


def test_denials_are_logged_once_per_principal_per_interval(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.service.rule_cpu = None
    now = [0.0]
    world.service._denial_log = LogThrottle(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="lockd.daemon.service"):
        for n in range(1000):
            refusal(world, ALICE, try_acquire(n, f"no:{n}"))
        refusal(world, BOB, try_acquire(1, "no:bob"))
        now[0] = 11.0
        refusal(world, ALICE, try_acquire(1, "no:again"))
    lines = [r.getMessage() for r in caplog.records if "event=denied" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "principal=user:alice" in lines[0] and "suppressed=0" in lines[0]
    assert "principal=user:bob" in lines[1]
    assert "principal=user:alice" in lines[2] and "suppressed=999" in lines[2]
    assert world.service.stats.counters["denials"] == 1002  # every one still counted


def test_memory_is_trimmed_as_a_flood_of_waits_ends_not_per_request() -> None:
    trims: list[int] = []
    gauge = TrimAfterDrop("waits", 1024, trim=lambda: trims.append(1))
    for pending in range(1, 2049):
        gauge.observe(pending)
    for pending in range(2047, 1000, -1):
        gauge.observe(pending)
    assert trims == [1]  # at half the high-water mark, once
    for pending in range(1000, -1, -1):
        gauge.observe(pending)
    assert trims == [1, 1]  # at 512, half of 1024; then the mark is below min_high
    small = TrimAfterDrop("waits", 1024, trim=lambda: trims.append(2))
    for pending in [*range(1, 100), *range(100, 0, -1)]:
        small.observe(pending)
    assert trims == [1, 1]  # small swings never trim
