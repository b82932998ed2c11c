"""A grant on its way to its caller (etcd): untied from this daemon's session before it is
answered, or discarded when nobody will get it.

A grant a waiter's daemon made through the queue is *tied*: its hold ends with
that daemon's etcd session until the untie transaction commits. The answer
waits for that commit, so an acknowledged hold lasts its TTL whichever daemon
dies when (docs/etcd-design.md, the untie). Moved out of ``acquiring.py``,
which asks for these, so that each room stays one sitting's read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import trio

from lockd.daemon.backends import BackendUnavailable
from lockd.daemon.backends.etcd.cleanup import CleanupList
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdGateway, EtcdUnavailable
from lockd.daemon.backends.etcd.records import Hold, Layout
from lockd.daemon.backends.etcd.supply import HoldSupply, kept_lease
from lockd.daemon.backends.etcd.waiting import RETRY_INTERVAL
from lockd.daemon.backends.etcd.wire import Compare, DeleteOp, PutOp, RangeOp, RangeResult
from lockd.logfmt import kv

log = logging.getLogger("lockd.etcd")


class Delivery:
    """Grants of this daemon's acquires, between their transaction and their answer."""

    def __init__(
        self,
        etcd: EtcdGateway,
        layout: Layout,
        timeout: float,
        supply: HoldSupply,
        cleanup: CleanupList,
        track: Callable[[Hold, int | None], None],
    ) -> None:
        self._etcd = etcd
        self._layout = layout
        self._timeout = timeout
        self._supply = supply
        self._cleanup = cleanup
        #: the backend's books: a grant's fence, a bound hold's connection.
        self._track = track

    async def deliver(self, granted: Hold, conn: int, deadline: float) -> Hold | None:
        """A grant to a waiter of ours, as its acquire answers it: untied first if tied."""
        if granted.tied:
            try:
                confirmed = await self._confirm(granted, max(deadline, trio.current_time() + 1))
            except BaseException:
                await self.discard(granted)
                raise
            if confirmed is None:
                await self.discard(granted)
                return None
            granted = confirmed
        self._track(granted, conn)
        return granted

    async def _untie_txn(self, hold: Hold) -> bool:
        """Rewrite a tied hold untied, if it is unchanged and still live (its binding there).

        The binding must exist: once it is gone (the session ended) the hold
        is dead, and other daemons' decisions delete it; untying it then
        would bring back a hold they may be granting over.
        """
        hold_key = self._layout.hold(hold.key, hold.handle)
        binding_key = self._layout.binding(hold.key, hold.handle)
        result = await self._etcd.txn(
            [
                Compare(hold_key, "mod_revision", "==", hold.mod_revision),
                Compare(binding_key, "version", ">", 0),
            ],
            [
                PutOp(hold_key, replace(hold, tied=False).value(), lease=hold.lease),
                DeleteOp(binding_key),
            ],
            [RangeOp(hold_key)],
        )
        if result.succeeded:
            return True
        # An earlier attempt whose outcome was unknown may have untied it:
        # then the same grant (its create revision, the fence) is there untied.
        read = result.responses[0]
        assert isinstance(read, RangeResult)
        if read.kvs and read.kvs[0].create_revision == hold.fence:
            return not Hold.parse(hold.key, hold.handle, read.kvs[0]).needs_binding
        return False

    async def _confirm(self, hold: Hold, deadline: float) -> Hold | None:
        """Untie a tied hold before its grant is answered (docs/contract.md: an acknowledged hold
        lasts
        its TTL whichever daemon dies when).

        Until then it ends with this daemon's session, like any grant that was
        never delivered. Retried while etcd does not answer, up to the
        acquire's ``deadline``; None when that passed first (the caller then
        discards the grant and times out). ``EtcdUnavailable`` when the hold
        was dead already (this daemon's session ended under it).
        """
        with trio.move_on_at(deadline):
            while True:
                try:
                    if await self._untie_txn(hold):
                        return replace(hold, tied=False)
                except (EtcdUnavailable, EtcdError) as exc:
                    log.info(kv(event="untie_retry", key=hold.key, error=exc))
                    await trio.sleep(RETRY_INTERVAL)
                    continue
                raise EtcdUnavailable(
                    f"the grant of {hold.key!r} ended with this daemon's etcd session"
                )
        return None

    async def discard(self, hold: Hold) -> None:
        """Delete a grant nobody will get, before the caller answers (``cancel``: CANCELLED
        comes once the key is free of it). Shielded and bounded by the etcd timeout; the
        clean-up list takes it when etcd does not answer in time."""
        hold_key, binding_key = (
            self._layout.hold(hold.key, hold.handle),
            self._layout.binding(hold.key, hold.handle),
        )
        with trio.CancelScope(shield=True), trio.move_on_after(self._timeout):
            try:
                await self._etcd.txn([], [DeleteOp(hold_key), DeleteOp(binding_key)])
            except (BackendUnavailable, EtcdError) as exc:
                log.info(kv(event="discard_later", key=hold.key, error=exc))
            else:
                self._supply.keep_lease(kept_lease(hold))
                return
        self.release_undelivered(hold)

    def release_undelivered(self, hold: Hold) -> None:
        """A grant nobody will get: its records deleted and its lease revoked, once etcd answers."""
        self._cleanup.delete_later(self._layout.hold(hold.key, hold.handle))
        self._cleanup.delete_later(self._layout.binding(hold.key, hold.handle))
        self._cleanup.revoke_later(hold.lease)
