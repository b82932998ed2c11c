"""The lock semantics, with no I/O and no clock of its own.

Every public method takes ``now`` (milliseconds on a clock that wall-clock
steps cannot move; the daemon passes CLOCK_BOOTTIME) and answers at once.
What must happen outside -- rows to persist, parked waiters to wake -- piles up
in :class:`Changes`, which the caller drains with :meth:`LockEngine.drain`
after each call, commits, and only then replies. This is the h11 shape: the
engine is a state machine, the server moves bytes and time.

Invariants the methods keep (and ``check_invariants`` asserts in tests):

* a key with waiters has a holder: a freed key is handed to the head of its
  queue in the same step, so no grant can slip in between;
* a holder's handle is the only valid handle for its key: a re-take, a break
  or an expiry fences every earlier handle of that key;
* fences strictly increase across every grant of the engine's life.

Expiry is driven by the earliest deadline: leases and waiter deadlines sit in
two heaps with lazy deletion, so neither the timer nor any operation ever
scans all keys.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

MAX_TTL_MS = 86_400_000
MAX_TIMEOUT_MS = 86_400_000


def new_handle_id() -> str:
    """128 random bits from the OS CSPRNG, URL-safe base64 (22 characters)."""
    return secrets.token_urlsafe(16)


@dataclass
class Lease:
    """A hold on a key. ``expires_at`` is in boot-clock milliseconds."""

    key: str
    handle: str
    fence: int
    owner: str | None
    principal: str
    ttl_ms: int
    expires_at: int
    #: id of the connection the lease is bound to (``releaseOnClose``), or None.
    conn: int | None = None

    def __repr__(self) -> str:  # never show the handle id, not even in a traceback
        return (
            f"Lease(key={self.key!r}, fence={self.fence}, owner={self.owner!r}, "
            f"principal={self.principal!r}, expires_at={self.expires_at})"
        )


@dataclass(eq=False)
class Waiter:
    """A parked blocking acquire. The engine fills ``lease`` or ``timed_out``."""

    id: int
    key: str
    principal: str
    owner: str | None
    ttl_ms: int
    conn: int
    release_on_close: bool
    deadline: int
    lease: Lease | None = None
    timed_out: bool = False
    cancelled: bool = False

    @property
    def resolved(self) -> bool:
        return self.lease is not None or self.timed_out or self.cancelled


@dataclass
class Changes:
    """Effects of the calls since the last :meth:`LockEngine.drain`."""

    #: key -> its lease now, or None when the key became free. Last write wins.
    rows: dict[str, Lease | None] = field(default_factory=dict)
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

    def merged_with(self, newer: Changes) -> Changes:
        """This batch followed by ``newer`` (a failed commit is retried so)."""
        fences = [f for f in (self.fence, newer.fence) if f is not None]
        return Changes(
            rows={**self.rows, **newer.rows},
            fence=max(fences) if fences else None,
            resolved=self.resolved + newer.resolved,
            expired=self.expired + newer.expired,
            grants=self.grants + newer.grants,
            retakes=self.retakes + newer.retakes,
        )


@dataclass(frozen=True)
class KeyStatus:
    key: str
    holder: Lease | None
    waiters: int


@dataclass(frozen=True)
class Busy:
    """tryAcquire found the key held."""

    holder: Lease


@dataclass(frozen=True)
class Parked:
    """A blocking acquire is queued; wait for ``waiter.resolved``."""

    waiter: Waiter


@dataclass(frozen=True)
class TimedOut:
    """A blocking acquire with nothing left of its timeout found the key held."""


AcquireResult = Lease | Busy | Parked | TimedOut


@dataclass
class _KeyState:
    holder: Lease | None = None
    #: FIFO of parked waiters; a dict keeps insertion order and removes in O(1).
    queue: dict[int, Waiter] = field(default_factory=dict)


class LockEngine:
    """All keys, leases, waiters and the fence counter of one daemon."""

    def __init__(
        self,
        *,
        fence: int = 0,
        handle_factory: Callable[[], str] = new_handle_id,
    ) -> None:
        self._keys: dict[str, _KeyState] = {}
        self._fence = fence
        self._new_handle = handle_factory
        self._lease_heap: list[tuple[int, int, str, str]] = []
        self._waiter_heap: list[tuple[int, int]] = []
        self._waiters: dict[int, Waiter] = {}
        self._conn_waiters: dict[int, set[int]] = {}
        self._conn_leases: dict[int, set[str]] = {}
        self._seq = itertools.count()
        self._waiter_ids = itertools.count(1)
        self._changes = Changes()

    # ------------------------------------------------------------------ state

    @property
    def fence(self) -> int:
        """The last fence handed out (0 before the first grant ever)."""
        return self._fence

    @property
    def held_count(self) -> int:
        # Every tracked key has a holder: a freed key without waiters is dropped.
        return len(self._keys)

    @property
    def waiter_count(self) -> int:
        return len(self._waiters)

    def restore(self, leases: Iterable[Lease], now: int) -> None:
        """Load leases kept by the store; those already run out are freed."""
        for lease in leases:
            self._fence = max(self._fence, lease.fence)
            lease.conn = None  # a restart ends every connection binding
            self._keys[lease.key] = _KeyState(holder=lease)
            self._push_lease(lease)
        self._advance(now)

    def drain(self) -> Changes:
        """Hand over the effects gathered so far and start a new batch."""
        changes, self._changes = self._changes, Changes()
        return changes

    def undrain(self, changes: Changes) -> None:
        """Put back a batch that could not be committed, ahead of newer effects."""
        self._changes = changes.merged_with(self._changes)

    def next_deadline(self) -> int | None:
        """The earliest lease expiry or waiter deadline still pending."""
        self._prune_heaps()
        candidates = []
        if self._lease_heap:
            candidates.append(self._lease_heap[0][0])
        if self._waiter_heap:
            candidates.append(self._waiter_heap[0][0])
        return min(candidates) if candidates else None

    def advance(self, now: int) -> None:
        """Let time pass: expire leases and waiters whose deadline is <= now."""
        self._advance(now)

    # ------------------------------------------------------------- operations

    def acquire(
        self,
        now: int,
        key: str,
        *,
        ttl_ms: int,
        principal: str,
        owner: str | None = None,
        conn: int = 0,
        release_on_close: bool = False,
        wait_ms: int | None = None,
    ) -> AcquireResult:
        """Take ``key`` now, re-take it, or (with ``wait_ms``) park in its queue.

        ``wait_ms=None`` is a tryAcquire: a held key answers :class:`Busy`.
        """
        self._advance(now)
        state = self._keys.get(key)
        holder = state.holder if state else None
        bound = conn if release_on_close else None
        if holder is None:
            return self._grant(now, key, ttl_ms, principal, owner, bound)
        if owner is not None and holder.owner == owner and holder.principal == principal:
            self._changes.retakes += 1
            self._unbind(holder)
            return self._grant(now, key, ttl_ms, principal, owner, bound)
        if wait_ms is None:
            return Busy(holder)
        if wait_ms <= 0:
            return TimedOut()
        assert state is not None
        waiter = Waiter(
            id=next(self._waiter_ids),
            key=key,
            principal=principal,
            owner=owner,
            ttl_ms=ttl_ms,
            conn=conn,
            release_on_close=release_on_close,
            deadline=now + wait_ms,
        )
        state.queue[waiter.id] = waiter
        self._waiters[waiter.id] = waiter
        self._conn_waiters.setdefault(conn, set()).add(waiter.id)
        heapq.heappush(self._waiter_heap, (waiter.deadline, waiter.id))
        return Parked(waiter)

    def renew(self, now: int, key: str, handle: str, ttl_ms: int) -> Lease | None:
        """Extend the lease if ``handle`` still holds ``key``; None means lost."""
        self._advance(now)
        holder = self._holder(key)
        if holder is None or holder.handle != handle:
            return None
        holder.ttl_ms = ttl_ms
        holder.expires_at = now + ttl_ms
        self._push_lease(holder)
        self._changes.rows[key] = holder
        return holder

    def release(self, now: int, key: str, handle: str) -> bool:
        """Free ``key`` if ``handle`` still holds it; the queue head gets it."""
        self._advance(now)
        holder = self._holder(key)
        if holder is None or holder.handle != handle:
            return False
        self._free(now, key)
        return True

    def break_lock(self, now: int, key: str) -> Lease | None:
        """Free ``key`` whoever holds it; returns the broken lease, if any."""
        self._advance(now)
        holder = self._holder(key)
        if holder is None:
            return None
        self._free(now, key)
        return holder

    def cancel_waiter(self, now: int, waiter: Waiter) -> None:
        """The waiter gave up (connection closed, request cancelled).

        A waiter that was already granted keeps its lease: the caller must
        release it if the reply cannot be delivered. The waiter leaves the
        queue *before* time moves on, so a lease that ran out meanwhile goes
        to the next waiter, not to this one that is no longer listening.
        """
        if not waiter.resolved:
            waiter.cancelled = True
            self._forget_waiter(waiter)
        self._advance(now)

    def connection_closed(self, now: int, conn: int, *, release_bound: bool = True) -> list[Lease]:
        """Drop the connection's waiters and release its bound leases.

        With ``release_bound=False`` (the daemon is stopping, not the client
        leaving) the bound leases stay as ordinary TTL leases instead, as they
        would across a crash. Waiters leave first, for the reason given in
        :meth:`cancel_waiter`.
        """
        for waiter_id in list(self._conn_waiters.get(conn, ())):
            waiter = self._waiters.get(waiter_id)
            if waiter is not None:
                waiter.cancelled = True
                self._forget_waiter(waiter)
        self._advance(now)
        released = []
        for key in list(self._conn_leases.pop(conn, ())):
            holder = self._holder(key)
            if holder is not None and holder.conn == conn:
                if release_bound:
                    released.append(holder)
                    self._free(now, key)
                else:
                    holder.conn = None
        return released

    def status(self, now: int, key: str) -> KeyStatus:
        self._advance(now)
        state = self._keys.get(key)
        if state is None:
            return KeyStatus(key, None, 0)
        return KeyStatus(key, state.holder, len(state.queue))

    def list_held(self, now: int, prefix: str = "", limit: int | None = None) -> list[KeyStatus]:
        """Held keys under ``prefix`` in key order, at most ``limit`` of them."""
        self._advance(now)
        keys = sorted(k for k in self._keys if k.startswith(prefix))
        if limit is not None:
            keys = keys[:limit]
        return [KeyStatus(k, self._keys[k].holder, len(self._keys[k].queue)) for k in keys]

    # --------------------------------------------------------------- internals

    def _holder(self, key: str) -> Lease | None:
        state = self._keys.get(key)
        return state.holder if state else None

    def _grant(
        self,
        now: int,
        key: str,
        ttl_ms: int,
        principal: str,
        owner: str | None,
        conn: int | None,
    ) -> Lease:
        self._fence += 1
        lease = Lease(
            key=key,
            handle=self._new_handle(),
            fence=self._fence,
            owner=owner,
            principal=principal,
            ttl_ms=ttl_ms,
            expires_at=now + ttl_ms,
            conn=conn,
        )
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState()
        state.holder = lease
        if conn is not None:
            self._conn_leases.setdefault(conn, set()).add(key)
        self._push_lease(lease)
        self._changes.rows[key] = lease
        self._changes.fence = self._fence
        self._changes.grants += 1
        return lease

    def _free(self, now: int, key: str) -> None:
        """The holder is gone: hand the key to the queue head, or drop it."""
        state = self._keys[key]
        assert state.holder is not None
        self._unbind(state.holder)
        state.holder = None
        self._changes.rows[key] = None
        if state.queue:
            waiter_id = next(iter(state.queue))
            waiter = state.queue[waiter_id]
            self._forget_waiter(waiter)
            bound = waiter.conn if waiter.release_on_close else None
            waiter.lease = self._grant(
                now, key, waiter.ttl_ms, waiter.principal, waiter.owner, bound
            )
            self._changes.resolved.append(waiter)
        else:
            del self._keys[key]

    def _unbind(self, lease: Lease) -> None:
        if lease.conn is not None:
            keys = self._conn_leases.get(lease.conn)
            if keys is not None:
                keys.discard(lease.key)
                if not keys:
                    del self._conn_leases[lease.conn]

    def _forget_waiter(self, waiter: Waiter) -> None:
        self._waiters.pop(waiter.id, None)
        state = self._keys.get(waiter.key)
        if state is not None:
            state.queue.pop(waiter.id, None)
        ids = self._conn_waiters.get(waiter.conn)
        if ids is not None:
            ids.discard(waiter.id)
            if not ids:
                del self._conn_waiters[waiter.conn]

    def _push_lease(self, lease: Lease) -> None:
        heapq.heappush(
            self._lease_heap, (lease.expires_at, next(self._seq), lease.key, lease.handle)
        )

    def _lease_entry_live(self, entry: tuple[int, int, str, str]) -> bool:
        expires_at, _, key, handle = entry
        holder = self._holder(key)
        return holder is not None and holder.handle == handle and holder.expires_at == expires_at

    def _prune_heaps(self) -> None:
        heap = self._lease_heap
        while heap and not self._lease_entry_live(heap[0]):
            heapq.heappop(heap)
        wheap = self._waiter_heap
        while wheap and wheap[0][1] not in self._waiters:
            heapq.heappop(wheap)

    def _advance(self, now: int) -> None:
        """Apply every deadline <= now, in time order.

        Order matters when the timer runs late (a loaded box, a resume from
        suspend): a waiter whose deadline came before a lease's expiry has
        timed out and must not be handed that key. At equal times the lease
        goes first, so a waiter whose deadline is the expiry still wins.
        """
        heap, wheap = self._lease_heap, self._waiter_heap
        while True:
            self._prune_heaps()
            lease_at = heap[0][0] if heap else None
            waiter_at = wheap[0][0] if wheap else None
            if (
                lease_at is not None
                and lease_at <= now
                and (waiter_at is None or lease_at <= waiter_at)
            ):
                key = heapq.heappop(heap)[2]
                holder = self._holder(key)
                assert holder is not None  # the entry was live after pruning
                self._changes.expired.append(holder)
                self._free(now, key)
            elif waiter_at is not None and waiter_at <= now:
                waiter = self._waiters[heapq.heappop(wheap)[1]]
                waiter.timed_out = True
                self._forget_waiter(waiter)
                self._changes.resolved.append(waiter)
            else:
                break
        self._compact_if_bloated()

    def _compact_if_bloated(self) -> None:
        """Renewals leave dead heap entries; rebuild when they dominate."""
        if len(self._lease_heap) > 64 and len(self._lease_heap) > 4 * len(self._keys):
            self._lease_heap = [e for e in self._lease_heap if self._lease_entry_live(e)]
            heapq.heapify(self._lease_heap)
        if len(self._waiter_heap) > 64 and len(self._waiter_heap) > 4 * len(self._waiters):
            self._waiter_heap = [e for e in self._waiter_heap if e[1] in self._waiters]
            heapq.heapify(self._waiter_heap)

    def check_invariants(self) -> None:
        """Assert the invariants of the module docstring (for tests)."""
        for key, state in self._keys.items():
            assert state.holder is not None or not state.queue, f"{key}: waiters but no holder"
            assert state.holder is None or state.holder.key == key
            assert state.holder is None or state.holder.fence <= self._fence
            for waiter in state.queue.values():
                assert self._waiters.get(waiter.id) is waiter
        assert sum(len(s.queue) for s in self._keys.values()) == len(self._waiters)
