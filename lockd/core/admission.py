"""May this request hold the key now? The admission rules of docs/contract.md §1 and §10.

A request (principal P, owner O, mode M, limit L) meets a key that has
holders (all of one mode and one limit) and a FIFO queue of waiters. The
rules, in the order :func:`admit` applies them:

1. :func:`refusal`: a request that contradicts the key (another limit than
   the one in force, or shared with a limit above 1) or its own hold (a
   re-take in another mode) is refused at once, before anything changes,
   and is never queued.
2. Re-take: when P already holds the key with owner O (:func:`is_retake`),
   the request takes that hold back at once -- new handle, new fence, same
   slot -- even while waiters are queued, for ``tryAcquire`` too. Other
   holders are untouched.
3. Otherwise the request wins at once only if it :func:`fits` beside the
   holders and nobody is queued (no overtaking).
4. Otherwise a blocking acquire parks at the tail of the key's queue; a
   ``tryAcquire`` answers busy.

The caller reads the key however it keeps it (the engine from its own
state, the etcd backend from a directory read at one revision) and passes
numbers in; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

EXCLUSIVE: Final = "exclusive"
SHARED: Final = "shared"
MODES: Final = frozenset({EXCLUSIVE, SHARED})
MAX_LIMIT: Final = 1000

#: what :func:`admit` answers for a request it does not refuse.
Verdict = Literal["grant", "retake", "park", "busy"]
#: it fits and nobody waits before it: hold now.
GRANT: Final = "grant"
#: it takes back the caller's own hold (same principal, same owner).
RETAKE: Final = "retake"
#: a blocking acquire that cannot hold now: join the tail of the queue.
PARK: Final = "park"
#: a ``tryAcquire`` that cannot hold now.
BUSY: Final = "busy"


class Held(Protocol):
    """What the rules read of one hold: its mode and limit."""

    @property
    def mode(self) -> str: ...

    @property
    def limit(self) -> int: ...


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


def is_retake(
    hold_principal: str, hold_owner: str | None, principal: str, owner: str | None
) -> bool:
    """Same principal and the exact same owner string; a hold without owner never."""
    return owner is not None and hold_owner == owner and hold_principal == principal


def refusal(
    key: str, mode: str, limit: int, *, key_limit: int | None, own_hold: Held | None
) -> Refused | None:
    """Why a request may not even queue for ``key``, or None.

    ``key_limit`` is the limit in force (None when the key has no holders
    and no waiters); ``own_hold`` the caller's own hold with the same owner
    (:func:`is_retake`), if it has one.
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
    if own_hold is not None and own_hold.mode != mode:
        return Refused(
            "mode",
            f"your hold of {key!r} with this owner is {own_hold.mode}; a re-take must "
            f"name the same mode",
            {"mode": own_hold.mode, "limit": own_hold.limit},
        )
    return None


def admit_free(key: str, mode: str, limit: int) -> Verdict | Refused:
    """:func:`admit` on a free key (no holders, no waiters): ``GRANT``, or refused.

    The common case of every backend (the engine's hot path, etcd's
    one-transaction fast path), so it costs one comparison.
    """
    if limit > 1 and mode == SHARED:
        refused = refusal(key, mode, limit, key_limit=None, own_hold=None)
        assert refused is not None
        return refused
    return GRANT


def admit(
    key: str,
    mode: str,
    limit: int,
    *,
    held_mode: str | None,
    held_count: int,
    key_limit: int | None,
    queued: int,
    own_hold: Held | None,
    blocking: bool,
) -> Verdict | Refused:
    """The answer to one acquire on a key, in the order of the module's rules.

    ``held_mode`` and ``held_count`` describe the key's current holders
    (None and 0 when free), ``key_limit`` the limit in force (None while the
    key has no holders and no waiters), ``queued`` how many wait for it,
    ``own_hold`` the caller's own hold with the same owner (its re-take),
    ``blocking`` whether the request may wait (``acquire``, not
    ``tryAcquire``). Called on every acquire: the common case (a free key,
    nothing to refuse) costs a few comparisons.
    """
    if (
        (key_limit is not None and limit != key_limit)
        or (own_hold is not None and own_hold.mode != mode)
        or (limit > 1 and mode == SHARED)
    ):
        refused = refusal(key, mode, limit, key_limit=key_limit, own_hold=own_hold)
        assert refused is not None
        return refused
    if own_hold is not None:
        return RETAKE
    if queued == 0 and (held_count == 0 or fits(mode, held_mode, held_count, limit)):
        return GRANT
    return PARK if blocking else BUSY
