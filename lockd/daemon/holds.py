"""What a key's holders admit: the decision rules of SPEC 10, for every backend.

These functions read a few numbers about one key and answer; they keep no
state and do no I/O, so the in-memory engine (``engine.py``) and a backend
that decides inside a transaction of its own (etcd) apply the very same
rules. The order they are applied in, for a request (principal P, owner O,
mode M, limit L) on a key:

1. :func:`refusal`: a request that contradicts the key (another limit than
   the one in force) or its own hold (a re-take in another mode) is refused
   at once, before anything changes, and is never queued.
2. Re-take: when P already holds the key with owner O (``is_retake``), the
   request takes that hold back at once -- new handle, new fence, same slot
   -- even while waiters are queued, for ``tryAcquire`` too. Other holders
   are untouched.
3. :func:`may_take_now`: otherwise the request wins at once only if it
   :func:`fits` and nobody is queued (no overtaking).
4. Otherwise a blocking acquire joins the tail of the key's single FIFO
   queue; a ``tryAcquire`` answers busy.

Whenever holders leave (release, expiry, break, connection close) or a
queued waiter leaves (timeout, cancel), the queue is served from its head:
the head is granted while it fits, then the next head, and so on; the first
head that does not fit stops the hand-out (:func:`fits` again). So
consecutive shared waiters are granted together, and a shared request behind
an exclusive one waits: writers never starve.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

EXCLUSIVE: Final = "exclusive"
SHARED: Final = "shared"
MODES: Final = frozenset({EXCLUSIVE, SHARED})
MAX_LIMIT: Final = 1000


@dataclass(frozen=True)
class Refused:
    """A request that contradicts the key's state: ``INVALID_REQUEST`` on the wire."""

    field: str
    message: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def fits(mode: str, held_mode: str | None, held_count: int, limit: int) -> bool:
    """May a request in ``mode`` join the current holders of a key?

    A free key takes anyone. An exclusive hold with limit 1 takes nobody
    else; shared holds take more shared ones; a semaphore (exclusive with
    ``limit`` > 1) takes exclusive holders while a slot is free.
    """
    if held_count == 0:
        return True
    if mode != held_mode:
        return False
    return mode == SHARED or held_count < limit


def may_take_now(fitting: bool, queued: int) -> bool:
    """A new claim (not a re-take) wins at once only if nobody waits before it."""
    return fitting and queued == 0


def is_retake(
    hold_principal: str, hold_owner: str | None, principal: str, owner: str | None
) -> bool:
    """Same principal and the exact same owner string; a hold without owner never."""
    return owner is not None and hold_owner == owner and hold_principal == principal


def refusal(
    key: str,
    mode: str,
    limit: int,
    *,
    key_limit: int | None,
    own_hold: tuple[str, int] | None,
) -> Refused | None:
    """Why a request may not even queue for ``key``, or None.

    ``key_limit`` is the limit in force (None when the key has no holders
    and no waiters); ``own_hold`` the (mode, limit) of the caller's own hold
    with the same owner, if it has one.
    """
    if mode == SHARED and limit > 1:
        return Refused("limit", "a shared hold takes no limit above 1")
    if key_limit is not None and limit != key_limit:
        return Refused(
            "limit",
            f"key {key!r} is in use with limit {key_limit}; every request for it "
            f"must name limit {key_limit}",
            {"limit": key_limit},
        )
    if own_hold is not None and own_hold[0] != mode:
        held_mode, held_limit = own_hold
        return Refused(
            "mode",
            f"your hold of {key!r} with this owner is {held_mode}; a re-take must "
            f"name the same mode",
            {"mode": held_mode, "limit": held_limit},
        )
    return None
