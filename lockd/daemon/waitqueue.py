"""The engine's waiters: every key's queue, who is woken when a hold ends, deadlock checks.

A blocking acquire that cannot hold now waits in its key's queue (an
intrusive list on the key's :class:`~lockd.daemon.keytable.KeyState`, in
arrival order). When a holder leaves, :meth:`WaitQueues.serve` asks
:func:`lockd.core.woken` who may hold now and grants them, head first
(docs/contract.md §10: no overtaking); a waiter that leaves from the head
(timeout, cancel) may let the next one in. Before a wait begins,
:meth:`WaitQueues.cycle_closed_by` asks :mod:`lockd.core.deadlock` whether
it would close a cycle of waits (docs/contract.md §12).

This is the engine's queue service (:mod:`lockd.daemon.engine`), kept
apart from the holders' bookkeeping (:mod:`lockd.daemon.keytable`) it
grants through, and from time (:mod:`lockd.daemon.expiry`), which only
tells it that a hold or a wait has ended.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from lockd import core
from lockd.core.deadlock import Budget, blockers, find_cycle
from lockd.daemon.deadlines import Deadlines
from lockd.daemon.journal import Journal
from lockd.daemon.keytable import KeyState, KeyTable, holders
from lockd.daemon.leases import Lease, Waiter


class WaitQueues:
    """Every waiter, by id and by connection, and the service of each key's queue."""

    def __init__(
        self,
        table: KeyTable,
        deadlines: Deadlines,
        journal: Journal,
        waiters: dict[int, Waiter],
    ) -> None:
        self._table = table
        self._deadlines = deadlines
        self._journal = journal
        self._undo = journal.undo
        #: every waiting waiter by id (shared with ``deadlines``, which skips
        #: the heap entries of ids no longer here).
        self.waiters = waiters
        self.conn_waiters: dict[int, set[int]] = {}
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    # ------------------------------------------------------------- joining

    def enqueue(self, state: KeyState, waiter: Waiter) -> None:
        undo = self._undo
        last = state.q_last
        waiter.prev = last
        if last is None:
            state.q_first = waiter
        else:
            undo.set_attr(last, "next", waiter)
        state.q_last = waiter
        state.q_len += 1
        undo.put(self.waiters, waiter.id, waiter)
        ids = self.conn_waiters.get(waiter.conn)
        if ids is None:
            ids = set()
            undo.put(self.conn_waiters, waiter.conn, ids)
        undo.add_to(ids, waiter.id)
        self._deadlines.push_waiter(waiter)

    def dequeue(self, state: KeyState, waiter: Waiter) -> None:
        """Unlink ``waiter`` from its key's queue and forget it: O(1) anywhere in the queue."""
        self._table.unlink(state, waiter, "q_first", "q_last")
        state.q_len -= 1
        self._undo.delete(self.waiters, waiter.id)
        ids = self.conn_waiters.get(waiter.conn)
        if ids is not None:
            self._undo.discard_from(ids, waiter.id)
            if not ids:
                self._undo.delete(self.conn_waiters, waiter.conn)

    def leave(self, now: int, waiter: Waiter, at: int | None = None) -> None:
        """A waiter left (timeout, cancel); if it was the head, the next may fit now."""
        if self.waiters.get(waiter.id) is not waiter:
            return
        state = self._table.keys[waiter.key]
        was_head = state.q_first is waiter
        self.dequeue(state, waiter)
        if was_head:
            self.serve(now, state, at)

    # ------------------------------------------------------------- serving

    def end_hold(self, now: int, state: KeyState, lease: Lease, at: int | None = None) -> None:
        """A holder is gone (release, expiry, close): serve the queue, or drop the key.

        ``at`` is when it happened if that was before ``now`` (an expiry
        applied late): see :meth:`serve`.
        """
        if state.count == 1 and state.q_len == 0:
            self._table.drop_key(lease.key, state)
            return
        self._table.free(state, lease)
        self.serve(now, state, at)

    def serve(self, now: int, state: KeyState, at: int | None = None) -> None:
        """Grant the head of the queue while it fits (docs/contract.md §10: no overtaking).

        The key freed ``at`` (default: now). A waiter whose own deadline
        came before that has timed out and is not granted: in time order
        its timeout comes first. Only a late expiry or a request settling
        its key while the timer is behind meets such a waiter here.
        """
        dead_before = now + 1 if at is None else at
        timed_out: list[Waiter] = []
        table = self._table
        owned = table.owned
        key = state.q_first.key if state.q_first is not None else None

        def holds_owned(principal: str, owner: str) -> bool:
            return (key, principal, owner) in owned

        resolved = self._journal.changes.resolved
        for waiter in core.woken(
            state.mode,
            state.count,
            state.limit,
            self._live_heads(state, dead_before, timed_out),
            holds_owned=holds_owned,
        ):
            self.dequeue(state, waiter)
            self._undo.set_attr(waiter, "lease", table.grant(now, state, waiter))
            resolved.append(waiter)
        if timed_out and state.count == 0 and state.q_len == 0:
            table.drop_key(timed_out[0].key, state)  # nobody left to hand the key to

    def _live_heads(
        self, state: KeyState, dead_before: int, timed_out: list[Waiter]
    ) -> Iterator[Waiter]:
        """The head of the key's queue, read afresh each time (the caller grants it).

        A head whose deadline came before ``dead_before`` has timed out: it
        leaves the queue (noted in ``timed_out``) and is never offered.
        """
        while (waiter := state.q_first) is not None:
            if waiter.deadline < dead_before:
                self._undo.set_attr(waiter, "timed_out", True)
                self._journal.changes.resolved.append(waiter)
                self.dequeue(state, waiter)
                timed_out.append(waiter)
                continue
            yield waiter

    # ------------------------------------------------------------ deadlock

    def cycle_closed_by(self, state: KeyState, claim: Waiter) -> list[str] | None:
        """The keys of the cycle of waits ``claim`` would close by parking, or None.

        Runs only when a blocking acquire is about to park; the graph and
        its bounds are :mod:`lockd.core.deadlock`'s.
        """
        if len(self.conn_waiters) == (claim.conn in self.conn_waiters):
            return None  # no other connection waits: nobody can wait for this one
        budget = Budget()
        first = self._blockers(state, claim, state.q_last, budget)
        if not first:
            return None
        keys = self._table.keys

        def waits_of(conn: int) -> Iterator[tuple[str, set[int]]]:
            for waiter_id in self.conn_waiters.get(conn, ()):
                waiter = self.waiters[waiter_id]
                waited = keys.get(waiter.key)
                if waited is not None:
                    yield waiter.key, self._blockers(waited, waiter, waiter.prev, budget)

        return find_cycle(claim.conn, claim.key, first, waits_of, budget=budget)

    def _blockers(
        self, state: KeyState, claim: Waiter, last_ahead: Waiter | None, budget: Budget
    ) -> set[int]:
        """The connections ``claim`` waits for: its key's holders, the queue to ``last_ahead``."""
        held = ((lease.mode, lease.taken_by) for lease in holders(state))
        return blockers(
            claim.mode,
            claim.limit,
            held,
            self._queue_back(last_ahead),
            conn=claim.conn,
            budget=budget,
        )

    @staticmethod
    def _queue_back(waiter: Waiter | None) -> Iterator[tuple[str, int | None]]:
        """Mode and connection of ``waiter`` and every waiter before it, nearest first."""
        while waiter is not None:
            yield waiter.mode, waiter.conn
            waiter = waiter.prev
