"""The pure wait-for graph check: lockd.core.deadlock (docs/contract.md §12)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hypothesis import given
from hypothesis import strategies as st

from lockd.core import EXCLUSIVE, SHARED
from lockd.core.deadlock import Budget, blockers, find_cycle

X, S = EXCLUSIVE, SHARED


Waits = Callable[[int], Iterable[tuple[str, Iterable[int]]]]


def graph(waits: dict[int, list[tuple[str, set[int]]]]) -> Waits:
    def waits_of(conn: int) -> Iterable[tuple[str, Iterable[int]]]:
        return waits.get(conn, [])

    return waits_of


def test_two_connections_each_holding_what_the_other_wants() -> None:
    # conn 2 waits on k2 for conn 1 (which holds it); conn 1 now asks k1, held by 2.
    waits = graph({2: [("k2", {1})]})
    assert find_cycle(1, "k1", {2}, waits) == ["k1", "k2"]


def test_three_connections_in_a_ring() -> None:
    waits = graph({2: [("k2", {3})], 3: [("k3", {1})]})
    assert find_cycle(1, "k1", {2}, waits) == ["k1", "k2", "k3"]


def test_the_shortest_cycle_is_named() -> None:
    waits = graph({2: [("k2", {3}), ("k9", {1})], 3: [("k3", {1})]})
    assert find_cycle(1, "k1", {2}, waits) == ["k1", "k9"]


def test_a_long_chain_that_does_not_come_back_is_no_cycle() -> None:
    chain = {c: [(f"k{c + 1}", {c + 1})] for c in range(2, 500)}
    assert find_cycle(1, "k1", {2}, graph(chain)) is None
    chain[500] = [("back", {1})]
    found = find_cycle(1, "k1", {2}, graph(chain))
    assert found is not None and len(found) == 500 and found[-1] == "back"


def test_the_visit_bound_gives_up_quietly() -> None:
    chain = {c: [(f"k{c + 1}", {c + 1})] for c in range(2, 60)}
    chain[60] = [("back", {1})]
    assert find_cycle(1, "k1", {2}, graph(chain), max_visited=10) is None


def test_a_cycle_not_through_the_requester_is_not_its_business() -> None:
    # 2 and 3 wait for each other (somehow); 1 waits for 2: 1 closes nothing.
    waits = graph({2: [("a", {3})], 3: [("b", {2})]})
    assert find_cycle(1, "k1", {2}, waits) is None


def test_plain_queue_is_no_cycle() -> None:
    # one holder (conn 1), waiters 2, 3, 4 queued on one key: nobody waits for a waiter's holds.
    holders = [(X, 1)]
    queue = [(X, 2), (X, 3), (X, 4)]
    for position, (mode, conn) in enumerate(queue):
        assert blockers(mode, 1, holders, queue[:position], conn=conn) == {1, *range(2, conn)}
    waits = graph({c: [("k", blockers(X, 1, holders, queue[: c - 2], conn=c))] for c in (2, 3, 4)})
    first = blockers(X, 1, holders, queue, conn=5)
    assert find_cycle(5, "k", first, waits) is None


def test_exclusive_waiter_waits_for_every_shared_holder() -> None:
    assert blockers(X, 1, [(S, 1), (S, 2)], [], conn=3) == {1, 2}


def test_shared_waiter_waits_for_a_writer_but_not_beside_readers() -> None:
    assert blockers(S, 1, [(X, 1)], [], conn=3) == {1}
    # readers holding, a writer queued, a reader queued behind a reader: only the writer blocks.
    assert blockers(S, 1, [(S, 1)], [(X, 2), (S, 4)], conn=3) == {2}
    # a shared waiter behind a shared waiter behind a writer holder: the holder only.
    assert blockers(S, 1, [(X, 1)], [(S, 2)], conn=3) == {1}


def test_a_connection_never_waits_for_itself() -> None:
    assert blockers(X, 1, [(X, 1)], [(X, 1)], conn=1) == set()
    assert blockers(X, 3, [(X, 1), (X, 1), (X, 1)], [], conn=1) == set()


def test_holds_of_no_known_connection_draw_no_edge() -> None:
    assert blockers(X, 1, [(X, None), (X, 2)], [], conn=3) == {2}
    assert blockers(X, 2, [(X, None), (X, None)], [], conn=3) == set()


def test_semaphore_waits_for_one_party_only_when_it_is_the_only_one() -> None:
    assert blockers(X, 3, [(X, 1), (X, 1), (X, 1)], [], conn=2) == {1}
    assert blockers(X, 3, [(X, 1), (X, 1)], [(X, 1)], conn=2) == {1}
    # slots held by two connections: either may free one, no hard edge.
    assert blockers(X, 3, [(X, 1), (X, 1), (X, 4)], [], conn=2) == set()
    assert blockers(X, 2, [(X, 1), (X, 1)], [(X, 4)], conn=2) == set()


def test_semaphore_held_by_one_connection_closes_a_cycle() -> None:
    # conn 1 holds both slots of "pool" and waits on "k" for conn 2; conn 2 asks "pool".
    waits = graph({1: [("k", {2})]})
    first = blockers(X, 2, [(X, 1), (X, 1)], [], conn=2)
    assert find_cycle(2, "pool", first, waits) == ["pool", "k"]


@given(
    st.dictionaries(
        st.integers(1, 8),
        st.lists(st.tuples(st.sampled_from("abcd"), st.sets(st.integers(1, 8))), max_size=3),
    ),
    st.sets(st.integers(1, 8), min_size=1),
)
def test_a_named_cycle_is_a_real_path_of_waits(
    waits: dict[int, list[tuple[str, set[int]]]], first: set[int]
) -> None:
    """Whatever the graph, a cycle answered walks real edges back to the requester."""
    found = find_cycle(0, "start", first, graph(waits))
    reachable = _reaches_zero(waits, first)
    assert (found is not None) == reachable
    if found is not None:
        assert found[0] == "start"
        # each later key is one some connection on the path waits on
        assert all(any(k == key for c in waits for key, _ in waits[c]) for k in found[1:])


def _reaches_zero(waits: dict[int, list[tuple[str, set[int]]]], first: set[int]) -> bool:
    seen, stack = set(), [c for c in first if c != 0]
    while stack:
        conn = stack.pop()
        if conn in seen:
            continue
        seen.add(conn)
        for _, parties in waits.get(conn, []):
            if 0 in parties:
                return True
            stack.extend(p for p in parties if p != conn)
    return False


def test_the_step_budget_bounds_every_read_and_only_hides_edges() -> None:
    queue = [(X, c) for c in range(2, 1002)]
    budget = Budget(10)
    found = blockers(X, 1, [(X, 1)], queue, conn=5000, budget=budget)
    assert found == {1, *range(2, 11)} and budget.spent  # a subset, read in 10 steps
    # a semaphore read in part draws no edge: the unread slots may be anyone's.
    assert blockers(X, 5, [(X, 1)] * 5, [], conn=2, budget=Budget(3)) == set()
    assert blockers(X, 5, [(X, 1)] * 5, [], conn=2, budget=Budget(5)) == {1}
    # once spent, the search gives up instead of walking on.
    chain = {c: [(f"k{c + 1}", {c + 1})] for c in range(2, 60)}
    chain[60] = [("back", {1})]
    assert find_cycle(1, "k1", {2}, graph(chain), budget=Budget(0)) is None
