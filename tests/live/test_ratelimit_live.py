"""The acquire rate limit (docs/contract.md §6) on a real daemon, for real Unix users.

``acquire_per_hour = 5`` in lockd.toml. Members are throwaway users whose
clients run as separate processes (:class:`Agent`); the daemon runs as root,
so the test's own client is an ``owner``. Each test gets a fresh daemon, so
every principal starts with a full budget.

How a test tells how many attempts were counted: with ``used`` attempts
spent, ``limit - used`` more ``tryAcquire`` calls must all be granted, and
then the principal must be over the limit -- a ``tryAcquire`` gets
``RATE_LIMITED`` and a *blocking* acquire of a free key gets ``LOCK_TIMEOUT``
(neither is counted). That pins the count exactly, from both sides.

Each host counts its own callers before the backend (docs/contract.md §11), so
only the counts that depend on the store's answer (a lost key, a re-take, a
long wait in the queue) run on both backends.

The module is skipped when it cannot create users (not root, no useradd).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from lockd_client import LockClient

from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for
from lockd.testing.users import Accounts, Agent, User, missing_prerequisite, share_socket

_WHY = missing_prerequisite()
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)

LIMIT = 5
HOUR_MS = 3_600_000


@dataclass(frozen=True)
class Cast:
    alice: User
    bob: User
    admin: User
    svc: User
    admin_group: str


@pytest.fixture(scope="module")
def cast() -> Iterator[Cast]:
    with Accounts() as accounts:
        admin_group = accounts.group()
        yield Cast(
            alice=accounts.user(),
            bob=accounts.user(),
            admin=accounts.user(groups=(admin_group,)),
            svc=accounts.user(),
            admin_group=admin_group,
        )


@dataclass
class Live:
    daemon: DaemonProcess
    root: LockClient
    agents: list[Agent] = field(default_factory=list)
    _probes: itertools.count[int] = field(default_factory=itertools.count)

    def agent(self, user: User) -> Agent:
        agent = Agent(user, self.daemon.socket)
        self.agents.append(agent)
        return agent

    def spend(self, agent: Agent, count: int, prefix: str = "spend") -> None:
        """``count`` counted attempts that must all be granted (then released)."""
        for _ in range(count):
            key = f"{prefix}:{next(self._probes)}"
            handle = agent.call("try_acquire", key, 5)
            assert handle is not None, key
            assert agent.call("release", handle)["released"] is True

    def assert_exhausted(self, agent: Agent, prefix: str = "probe") -> None:
        """Over the limit: tryAcquire is RATE_LIMITED, a blocking acquire times out."""
        key = f"{prefix}:{next(self._probes)}"
        error = agent.error("try_acquire", key, 5)
        assert error.code == "RATE_LIMITED", error
        assert error.details["limit"] == LIMIT
        error = agent.error("acquire", key, 5, 0.2)
        assert error.code == "LOCK_TIMEOUT", error
        assert not self.root.status(key).held

    def assert_used(self, agent: Agent, used: int, prefix: str = "spend") -> None:
        """Exactly ``used`` attempts of ``agent`` were counted so far."""
        self.spend(agent, LIMIT - used, prefix)
        self.assert_exhausted(agent, prefix)


@pytest.fixture
def start(daemon_paths: DaemonProcess, cast: Cast) -> Iterator[Callable[..., Live]]:
    lives: list[Live] = []

    def _start(rules: str | None = None) -> Live:
        daemon_paths.write_config(
            f"acquire_per_hour = {LIMIT}\n"
            f'admin_groups = ["{cast.admin_group}"]\n'
            f'service_users = ["{cast.svc.name}"]\n'
        )
        if rules is not None:
            daemon_paths.write_rules("lock-policy.toml", rules)
        daemon_paths.start()
        share_socket(daemon_paths.socket)
        live = Live(daemon_paths, LockClient(str(daemon_paths.socket)))
        lives.append(live)
        return live

    yield _start
    for live in lives:
        for agent in live.agents:
            agent.close()
        live.root.close()
    daemon_paths.terminate()


def test_sixth_try_acquire_is_rate_limited(start: Callable[..., Live], cast: Cast) -> None:
    live = start()
    alice = live.agent(cast.alice)
    live.spend(alice, LIMIT)
    error = alice.error("try_acquire", "sixth", 5)
    assert (error.code, error.status, error.kind) == ("RATE_LIMITED", 429, "RateLimitedError")
    retry_ms = error.details["retryAfterMs"]
    # The oldest attempt was made seconds ago: room comes back in about an hour.
    assert HOUR_MS - 60_000 < retry_ms <= HOUR_MS
    assert error.details["limit"] == LIMIT
    assert error.retry_after == retry_ms / 1000 and error.limit == LIMIT
    assert not live.root.status("sixth").held


def test_limit_is_per_principal(start: Callable[..., Live], cast: Cast) -> None:
    live = start()
    alice, bob = live.agent(cast.alice), live.agent(cast.bob)
    live.spend(alice, LIMIT)
    live.assert_exhausted(alice)
    live.assert_used(bob, 0)  # alice's attempts are not bob's
    # A second connection of the same user shares the principal's budget.
    live.assert_exhausted(live.agent(cast.alice))


def test_blocking_acquire_over_the_limit_times_out_never_rate_limited(
    start: Callable[..., Live], cast: Cast
) -> None:
    live = start()
    alice = live.agent(cast.alice)
    live.spend(alice, LIMIT)
    held = live.root.try_acquire("held-by-root", 30)
    assert held is not None
    for key in ("free-key", "held-by-root"):
        for timeout, timeout_ms in ((0, 0), (0.2, 200), (1.0, 1000)):
            started = time.monotonic()
            error = alice.error("acquire", key, 5, timeout)
            waited = time.monotonic() - started
            assert (error.code, error.status, error.kind) == (
                "LOCK_TIMEOUT",
                408,
                "LockTimeoutError",
            ), error
            assert error.details == {"key": key, "timeoutMs": timeout_ms}
            # No room comes within the hour's window: it still waits its
            # timeout out (docs/contract.md §6), so a caller retrying on LOCK_TIMEOUT is paced.
            assert waited >= timeout * 0.98, (key, timeout, waited)
    assert not live.root.status("free-key").held
    assert live.root.status("held-by-root").held_by == "user:root"


@pytest.mark.both_backends
def test_attempts_that_lose_the_key_count_too(start: Callable[..., Live], cast: Cast) -> None:
    live = start()
    assert live.root.try_acquire("busy", 30) is not None
    alice = live.agent(cast.alice)
    for _ in range(LIMIT):
        assert alice.call("try_acquire", "busy", 5) is None
    live.assert_exhausted(alice)


@pytest.mark.both_backends
def test_retake_counts(start: Callable[..., Live], cast: Cast) -> None:
    live = start()
    alice = live.agent(cast.alice)
    handles = [alice.call("try_acquire", "job", 5, owner="run-1") for _ in range(LIMIT)]
    fences = [h["fence"] for h in handles]
    assert fences == sorted(set(fences)), "each re-take is a fresh grant"
    assert alice.call("release", handles[0]) == {"released": False, "reason": "not_holder"}
    live.assert_exhausted(alice)
    # Over the limit a re-take is refused too: the hold is left as it was.
    error = alice.error("acquire", "job", 5, 0.2, owner="run-1")
    assert error.code == "LOCK_TIMEOUT"
    assert live.root.status("job").fence == fences[-1]


@pytest.mark.both_backends
def test_blocking_acquire_counts_once_however_long_it_waits(
    start: Callable[..., Live], cast: Cast
) -> None:
    live = start()
    handle = live.root.try_acquire("slot", 30, owner="root-run")
    assert handle is not None
    alice = live.agent(cast.alice)
    alice.send("acquire", "slot", 5, 20)
    wait_for(lambda: live.root.status("slot").waiters == 1, 5)
    # While alice waits, the key changes hands above her (re-takes go first).
    for _ in range(3):
        handle = live.root.try_acquire("slot", 30, owner="root-run")
        assert handle is not None
    assert live.root.status("slot").waiters == 1
    assert live.root.release(handle).released
    granted = alice.receive()
    assert granted["key"] == "slot" and granted["fence"] > handle.fence
    assert alice.call("release", granted)["released"] is True
    live.assert_used(alice, 1)


def test_timed_out_blocking_acquire_counts_once(start: Callable[..., Live], cast: Cast) -> None:
    live = start()
    assert live.root.try_acquire("slot", 30) is not None
    alice = live.agent(cast.alice)
    assert alice.error("acquire", "slot", 5, 0.3).code == "LOCK_TIMEOUT"
    live.assert_used(alice, 1)


def test_owner_and_service_are_not_counted(start: Callable[..., Live], cast: Cast) -> None:
    live = start()
    for number in range(3 * LIMIT):
        handle = live.root.try_acquire(f"root:{number}", 5)
        assert handle is not None
        assert live.root.release(handle).released
    handle = live.root.acquire("root:blocking", 5, 0.2)
    assert live.root.release(handle).released

    svc = live.agent(cast.svc)
    assert svc.call("hello")["role"] == "service"
    live.spend(svc, 3 * LIMIT)
    handle = svc.call("acquire", "svc:blocking", 5, 0.2)
    assert svc.call("release", handle)["released"] is True


def test_admin_is_counted(start: Callable[..., Live], cast: Cast) -> None:
    live = start()
    admin = live.agent(cast.admin)
    assert admin.call("hello")["role"] == "admin"
    live.assert_used(admin, 0)


def test_denied_attempts_count(start: Callable[..., Live], cast: Cast) -> None:
    """Issue 21: a denial costs the daemon a rule evaluation; it counts like any attempt."""
    rules = (
        '[ruleSet]\nname = "ok-only"\nresourceType = "lock"\n\n'
        "[rules.lock]\nacquire = \"record.key.startsWith('ok:')\"\n"
    )
    live = start(rules)
    alice = live.agent(cast.alice)
    for number in range(2):
        error = alice.error("try_acquire", f"no:{number}", 5)
        assert error.code == "LOCK_ACCESS_DENIED"
    live.assert_used(alice, 2, prefix="ok")
    live.assert_used(live.agent(cast.bob), 0, prefix="ok")  # bob's budget is his own


def test_rate_limited_replies_leave_the_daemon_serving(
    start: Callable[..., Live], cast: Cast
) -> None:
    """Refusals are not counted and grant nothing; the daemon and others go on."""
    live = start()
    alice = live.agent(cast.alice)
    live.spend(alice, LIMIT)
    for _ in range(3 * LIMIT):
        assert alice.error("try_acquire", "over", 5).code == "RATE_LIMITED"
    assert not live.root.status("over").held
    assert live.daemon.proc is not None and live.daemon.proc.poll() is None
    assert "Traceback" not in live.daemon.read_log()
    live.assert_used(live.agent(cast.bob), 0)
    counters = live.root.stats()["counters"]
    assert counters["rateLimited"] >= 3 * LIMIT and counters["internalErrors"] == 0
