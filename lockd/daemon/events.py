"""Lease-loss events (docs/contract.md §12): who listens, what was lost, which breaks wait.

Plain bookkeeping, no I/O and no clock of its own: the service
(:mod:`lockd.daemon.service`) tells it what the engine did and asks it
whom to tell; the server writes the lines and does the waiting.

* A hold is *watched* once its grant reached a connection that asked for
  events (``hello {"events": true}``). When it ends other than by its own
  ``release`` -- broken, re-taken, expired -- one :class:`LossEvent` goes to
  that connection. Holds taken on other connections are never watched:
  their holders learn at ``renew``, as before.
* A ``break`` of a watched hold does not end it at once. Its holder is told
  (the event goes out at the start of the break), and the hold stays in the
  engine, *stopping*, until the holder answers ``stopped`` for it, its
  connection closes, the hold ends some other way (expiry, release, re-take)
  or ``break_grace`` passes: :class:`PendingBreak`. Keeping the hold in the
  engine is what makes the hand-off safe: no admission rule can grant an
  overlapping hold while it is there. The break's reply comes when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: the causes of a loss (docs/contract.md §12).
BREAK = "break"
RETAKE = "retake"
EXPIRED = "expired"
SESSION = "session"


class HoldLike(Protocol):
    """What the watch needs of a hold (an engine lease)."""

    @property
    def key(self) -> str: ...
    @property
    def handle(self) -> str: ...
    @property
    def fence(self) -> int: ...
    @property
    def principal(self) -> str: ...
    @property
    def owner(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Watched:
    """A hold granted to a connection that listens for events."""

    conn: int
    key: str
    handle: str
    fence: int
    principal: str
    owner: str | None


@dataclass(frozen=True, slots=True)
class LossEvent:
    """One ``{"event": "lost", ...}`` line for connection ``conn``."""

    conn: int
    key: str
    handle: str
    fence: int
    cause: str
    reason: str | None
    by: str | None
    #: wall-clock RFC 3339 time the loss was decided.
    at: str

    def wire(self) -> dict[str, Any]:
        return {
            "event": "lost",
            "key": self.key,
            "handle": self.handle,
            "fence": self.fence,
            "cause": self.cause,
            "reason": self.reason,
            "by": self.by,
            "at": self.at,
        }


def _no_wake() -> None:
    pass


def _no_watch(watched: Watched) -> None:
    pass


@dataclass(eq=False)
class PendingBreak:
    """A break waiting for the holders it told to stop (see the module doc)."""

    key: str
    reason: str
    by: str
    #: the holds this break ends that were told and are still in the engine.
    stopping: list[Watched]
    #: what the break already ended at its start (holders that do not listen).
    ended: Sequence[Any]
    #: boot-clock ms when ``break_grace`` has passed.
    deadline: int
    #: handles of ``stopping`` whose holder has not stopped yet.
    waiting_for: set[str] = field(default_factory=set)
    #: called when ``waiting_for`` shrinks (the server's task checks again).
    wake: Callable[[], None] = _no_wake

    def ready(self, now: int) -> bool:
        """Every told holder stopped (or is gone), or the grace is over."""
        return not self.waiting_for or now >= self.deadline


class LossWatch:
    """Watched holds by handle, connection and key; the breaks that wait for them."""

    def __init__(self) -> None:
        self._watched: dict[str, Watched] = {}
        self._by_conn: dict[int, set[str]] = {}
        self._by_key: dict[str, set[str]] = {}
        #: holds told of a break and still in the engine, by handle.
        self._stopping: dict[str, Watched] = {}
        self.breaks: list[PendingBreak] = []
        #: called with each hold newly watched (the etcd backend follows it in etcd).
        self.on_watch: Callable[[Watched], None] = _no_watch

    # ------------------------------------------------------------ watching

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, conn: int, hold: HoldLike) -> None:
        """The grant of ``hold`` reached connection ``conn``, which listens for events."""
        watched = Watched(conn, hold.key, hold.handle, hold.fence, hold.principal, hold.owner)
        self._watched[hold.handle] = watched
        self._by_conn.setdefault(conn, set()).add(hold.handle)
        self._by_key.setdefault(hold.key, set()).add(hold.handle)
        self.on_watch(watched)

    def watched(self, handle: str) -> Watched | None:
        return self._watched.get(handle)

    def holds(self) -> list[Watched]:
        """Every watched hold."""
        return list(self._watched.values())

    def of_key(self, key: str) -> list[Watched]:
        """The watched holds of ``key`` (oldest grant first)."""
        handles = self._by_key.get(key, ())
        return sorted((self._watched[h] for h in handles), key=lambda w: w.fence)

    def same_owner(self, key: str, principal: str, owner: str) -> list[Watched]:
        """Watched holds a re-take by ``principal`` with ``owner`` on ``key`` may have ended."""
        return [w for w in self.of_key(key) if w.principal == principal and w.owner == owner]

    def forget(self, handle: str) -> Watched | None:
        """Stop watching ``handle`` (its holder released it, or it was lost)."""
        watched = self._watched.pop(handle, None)
        if watched is None:
            return None
        _discard(self._by_conn, watched.conn, handle)
        _discard(self._by_key, watched.key, handle)
        return watched

    def lost(
        self,
        handle: str,
        cause: str,
        at: str,
        *,
        by: str | None = None,
        reason: str | None = None,
    ) -> LossEvent | None:
        """The event for a watched hold that ended (None when nobody listens for it)."""
        watched = self.forget(handle)
        if watched is None:
            return None
        return LossEvent(watched.conn, watched.key, handle, watched.fence, cause, reason, by, at)

    # -------------------------------------------------------------- breaks

    def stopping(self, handle: str) -> Watched | None:
        """The hold of ``handle`` if it was told of a break and is still in the engine."""
        return self._stopping.get(handle)

    def stopping_of_key(self, key: str) -> list[Watched]:
        return [w for w in self._stopping.values() if w.key == key]

    def begin_break(
        self,
        key: str,
        reason: str,
        by: str,
        listening: Iterable[Watched],
        ended: Sequence[Any],
        deadline: int,
        at: str,
    ) -> tuple[PendingBreak, list[LossEvent]]:
        """Start a break of ``key`` that waits for the ``listening`` holds it ends.

        Returns the break and the events to send now (one per newly told
        hold; a hold already told by an earlier break of the key is waited
        for again, not told twice).
        """
        events: list[LossEvent] = []
        stopping: list[Watched] = []
        for watched in listening:
            if watched.handle not in self._stopping:
                self.forget(watched.handle)
                self._stopping[watched.handle] = watched
                events.append(
                    LossEvent(
                        watched.conn,
                        key,
                        watched.handle,
                        watched.fence,
                        BREAK,
                        reason,
                        by,
                        at,
                    )
                )
            stopping.append(watched)
        stopping += [w for w in self.stopping_of_key(key) if w not in stopping]
        pending = PendingBreak(
            key, reason, by, stopping, ended, deadline, {w.handle for w in stopping}
        )
        self.breaks.append(pending)
        return pending, events

    def stopped(self, conn: int, handle: str) -> bool:
        """Connection ``conn`` says the work of ``handle`` stopped; False if nothing waited."""
        watched = self._stopping.get(handle)
        if watched is None or watched.conn != conn:
            return False
        self.hold_ended(handle)
        return True

    def hold_ended(self, handle: str) -> None:
        """A stopping hold is no longer waited for (stopped, gone from the engine)."""
        if self._stopping.pop(handle, None) is None:
            return
        for pending in self.breaks:
            if handle in pending.waiting_for:
                pending.waiting_for.discard(handle)
                pending.wake()

    def still_stopping(self, held: Callable[[Watched], bool]) -> None:
        """Drop the stopping holds that ``held`` says are no longer in the engine."""
        for watched in [w for w in self._stopping.values() if not held(w)]:
            self.hold_ended(watched.handle)

    def end_break(self, pending: PendingBreak) -> None:
        """The break is over: its holds leave the stopping set (unless another break waits)."""
        if pending in self.breaks:
            self.breaks.remove(pending)
        waited = {h for other in self.breaks for h in other.waiting_for}
        for watched in pending.stopping:
            if watched.handle not in waited:
                self._stopping.pop(watched.handle, None)

    # -------------------------------------------------------- connections

    def connection_closed(self, conn: int) -> None:
        """Connection ``conn`` is gone: nobody to tell, and its stopping holds stopped."""
        for handle in list(self._by_conn.get(conn, ())):
            self.forget(handle)
        for watched in [w for w in self._stopping.values() if w.conn == conn]:
            self.hold_ended(watched.handle)


def _discard(index: dict[Any, set[str]], item: object, handle: str) -> None:
    handles = index.get(item)
    if handles is not None:
        handles.discard(handle)
        if not handles:
            del index[item]
