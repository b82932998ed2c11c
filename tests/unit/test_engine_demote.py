"""Demotion: settled keys leave memory for the store and come back unseen (fake clock).

:meth:`LockEngine.demote` keeps only a key and its first deadline of the
keys it sends back (:mod:`lockd.daemon.demoted`); the engine reads their
rows again when it needs them. The promise is the one of cold keys: nobody
can tell. The hypothesis test runs the same requests against an engine that
never demotes and one that demotes after every commit, and compares every
answer, every woken waiter and every row written.
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockd.daemon import engine as engine_module
from lockd.daemon.cold import ColdLeases
from lockd.daemon.demoted import MAX_DEADLINE, DemotedKeys, _pop, _push
from lockd.daemon.engine import EXCLUSIVE, SHARED, Changes, Lease, LockEngine
from tests.depth import examples
from tests.engine_twins import apply_op, written

from .test_engine import grant, make_engine, park


class FakeStore:
    """The committed rows, as the store keeps them; the loader reads copies."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], Lease] = {}
        self.reads = 0

    def apply(self, changes: Changes) -> None:
        for row_id, lease in changes.rows.items():
            if lease is None:
                self.rows.pop(row_id, None)
            else:
                self.rows[row_id] = copy.copy(lease)

    def leases_of(self, keys: list[str]) -> Iterable[Lease]:
        self.reads += 1
        wanted = set(keys)
        return [copy.copy(self.rows[r]) for r in sorted(self.rows) if r[0] in wanted]


def demoting_engine(fence: int = 0) -> tuple[LockEngine, FakeStore]:
    e = make_engine(fence=fence)
    store = FakeStore()
    e.restore_cold(ColdLeases(), store.leases_of, 0)
    return e, store


def commit(e: LockEngine, store: FakeStore, now: int) -> tuple[Changes, int]:
    changes = e.drain()
    store.apply(changes)
    return changes, e.demote(now)


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "HOT_KEYS", 2)
    monkeypatch.setattr(engine_module, "IDLE_MS", 50)


# ------------------------------------------------------------ DemotedKeys


def test_array_heap_pops_in_order() -> None:
    heap = array("Q")
    values = [5, 3, 9, 1, 1, 8, 2, 7, 0, 6]
    for value in values:
        _push(heap, value)
    assert [_pop(heap) for _ in values] == sorted(values)


def test_demoted_keys_find_take_list_and_come_due_in_time_order() -> None:
    d = DemotedKeys()
    assert d.add("b", 30, 1) and d.add("a", 20, 2) and d.add("é", 10, 1)
    assert (d.key_count, d.lease_count) == (3, 4)
    assert "a" in d and "c" not in d
    assert list(d.keys_from("a", inclusive=False)) == ["b", "é"]
    assert d.next_deadline() == 10
    assert d.due(25, 10) == ["é", "a"]
    assert d.due(25, 10) == ["é", "a"]  # looking takes nothing
    assert d.take("a") and not d.take("a")
    assert (d.key_count, d.lease_count) == (2, 2)
    assert d.due(40, 10) == ["é", "b"]
    assert d.take("é") and d.take("b")
    assert d.next_deadline() is None and d.due(100, 10) == []


def test_demoted_slots_are_reused_once_their_entry_is_gone() -> None:
    d = DemotedKeys()
    d.add("a", 10, 1)
    d.take("a")
    assert d.next_deadline() is None  # the dead entry leaves, its slot is free
    d.add("b", 20, 1)
    assert len(d._slot_keys) == 1 and d.due(20, 5) == ["b"]


def test_a_key_demoted_after_a_look_ahead_comes_due_at_its_own_deadline() -> None:
    """due() takes entries off the heap up to the first one not due; one added
    after that with an earlier deadline must not wait behind them (hypothesis
    found it: a demoted key's leases outlived their TTL until a later key's
    deadline, and ``list`` showed them held)."""
    keys = DemotedKeys()
    keys.add("b", 40, 1)
    keys.add("c", 300, 1)
    assert keys.due(40, 10) == ["b"]  # looked at c (300) on the way
    assert keys.take("b")
    assert keys.add("a", 100, 1)
    assert keys.next_deadline() == 100
    assert keys.due(100, 10) == ["a"]
    assert keys.take("a")
    assert keys.next_deadline() == 300 and keys.due(300, 10) == ["c"]


def test_a_deadline_that_does_not_fit_is_refused() -> None:
    d = DemotedKeys()
    assert not d.add("a", MAX_DEADLINE + 1, 1) and not d.add("a", -1, 1)
    assert d.key_count == 0


# ------------------------------------------------------------ the engine


def test_keys_beyond_the_hot_set_are_demoted_and_answer_as_before(small: None) -> None:
    e, store = demoting_engine()
    leases = [grant(e.acquire(0, f"k{i}", ttl_ms=1000, principal="user:a")) for i in range(5)]
    _, demoted = commit(e, store, 0)
    assert demoted == 3 and e.held_count == 5 and e.lease_count == 5
    assert len(e._keys) == 2
    e.check_invariants()
    reads = store.reads
    st = e.status(1, "k0")
    assert st.holder_count == 1 and st.holders[0].fence == leases[0].fence
    assert store.reads == reads + 1
    assert e.renew(2, "k1", leases[1].handle, 1000) is not None
    assert e.release(2, "k2", leases[2].handle)
    e.check_invariants()


def test_idle_keys_are_demoted_even_when_few(small: None) -> None:
    e, store = demoting_engine()
    grant(e.acquire(0, "k", ttl_ms=10_000, principal="user:a"))
    assert commit(e, store, 0)[1] == 0
    assert commit(e, store, 49)[1] == 0
    assert commit(e, store, 51)[1] == 1
    assert e.held_count == 1 and not e._keys


def test_an_idle_key_ending_soon_runs_out_hot(small: None) -> None:
    e, store = demoting_engine()
    grant(e.acquire(0, "k", ttl_ms=80, principal="user:a"))
    commit(e, store, 0)
    assert commit(e, store, 51)[1] == 0  # ends within IDLE_MS: no read for its expiry
    e.advance(80)
    changes, _ = commit(e, store, 80)
    assert [lease.key for lease in changes.expired] == ["k"] and e.held_count == 0


def test_waiters_and_connection_bound_leases_keep_their_key(small: None) -> None:
    e, store = demoting_engine()
    grant(e.acquire(0, "queued", ttl_ms=1000, principal="user:a"))
    commit(e, store, 0)
    park(e.acquire(0, "queued", ttl_ms=1000, principal="user:b", wait_ms=500, conn=2))
    commit(e, store, 0)
    grant(e.acquire(0, "bound", ttl_ms=1000, principal="user:a", conn=1, release_on_close=True))
    for i in range(4):
        grant(e.acquire(0, f"k{i}", ttl_ms=1000, principal="user:a"))
    commit(e, store, 0)
    assert {"queued", "bound"} <= set(e._keys)
    assert [lease.key for lease in e.connection_closed(1, 1)] == ["bound"]
    e.check_invariants()


def test_nothing_is_demoted_with_uncommitted_changes(small: None) -> None:
    e, store = demoting_engine()
    for i in range(4):
        grant(e.acquire(0, f"k{i}", ttl_ms=1000, principal="user:a"))
    assert e.demote(0) == 0  # not drained: the rows may not be in the store
    assert commit(e, store, 0)[1] == 2


def test_a_demoted_key_comes_due_and_expires_from_its_rows(small: None) -> None:
    e, store = demoting_engine()
    for i in range(4):
        grant(e.acquire(0, f"k{i}", ttl_ms=100 + i, principal="user:a"))
    commit(e, store, 0)
    assert e.next_deadline() == 100
    e.advance(200)
    changes, _ = commit(e, store, 200)
    assert sorted(lease.key for lease in changes.expired) == ["k0", "k1", "k2", "k3"]
    assert e.held_count == 0 and e.lease_count == 0 and not store.rows
    e.check_invariants()


def test_a_retake_finds_the_demoted_hold(small: None) -> None:
    e, store = demoting_engine()
    first = grant(e.acquire(0, "job", ttl_ms=1000, principal="user:a", owner="run"))
    for i in range(3):
        grant(e.acquire(0, f"k{i}", ttl_ms=1000, principal="user:a"))
    commit(e, store, 0)
    assert "job" not in e._keys
    again = grant(e.acquire(1, "job", ttl_ms=1000, principal="user:a", owner="run"))
    assert again.slot == first.slot and again.fence > first.fence
    assert e.status(1, "job").holder_count == 1
    e.check_invariants()


# ------------------------------------------------ the same as never demoting

KEYS = ["a", "b", "bb", "c", "é"]

ops = st.one_of(
    st.tuples(st.just("status"), st.sampled_from(KEYS)),
    st.tuples(
        st.just("list"),
        st.sampled_from(["", "b"]),
        st.integers(1, 3),
        st.sampled_from([None, *KEYS]),
    ),
    st.tuples(
        st.just("acquire"),
        st.sampled_from(KEYS),
        st.sampled_from([EXCLUSIVE, SHARED]),
        st.sampled_from([None, "run"]),
        st.sampled_from([None, 0, 30]),  # wait_ms
        st.sampled_from([0, 0, 0, 0, 0, 1, 2]),  # connection (0: not bound)
        st.sampled_from([40, 300, 5000]),  # ttl
    ),
    st.tuples(st.just("release"), st.sampled_from(KEYS), st.integers(0, 30)),
    st.tuples(st.just("renew"), st.sampled_from(KEYS), st.integers(0, 30)),
    st.tuples(st.just("break"), st.sampled_from(KEYS)),
    st.tuples(st.just("close"), st.integers(1, 2)),
    st.tuples(st.just("advance"), st.integers(1, 3)),
)


def woken(changes: Changes) -> Any:
    return [(w.id, w.timed_out, w.lease.fence if w.lease else None) for w in changes.resolved]


@settings(max_examples=examples(300), deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 30), ops), max_size=30))
def test_demoting_answers_exactly_as_keeping_everything(steps: list[Any]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "HOT_KEYS", 1)
        patch.setattr(engine_module, "IDLE_MS", 20)
        patch.setattr(engine_module, "DEMOTE_RETRY_MS", 0)
        compare_with_demotion(steps)


def compare_with_demotion(steps: list[Any]) -> None:
    plain = make_engine()
    demoting, store = demoting_engine()
    handles: list[str] = []
    rows: list[dict[Any, Any]] = [{}, {}]
    now = 0
    for dt, op in steps:
        now += dt
        answers = []
        for e in (plain, demoting):
            answers.append(apply_op(e, now, op, handles, record=e is plain))
            e.check_invariants()
        if op[0] != "advance":  # how far a bounded pass gets may differ; not what it shows
            assert answers[0] == answers[1], op
        plain_changes = plain.drain()
        demoting_changes, _ = commit(demoting, store, now)
        assert woken(plain_changes) == woken(demoting_changes)
        for mine, changes in zip(rows, (plain_changes, demoting_changes), strict=True):
            mine.update(changes.rows)
        assert plain.held_count == demoting.held_count
        assert plain.lease_count == demoting.lease_count
    for mine, e in zip(rows, (plain, demoting), strict=True):
        # The first pass may grant a waiter its key (from then on); the second ends it.
        for later in (10_000, 20_000):
            e.advance(now + later)
            changes = e.drain()
            if e is demoting:
                store.apply(changes)
            mine.update(changes.rows)
        assert e.held_count == 0 and e.lease_count == 0
    assert written(rows)[0] == written(rows)[1]
