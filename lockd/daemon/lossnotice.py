"""Telling listening holders of the embedded engine's holds what they lost, and when.

:class:`~lockd.daemon.events.LossWatch` knows who listens for lease-loss
events (docs/contract.md §12). :class:`LossNotices` is the embedded
backend's side of it: after each commit it tells the holders whose holds
ran out or were re-taken -- before any reply that depends on the loss goes
out -- and puts re-taken holds back under watch when a failed commit
undid the re-take. It is separate from the service
(:mod:`lockd.daemon.service`) because it runs on the commit's schedule, not
a request's: a re-take is noted during the request and told after the
commit.
"""

from __future__ import annotations

from collections.abc import Callable

from lockd.daemon.clock import Clock
from lockd.daemon.engine import Lease, LockEngine
from lockd.daemon.events import EXPIRED, RETAKE, LossEvent, LossWatch
from lockd.identity import Caller
from lockd.timefmt import format_epoch_ms


class LossNotices:
    """Loss events of the engine's holds: noted during a request, told after its commit."""

    def __init__(self, engine: LockEngine, losses: LossWatch, clock: Clock) -> None:
        self._engine = engine
        self._losses = losses
        self._clock = clock
        #: writes one loss event to its connection (the server sets it); called
        #: before any reply that depends on the loss goes out.
        self.on_lost: Callable[[LossEvent], None] = lambda event: None
        #: re-takes of watched holds, announced once their commit is done.
        self._retaken: list[LossEvent] = []

    def at(self) -> str:
        """Now on the wall clock, as an event's ``at`` shows it."""
        return format_epoch_ms(self._clock.wall_ms())

    def announce(self, expired: list[Lease]) -> None:
        """After a commit: tell the listening holders of what it ended, then wake breaks.

        Runs before the commit's waiters are woken and its replies go out,
        so a holder hears of its loss before anyone hears of a grant that
        depends on it.
        """
        losses = self._losses
        if not (len(losses) or self._retaken or losses.breaks):
            return
        at = self.at() if expired else ""
        for lease in expired:
            event = losses.lost(lease.handle, EXPIRED, at)
            if event is not None:
                self.on_lost(event)
        retaken, self._retaken = self._retaken, []
        for event in retaken:
            self.on_lost(event)
        if losses.breaks:
            engine = self._engine
            losses.still_stopping(lambda w: engine.find(w.key, w.handle) is not None)

    def rewatch_retaken(self) -> None:
        """A failed commit undid its re-takes: the holds they ended are back, watched again."""
        retaken, self._retaken = self._retaken, []
        for event in retaken:
            lease = self._engine.find(event.key, event.handle)
            if lease is not None:
                self._losses.watch(event.conn, lease)
            else:
                self._retaken.append(event)

    def watch_grant(self, conn: int, lease: Lease) -> None:
        """The grant of ``lease`` reached connection ``conn``, which listens for events."""
        if self._engine.find(lease.key, lease.handle) is lease:
            self._losses.watch(conn, lease)
            return
        # Ended in the batch that granted it, before its reply went out (only
        # a re-take can: nobody else knew its handle yet): say so at once.
        self.on_lost(
            LossEvent(
                conn,
                lease.key,
                lease.handle,
                lease.fence,
                RETAKE,
                None,
                lease.principal,
                self.at(),
            )
        )

    def note_retake(self, caller: Caller, lease: Lease) -> None:
        """A grant with an owner may have re-taken watched holds: told after the commit."""
        assert lease.owner is not None
        losses = self._losses
        for watched in losses.same_owner(lease.key, caller.principal, lease.owner):
            if (
                watched.handle != lease.handle
                and self._engine.find(lease.key, watched.handle) is None
            ):
                event = losses.lost(watched.handle, RETAKE, self.at(), by=caller.principal)
                if event is not None:
                    self._retaken.append(event)
