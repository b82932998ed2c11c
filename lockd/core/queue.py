"""Who gets the key when holders or waiters leave: the queue rules of docs/contract.md §10.

One FIFO queue per key holds every waiter, whatever its mode. Whenever a
holder leaves (release, expiry, break, connection close) or a queued waiter
leaves (timeout, cancel), the queue is served from its head: the head is
granted while it fits, then the next head, and so on; the first head that
does not fit stops the hand-out. So consecutive shared waiters are granted
together, a shared request behind an exclusive one waits (writers never
starve), and nobody overtakes a waiter that does not fit yet.

A waiter granted with the owner of a hold its principal has already (it
queued before that hold was granted, or twice) takes that hold back, as a
re-take does (docs/contract.md §1): the key's count of holders stays the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

from lockd.core.admission import fits


class Queued(Protocol):
    """What the rules read of one waiter."""

    @property
    def mode(self) -> str: ...

    @property
    def principal(self) -> str: ...

    @property
    def owner(self) -> str | None: ...


W = TypeVar("W", bound=Queued)


def woken(
    held_mode: str | None,
    held_count: int,
    limit: int,
    queue: Iterable[W],
    *,
    holds_owned: Callable[[str, str], bool],
) -> Iterator[W]:
    """The waiters the key goes to now, head first (a generator: lazy, see below).

    ``held_mode``, ``held_count`` and ``limit`` describe the holders left
    (all of one mode and limit), ``queue`` the waiters in queue order;
    ``holds_owned(principal, owner)`` says whether that principal holds the
    key with that owner now (a grant to it is a re-take: no new slot).

    Lazy on purpose: the engine grants each waiter as it is yielded and its
    ``queue`` reads the head of its live queue afresh (dropping waiters
    whose deadline has passed), so nothing is copied; a backend holding a
    read of the key takes ``list(woken(...))``. Stops at the first waiter
    that does not fit.
    """
    granted_owners: set[tuple[str, str]] = set()
    for waiter in queue:
        if not fits(waiter.mode, held_mode, held_count, limit):
            return
        owner = waiter.owner
        takes_back = owner is not None and (
            (waiter.principal, owner) in granted_owners or holds_owned(waiter.principal, owner)
        )
        yield waiter
        if owner is not None:
            granted_owners.add((waiter.principal, owner))
        if not takes_back:
            held_count += 1
        held_mode = waiter.mode
