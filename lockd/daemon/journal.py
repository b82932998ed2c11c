"""What the engine's requests since the last commit did: effects to persist, changes to undo.

The engine (:mod:`lockd.daemon.engine`) hands its effects to the caller as
one :class:`~lockd.daemon.leases.Changes` per commit, and must be able to
put its memory back when that commit fails. Both records start and end
together -- at the first request after a commit, at :meth:`Journal.drain`
or :meth:`Journal.rollback` -- so they live in one object, kept apart from
the lock state they describe: every part of the engine writes to it, none
of them owns it.

A rollback here only restores what the journal itself holds (the
effects gathered and the undo log's entries); re-indexing the state the
undo log brought back is the engine's part, since only it knows the
indexes (:meth:`lockd.daemon.engine.LockEngine.rollback`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lockd.daemon.leases import Changes
from lockd.daemon.undo import UndoLog

#: where :class:`Changes` stood when the batch's first request began:
#: (resolved, expired, grants, retakes, fence, lease count).
_Mark = tuple[int, int, int, int, int | None, int]


class Journal:
    """The pending :class:`Changes` and the undo log of the requests since the last drain."""

    __slots__ = ("_mark", "changes", "request_keys", "undo")

    def __init__(self) -> None:
        self.changes = Changes()
        #: what the running request changed (see rollback()).
        self.undo = UndoLog()
        self._mark: _Mark = (0, 0, 0, 0, None, 0)
        #: the keys the requests since the last drain() changed (one each).
        self.request_keys: set[str] = set()

    @property
    def recording(self) -> bool:
        """Requests changed state since the last drain: a rollback would undo them."""
        return self.undo.recording

    def begin(self, key: str, lease_count: int) -> None:
        """A request on ``key`` starts: record what it changes until drain() or rollback().

        Requests of one group commit (several before a drain) share one
        record, and what time did between them joins it: a failed commit
        undoes every request of the batch, back to its first one's start.
        """
        if self.undo.recording:
            self.request_keys.add(key)
            return
        c = self.changes
        self.request_keys = {key}
        self.undo.begin()
        self._mark = (len(c.resolved), len(c.expired), c.grants, c.retakes, c.fence, lease_count)

    def drain(self) -> Changes:
        """Hand over the effects gathered so far (they were committed)."""
        changes, self.changes = self.changes, Changes()
        self.undo.stop()
        return changes

    @contextlib.contextmanager
    def outside_requests(self, lease_count: Callable[[], int]) -> Iterator[None]:
        """Cold keys come in during a batch of requests: no part of the batch.

        A failed group commit rolls back every request of the batch (see
        :meth:`begin`); a key loaded meanwhile stays loaded, with its
        leases counted (``lease_count()`` before and after the block), as
        if it had been loaded before the batch began.
        """
        count = lease_count()
        with self.undo.paused():
            yield
        if self.undo.recording:
            resolved, expired, grants, retakes, fence, counted = self._mark
            added = lease_count() - count
            self._mark = (resolved, expired, grants, retakes, fence, counted + added)

    def rollback(self) -> tuple[list[Any], int] | None:
        """Undo the batch's changes: the objects that came back and the lease count to restore.

        The gathered effects go back to where the batch began; effects of
        time and of departed clients gathered before its first request
        stay. Handed-out fences are not taken back (a skipped fence is
        harmless, a reused one is not). None when nothing was recording.
        """
        if not self.undo.recording:
            return None
        restored = self.undo.rollback()
        resolved, expired, grants, retakes, fence, lease_count = self._mark
        changes = self.changes
        del changes.resolved[resolved:]
        del changes.expired[expired:]
        changes.grants, changes.retakes, changes.fence = grants, retakes, fence
        return restored, lease_count
