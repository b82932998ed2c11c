"""Both ends of a break across hosts that waits for the holder (docs/etcd-design.md §6a).

The records and decisions are in :mod:`holdstop` (no I/O); here the etcd
calls:

- :func:`break_waiting`, the breaking daemon's side: one guarded
  transaction deletes what need not wait and asks the holders' daemons to
  stop the rest; then it waits, on a watch of the directory, until those
  holds are gone, and deletes any still there at the bound itself;
- :func:`end_stopped`, the holder's daemon's side: its holder stopped (or
  its grace passed): delete the hold, its binding and the request at once.

Each etcd step is bounded by the backend's timeout; the wait between them
by the grace plus ``TAKEOVER_MARGIN_MS``: a break never wedges a key.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import trio

from lockd.daemon.backends import BackendUnavailable
from lockd.daemon.backends.etcd.acquiring import guard
from lockd.daemon.backends.etcd.gateway import (
    EtcdError,
    EtcdUnavailable,
    LeaseNotFound,
    WatchCompacted,
)
from lockd.daemon.backends.etcd.holdloss import BREAK_RECORD, break_record
from lockd.daemon.backends.etcd.holdstop import (
    StopAsked,
    ask_ops,
    end_ops,
    hold_keys_gone,
    must_wait_for,
    stop_key,
    stop_record,
    takeover_at,
)
from lockd.daemon.backends.etcd.records import Directory, Hold
from lockd.daemon.backends.etcd.waiting import RETRY_INTERVAL
from lockd.daemon.backends.etcd.wire import (
    DeleteOp,
    DeleteResult,
    Op,
    OpResult,
    PutOp,
    RangeOp,
    RangeResult,
    WatchRequest,
    as_bytes,
)
from lockd.logfmt import kv
from lockd.timefmt import format_epoch_ms

if TYPE_CHECKING:
    from lockd.daemon.backends.etcd.backend import EtcdBackend

log = logging.getLogger("lockd.etcd")

#: guarded attempts before a break gives up on a directory that keeps changing.
BREAK_ATTEMPTS = 8


def _bounded(backend: EtcdBackend) -> trio.CancelScope:
    return trio.CancelScope(deadline=trio.current_time() + backend.timeout)


def _unavailable(backend: EtcdBackend) -> BackendUnavailable:
    return BackendUnavailable(f"no answer within {backend.timeout:g} s")


async def _nothing_to_stop(handles: list[str]) -> None:
    pass


async def break_waiting(
    backend: EtcdBackend,
    key: str,
    by: str,
    reason: str,
    grace_ms: int,
    *,
    keep: frozenset[str] = frozenset(),
    stop_local: Callable[[list[str]], Awaitable[None]] = _nothing_to_stop,
) -> list[Hold]:
    """Break ``key``, waiting up to the bound for the holders that get time to stop.

    ``keep``: holds of this daemon's listening connections; those still
    there at the first transaction stay while ``stop_local`` (given their
    handles after it) tells their holders and waits for them, then go.
    Listening holds of other daemons are asked to stop through etcd at the
    same time. Every other hold ends at once. Returns every hold the break
    ended, oldest first; the reply that follows means the key is free
    (docs/contract.md §12.1), as on one host.
    """
    with _bounded(backend) as scope:
        asked = await _ask(backend, key, by, reason, grace_ms, keep)
    if scope.cancelled_caught or asked is None:
        raise _unavailable(backend)
    deleted, kept, waited, revision = asked
    for hold in deleted:
        backend.revoke_later(hold.lease)
    failed: list[BackendUnavailable] = []

    async def reported(part: Callable[[], Awaitable[None]]) -> None:
        try:
            await part()
        except BackendUnavailable as exc:  # etcd did not answer: the break fails as a whole
            failed.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reported, partial(_end_kept, backend, key, kept, by, reason, stop_local))
        if waited:
            nursery.start_soon(
                reported,
                partial(_await_elsewhere, backend, key, waited, revision, by, reason, grace_ms),
            )
    if failed:
        raise failed[0]
    return sorted([*deleted, *kept, *waited], key=lambda hold: hold.fence)


async def _end_kept(
    backend: EtcdBackend,
    key: str,
    kept: list[Hold],
    by: str,
    reason: str,
    stop_local: Callable[[list[str]], Awaitable[None]],
) -> None:
    """Tell this daemon's listening holders; once they stopped (or the grace passed), end them."""
    await stop_local([hold.handle for hold in kept])
    if not kept:
        return
    await _take_over(backend, key, [hold.handle for hold in kept], by, reason)


async def _await_elsewhere(
    backend: EtcdBackend,
    key: str,
    waited: list[Hold],
    revision: int,
    by: str,
    reason: str,
    grace_ms: int,
) -> None:
    """Wait for the holds other daemons end once their holders stopped; end them at the bound."""
    log.info(kv(event="break_waits_elsewhere", key=key, by=by, holders=len(waited)))
    requests = {stop_key(backend.layout, key, hold.handle) for hold in waited}
    backend.stop_requests |= requests  # not orphans while the break waits
    try:
        deadline = trio.current_time() + takeover_at(0, grace_ms) / 1000
        left = await _wait_gone(backend, key, {h.handle for h in waited}, revision, deadline)
        if left:
            log.warning(kv(event="break_takeover", key=key, by=by, holders=len(left)))
            await _take_over(backend, key, sorted(left), by, reason)
    finally:
        backend.stop_requests -= requests
        for request in requests:  # gone with their hold, or left by a re-take
            backend.delete_later(request)


async def _ask(
    backend: EtcdBackend, key: str, by: str, reason: str, grace_ms: int, keep: frozenset[str]
) -> tuple[list[Hold], list[Hold], list[Hold], int] | None:
    """One guarded txn: delete the holds that need not wait, ask the others' daemons to stop.

    Returns (deleted, kept, waited for elsewhere, the txn's revision); None
    if the directory kept changing under it.
    """
    layout = backend.layout
    directory = await backend._read(key)
    for _attempt in range(BREAK_ATTEMPTS):
        waited = [h for h in must_wait_for(directory.holds, backend.node) if h.handle not in keep]
        spared = keep | {hold.handle for hold in waited}
        kept = [hold for hold in directory.holds if hold.handle in keep]
        deleted = [hold for hold in directory.holds if hold.handle not in spared]
        at = format_epoch_ms(backend.clock.wall_ms())
        # The records hang on the session: they go with this daemon if it dies.
        lease = await backend.sessions.wait()
        ops: list[Op] = []
        for hold in deleted:
            ops += [
                DeleteOp(layout.hold(key, hold.handle)),
                DeleteOp(layout.binding(key, hold.handle)),
            ]
        ops += [DeleteOp(dead) for dead in directory.dead]
        record_key = layout.directory(key) + BREAK_RECORD
        if deleted:
            ops.append(PutOp(record_key, break_record(by, reason, at), lease=lease))
        values = {h.handle: stop_record(h.node, by, reason, at, grace_ms) for h in waited}
        ops += ask_ops(layout, key, waited, values, lease)
        if not ops:
            return [], kept, [], directory.revision
        try:
            result = await backend.etcd.txn(
                [guard(layout, key, directory.revision)],
                ops,
                [RangeOp(layout.directory(key), prefix=True)],
            )
        except LeaseNotFound:
            backend.sessions.refused(lease)  # the session ended under us: the next one
            raise EtcdUnavailable("the etcd session ended; a new one is being granted") from None
        if result.succeeded:
            if deleted:
                backend.delete_later(record_key)
            return deleted, kept, waited, result.header.revision
        directory = _reread(backend, key, result.responses[0], result.header.revision)
    return None


def _reread(backend: EtcdBackend, key: str, read: object, revision: int) -> Directory:
    assert isinstance(read, RangeResult)
    return Directory.parse(backend.layout, key, read.kvs, revision)


async def _wait_gone(
    backend: EtcdBackend, key: str, waited: set[str], revision: int, deadline: float
) -> set[str]:
    """Follow the directory from ``revision`` until every waited hold is deleted.

    Returns the handles still there at ``deadline`` (empty: all gone).
    Survives etcd being away and compaction (the holds are read again).
    """
    layout = backend.layout
    left = set(waited)
    start = revision + 1
    with trio.move_on_at(deadline):
        while left:
            try:
                async with backend.etcd.watch(
                    WatchRequest(layout.directory(key), prefix=True, start_revision=start)
                ) as watch:
                    try:
                        async for response in watch:
                            left -= hold_keys_gone(layout, key, left, response.events)
                            if not left:
                                break
                    finally:
                        start = watch.next_revision or start
            except WatchCompacted as exc:
                start = exc.compact_revision
                left = await _still_held(backend, key, left)
            except (EtcdUnavailable, EtcdError) as exc:
                log.info(kv(event="break_wait_retry", key=key, error=exc))
                await trio.sleep(RETRY_INTERVAL)
    return left


async def _still_held(backend: EtcdBackend, key: str, handles: set[str]) -> set[str]:
    result = await backend.etcd.txn(
        [], [RangeOp(backend.layout.hold(key, handle)) for handle in sorted(handles)]
    )
    found = set()
    for handle, read in zip(sorted(handles), result.responses, strict=True):
        if isinstance(read, RangeResult) and read.kvs:
            found.add(handle)
    return found


async def _take_over(
    backend: EtcdBackend, key: str, handles: list[str], by: str, reason: str
) -> None:
    """Delete holds a break waited for, with the break record: this daemon's own once
    their holders stopped, or another daemon's still there at the bound.

    The record lets another daemon, if it comes back, tell its holder a
    break (with who and why) rather than an expiry.
    """
    layout = backend.layout
    record_key = layout.directory(key) + BREAK_RECORD
    at = format_epoch_ms(backend.clock.wall_ms())
    ops = [
        *end_ops(layout, key, handles),
        PutOp(record_key, break_record(by, reason, at), lease=backend.session_lease or 0),
    ]
    result = None
    with _bounded(backend) as scope:
        try:
            result = await backend.etcd.txn([], ops)
        except (EtcdUnavailable, EtcdError) as exc:
            log.info(kv(event="break_takeover_failed", key=key, error=exc))
    backend.delete_later(record_key)
    if result is None or scope.cancelled_caught:
        # The clean-up list deletes them as soon as etcd answers; the breaker
        # is told the backend did not answer (a break can be sent again).
        for op in ops[:-1]:
            assert isinstance(op, DeleteOp)
            backend.delete_later(as_bytes(op.key))
        raise _unavailable(backend)
    _revoke_deleted(backend, result.responses)


def _revoke_deleted(backend: EtcdBackend, responses: Sequence[OpResult]) -> None:
    """Revoke the lease of every hold ``end_ops`` deleted (its prev_kv says which)."""
    for response in responses[::3]:
        if isinstance(response, DeleteResult):
            for record in response.prev_kvs:
                backend.revoke_later(record.lease)


async def end_stopped(backend: EtcdBackend, ask: StopAsked) -> bool:
    """The holder stopped (or its grace passed): delete its hold, binding and request.

    One transaction; the key's queue moves on from the deletion as from a
    release. Tried while etcd does not answer, up to the backend's timeout:
    past that the breaking daemon deletes it at its bound. True once done.
    """
    ops = end_ops(backend.layout, ask.key, [ask.handle])
    with trio.move_on_after(backend.timeout):
        while True:
            try:
                result = await backend.etcd.txn([], ops)
            except (EtcdUnavailable, EtcdError) as exc:
                log.info(kv(event="break_end_retry", key=ask.key, error=exc))
                await trio.sleep(RETRY_INTERVAL)
                continue
            _revoke_deleted(backend, result.responses)
            return True
    return False
