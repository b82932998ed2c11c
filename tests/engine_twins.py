"""Two engines that must answer alike, driven by the same generated requests.

The cold-start, lazy-restore and demotion tests each compare an engine that
keeps everything in memory with one that does not; this is what they share:
one request applied to an engine (:func:`apply_op`), and how answers, key
views and written rows are put in a comparable form.
"""

from __future__ import annotations

from typing import Any

from lockd.daemon.engine import KeyStatus, Lease, LockEngine


def view(status: KeyStatus) -> Any:
    return (
        status.key,
        status.mode,
        status.limit,
        status.holder_count,
        status.waiters,
        [(h.fence, h.handle, h.slot, h.owner, h.principal, h.expires_at) for h in status.holders],
    )


def answer(result: object) -> Any:
    if isinstance(result, Lease):
        return ("lease", result.fence, result.handle, result.slot, result.expires_at)
    return type(result).__name__


def apply_op(
    e: LockEngine, now: int, op: tuple[Any, ...], handles: list[str], *, record: bool
) -> Any:
    """Apply one generated request to ``e``; its answer, comparable across engines.

    ``acquire`` is ``(kind, key, mode, owner)`` or, with more to vary,
    ``(kind, key, mode, owner, wait_ms, conn, ttl)`` (conn 0: not bound).
    ``release``/``renew`` pick one of ``handles`` by number; with ``record``, the
    handle of every lease this engine grants is added to them (one engine of the
    two records: both answer with the same handles).
    """
    kind = op[0]
    if kind == "status":
        return view(e.status(now, op[1]))
    if kind == "list":
        page = e.list_held(now, prefix=op[1], limit=op[2], after=op[3])
        return ([view(s) for s in page.locks], page.next)
    if kind == "acquire":
        _, key, mode, owner, *more = op
        wait_ms, conn, ttl = more if more else (None, 0, 100)
        result = e.acquire(
            now,
            key,
            ttl_ms=ttl,
            principal="user:a",
            owner=owner,
            mode=mode,
            wait_ms=wait_ms,
            conn=conn,
            release_on_close=conn > 0,
        )
        if isinstance(result, Lease) and record:
            handles.append(result.handle)
        return answer(result)
    if kind in ("release", "renew"):
        handle = handles[op[2] % len(handles)] if handles else "none"
        if kind == "release":
            return e.release(now, op[1], handle)
        return answer(e.renew(now, op[1], handle, 100))
    if kind == "break":
        return [lease.fence for lease in e.break_lock(now, op[1])]
    if kind == "close":
        return sorted(lease.fence for lease in e.connection_closed(now, op[1]))
    assert kind == "advance", op
    return e.advance(now, budget=op[1])


def written(rows: list[dict[Any, Any]]) -> list[dict[Any, Any]]:
    """The rows each engine wrote, as (fence, expiry) per key (None: deleted)."""
    return [{k: None if v is None else (v.fence, v.expires_at) for k, v in r.items()} for r in rows]
