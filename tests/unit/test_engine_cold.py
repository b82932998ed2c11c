"""Cold keys: leases taken up at start and loaded only when first needed (fake clock).

The promise of :meth:`LockEngine.restore_cold` is that nobody can tell it
from :meth:`LockEngine.restore`: the hypothesis test runs the same requests
against both and compares every answer and every row written.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockd.daemon.cold import ColdLeases
from lockd.daemon.engine import EXCLUSIVE, SHARED, Busy, Lease, LockEngine
from tests.depth import examples
from tests.engine_twins import apply_op, written

from .test_engine import grant, make_engine, park


def cold_of(leases: list[Lease]) -> ColdLeases:
    ordered = sorted(leases, key=lambda lease: (lease.key, lease.slot))
    return ColdLeases.of((x.key.encode(), x.expires_at) for x in ordered)


class Loader:
    """The store's part: fresh copies of a key's stored leases, and who asked for what."""

    def __init__(self, leases: list[Lease]) -> None:
        self.rows = sorted(leases, key=lambda lease: (lease.key, lease.slot))
        self.asked: list[list[str]] = []

    def __call__(self, keys: list[str]) -> Iterable[Lease]:
        self.asked.append(list(keys))
        wanted = set(keys)
        return [copy.copy(lease) for lease in self.rows if lease.key in wanted]

    @property
    def loaded(self) -> list[str]:
        return [key for keys in self.asked for key in keys]


def cold_engine(leases: list[Lease], now: int = 0, fence: int = 0) -> tuple[LockEngine, Loader]:
    e = make_engine(fence=fence)
    loader = Loader(leases)
    e.restore_cold(cold_of(leases), loader, now)
    return e, loader


def stored(key: str, fence: int, expires_at: int, owner: str | None = None, **kw: Any) -> Lease:
    return Lease(key, f"h-{key}-{fence}", fence, owner, "user:a", 1000, expires_at, **kw)


# ---------------------------------------------------------------- ColdLeases


def take_due(cold: ColdLeases, now: int, limit: int) -> list[str]:
    """What the engine does with due keys: read their rows, then take them."""
    keys = cold.due(now, limit)
    assert cold.due(now, limit) == keys  # looking takes nothing
    for key in keys:
        assert cold.take(key)
    return keys


def test_cold_leases_find_take_and_list_keys_in_order() -> None:
    keys = [b"a", b"b", b"b", b"c\xc3\xa9", b"d"]  # "b" has two holders
    cold = ColdLeases.of(zip(keys, [50, 20, 30, 10, 40], strict=True))
    assert (cold.key_count, cold.lease_count) == (4, 5)
    assert "b" in cold and "cé" in cold and "bb" not in cold and "" not in cold
    assert list(cold.keys_from("b", inclusive=True)) == ["b", "cé", "d"]
    assert list(cold.keys_from("b", inclusive=False)) == ["cé", "d"]
    assert cold.take("b") and not cold.take("b") and "b" not in cold
    assert (cold.key_count, cold.lease_count) == (3, 3)
    assert list(cold.keys_from("a", inclusive=True)) == ["a", "cé", "d"]


def test_cold_deadlines_come_in_time_order_and_skip_taken_keys() -> None:
    cold = ColdLeases.of([(b"a", 30), (b"b", 10), (b"c", 10), (b"d", 20)])
    assert cold.next_deadline() == 10
    assert take_due(cold, 15, limit=1) == ["b"]  # ties in key order
    assert cold.take("d")
    assert take_due(cold, 100, limit=10) == ["c", "a"]
    assert cold.next_deadline() is None and cold.key_count == 0


def test_a_key_with_several_leases_is_taken_whole_by_its_first_deadline() -> None:
    cold = ColdLeases.of([(b"a", 99), (b"k", 50), (b"k", 5), (b"k", 70)])
    assert take_due(cold, 5, limit=10) == ["k"]
    assert (cold.key_count, cold.lease_count, cold.next_deadline()) == (1, 1, 99)


@settings(max_examples=examples(50), deadline=None)
@given(
    counts=st.lists(st.integers(1, 3), min_size=1, max_size=300),
    probes=st.lists(st.integers(0, 700), max_size=20),
    batch=st.integers(1, 40),
)
def test_cold_keys_are_found_through_the_posts_as_in_a_sorted_list(
    counts: list[int], probes: list[int], batch: int
) -> None:
    """Keys with several leases straddle the first-level index's posts and the batches."""
    keys = [f"k{2 * i:04d}" for i in range(len(counts))]  # odd numbers: absent
    rows = [(k.encode(), 1) for k, n in zip(keys, counts, strict=True) for _ in range(n)]
    cold = ColdLeases.build(rows[i : i + batch] for i in range(0, len(rows), batch))
    assert (cold.key_count, cold.lease_count) == (len(keys), sum(counts))
    taken = set()
    for p in probes:
        key = f"k{p:04d}"
        assert (key in cold) == (key in keys and key not in taken)
        left = [k for k in keys if k not in taken]
        assert list(cold.keys_from(key, inclusive=True)) == [k for k in left if k >= key]
        assert list(cold.keys_from(key, inclusive=False)) == [k for k in left if k > key]
        if cold.take(key):
            taken.add(key)
    assert cold.lease_count == sum(n for k, n in zip(keys, counts, strict=True) if k not in taken)


@settings(max_examples=examples(80), deadline=None)
@given(
    deadlines=st.lists(st.lists(st.integers(-5, 60), min_size=1, max_size=3), max_size=120),
    steps=st.lists(
        st.tuples(st.sampled_from(["due", "look", "take"]), st.integers(0, 70), st.integers(1, 9)),
        max_size=40,
    ),
)
def test_cold_deadlines_come_as_from_a_sorted_list(
    deadlines: list[list[int]], steps: list[tuple[str, int, int]]
) -> None:
    """The deadline heap against a plain sort: earliest first, ties in key order.

    ``look`` is a read that failed (the keys stay cold and due); ``take`` a
    request that loads a key out of deadline order.
    """
    keys = [f"k{i:03d}" for i in range(len(deadlines))]
    rows = [(k.encode(), d) for k, ds in zip(keys, deadlines, strict=True) for d in ds]
    cold = ColdLeases.build(rows[i : i + 7] for i in range(0, len(rows), 7))
    taken: set[str] = set()

    def expected(now: int, limit: int) -> list[str]:
        first: dict[str, int] = {}
        for number, (key, deadline) in sorted(enumerate(rows), key=lambda r: (r[1][1], r[0])):
            name = key.decode()
            if deadline <= now and name not in taken:
                first.setdefault(name, number)
        return list(first)[:limit]

    for op, now, limit in steps:
        left = [d for k, ds in zip(keys, deadlines, strict=True) if k not in taken for d in ds]
        assert cold.next_deadline() == min(left, default=None)
        if op == "take":
            key = keys[now % len(keys)] if keys else "absent"
            assert cold.take(key) == (key in keys and key not in taken)
            taken.add(key)
            continue
        due = cold.due(now, limit)
        assert due == expected(now, limit)
        if op == "due":
            for key in due:
                assert cold.take(key)
            taken.update(due)
    left = zip(keys, deadlines, strict=True)
    assert cold.lease_count == sum(len(ds) for k, ds in left if k not in taken)


def test_cold_leases_refuse_keys_out_of_order() -> None:
    with pytest.raises(ValueError, match="key order"):
        ColdLeases.of([(b"b", 1), (b"a", 2)])
    with pytest.raises(ValueError, match="key order"):
        ColdLeases.build([[(b"a", 1), (b"c", 2)], [(b"b", 3)]])


def test_batches_join_into_one_index() -> None:
    """A key's leases may straddle two batches of the store's stream."""
    cold = ColdLeases.build([[(b"a", 5), (b"k", 3)], [], [(b"k", 1), (b"z", 2)]])
    assert (cold.key_count, cold.lease_count) == (3, 4)
    assert list(cold.keys_from("a", inclusive=True)) == ["a", "k", "z"]
    assert take_due(cold, 10, limit=10) == ["k", "z", "a"]


# ---------------------------------------------------------------- the engine


def test_untouched_keys_are_never_loaded() -> None:
    leases = [stored(f"k{i}", i + 1, 10_000) for i in range(50)]
    e, loader = cold_engine(leases, fence=50)
    assert (e.held_count, e.lease_count) == (50, 50)
    holder = e.status(1, "k7").holder
    assert holder is not None and (holder.handle, holder.fence) == ("h-k7-8", 8)
    assert isinstance(e.acquire(2, "k8", ttl_ms=10, principal="user:b"), Busy)
    assert e.release(3, "k9", "h-k9-10")
    assert loader.loaded == ["k7", "k8", "k9"]
    assert (e.held_count, e.lease_count) == (49, 49)
    e.check_invariants()


def test_a_failed_read_leaves_the_key_cold_and_nothing_lost() -> None:
    e, loader = cold_engine([stored("k", 1, 100), stored("z", 2, 10_000)], fence=2)

    def failing(keys: list[str]) -> Iterable[Lease]:
        raise OSError("disk on fire")

    e._load = failing
    with pytest.raises(OSError):
        e.status(1, "z")
    with pytest.raises(OSError):
        e.advance(200)
    assert "z" in e._cold and "k" in e._cold and e.held_count == 2
    e._load = loader
    e.advance(200)
    assert [lease.key for lease in e.drain().expired] == ["k"]
    assert e.release(201, "z", "h-z-2")
    e.check_invariants()


def test_a_failed_group_commit_undoes_its_batch_around_a_cold_load() -> None:
    """Loading a key is no part of the batch: the batch rolls back whole, the key stays loaded.

    It used to end the batch's record: the grant before the load stayed in
    memory (and in the rows still to write) while its client was told
    STORAGE_UNAVAILABLE.
    """
    e, loader = cold_engine([stored("cold", 1, 10_000), stored("other", 2, 10_000)], fence=2)
    grant(e.acquire(1, "hot", ttl_ms=100, principal="user:b"))  # first request of the batch
    assert e.release(2, "cold", "h-cold-1")  # loads "cold", then releases it
    assert e.status(3, "other").holder is not None  # loads "other" (a read, no request)
    assert loader.loaded == ["cold", "other"]
    e.rollback()  # the batch's commit failed
    assert e.status(4, "hot").holder is None
    holder = e.status(4, "cold").holder
    assert holder is not None and holder.handle == "h-cold-1"
    assert not e.pending().rows
    assert (e.held_count, e.lease_count) == (2, 2)
    assert loader.loaded == ["cold", "other"]  # loaded once, still loaded
    e.check_invariants()


def test_a_cold_key_is_loaded_before_a_request_decides_on_it() -> None:
    e, _ = cold_engine([stored("k", 7, 10_000, owner="run")], fence=7)
    # A re-take needs the key's owner index: loaded first, so it is a re-take.
    again = grant(e.acquire(1, "k", ttl_ms=100, principal="user:a", owner="run"))
    assert again.fence == 8 and e.drain().retakes == 1
    assert e.renew(2, "k", "h-k-7", 100) is None  # the old handle is fenced
    waiter = park(e.acquire(3, "k", ttl_ms=100, principal="user:b", wait_ms=1000))
    assert e.release(4, "k", again.handle) and waiter.lease is not None
    e.check_invariants()


def test_cold_leases_expire_at_their_deadline_in_order() -> None:
    leases = [stored("a", 1, 300), stored("b", 2, 100), stored("c", 3, 200)]
    e, loader = cold_engine(leases, fence=3)
    assert e.next_deadline() == 100
    e.advance(250)
    changes = e.drain()
    assert [lease.key for lease in changes.expired] == ["b", "c"]
    assert changes.rows == {("b", 0): None, ("c", 0): None}
    assert e.status(250, "a").holder is not None and e.held_count == 1
    assert loader.loaded == ["b", "c", "a"]
    e.check_invariants()


def test_leases_run_out_while_down_expire_in_passes_at_restore() -> None:
    leases = [stored(f"k{i:04d}", i + 1, 5) for i in range(600)]
    e, _ = cold_engine(leases, now=1000, fence=600)
    expired = len(e.drain().expired)
    assert e.behind and expired < 600  # a bounded pass
    passes = 0
    while e.behind:
        e.advance(1000, 250)
        expired += len(e.drain().expired)
        passes += 1
    assert e.held_count == 0 and expired == 600 and passes == 2  # 250 a pass
    e.check_invariants()


def test_list_shows_cold_keys_without_loading_them_for_good() -> None:
    leases = [stored(f"k{i}", i + 1, 10_000) for i in range(6)]
    leases.append(stored("k3", 9, 10_000, slot=1, mode=SHARED))
    leases[3].mode = SHARED
    e, _ = cold_engine(leases, fence=9)
    grant(e.acquire(0, "k25", ttl_ms=100, principal="user:b"))  # a loaded key between
    e.release(0, "k1", "h-k1-2")
    page = e.list_held(1, limit=3, after="k0")
    assert [s.key for s in page.locks] == ["k2", "k25", "k3"] and page.next == "k3"
    k3 = page.locks[2]
    assert (k3.mode, k3.holder_count, [h.fence for h in k3.holders]) == (SHARED, 2, [4, 9])
    assert "k3" in e._cold  # still cold: shown from its rows
    rest = e.list_held(1, after=page.next)
    assert [s.key for s in rest.locks] == ["k4", "k5"] and rest.next is None
    assert [s.key for s in e.list_held(1, prefix="k2").locks] == ["k2", "k25"]
    e.check_invariants()


def test_list_while_behind_skips_cold_keys_that_ran_out() -> None:
    leases = [stored(f"k{i:03d}", i + 1, 10 if i % 2 else 5000) for i in range(400)]
    e, _ = cold_engine(leases, fence=400)
    e.advance(20, budget=10)
    assert e.behind
    page = e.list_held(20, limit=1000)
    assert [s.key for s in page.locks] == [f"k{i:03d}" for i in range(0, 400, 2)]
    e.check_invariants()


# ------------------------------------------------ the same as restore(), always

KEYS = ["a", "b", "bb", "c", "é"]


@st.composite
def stored_leases(draw: st.DrawFn) -> list[Lease]:
    fences = itertools.count(1)
    leases = []
    for key in draw(st.lists(st.sampled_from(KEYS), unique=True)):
        mode = draw(st.sampled_from([EXCLUSIVE, SHARED]))
        count = draw(st.integers(1, 3)) if mode == SHARED else 1
        for slot in sorted(draw(st.sets(st.integers(0, 4), min_size=count, max_size=count))):
            owner = draw(st.sampled_from([None, "run"]))
            leases.append(
                Lease(
                    key,
                    f"stored-{next(fences)}",
                    next(fences),
                    owner,
                    f"user:{slot}",  # one hold per principal and owner, as the engine keeps it
                    100,
                    draw(st.integers(0, 400)),
                    mode=mode,
                    slot=slot,
                )
            )
    return leases


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
    ),
    st.tuples(st.just("release"), st.sampled_from(KEYS), st.integers(0, 20)),
    st.tuples(st.just("renew"), st.sampled_from(KEYS), st.integers(0, 20)),
    st.tuples(st.just("break"), st.sampled_from(KEYS)),
    st.tuples(st.just("advance"), st.integers(1, 3)),
)


@settings(max_examples=examples(150), deadline=None)
@given(leases=stored_leases(), steps=st.lists(st.tuples(st.integers(0, 60), ops), max_size=25))
def test_cold_restore_answers_exactly_as_restore(leases: list[Lease], steps: list[Any]) -> None:
    fence = max((lease.fence for lease in leases), default=0)
    eager = make_engine(fence=fence)
    eager.restore([copy.copy(lease) for lease in leases], now=0)
    cold, _ = cold_engine(leases, fence=fence)
    handles = [lease.handle for lease in leases]
    rows: list[dict[Any, Any]] = [{}, {}]
    now = 0
    for dt, op in steps:
        now += dt
        answers = []
        for e in (eager, cold):
            answers.append(apply_op(e, now, op, handles, record=e is cold))
            e.check_invariants()
        if op[0] != "advance":  # how far a bounded pass gets may differ; not what it shows
            assert answers[0] == answers[1], op
        for mine, e in zip(rows, (eager, cold), strict=True):
            mine.update(e.drain().rows)
    for mine, e in zip(rows, (eager, cold), strict=True):
        e.advance(now + 10_000)
        mine.update(e.drain().rows)
        assert e.held_count == 0 and e.lease_count == 0
    assert written(rows)[0] == written(rows)[1]


def test_held_leases_do_not_run_out_cold_or_loaded_until_released() -> None:
    """LockEngine.hold_leases (a restart's integrity check): deadlines after the hold wait.

    Leases whose deadline came before the hold run out as always; the rest,
    cold or loaded, stay until :meth:`release_leases`, so a renew judged
    late (after the check) finds its lease; a waiter's timeout is not held.
    """
    leases = [stored("before", 1, 900), stored("cold", 2, 1_500), stored("loaded", 3, 1_600)]
    e, loader = cold_engine(leases, fence=3)
    e.hold_leases(1_000)
    assert e.status(1_000, "loaded").holder is not None  # loaded now, deadline 1,600
    waiter = park(e.acquire(1_000, "loaded", ttl_ms=100, principal="user:b", wait_ms=2_000))
    # "before" ran out on the way in (900 <= the hold); the timer wakes for
    # the waiter only, not for the held leases.
    assert e.next_deadline() == 3_000
    e.advance(10_000)
    assert [lease.key for lease in e.drain().expired] == ["before"]
    assert waiter.timed_out  # its deadline (3,000) is not held
    assert e.next_deadline() is None
    assert e.status(10_000, "cold").holder is not None  # loaded at 10 s, still held
    renewed = e.renew(10_000, "cold", "h-cold-2", 1_000)
    assert renewed is not None and renewed.expires_at == 11_000
    assert e.renew(10_000, "before", "h-before-1", 1_000) is None  # it ran out before
    e.release_leases()
    assert e.next_deadline() == 1_600
    e.advance(10_001)
    assert [lease.key for lease in e.drain().expired] == ["loaded"]
    e.advance(11_000)
    assert [lease.key for lease in e.drain().expired] == ["cold"]
    assert loader.loaded == ["loaded", "before", "cold"]
    e.check_invariants()
