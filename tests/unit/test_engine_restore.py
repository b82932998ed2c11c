"""A restore in chunks between requests: answers from the first request on (fake clock).

:meth:`LockEngine.restore_lazily` answers before it has read the stored
leases: a key past the chunks read so far is read from the store when a
request needs it, and :meth:`LockEngine.restore_step` skips the rows of
keys the engine took up meanwhile. The hypothesis test runs the same
requests against an eager :meth:`LockEngine.restore` and a lazy restore
whose chunks come between them, and compares every answer and every row.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockd.daemon import engine as engine_module
from lockd.daemon.engine import Lease, LockEngine
from tests.depth import examples
from tests.engine_twins import apply_op, written

from .test_engine import make_engine
from .test_engine_cold import ops, stored, stored_leases
from .test_engine_demote import FakeStore


class ChunkedStore(FakeStore):
    """The fake store, read in chunks of about ``rows`` rows (whole keys), as Store does."""

    def __init__(self, leases: list[Lease], rows: int = 2) -> None:
        super().__init__()
        self.rows = {(lease.key, lease.slot): copy.copy(lease) for lease in leases}
        self.chunk = rows
        self.chunks = 0

    def deadlines_after(self, after: str | None) -> tuple[list[tuple[bytes, int]], str | None]:
        self.chunks += 1
        ids = [r for r in sorted(self.rows) if after is None or r[0] > after]
        taken = ids[: self.chunk]
        if len(ids) > self.chunk:  # whole keys: the last key's other rows too
            taken += [r for r in ids[self.chunk :] if r[0] == taken[-1][0]]
        rows = [(key.encode(), self.rows[(key, slot)].expires_at) for key, slot in taken]
        more = len(taken) < len(ids)
        return rows, taken[-1][0] if more else None


def lazy_engine(leases: list[Lease], fence: int = 0) -> tuple[LockEngine, ChunkedStore]:
    e = make_engine(fence=fence)
    store = ChunkedStore(leases)
    e.restore_lazily(store.deadlines_after, store.leases_of)
    return e, store


def test_a_stored_key_answers_before_its_chunk_is_read() -> None:
    e, store = lazy_engine([stored("a", 1, 100), stored("b", 2, 100), stored("c", 3, 100)])
    assert e.restoring
    st = e.status(0, "c")
    assert st.holder_count == 1 and st.holders[0].fence == 3 and store.chunks == 0
    assert e.acquire(0, "c", ttl_ms=10, principal="user:b").__class__.__name__ == "Busy"
    e.drain()
    while not e.restore_step(0):
        pass
    assert not e.restoring and e.held_count == 3 and e.lease_count == 3
    e.check_invariants()


def test_rows_of_keys_taken_up_meanwhile_are_skipped() -> None:
    leases = [stored(k, i + 1, 100) for i, k in enumerate(["a", "b", "c", "d"])]
    e, store = lazy_engine(leases, fence=4)
    assert e.release(0, "c", "h-c-3")  # read from the store, then let go
    e.status(0, "d")  # read, kept hot
    store.apply(e.drain())
    e.finish_restore(0)
    assert e.held_count == 3 and e.lease_count == 3
    assert not e.status(0, "c").holders
    e.check_invariants()


def test_deadlines_come_once_the_last_chunk_is_in() -> None:
    e, _ = lazy_engine([stored("a", 1, 50), stored("b", 2, 500)], fence=2)
    assert e.next_deadline() is None
    e.finish_restore(100)  # "a" ran out while lockd was down: expired at once
    changes = e.drain()
    assert [lease.key for lease in changes.expired] == ["a"]
    assert e.next_deadline() == 500 and e.lease_count == 1


def test_a_list_reads_every_chunk_first() -> None:
    e, _ = lazy_engine([stored(f"k{i}", i + 1, 100) for i in range(7)], fence=7)
    page = e.list_held(0, limit=100)
    assert [s.key for s in page.locks] == [f"k{i}" for i in range(7)] and not e.restoring


def test_a_step_with_uncommitted_changes_is_refused() -> None:
    e, _ = lazy_engine([stored("a", 1, 100)], fence=1)
    e.acquire(0, "z", ttl_ms=10, principal="user:a")
    with pytest.raises(RuntimeError):
        e.restore_step(0)


@settings(max_examples=examples(200), deadline=None)
@given(
    leases=stored_leases(),
    steps=st.lists(st.tuples(st.integers(0, 60), ops, st.booleans()), max_size=25),
)
def test_lazy_restore_answers_exactly_as_restore(leases: list[Lease], steps: list[Any]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "HOT_KEYS", 2)  # demotion in the mix too
        patch.setattr(engine_module, "DEMOTE_RETRY_MS", 0)
        compare_with_eager(leases, steps)


def compare_with_eager(leases: list[Lease], steps: list[Any]) -> None:
    fence = max((lease.fence for lease in leases), default=0)
    eager = make_engine(fence=fence)
    eager.restore([copy.copy(lease) for lease in leases], now=0)
    lazy, store = lazy_engine(leases, fence=fence)
    handles = [lease.handle for lease in leases]
    rows: list[dict[Any, Any]] = [dict(eager.drain().rows), {}]
    now = 0
    for dt, op, step in steps:
        now += dt
        answers = []
        for e in (eager, lazy):
            answers.append(apply_op(e, now, op, handles, record=e is lazy))
            e.check_invariants()
        if op[0] != "advance":  # how far a bounded pass gets may differ; not what it shows
            assert answers[0] == answers[1], op
        rows[0].update(eager.drain().rows)
        changes = lazy.drain()
        store.apply(changes)
        rows[1].update(changes.rows)
        lazy.demote(now)
        if step:
            lazy.restore_step(now)
            lazy.check_invariants()
    lazy.finish_restore(now)
    for mine, e in zip(rows, (eager, lazy), strict=True):
        e.advance(now + 10_000)
        mine.update(e.drain().rows)
        assert e.held_count == 0 and e.lease_count == 0
    assert written(rows)[0] == written(rows)[1]
