"""Would this wait close a cycle of waits? The deadlock check of docs/contract.md §12.

The parties are connections: a connection waits while it has a parked
acquire, and it keeps every hold it took (whether or not the hold is bound
to it with ``releaseOnClose``: a hold used from another connection through
its handle still belongs to the connection that took it). A parked waiter
adds edges from its connection to the connections it cannot get past.
Only *hard* edges are drawn -- a party whose own progress the waiter
needs, whatever else happens -- so every cycle found is a real deadlock
under that model (PostgreSQL's deadlock.c draws the same kind of edge for
a lock held in a conflicting mode; lockd never reorders a queue, so it
needs no soft edges to rearrange). :func:`blockers` says which, per key:

- a key with limit 1 (exclusive or shared): every holder whose mode
  conflicts with the waiter's (either of the two is exclusive), and every
  waiter queued ahead of it whose mode conflicts too -- no overtaking means
  the waiter needs that one to be granted and to release first. A shared
  waiter behind shared waiters draws no edge to them: they are granted
  together.
- a semaphore (limit above 1): the waiter needs *one* slot, from whichever
  party lets go first, so it waits for a single party only when every
  holder and every waiter ahead of it is that one connection. Holders on
  several connections draw no edge: a cycle through one slot of a
  semaphore is not seen (it ends when a timeout runs out).
- a hold with no taking connection (taken up after a daemon restart)
  draws no edge: nobody known waits behind it.
- a connection never waits for itself: one connection is often shared by
  the threads or tasks of one program (the clients pipeline), so a wait
  behind a hold of the same connection is ordinary contention.

:func:`find_cycle` runs only when a blocking acquire is about to park
(never on the uncontended path) and visits at most ``max_visited``
connections and reads at most ``MAX_STEPS`` holders and waiters in all (a
:class:`Budget` shared by every :func:`blockers` of one check): a long
plain queue costs one bounded walk per park, not a walk per waiter. Past
either bound it reports what it has found, or no cycle (the wait then ends
by its timeout, as before); edges left unread only hide cycles, never make
one up. Nothing here does I/O or keeps state.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final

from lockd.core.admission import EXCLUSIVE

#: connections :func:`find_cycle` visits at most before it gives up.
MAX_VISITED: Final = 10_000
#: holders and waiters one check reads at most, over all its keys.
MAX_STEPS: Final = 256


class Budget:
    """How many more holders and waiters one check may read."""

    __slots__ = ("left",)

    def __init__(self, steps: int = MAX_STEPS) -> None:
        self.left = steps

    @property
    def spent(self) -> bool:
        return self.left <= 0


#: one party on a key: its mode and its connection (None when unknown).
Party = tuple[str, int | None]


def conflicts(mode: str, other_mode: str) -> bool:
    """Do two holds of a limit-1 key exclude each other?"""
    return mode == EXCLUSIVE or other_mode == EXCLUSIVE


def blockers(
    mode: str,
    limit: int,
    holders: Iterable[Party],
    ahead: Iterable[Party],
    *,
    conn: int,
    budget: Budget | None = None,
) -> set[int]:
    """The connections a waiter of ``conn`` on one key has hard edges to.

    ``holders`` are the key's holders, ``ahead`` the waiters queued before
    this one (its position if it parks now: the whole queue), each as
    (mode, connection); both are read lazily, one step of ``budget`` each,
    and no further once it is spent (a semaphore read in part draws no
    edge). The rules are the module's.
    """
    budget = budget if budget is not None else Budget()
    parties = itertools.chain(holders, ahead)
    if limit > 1:
        conns: set[int | None] = set()
        for _, party_conn in parties:
            if budget.spent or (party_conn not in conns and conns):
                return set()
            budget.left -= 1
            conns.add(party_conn)
        (only,) = conns or {None}
        return {only} if only is not None and only != conn else set()
    found: set[int] = set()
    for party_mode, party_conn in parties:
        if budget.spent:
            break
        budget.left -= 1
        if party_conn is not None and party_conn != conn and conflicts(mode, party_mode):
            found.add(party_conn)
    return found


def find_cycle(
    conn: int,
    key: str,
    first: Iterable[int],
    waits_of: Callable[[int], Iterable[tuple[str, Iterable[int]]]],
    *,
    max_visited: int = MAX_VISITED,
    budget: Budget | None = None,
) -> list[str] | None:
    """The keys of the cycle a new wait of ``conn`` on ``key`` would close, or None.

    ``first`` are the new waiter's :func:`blockers`; ``waits_of(c)`` gives,
    for every parked waiter of connection ``c``, its key and its blockers
    (computed with ``budget``, which ends the search once spent).
    The answer starts with ``key`` and follows the waits in order back to
    ``conn``: ``[key, k2, ...]`` means ``conn`` waits on ``key`` for a
    connection that waits on ``k2`` for ... a connection ``conn`` blocks.
    Breadth first, so the shortest cycle is named.
    """
    # came_from[c] = (the connection whose wait reached c, the key it waits on)
    came_from: dict[int, tuple[int, str]] = {}
    frontier: deque[int] = deque()
    for party in first:
        if party != conn and party not in came_from:
            came_from[party] = (conn, key)
            frontier.append(party)
    while frontier:
        if len(came_from) > max_visited or (budget is not None and budget.spent):
            return None
        waiting = frontier.popleft()
        for waited_key, parties in waits_of(waiting):
            for party in parties:
                if party == conn:
                    return _keys_back(came_from, waiting, [waited_key])
                if party != waiting and party not in came_from:
                    came_from[party] = (waiting, waited_key)
                    frontier.append(party)
    return None


def _keys_back(came_from: dict[int, tuple[int, str]], last: int, tail: list[str]) -> list[str]:
    """Walk the BFS tree from ``last`` back to the start: the keys in wait order."""
    keys = tail
    party = last
    while party in came_from:
        party, waited_key = came_from[party]
        keys.append(waited_key)
    keys.reverse()
    return keys
