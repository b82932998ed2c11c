"""Losses made elsewhere, pushed at once: one watch over every lock directory.

docs/contract.md §12.1, docs/etcd-design.md §6a. A hold this daemon granted
to a connection that listens for events can end without this daemon doing
anything: a break or a re-take through another host's daemon, its TTL
lease running out in etcd, or etcd ending the session lease its binding
hangs on. :class:`HoldWatch` follows ``<prefix>k/`` (``prev_kv``: a
deleted hold's record says which node granted it) from the first such hold
on, and tells the daemon (``on_loss``) within one watch event of the
revision that ended it; :mod:`holdloss` reads the cause from the events.

Why one watch over the prefix rather than one per held key: over etcd's
JSON gateway every watch is an HTTP stream of its own (a connection, a
watcher in etcd, a round trip to start), so a watch per key would cost a
connection per held key and leave each new hold unwatched until its watch
started. One stream costs one connection for the daemon's life and covers a
hold from its grant's revision on; its price is that every lockd write of
the cluster passes through it (a few hundred bytes each), dropped here
unless it ends a hold of this node. It starts with the first listened-to
hold and ends at the first event after the last one went: a daemon whose
clients never ask for events never opens it.

The stream survives the loss of a member (the gateway resumes it elsewhere
from the next revision), etcd being away (tried again every
``RETRY_INTERVAL``, from where it stopped) and compaction (each watched hold
is read again; one found gone is told as below, without who or why). A
failure of its own code restarts it with back-off (``tasks.keep_running``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends.etcd.crossbreak import end_stopped
from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdUnavailable, WatchCompacted
from lockd.daemon.backends.etcd.holdloss import SeenLoss, losses_in
from lockd.daemon.backends.etcd.holdstop import StopAsked, stops_asked
from lockd.daemon.backends.etcd.tasks import keep_running, logged
from lockd.daemon.backends.etcd.waiting import RETRY_INTERVAL
from lockd.daemon.backends.etcd.wire import Event, WatchRequest
from lockd.daemon.events import EXPIRED
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.backend import EtcdBackend
    from lockd.daemon.remote import StopRequest

log = logging.getLogger("lockd.etcd")

#: losses of holds not (yet) watched, kept for a grant whose watch starts
#: after the stream passed its revision (the grant's reply goes out after
#: its commit): that many at most, oldest dropped first.
RECENT_LOSSES = 4096


def _ignore_loss(key: str, handle: str, cause: str, by: str | None, reason: str | None) -> None:
    pass


def _ignore_release(handle: str) -> None:
    pass


def _nothing_watched(handle: str) -> bool:
    return False


def _no_holds() -> list[tuple[str, str]]:
    return []


def _none_watched() -> bool:
    return False


async def _not_stopping(ask: StopRequest) -> bool:
    return False


class HoldWatch:
    """One daemon's watch of the holds it granted (see the module doc)."""

    def __init__(self, backend: EtcdBackend) -> None:
        self.backend = backend
        #: tells the listening holder: ``(key, handle, cause, by, reason)``.
        self.on_loss: Callable[[str, str, str, str | None, str | None], None] = _ignore_loss
        #: a watched hold was released through another daemon (no event).
        self.on_released: Callable[[str], object] = _ignore_release
        #: is ``handle`` a hold whose holder listens (and should be told)?
        self.is_watched: Callable[[str], bool] = _nothing_watched
        #: ``(key, handle)`` of every watched hold (read again after compaction).
        self.watched_holds: Callable[[], list[tuple[str, str]]] = _no_holds
        #: is any hold watched? (None is: the stream ends at its next event.)
        self.any_watched: Callable[[], bool] = _none_watched
        #: a break through another daemon asks a watched hold to stop: tell its
        #: holder and wait until it stopped or its grace passed (False: the hold
        #: is not watched any more, nothing to end here).
        self.await_stop: Callable[[StopRequest], Awaitable[bool]] = _not_stopping
        self._started = False
        #: the revision the stream goes on from.
        self._from = 0
        self._recent: OrderedDict[str, SeenLoss] = OrderedDict()
        #: stop requests for holds not (yet) watched, kept likewise.
        self._recent_asks: OrderedDict[str, StopAsked] = OrderedDict()
        #: losses told (tests, debugging), by cause.
        self.told: dict[str, int] = {}

    def follow(self, handle: str, fence: int) -> None:
        """A hold granted at revision ``fence`` is now watched: follow it from there."""
        early = self._recent.pop(handle, None)
        if early is not None and early.revision > fence:
            self._seen(early)  # it ended before its watch began
        asked = self._recent_asks.pop(handle, None)
        if asked is not None:
            self._asked(asked)  # a break elsewhere asked before its watch began
        if self._started:
            return
        nursery = self.backend.nursery
        if nursery is None:  # not running (stopping): nothing to follow
            return
        self._started = True
        self._from = fence + 1
        nursery.start_soon(keep_running, "hold_watch", self._run)

    async def _run(self) -> None:
        while True:
            start = self._from
            request = WatchRequest(
                self.backend.layout.locks, prefix=True, start_revision=start, prev_kv=True
            )
            try:
                async with self.backend.etcd.watch(request) as watch:
                    try:
                        async for response in watch:
                            self.take(response.events)
                            if not self.any_watched():
                                # Nobody listens any more: the stream costs
                                # CPU for every write of the cluster; the
                                # next watched hold starts it again.
                                self._started = False
                                return
                    finally:
                        self._from = watch.next_revision or start
            except WatchCompacted as exc:
                log.info(kv(event="hold_watch_compacted", revision=exc.compact_revision))
                self._from = exc.compact_revision
                await self._read_again()
            except (EtcdUnavailable, EtcdError) as exc:
                log.info(kv(event="hold_watch_retry", error=exc))
                await trio.sleep(RETRY_INTERVAL)

    def take(self, events: Sequence[Event]) -> None:
        """One watch response: tell the losses it shows of holds of this node."""
        backend = self.backend
        for loss in losses_in(backend.layout, backend.node, events):
            self._seen(loss)
        for ask in stops_asked(backend.layout, backend.node, events):
            self._asked(ask)

    def _asked(self, ask: StopAsked) -> None:
        if not self.is_watched(ask.handle):
            self._recent_asks[ask.handle] = ask
            while len(self._recent_asks) > RECENT_LOSSES:
                self._recent_asks.popitem(last=False)
            return
        nursery = self.backend.nursery
        if nursery is not None:
            nursery.start_soon(logged, "hold_stop", partial(self._stop, ask))

    async def _stop(self, ask: StopAsked) -> None:
        """A break elsewhere waits for this hold: once its holder stopped, end it here."""
        if await self.await_stop(ask):
            self.told["stopAsked"] = self.told.get("stopAsked", 0) + 1
            await end_stopped(self.backend, ask)

    def _seen(self, loss: SeenLoss) -> None:
        if not self.is_watched(loss.handle):
            self._recent[loss.handle] = loss
            while len(self._recent) > RECENT_LOSSES:
                self._recent.popitem(last=False)
            return
        if loss.cause is not None:
            self._tell(loss.key, loss.handle, loss.cause, loss.by, loss.reason)
            return
        nursery = self.backend.nursery
        if nursery is not None:
            nursery.start_soon(logged, "hold_loss", partial(self._explain, loss))

    def _tell(self, key: str, handle: str, cause: str, by: str | None, reason: str | None) -> None:
        self.told[cause] = self.told.get(cause, 0) + 1
        self.on_loss(key, handle, cause, by, reason)

    async def _explain(self, loss: SeenLoss) -> None:
        """A hold deleted without a break or re-take: expired if its lease is gone.

        A lease that still exists means a plain deletion: the handle was
        released through another daemon (its lease went back to that
        daemon's pool), or a dead hold was cleared, or an older daemon broke
        it without a record: nothing is told (a renew answers ``lease_lost``).
        When etcd cannot say within the backend's timeout, or the lease is
        unknown (compaction took the record), the hold is gone all the same:
        it is told as expired.
        """
        expired = True
        if loss.lease:
            with trio.move_on_after(self.backend.timeout):
                while True:
                    try:
                        found = await self.backend.etcd.lease_time_to_live(loss.lease)
                    except (EtcdUnavailable, EtcdError) as exc:
                        log.info(kv(event="hold_loss_retry", key=loss.key, error=exc))
                        await trio.sleep(RETRY_INTERVAL)
                        continue
                    expired = found.ttl < 0
                    break
        if not self.is_watched(loss.handle):
            return  # released meanwhile by this daemon, or told another way
        if expired:
            self._tell(loss.key, loss.handle, EXPIRED, None, None)
        else:
            self.on_released(loss.handle)

    async def _read_again(self) -> None:
        """After compaction: every watched hold still in etcd? (What is gone is told.)"""
        for key, handle in self.watched_holds():
            while True:
                try:
                    hold = await self.backend.find(key, handle)
                    break
                except (EtcdUnavailable, EtcdError) as exc:
                    log.info(kv(event="hold_watch_retry", key=key, error=exc))
                    await trio.sleep(RETRY_INTERVAL)
            if hold is None and self.is_watched(handle):
                self._seen(SeenLoss(key, handle, None, None, None, 0, self._from))
