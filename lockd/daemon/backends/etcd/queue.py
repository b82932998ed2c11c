"""The cross-host queue of one key, decided by the core over what etcd holds.

Every daemon sees the same thing for a key: its current holds and its waiter
keys, each waiter with the create revision etcd gave it. From that alone,
without any daemon's memory, ``decide`` says

- which waiters are granted now (``decide(...).granted``): whom
  :func:`lockd.core.woken` lets in -- the head of the queue as soon as it
  fits, then each next head that fits -- and which hold each grant takes
  back (``replaces``: a waiter whose principal holds the key with its owner
  already);
- what every other waiter waits for (``decide(...).wake_on``): the keys
  whose deletion can let it move. This is etcd's mutex recipe (a waiter
  watches the waiter just before it, not the whole queue, so a release
  wakes one daemon, not all) extended to shared holds and semaphores: the
  head watches the holds that block it, every later waiter its immediate
  predecessor, which wakes it when it is granted or leaves.

Whether a request fits, and who is woken, are the core's rules
(:mod:`lockd.core`), the ones the embedded engine applies too; only what a
waiter watches is etcd's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal

from lockd import core

Mode = Literal["exclusive", "shared"]


@dataclass(frozen=True)
class Claim:
    """A hold or a waiter of one lock key, as read from etcd.

    ``etcd_key`` is the record's own etcd key (what a watcher waits to see
    deleted); ``create_revision`` is its place in the queue. Several waiter
    keys written by one transaction share a create revision; their etcd keys
    then break the tie, the same way on every host.
    """

    etcd_key: bytes
    create_revision: int
    mode: Mode = "exclusive"
    limit: int = 1
    principal: str = ""
    owner: str | None = None

    @property
    def order(self) -> tuple[int, bytes]:
        return (self.create_revision, self.etcd_key)


@dataclass(frozen=True)
class QueueDecision:
    granted: list[Claim]  # waiters to grant now, in queue order
    wake_on: dict[bytes, frozenset[bytes]]  # each other waiter -> keys whose deletion moves it
    #: granted waiter -> the hold its grant takes back (same principal and owner).
    replaces: dict[bytes, bytes] = field(default_factory=dict)


def fits(mode: Mode, limit: int, holds: Iterable[Claim]) -> bool:
    """True when a request of ``mode`` and ``limit`` can be held beside ``holds``.

    The rule is :func:`lockd.core.fits`, the one the embedded engine applies
    too; a key's holds all have one mode, so the first one speaks for all.
    """
    held = list(holds)
    return core.fits(mode, held[0].mode if held else None, len(held), limit)


def blockers(waiter: Claim, holds: Iterable[Claim]) -> frozenset[bytes]:
    """The holds whose end can make ``waiter`` fit (empty when it fits already)."""
    holds = list(holds)
    if fits(waiter.mode, waiter.limit, holds):
        return frozenset()
    if waiter.mode == "shared":
        return frozenset(h.etcd_key for h in holds if h.mode == "exclusive")
    # Exclusive or a semaphore slot: any hold's end frees room.
    return frozenset(h.etcd_key for h in holds)


def decide(holds: Sequence[Claim], waiters: Sequence[Claim]) -> QueueDecision:
    """Who is granted now and what every waiter left behind waits for (docs/contract.md §10).

    One transaction writes a key once, so the grants stop before a waiter
    whose principal and owner an earlier grant of the same decision has
    (it would take that new hold back): the next decision, after the
    commit, grants it, with the same outcome as one pass of the core.
    """
    queue = sorted(waiters, key=lambda w: w.order)
    held = list(holds)
    owned = {(h.principal, h.owner): h.etcd_key for h in held if h.owner is not None}
    granted: list[Claim] = []
    replaces: dict[bytes, bytes] = {}
    limit = held[0].limit if held else (queue[0].limit if queue else 1)
    woken = core.woken(
        held[0].mode if held else None,
        len(held),
        limit,
        queue,
        holds_owned=lambda principal, owner: (principal, owner) in owned,
    )
    for waiter in woken:
        mine = (waiter.principal, waiter.owner)
        if waiter.owner is not None:
            if any((g.principal, g.owner) == mine for g in granted):
                break  # the next decision grants it (one write per key per transaction)
            if mine in owned:
                replaces[waiter.etcd_key] = owned[mine]
        granted.append(waiter)
    left = [h for h in held if h.etcd_key not in replaces.values()]
    held = [*left, *granted]
    wake_on: dict[bytes, frozenset[bytes]] = {}
    rest = queue[len(granted) :]
    if rest:
        head = rest[0]
        wake_on[head.etcd_key] = blockers(head, held)
        for before, waiter in pairwise(rest):
            wake_on[waiter.etcd_key] = frozenset({before.etcd_key})
    return QueueDecision(granted, wake_on, replaces)
