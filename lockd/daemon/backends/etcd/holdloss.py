"""What ended a hold, read from the watch of the lock directories (docs/etcd-design.md §6a).

Pure: no I/O. :class:`~lockd.daemon.backends.etcd.holdwatch.HoldWatch`
follows every directory (``<prefix>k/``) with ``prev_kv`` and hands each
watch response here; this module says which holds of *this* daemon's node
the response ended, and why. Every way a hold ends is one revision, and
etcd delivers a revision's events together:

- **break** (any daemon of this version): the break's transaction deletes
  the holds and bindings and puts ``<directory>x``, the break record
  (:func:`break_record`: who broke it and the reason);
- **re-take** (a request through any daemon, or a queue grant that takes a
  hold back): the old hold is deleted and a hold with the same principal and
  owner is put in the same directory;
- **session**: a binding (``b/``) deleted alone, its hold neither deleted
  nor rewritten in that revision: etcd ended the session lease it hung on
  (an untie or a renew rewrites the hold in the same revision);
- anything else that deletes a hold is *unexplained* here: its lease ran
  out (etcd deletes the key when it revokes the lease), or somebody with
  the handle released it through another daemon, or a daemon older than
  this one broke it without a record. The watcher tells them apart by
  asking etcd whether the hold's lease still exists (``cause=None`` below).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lockd.daemon.backends.etcd.records import Layout
from lockd.daemon.backends.etcd.wire import Event, KeyValue
from lockd.daemon.events import BREAK, RETAKE, SESSION

#: the name of the break record in a lock key's directory.
BREAK_RECORD = b"x"


def break_record(by: str, reason: str, at: str) -> bytes:
    """The break record's value: who broke the key, why, when (RFC 3339)."""
    return json.dumps({"by": by, "reason": reason, "at": at}, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Broken:
    """Who broke a key and why, as the break record says (fields may be missing: None)."""

    by: str | None
    reason: str | None

    @classmethod
    def parse(cls, value: bytes) -> Broken:
        try:
            doc: Any = json.loads(value)
        except ValueError:
            return cls(None, None)
        if not isinstance(doc, dict):
            return cls(None, None)
        by, reason = doc.get("by"), doc.get("reason")
        return cls(by if isinstance(by, str) else None, reason if isinstance(reason, str) else None)


@dataclass(frozen=True, slots=True)
class SeenLoss:
    """A hold of this node that a watch response ended."""

    key: str
    handle: str
    #: break, retake, session; None: unexplained (expired, or released elsewhere).
    cause: str | None
    by: str | None
    reason: str | None
    #: the hold's lease (to ask etcd when the cause is unexplained); 0 if unknown.
    lease: int
    #: the revision that ended it.
    revision: int


@dataclass(slots=True)
class _Revision:
    """One directory's events at one revision."""

    broken: Broken | None = None
    #: (principal, owner) of every hold put.
    put_holds: list[tuple[str, str | None]] | None = None
    #: handle -> the deleted hold's record (prev_kv, None when etcd sent none).
    deleted_holds: dict[str, KeyValue | None] | None = None
    #: handles whose binding was deleted.
    deleted_bindings: list[str] | None = None
    #: handles whose hold was put (a rewrite: renew, untie, unbind).
    rewritten: set[str] | None = None


def _parse_doc(kv: KeyValue | None) -> dict[str, Any]:
    if kv is None:
        return {}
    try:
        doc = json.loads(kv.value)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def losses_in(layout: Layout, node: str, events: Sequence[Event]) -> list[SeenLoss]:
    """The holds granted on ``node`` that ``events`` (one watch response) ended, and why.

    A deleted hold whose record (``prev_kv``) names another node is not
    ours; one without a record (etcd compacted it) is kept, since the
    caller only acts on handles it watches.
    """
    groups: dict[tuple[int, str], _Revision] = {}
    base = len(layout.locks)
    for event in events:
        etcd_key = event.kv.key
        if not etcd_key.startswith(layout.locks):
            continue
        hex_key, _, rest = etcd_key[base:].partition(b"/")
        kind, _, name = rest.partition(b"/")
        try:
            key = bytes.fromhex(hex_key.decode()).decode()
        except ValueError:
            continue
        group = groups.setdefault((event.kv.mod_revision, key), _Revision())
        handle = name.decode(errors="replace")
        if event.type == "PUT":
            if kind == BREAK_RECORD and not name:
                group.broken = Broken.parse(event.kv.value)
            elif kind == b"h":
                doc = _parse_doc(event.kv)
                if group.put_holds is None:
                    group.put_holds, group.rewritten = [], set()
                assert group.rewritten is not None
                group.put_holds.append((str(doc.get("principal")), doc.get("owner")))
                group.rewritten.add(handle)
        elif kind == b"h":
            if group.deleted_holds is None:
                group.deleted_holds = {}
            group.deleted_holds[handle] = event.prev_kv
        elif kind == b"b":
            if group.deleted_bindings is None:
                group.deleted_bindings = []
            group.deleted_bindings.append(handle)
    found: list[SeenLoss] = []
    for (revision, key), group in groups.items():
        for handle, record in (group.deleted_holds or {}).items():
            doc = _parse_doc(record)
            if record is not None and doc.get("node") != node:
                continue
            lease = record.lease if record is not None else 0
            if group.broken is not None:
                cause, by, reason = BREAK, group.broken.by, group.broken.reason
            elif doc.get("owner") is not None and (
                (doc.get("principal"), doc.get("owner")) in (group.put_holds or ())
            ):
                cause, by, reason = RETAKE, str(doc.get("principal")), None
            else:
                cause, by, reason = None, None, None
            found.append(SeenLoss(key, handle, cause, by, reason, lease, revision))
        for handle in group.deleted_bindings or ():
            if handle in (group.deleted_holds or {}) or handle in (group.rewritten or ()):
                continue  # released, broken, re-taken, or untied: not the session
            found.append(SeenLoss(key, handle, SESSION, None, None, 0, revision))
    return found
