"""What the engine hands out and takes in: plain data, no lock semantics.

A :class:`Lease` is one holder's hold on a key, a :class:`Waiter` one
acquire request; :class:`Changes` is the batch of effects the caller
commits after each engine call; :class:`KeyStatus`, :class:`ListPage` and
the acquire answers (:class:`Busy`, :class:`Parked`, :class:`TimedOut`,
:class:`~lockd.core.admission.Refused`) are what status, list and acquire
return. The rules that move them live in :mod:`lockd.daemon.engine`.
"""

from __future__ import annotations

from binascii import b2a_base64
from dataclasses import dataclass, field
from os import urandom

from lockd.core.admission import EXCLUSIVE, Refused

__all__ = [
    "MAX_LISTED_HOLDERS",
    "AcquireResult",
    "Busy",
    "Changes",
    "Deadlock",
    "KeyStatus",
    "Lease",
    "ListPage",
    "Parked",
    "RowId",
    "TimedOut",
    "Waiter",
    "new_handle_id",
]

#: holders listed per key by status and list (docs/contract.md §10).
MAX_LISTED_HOLDERS = 100


#: base64's alphabet to its URL-safe one (what base64.urlsafe_b64encode does).
_URLSAFE = bytes.maketrans(b"+/", b"-_")


def new_handle_id() -> str:
    """128 random bits from the OS CSPRNG, URL-safe base64 (22 characters).

    ``secrets.token_urlsafe(16)`` to the byte, through the C calls it ends
    in: it takes five Python-level calls to get there (token_bytes,
    SystemRandom.randbytes, urlsafe_b64encode, b64encode), once per grant.
    """
    raw = b2a_base64(urandom(16), newline=False)
    return raw.translate(_URLSAFE).rstrip(b"=").decode("ascii")


class Lease:
    """One holder's hold on a key. ``expires_at`` is in boot-clock milliseconds.

    ``slot`` numbers the holders of a key (0 for an exclusive hold); the
    store keeps one row per (key, slot), so a hand-off or a re-take
    overwrites one row. ``pid`` and ``process`` are the holder's process as
    the daemon saw it. ``prev``/``next`` link the key's holders in grant
    order. ``conn`` is the connection the lease is bound to
    (``releaseOnClose``), or None; ``taken_by`` the connection that took it,
    bound or not (None once the daemon restarted), which the deadlock check
    reads (:mod:`lockd.core.deadlock`).
    """

    __slots__ = (
        "conn",
        "expires_at",
        "fence",
        "handle",
        "key",
        "limit",
        "mode",
        "next",
        "owner",
        "pid",
        "pid_start",
        "prev",
        "principal",
        "process",
        "slot",
        "taken_by",
        "ttl_ms",
    )

    def __init__(
        self,
        key: str,
        handle: str,
        fence: int,
        owner: str | None,
        principal: str,
        ttl_ms: int,
        expires_at: int,
        conn: int | None = None,
        mode: str = EXCLUSIVE,
        limit: int = 1,
        slot: int = 0,
        pid: int | None = None,
        process: str | None = None,
        pid_start: int | None = None,
    ) -> None:
        self.key, self.handle, self.fence, self.owner = key, handle, fence, owner
        self.principal, self.ttl_ms, self.expires_at, self.conn = (
            principal,
            ttl_ms,
            expires_at,
            conn,
        )
        self.mode, self.limit, self.slot, self.pid, self.process = mode, limit, slot, pid, process
        self.taken_by: int | None = None
        #: when ``pid`` started (identity.process_start): tells it from a reused
        #: pid; None when unknown (a row written before schema 4).
        self.pid_start = pid_start
        self.prev: Lease | None = None
        self.next: Lease | None = None

    def __lt__(self, other: Lease) -> bool:
        # The engine's deadline heap holds (expires_at, fence, lease); two
        # entries tie only for a lease and its copy read back from the store
        # (a demoted key loaded again, lockd.daemon.demoted), one of them
        # dead. Which goes first does not matter: any order will do.
        return id(self) < id(other)

    def __repr__(self) -> str:  # never show the handle id, not even in a traceback
        return (
            f"Lease(key={self.key!r}, fence={self.fence}, owner={self.owner!r}, "
            f"principal={self.principal!r}, mode={self.mode}, limit={self.limit}, "
            f"slot={self.slot}, expires_at={self.expires_at})"
        )


class Waiter:
    """One acquire request: what it asks for, and once parked, its place in the queue.

    The engine fills ``lease`` (granted) or ``timed_out``; ``cancelled`` when
    the caller gave up. ``prev``/``next`` link the key's queue in arrival order.
    """

    __slots__ = (
        "cancelled",
        "conn",
        "deadline",
        "id",
        "key",
        "lease",
        "limit",
        "mode",
        "next",
        "owner",
        "pid",
        "pid_start",
        "prev",
        "principal",
        "process",
        "release_on_close",
        "since",
        "timed_out",
        "ttl_ms",
    )

    def __init__(
        self,
        id: int,
        key: str,
        principal: str,
        owner: str | None,
        ttl_ms: int,
        conn: int,
        release_on_close: bool,
        deadline: int,
        mode: str = EXCLUSIVE,
        limit: int = 1,
        pid: int | None = None,
        process: str | None = None,
        pid_start: int | None = None,
    ) -> None:
        self.id, self.key, self.principal, self.owner = id, key, principal, owner
        self.ttl_ms, self.conn, self.release_on_close = ttl_ms, conn, release_on_close
        self.deadline, self.mode, self.limit, self.pid, self.process = (
            deadline,
            mode,
            limit,
            pid,
            process,
        )
        #: when it parked (boot ms; 0 until then): status's ``waiterList.since``.
        self.since = 0
        self.pid_start = pid_start
        self.lease: Lease | None = None
        self.timed_out = False
        self.cancelled = False
        self.prev: Waiter | None = None
        self.next: Waiter | None = None

    @property
    def resolved(self) -> bool:
        return self.lease is not None or self.timed_out or self.cancelled

    def __repr__(self) -> str:
        return f"Waiter(id={self.id}, key={self.key!r}, mode={self.mode}, deadline={self.deadline})"


#: (key, slot): the store's row address of a lease.
RowId = tuple[str, int]


@dataclass
class Changes:
    """Effects of the calls since the last :meth:`~lockd.daemon.engine.LockEngine.drain`."""

    #: (key, slot) -> the lease in that slot now, or None when it became free.
    #: Last write wins, so a hand-off is one row.
    rows: dict[RowId, Lease | None] = field(default_factory=dict)
    #: the highest fence handed out so far, when it moved.
    fence: int | None = None
    #: waiters granted or timed out; the server wakes each one.
    resolved: list[Waiter] = field(default_factory=list)
    #: leases that ran out while held (for logs and counters).
    expired: list[Lease] = field(default_factory=list)
    #: counters for stats: grants, re-takes, releases, ...
    grants: int = 0
    retakes: int = 0

    def __bool__(self) -> bool:
        return bool(self.rows or self.fence is not None or self.resolved or self.expired)


@dataclass(frozen=True)
class KeyStatus:
    key: str
    #: "exclusive" or "shared"; None when the key is free.
    mode: str | None
    limit: int | None
    holder_count: int
    #: the oldest holders first, at most MAX_LISTED_HOLDERS of them.
    holders: list[Lease]
    waiters: int
    #: the first waiters in queue order, at most MAX_LISTED_WAITERS (docs/contract.md §12).
    queue: list[Waiter] = field(default_factory=list)

    @property
    def holder(self) -> Lease | None:
        """The oldest current grant (docs/contract.md §10: the singular status fields)."""
        return self.holders[0] if self.holders else None


@dataclass(frozen=True)
class Busy:
    """tryAcquire found the key taken (or others queued before it)."""

    holder: Lease


@dataclass(frozen=True)
class Parked:
    """A blocking acquire is queued; wait for ``waiter.resolved``."""

    waiter: Waiter


@dataclass(frozen=True)
class TimedOut:
    """A blocking acquire with nothing left of its timeout found the key taken."""


@dataclass(frozen=True)
class Deadlock:
    """A blocking acquire that would close a cycle of waits: refused, not queued.

    ``cycle`` lists the keys of the cycle in order, the requested key first
    (:func:`lockd.core.deadlock.find_cycle`).
    """

    cycle: list[str]


AcquireResult = Lease | Busy | Parked | TimedOut | Deadlock | Refused


@dataclass(frozen=True)
class ListPage:
    """One page of held keys; ``next`` is the key to start after, or None at the end."""

    locks: list[KeyStatus]
    next: str | None
