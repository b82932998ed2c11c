"""The expiry timer: one task that sleeps until the engine's earliest deadline.

The engine has no clock (:mod:`lockd.daemon.engine`): something must wake
it when a lease runs out or a wait ends with no request coming. That is
this task. Every request may move the earliest deadline earlier, so the
server calls :meth:`ExpiryTimer.reschedule` after each one; the task then
asks the service to let time pass (:meth:`LockService.tick
<lockd.daemon.service.LockService.tick>`). It is separate from the server
(:mod:`lockd.daemon.server`) because it is about time, not connections.
"""

from __future__ import annotations

import logging
import math

import trio

from lockd.daemon.service import LockService
from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.server")

#: longest the expiry timer sleeps before looking at the boot clock again.
TIMER_MAX_SLEEP = 1.0


class ExpiryTimer:
    """Sleeps until the next deadline the service knows of, then lets time pass."""

    def __init__(self, service: LockService) -> None:
        self._service = service
        self._scope: trio.CancelScope | None = None
        #: the engine deadline (boot ms) the timer scope was last pointed at.
        self._target: int | None = None

    def reschedule(self) -> None:
        """Make sure the timer fires no later than the engine's earliest deadline.

        Runs after every request, so it only ever moves the timer *earlier*:
        when the earliest deadline moved later (a release, a renew) the timer
        fires early once, finds nothing due and re-arms. In steady traffic
        that makes this a heap peek and a comparison; moving trio's deadline
        on every grant and release showed up as ~7 us per request.
        """
        scope = self._scope
        if scope is None:
            return
        deadline = self._service.next_deadline()
        if deadline is None:
            return
        target = self._target
        if target is not None and target <= deadline:
            return
        self._target = deadline
        delay = self._service.ms_until(deadline) / 1000
        # trio's clock stops during suspend, CLOCK_BOOTTIME does not: never
        # sleep long, so hand-offs after a resume are late by a second at most.
        scope.deadline = trio.current_time() + min(delay, TIMER_MAX_SLEEP)

    def lease_added(self, expires_at: int) -> None:
        """A new lease runs out at ``expires_at``: :meth:`reschedule` if that is before the target.

        The fast path's grant adds this one deadline and nothing else
        (its release only takes one away), so the engine is not asked:
        the target is never later than the earliest deadline.
        """
        if self._scope is not None and (self._target is None or expires_at < self._target):
            self.reschedule()

    async def run(self) -> None:
        """The timer task: runs until cancelled."""
        while True:
            with trio.CancelScope() as scope:
                self._scope = scope
                self._target = None
                scope.deadline = math.inf
                self.reschedule()
                await trio.sleep_forever()
            self._scope = None
            try:
                if not self._service.tick():
                    # The disk is full or failing, or the restart's integrity
                    # check is not in yet (Commits.commit_fact): the batch stays
                    # pending in the engine; retry it shortly (any request
                    # retries too; the check's end commits it).
                    await trio.sleep(TIMER_MAX_SLEEP)
            except Exception:
                self._service.stats.count("internalErrors")
                log.exception(kv(event="internal_error", op="tick"))
                await trio.sleep(TIMER_MAX_SLEEP)
