"""A break across hosts that waits for the holder to stop: records and decisions, no I/O.

docs/etcd-design.md §6a, docs/contract.md §11, §12.1. A hold whose record
says ``listens`` (granted to a connection that asked for events) and that
another daemon granted is not deleted by a break: the breaking daemon (B)
puts a **stop request** ``<directory>s/<handle>`` beside it, in a
transaction guarded by the directory's revision. The hold stays, so no
other request can be granted over it. The granting daemon (A) sees the
request on its watch of the holds (:func:`stops_asked`), tells the holder
(``cause: "break"``, with who and why), and once the holder said
``stopped`` (or closed, or the grace passed) deletes the hold, its binding
and the request in one transaction (:func:`end_ops`): the key's queue moves
on from that deletion as from any release. B answers the break once the
hold is gone; if it is still there at :func:`takeover_at` (A is dead, cut
off, or never saw the request), B deletes it itself (:func:`end_ops`, with
the break record): the wait is bounded by the grace plus
:data:`TAKEOVER_MARGIN_MS`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockd.daemon.backends.etcd.records import Hold, Layout
from lockd.daemon.backends.etcd.wire import DeleteOp, Event, Op, PutOp

#: the kind of a stop request in a lock key's directory (``s/<handle>``).
STOP_KIND = b"s"
#: how long after the grace the breaking daemon waits for the holder's
#: daemon before it deletes the hold itself: room for that daemon to see the
#: request (one watch event) and commit its deletion on a loaded box.
TAKEOVER_MARGIN_MS = 1000


def stop_key(layout: Layout, key: str, handle: str) -> bytes:
    return layout.directory(key) + STOP_KIND + b"/" + handle.encode()


def stop_record(node: str, by: str, reason: str, at: str, grace_ms: int) -> bytes:
    """The stop request's value: whose hold (``node``), who broke it, why, when, the grace."""
    doc = {"node": node, "by": by, "reason": reason, "at": at, "graceMs": grace_ms}
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class StopAsked:
    """A stop request seen on the watch: the hold ``handle`` of ``key`` was broken."""

    key: str
    handle: str
    by: str | None
    reason: str | None
    #: how long its holder may take to stop, counted from when it is seen.
    grace_ms: int


def must_wait_for(holds: Sequence[Hold], node: str) -> list[Hold]:
    """The holds a break through ``node`` asks to stop instead of deleting.

    Those another daemon granted to a listening connection: only that daemon
    can tell their holders and hear them stop. This daemon's own listening
    holders are waited for in its memory (``RemoteService``), and records
    without ``listens`` (older daemons, holds nobody listens for) end at once.
    """
    return [hold for hold in holds if hold.listens and hold.node != node]


def takeover_at(committed_ms: int, grace_ms: int) -> int:
    """When the breaking daemon deletes a hold still there (its clock, from its commit)."""
    return committed_ms + grace_ms + TAKEOVER_MARGIN_MS


def ask_ops(
    layout: Layout, key: str, waited: Sequence[Hold], value_of: dict[str, bytes], lease: int
) -> list[Op]:
    """Put one stop request per waited hold (``value_of``: handle -> :func:`stop_record`)."""
    return [
        PutOp(stop_key(layout, key, hold.handle), value_of[hold.handle], lease=lease)
        for hold in waited
    ]


def end_ops(layout: Layout, key: str, handles: Sequence[str]) -> list[Op]:
    """Delete each hold, its binding and its stop request (``prev_kv``: what was there)."""
    ops: list[Op] = []
    for handle in handles:
        ops += [
            DeleteOp(layout.hold(key, handle), prev_kv=True),
            DeleteOp(layout.binding(key, handle), prev_kv=True),
            DeleteOp(stop_key(layout, key, handle)),
        ]
    return ops


def stops_asked(layout: Layout, node: str, events: Sequence[Event]) -> list[StopAsked]:
    """The stop requests for holds of ``node`` that one watch response put."""
    asked: list[StopAsked] = []
    base = len(layout.locks)
    for event in events:
        if event.type != "PUT" or not event.kv.key.startswith(layout.locks):
            continue
        hex_key, _, rest = event.kv.key[base:].partition(b"/")
        kind, _, name = rest.partition(b"/")
        if kind != STOP_KIND or not name:
            continue
        try:
            key = bytes.fromhex(hex_key.decode()).decode()
            doc: Any = json.loads(event.kv.value)
        except ValueError:
            continue
        if not isinstance(doc, dict) or doc.get("node") != node:
            continue
        grace = doc.get("graceMs")
        grace_ms = grace if isinstance(grace, int) and not isinstance(grace, bool) else 0
        by, reason = doc.get("by"), doc.get("reason")
        asked.append(
            StopAsked(
                key,
                name.decode(errors="replace"),
                by if isinstance(by, str) else None,
                reason if isinstance(reason, str) else None,
                max(0, grace_ms),
            )
        )
    return asked


def hold_keys_gone(layout: Layout, key: str, waited: set[str], events: Sequence[Event]) -> set[str]:
    """The handles of ``waited`` whose hold one watch response deleted."""
    gone: set[str] = set()
    prefix = layout.holds(key)
    for event in events:
        if event.type == "DELETE" and event.kv.key.startswith(prefix):
            handle = event.kv.key[len(prefix) :].decode(errors="replace")
            if handle in waited:
                gone.add(handle)
    return gone
