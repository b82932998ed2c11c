"""The cross-host queue rules of SPEC §10 as pure functions over what etcd holds.

Every daemon sees the same thing for a key: its current holds and its waiter
keys, each waiter with the create revision etcd gave it. From that alone,
without any daemon's memory, these functions say

- which waiters are granted now (``decide(...).granted``): the head of the
  queue as soon as it fits, then each next head that fits, so consecutive
  shared waiters go together; the first waiter that does not fit stops the
  grants, so nobody overtakes it (a shared request behind an exclusive one
  waits: writers never starve);
- what every other waiter waits for (``decide(...).wake_on``): the keys
  whose deletion can let it move. This is etcd's mutex recipe (a waiter
  watches the waiter just before it, not the whole queue, so a release
  wakes one daemon, not all) extended to shared holds and semaphores: the
  head watches the holds that block it, every later waiter its immediate
  predecessor, which wakes it when it is granted or leaves.

Whether a request fits beside the current holds is ``lockd.daemon.holds``'
rule, shared with the embedded engine: an exclusive request of limit N fits
while fewer than N holds exist (exclusive is a semaphore of one slot), a
shared one while no exclusive hold exists.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

from lockd.daemon import holds as rules

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

    @property
    def order(self) -> tuple[int, bytes]:
        return (self.create_revision, self.etcd_key)


@dataclass(frozen=True)
class QueueDecision:
    granted: list[Claim]  # waiters to grant now, in queue order
    wake_on: dict[bytes, frozenset[bytes]]  # each other waiter -> keys whose deletion moves it


def fits(mode: Mode, limit: int, holds: Iterable[Claim]) -> bool:
    """True when a request of ``mode`` and ``limit`` can be held beside ``holds``.

    The rule is ``holds.fits``, the one the embedded engine applies too; a
    key's holds all have one mode, so the first one speaks for all.
    """
    held = list(holds)
    return rules.fits(mode, held[0].mode if held else None, len(held), limit)


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
    """Who is granted now and what every waiter left behind waits for (SPEC §10)."""
    queue = sorted(waiters, key=lambda w: w.order)
    held = list(holds)
    granted: list[Claim] = []
    for waiter in queue:
        if not fits(waiter.mode, waiter.limit, held):
            break
        granted.append(waiter)
        held.append(waiter)
    wake_on: dict[bytes, frozenset[bytes]] = {}
    rest = queue[len(granted) :]
    if rest:
        head = rest[0]
        wake_on[head.etcd_key] = blockers(head, held)
        for before, waiter in pairwise(rest):
            wake_on[waiter.etcd_key] = frozenset({before.etcd_key})
    return QueueDecision(granted, wake_on)


def try_fits(mode: Mode, limit: int, holds: Sequence[Claim], waiters: Sequence[Claim]) -> bool:
    """``tryAcquire``: wins only if the request fits and nobody is queued for the key."""
    return rules.may_take_now(fits(mode, limit, holds), len(waiters))


def limit_in_force(holds: Sequence[Claim], waiters: Sequence[Claim]) -> int | None:
    """The limit every new request for the key must name, or None while it has no claims.

    All claims of a key carry the same limit (requests naming another are
    refused), so the oldest one speaks for all.
    """
    claims = [*holds, *waiters]
    if not claims:
        return None
    return min(claims, key=lambda c: c.order).limit
