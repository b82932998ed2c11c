"""A ``break`` of the engine's holds: holders that listen are told first and given time.

A holder listening for lease-loss events (docs/contract.md §12) is told
its hold is being broken and keeps it until it says it stopped, closes, or
the break's grace runs out; only then does the break end it. Holders that
do not listen are released at once. :class:`Breaks` is the embedded
backend's side of that (the remote path has its own, in
:mod:`lockd.daemon.remote`): the break's first half, which releases what it
need not wait for and tells the listeners, and its second half, once the
server saw them stop. It is separate from the service
(:mod:`lockd.daemon.service`) because a break is the one request answered
in two halves with a wait between them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lockd.daemon.commits import Commits
from lockd.daemon.engine import Lease, LockEngine
from lockd.daemon.events import LossWatch, PendingBreak
from lockd.daemon.lossnotice import LossNotices
from lockd.daemon.replies import break_result
from lockd.daemon.stats import StatsRecorder
from lockd.identity import Caller
from lockd.logfmt import kv

# The service's logger: these lines were logged there before this module
# was split out of it, and log filters may name it.
log = logging.getLogger("lockd.daemon.service")


class Breaks:
    """Breaks of the engine's holds, in one step or two (see the module docstring)."""

    def __init__(
        self,
        engine: LockEngine,
        losses: LossWatch,
        notices: LossNotices,
        commits: Commits,
        stats: StatsRecorder,
        grace_ms: int,
    ) -> None:
        self._engine = engine
        self._losses = losses
        self._notices = notices
        self._commits = commits
        self._stats = stats
        #: how long a break waits for a listening holder to stop.
        self.grace_ms = grace_ms

    def begin(self, caller: Caller, key: str, reason: str) -> dict[str, Any] | PendingBreak:
        """An authorized break: the result now, or a :class:`PendingBreak` when a holder listens."""
        engine, losses, commits = self._engine, self._losses, self._commits
        now = commits.now()
        listening = [w for w in losses.of_key(key) if engine.find(key, w.handle) is not None]
        if not listening and not losses.stopping_of_key(key):
            broken = engine.break_lock(now, key)
            commits.commit_request()
            return break_result(self._stats, caller, key, reason, broken)
        keep = {w.handle for w in listening} | {w.handle for w in losses.stopping_of_key(key)}
        ended = self._release_others(now, key, keep)
        # Before anyone is told: a write that fails leaves the break undone.
        commits.commit_request(now=True)
        pending, events = losses.begin_break(
            key,
            reason,
            caller.principal,
            listening,
            ended,
            now + self.grace_ms,
            self._notices.at(),
        )
        log.info(kv(event="break_waits", key=key, by=caller.principal, holders=len(events)))
        for event in events:
            self._notices.on_lost(event)
        return pending

    def _release_others(self, now: int, key: str, keep: set[str]) -> Sequence[Lease]:
        """Release the holds of ``key`` a break need not wait for (nobody listens for them).

        Only holds granted before the break (fence up to the current one):
        a waiter these releases let in is a new holder, not broken.
        """
        engine = self._engine
        before = engine.fence
        ended: Sequence[Lease] = ()
        while True:
            others = [
                lease
                for lease in engine.status(now, key).holders
                if lease.handle not in keep and lease.fence <= before
            ]
            if not others:
                return ended
            for lease in others:
                engine.release(now, key, lease.handle)
            ended = (*ended, *others)

    def finish(self, caller: Caller, pending: PendingBreak) -> dict[str, Any]:
        """End a waiting break: the holds still stopping are released, the queue served."""
        engine, key = self._engine, pending.key
        now = self._commits.now()
        for watched in pending.stopping:
            if engine.find(key, watched.handle) is not None:
                engine.release(now, key, watched.handle)
        self._losses.end_break(pending)
        self._commits.commit_request(now=True)
        broken = sorted([*pending.ended, *pending.stopping], key=lambda hold: hold.fence)
        return break_result(self._stats, caller, key, pending.reason, broken)
