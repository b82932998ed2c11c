"""The engine's common case with less work: a free key granted, a lone holder released.

Most requests a busy daemon sees are a ``tryAcquire`` of a key nobody
holds and the ``release`` of that hold, with nobody queued and no deadline
due. :meth:`LockEngine.acquire <lockd.daemon.engine.LockEngine.acquire>`
and :meth:`~lockd.daemon.engine.LockEngine.release` answer them too, but
on the way build a :class:`~lockd.daemon.leases.Waiter` for the request,
look for due deadlines through the heaps' pruning, and keep the key's
state for a rollback. :class:`LoneKeys` answers exactly these two cases
the same way -- the same lease, fence, rows, undo entries and indexes, the
same :func:`lockd.core.admit_free` decision -- and says no (changing
nothing) to everything else, which then goes the usual way.

It is one of the engine's rooms (:mod:`lockd.daemon.engine`), given the
state it works on; the service's fast path (:mod:`lockd.daemon.fastpath`)
asks it through ``engine.lone``.
"""

from __future__ import annotations

from lockd import core
from lockd.daemon.coldpath import ColdPath
from lockd.daemon.expiry import Expiry
from lockd.daemon.journal import Journal
from lockd.daemon.keytable import KeyTable
from lockd.daemon.leases import Lease


class LoneKeys:
    """Grants of free keys and releases of their only holder, when no time has to pass first."""

    __slots__ = ("_coldpath", "_expiry", "_journal", "_table")

    def __init__(
        self, table: KeyTable, expiry: Expiry, coldpath: ColdPath, journal: Journal
    ) -> None:
        self._table = table
        self._expiry = expiry
        self._coldpath = coldpath
        self._journal = journal

    def can_grant(self, now: int, key: str, mode: str, limit: int) -> bool:
        """Would ``acquire`` grant ``key`` at once as a free key, with nothing due first?

        Changes nothing. True means :meth:`grant` may follow, with nothing
        else done to the engine in between. False for a key someone holds,
        a key still cold (its rows must be read), or when a deadline has
        come (it must be applied first).
        """
        return (
            key not in self._table.keys
            and core.admit_free(key, mode, limit) == core.GRANT
            and not self._coldpath.needs_load(key)
            and self._expiry.quiet(now)
        )

    def grant(
        self,
        now: int,
        key: str,
        *,
        ttl_ms: int,
        principal: str,
        owner: str | None,
        conn: int,
        release_on_close: bool,
        mode: str,
        limit: int,
        pid: int | None,
        process: str | None,
        pid_start: int | None,
    ) -> Lease:
        """``acquire``'s grant of a free key, once :meth:`can_grant` said yes: no waiter made."""
        table = self._table
        self._expiry.pass_quietly(now, key)
        self._journal.begin(key, table.lease_count)
        lease = table.new_lease(
            now,
            key,
            principal,
            owner,
            ttl_ms,
            conn,
            release_on_close,
            mode,
            limit,
            pid,
            process,
            pid_start,
        )
        return table.grant_free(lease)

    def release(self, now: int, key: str, handle: str) -> bool:
        """``release`` of ``key``'s only holder when nobody waits and nothing is due.

        False, with nothing changed, in every other case (other holders,
        waiters, a deadline that came, a handle that does not hold the
        key): ``release`` answers those.
        """
        table = self._table
        state = table.keys.get(key)
        if state is None or state.count != 1 or state.q_len or not self._expiry.quiet(now):
            return False
        lease = state.first
        if lease is None or lease.handle != handle:
            return False
        self._expiry.pass_quietly(now, key)
        self._journal.begin(key, table.lease_count)
        # release() keeps the key's state for a rollback first; dropping the
        # key leaves the state object as it was, so there is nothing to keep.
        table.drop_key(key, state)
        return True
