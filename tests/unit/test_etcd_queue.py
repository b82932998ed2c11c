"""The cross-host queue rules (lockd/daemon/backends/etcd/queue.py), with hypothesis.

Besides the rules of one decision (fits, FIFO, no overtaking, shared heads
together), a simulation checks the property the watch sets exist for: when
every waiter sleeps until a key it watches is deleted, and then decides for
itself alone (as a daemon does for its own waiters), no waiter is ever left
asleep while the rules say it should hold the key (no lost wake-up), and the
holds never conflict.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from lockd.daemon.backends.etcd.queue import Claim, blockers, decide, fits
from tests.depth import examples

# A key's claims share one limit: limit 1 mixes exclusive and shared,
# limit > 1 is a semaphore (exclusive only).
limits = st.integers(min_value=1, max_value=4)


@st.composite
def claims(draw: st.DrawFn, limit: int, count: int, first_revision: int) -> list[Claim]:
    modes = ["exclusive", "shared"] if limit == 1 else ["exclusive"]
    result = []
    for i in range(count):
        mode = draw(st.sampled_from(modes))
        result.append(Claim(f"c{first_revision + i}".encode(), first_revision + i, mode, limit))
    return result


@st.composite
def key_states(draw: st.DrawFn) -> tuple[list[Claim], list[Claim]]:
    """Holds that are compatible with each other, and waiters behind them."""
    limit = draw(limits)
    candidates = draw(claims(limit, draw(st.integers(0, 5)), 1))
    holds: list[Claim] = []
    for claim in candidates:
        if fits(claim.mode, claim.limit, holds):
            holds.append(claim)
    waiters = draw(claims(limit, draw(st.integers(0, 6)), 100))
    return holds, draw(st.permutations(waiters))


def compatible(holds: Sequence[Claim]) -> bool:
    exclusive = [h for h in holds if h.mode == "exclusive"]
    if not exclusive:
        return True
    limit = exclusive[0].limit
    if limit == 1:
        return len(holds) == 1
    return len(holds) <= limit


@given(key_states())
def test_grants_fit_follow_the_queue_and_stop_at_the_first_that_does_not(
    state: tuple[list[Claim], list[Claim]],
) -> None:
    holds, waiters = state
    decision = decide(holds, waiters)
    queue = sorted(waiters, key=lambda w: w.order)
    # FIFO, nobody overtakes: the grants are a prefix of the queue.
    assert decision.granted == queue[: len(decision.granted)]
    # Safe: everything held afterwards is compatible.
    after = [*holds, *decision.granted]
    assert compatible(after)
    # As many as fit: the next head does not fit beside what is held now.
    rest = queue[len(decision.granted) :]
    if rest:
        assert not fits(rest[0].mode, rest[0].limit, after)
    # Everyone not granted waits for something, and only for keys that exist.
    assert set(decision.wake_on) == {w.etcd_key for w in rest}
    existing = {c.etcd_key for c in [*after, *rest]}
    for keys in decision.wake_on.values():
        assert keys and keys <= existing


@given(st.integers(0, 3), st.integers(1, 5))
def test_consecutive_shared_heads_are_granted_together(shared_holds: int, shared: int) -> None:
    holds = [Claim(f"h{i}".encode(), i, "shared") for i in range(shared_holds)]
    waiters = [Claim(f"s{i}".encode(), 10 + i, "shared") for i in range(shared)]
    writer = Claim(b"x", 50, "exclusive")
    late_reader = Claim(b"r", 60, "shared")
    decision = decide(holds, [*waiters, writer, late_reader])
    assert decision.granted == waiters
    # The writer waits for every shared hold; the reader behind it does not overtake.
    assert decision.wake_on[b"x"] == {h.etcd_key for h in [*holds, *waiters]}
    assert decision.wake_on[b"r"] == {b"x"}


def test_the_head_waits_for_the_holds_that_block_it() -> None:
    writer = Claim(b"w", 1, "exclusive")
    readers = [Claim(b"r1", 2, "shared"), Claim(b"r2", 3, "shared")]
    assert blockers(Claim(b"s", 9, "shared"), [writer]) == {b"w"}
    assert blockers(Claim(b"x", 9, "exclusive"), readers) == {b"r1", b"r2"}
    slots = [Claim(f"s{i}".encode(), i, "exclusive", 3) for i in range(3)]
    assert blockers(Claim(b"n", 9, "exclusive", 3), slots) == {b"s0", b"s1", b"s2"}
    assert blockers(Claim(b"n", 9, "exclusive", 3), slots[:2]) == frozenset()


def test_waiters_written_in_one_transaction_are_ordered_by_key() -> None:
    a, b = Claim(b"q/0001", 7), Claim(b"q/0002", 7)
    decision = decide([Claim(b"h", 1)], [b, a])
    assert decision.wake_on == {b"q/0001": {b"h"}, b"q/0002": {b"q/0001"}}


# --- the wake-up simulation -----------------------------------------------------


class KeySimulation:
    """One lock key in etcd, and waiters that each act only when a watched key is deleted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.revision = itertools.count(1)
        self.holds: list[Claim] = []
        self.waiters: list[Claim] = []
        self.asleep: dict[bytes, frozenset[bytes]] = {}

    def arrive(self, mode: str) -> None:
        revision = next(self.revision)
        waiter = Claim(f"w{revision}".encode(), revision, mode, self.limit)  # type: ignore[arg-type]
        self.waiters.append(waiter)
        self.wake(waiter)  # a new waiter decides for itself once, on arrival

    def end_hold(self, index: int) -> None:
        """A release, an expiry or a break."""
        if self.holds:
            gone = self.holds.pop(index % len(self.holds))
            self.deleted(gone.etcd_key)

    def leave(self, index: int) -> None:
        """A waiter whose connection closed, or whose host died."""
        if self.waiters:
            gone = self.waiters.pop(index % len(self.waiters))
            self.asleep.pop(gone.etcd_key, None)
            self.deleted(gone.etcd_key)

    def wake(self, waiter: Claim) -> None:
        """What a daemon does for one of its waiters: decide, then grant it or sleep again."""
        decision = decide(self.holds, self.waiters)
        if waiter in decision.granted:
            # The grant transaction deletes the waiter key and writes a hold.
            self.waiters.remove(waiter)
            self.asleep.pop(waiter.etcd_key, None)
            revision = next(self.revision)
            self.holds.append(Claim(f"h{revision}".encode(), revision, waiter.mode, self.limit))
            assert compatible(self.holds)
            self.deleted(waiter.etcd_key)
        else:
            self.asleep[waiter.etcd_key] = decision.wake_on[waiter.etcd_key]

    def deleted(self, etcd_key: bytes) -> None:
        woken = [w for w in self.waiters if etcd_key in self.asleep.get(w.etcd_key, ())]
        for waiter in woken:
            if waiter in self.waiters:
                self.wake(waiter)


steps = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(["exclusive", "shared"])),
        st.tuples(st.just("end_hold"), st.integers(0, 10)),
        st.tuples(st.just("leave"), st.integers(0, 10)),
    ),
    max_size=40,
)


@settings(max_examples=examples(300), deadline=None)
@given(limits, steps)
def test_no_waiter_sleeps_while_the_rules_would_grant_it(
    limit: int, script: list[tuple[str, object]]
) -> None:
    key = KeySimulation(limit)
    for step, argument in script:
        if step == "arrive":
            key.arrive(str(argument) if limit == 1 else "exclusive")
        else:
            getattr(key, step)(argument)
        # Quiescent after every step: nothing the rules would grant is asleep.
        assert decide(key.holds, key.waiters).granted == []
        assert set(key.asleep) == {w.etcd_key for w in key.waiters}
    # Everyone is granted in the end once holds end one by one (liveness).
    while key.holds:
        key.end_hold(0)
        assert decide(key.holds, key.waiters).granted == []
    assert key.waiters == []
