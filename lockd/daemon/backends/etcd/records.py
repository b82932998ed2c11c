"""Where the etcd backend keeps a lock's state, and how its records read back.

Every record of one lock key lives in that key's **directory**
``<prefix>k/<hex of the key>/``, so one range read returns the key's holds,
bindings and waiters together, at one revision, and one compare over the
directory guards a decision (docs/etcd-design.md §2-3):

- ``h/<handle id>``: a hold, on its own lease (the TTL); its create
  revision is its fence;
- ``b/<handle id>``: the binding of a ``releaseOnClose`` hold, on the
  daemon's session lease: a bound hold is live only while both exist. A
  TTL hold that another daemon granted is *tied* the same way to the
  session of the waiter's daemon until that daemon has it (§5);
- ``w/<session lease, hex>/<seq>``: a waiter, on the session lease; queue
  order is its create revision, then its key. It carries the whole hold it
  asks for (handle, TTL, pid, process, ``releaseOnClose``), so any daemon
  can grant it.

Beside the directories, ``<prefix>n/<node>`` on a daemon's session lease
claims its node name (``nodeclaim.py``).

Lock keys are hex-encoded: any UTF-8 (``/`` included) becomes a path part,
and hex keeps byte order, so etcd's key order is the lock keys' order and
``list`` pages with plain range reads. No I/O here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lockd.core import EXCLUSIVE, SHARED, is_retake
from lockd.daemon.backends.etcd import queue
from lockd.daemon.backends.etcd.wire import KeyValue
from lockd.daemon.waiterview import QueuedWaiter


class Layout:
    """The etcd keys of one lockd installation, under ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self.root = prefix.encode()
        #: every lock key's directory starts with this.
        self.locks = self.root + b"k/"

    def node(self, name: str) -> bytes:
        """The claim of a node name (``backend.node``: letters, digits, ``.``, ``_``, ``-``)."""
        return self.root + b"n/" + name.encode()

    def directory(self, key: str) -> bytes:
        return self.locks + key.encode().hex().encode() + b"/"

    def hold(self, key: str, handle: str) -> bytes:
        return self.holds(key) + handle.encode()

    def holds(self, key: str) -> bytes:
        """The prefix of every hold of ``key``."""
        return self.directory(key) + b"h/"

    def is_waiter(self, etcd_key: bytes) -> bool:
        """True for a waiter record (``w/`` in its directory)."""
        parts = etcd_key[len(self.locks) :].split(b"/")
        return etcd_key.startswith(self.locks) and len(parts) > 1 and parts[1] == b"w"

    def binding(self, key: str, handle: str) -> bytes:
        return self.directory(key) + b"b/" + handle.encode()

    def waiter(self, key: str, session: int, seq: int) -> bytes:
        return self.directory(key) + b"w/%016x/%012d" % (session, seq)

    def lock_key(self, etcd_key: bytes) -> str:
        """The lock key a record of ``etcd_key`` belongs to."""
        hex_key = etcd_key[len(self.locks) :].split(b"/", 1)[0]
        return bytes.fromhex(hex_key.decode()).decode()

    def after(self, key: str) -> bytes:
        """The first etcd key past every record of lock key ``key`` (for paging)."""
        return self.directory(key)[:-1] + b"0"  # "0" sorts right after "/"


@dataclass(frozen=True)
class Hold:
    """One holder of a lock key, as its record says.

    ``expires_at`` (epoch ms) is the earliest moment the hold can end: the
    lease's TTL counted from when its grant or last keepalive was *sent*.
    """

    key: str
    handle: str
    principal: str
    owner: str | None
    mode: str
    limit: int
    node: str
    pid: int | None
    process: str | None
    ttl_ms: int
    expires_at: int
    lease: int
    bound: bool
    #: granted by another daemon and not yet confirmed by its own: live only
    #: while its binding (on its daemon's session lease) exists.
    tied: bool = False
    #: the lease's true end as its granter knew it (epoch ms, 0: unknown);
    #: ``expires_at`` is the TTL's end, up to HEADROOM_S earlier.
    lease_end: int = 0
    #: revisions etcd gave the record (0 before it is written).
    fence: int = 0
    mod_revision: int = 0
    #: granted as a re-take of the caller's own hold (not stored).
    retake: bool = False
    #: the holder process's start time and where its pid means something
    #: (``nodeclaim.pid_place``), for ``alive``; None in older records.
    pid_start: int | None = None
    pid_place: str | None = None
    #: granted to a connection that listens for events: a break made through
    #: another daemon waits for its holder to stop (etcd-design.md §6a).
    #: False in older records: such a break deletes it at once.
    listens: bool = False

    def value(self) -> bytes:
        return json.dumps(
            {
                "principal": self.principal,
                "owner": self.owner,
                "mode": self.mode,
                "limit": self.limit,
                "node": self.node,
                "pid": self.pid,
                "process": self.process,
                "ttlMs": self.ttl_ms,
                "expiresAt": self.expires_at,
                "bound": self.bound,
                "tied": self.tied,
                "leaseEnd": self.lease_end,
                "pidStart": self.pid_start,
                "pidPlace": self.pid_place,
                "listens": self.listens,
            },
            separators=(",", ":"),
        ).encode()

    @property
    def needs_binding(self) -> bool:
        """Live only while its binding exists (``releaseOnClose``, or tied)."""
        return self.bound or self.tied

    @classmethod
    def parse(cls, key: str, handle: str, kv: KeyValue) -> Hold:
        return _parsed_hold(key, handle, kv)

    @classmethod
    def _parse(cls, key: str, handle: str, kv: KeyValue) -> Hold:
        doc: dict[str, Any] = json.loads(kv.value)
        return cls(
            key=key,
            handle=handle,
            principal=doc["principal"],
            owner=doc["owner"],
            mode=doc["mode"],
            limit=doc["limit"],
            node=doc["node"],
            pid=doc["pid"],
            process=doc["process"],
            ttl_ms=doc["ttlMs"],
            expires_at=doc["expiresAt"],
            lease=kv.lease,
            bound=doc["bound"],
            tied=doc.get("tied", False),
            lease_end=doc.get("leaseEnd", 0),
            fence=kv.create_revision,
            mod_revision=kv.mod_revision,
            pid_start=_int_or_none(doc.get("pidStart")),
            pid_place=_str_or_none(doc.get("pidPlace")),
            listens=doc.get("listens") is True,
        )


@dataclass(frozen=True)
class Waiter:
    """A queued request, as its record says.

    It names the hold it asks for in full (``handle`` .. ``bound``), so the
    daemon that releases the key can grant it in its release's own
    transaction. A record without ``handle`` (written by a daemon before
    that) is granted by its own daemon only.
    """

    etcd_key: bytes
    create_revision: int
    principal: str
    owner: str | None
    mode: str
    limit: int
    node: str
    #: the session lease it hangs on.
    lease: int = 0
    handle: str | None = None
    ttl_ms: int = 0
    pid: int | None = None
    process: str | None = None
    bound: bool = False
    #: when the request came (epoch ms, the granting daemon's wall clock):
    #: status's ``waiterList.since``; None in records of older daemons.
    since: int | None = None
    #: as :class:`Hold`'s, carried into the hold it is granted.
    pid_start: int | None = None
    pid_place: str | None = None
    listens: bool = False

    def value(self) -> bytes:
        doc = {
            "principal": self.principal,
            "owner": self.owner,
            "mode": self.mode,
            "limit": self.limit,
            "node": self.node,
            "handle": self.handle,
            "ttlMs": self.ttl_ms,
            "pid": self.pid,
            "process": self.process,
            "bound": self.bound,
            "since": self.since,
            "pidStart": self.pid_start,
            "pidPlace": self.pid_place,
            "listens": self.listens,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, kv: KeyValue) -> Waiter:
        return _parsed_waiter(kv)

    @classmethod
    def _parse(cls, kv: KeyValue) -> Waiter:
        doc: dict[str, Any] = json.loads(kv.value)
        return cls(
            etcd_key=kv.key,
            create_revision=kv.create_revision,
            principal=doc["principal"],
            owner=doc["owner"],
            mode=doc["mode"],
            limit=doc["limit"],
            node=doc["node"],
            lease=kv.lease,
            handle=doc.get("handle"),
            ttl_ms=doc.get("ttlMs", 0),
            pid=doc.get("pid"),
            process=doc.get("process"),
            bound=doc.get("bound", False),
            since=doc.get("since"),
            pid_start=_int_or_none(doc.get("pidStart")),
            pid_place=_str_or_none(doc.get("pidPlace")),
            listens=doc.get("listens") is True,
        )

    def queued(self) -> QueuedWaiter:
        """As status's ``waiterList`` shows it."""
        return QueuedWaiter(
            self.principal, self.pid, self.process, self.mode, self.limit, self.since, self.node
        )

    @property
    def claim(self) -> queue.Claim:
        return queue.Claim(
            self.etcd_key,
            self.create_revision,
            _mode(self.mode),
            self.limit,
            self.principal,
            self.owner,
        )

    @property
    def grantable(self) -> bool:
        """True when its record names the whole hold (any daemon may grant it)."""
        return self.handle is not None and self.ttl_ms > 0

    def hold(self, key: str) -> Hold:
        """The hold it asks for, less what a grant fills in (lease, expiry, fence)."""
        assert self.handle is not None
        return Hold(
            key=key,
            handle=self.handle,
            principal=self.principal,
            owner=self.owner,
            mode=self.mode,
            limit=self.limit,
            node=self.node,
            pid=self.pid,
            process=self.process,
            ttl_ms=self.ttl_ms,
            expires_at=0,
            lease=0,
            bound=self.bound,
            pid_start=self.pid_start,
            pid_place=self.pid_place,
            listens=self.listens,
        )


@dataclass
class Directory:
    """One lock key's records at one revision, sorted out."""

    key: str
    revision: int
    #: live holds, oldest grant first.
    holds: list[Hold] = field(default_factory=list)
    #: etcd keys of bound holds whose binding is gone: dead, to delete.
    dead: list[bytes] = field(default_factory=list)
    #: waiters in queue order.
    waiters: list[Waiter] = field(default_factory=list)
    #: every etcd key present (to tell which of our waiters are still queued).
    present: set[bytes] = field(default_factory=set)
    #: the records it was read from.
    records: list[KeyValue] = field(default_factory=list)

    @classmethod
    def parse(cls, layout: Layout, key: str, kvs: Sequence[KeyValue], revision: int) -> Directory:
        base = len(layout.directory(key))
        bindings: set[bytes] = set()
        found: list[tuple[bytes, KeyValue]] = []
        waiters: list[Waiter] = []
        for kv in kvs:
            kind, _, name = kv.key[base:].partition(b"/")
            if kind == b"b":
                bindings.add(name)
            elif kind == b"h":
                found.append((name, kv))
            elif kind == b"w":
                waiters.append(Waiter.parse(kv))
        directory = cls(key, revision, present={kv.key for kv in kvs}, records=list(kvs))
        for name, kv in found:
            hold = Hold.parse(key, name.decode(), kv)
            if hold.needs_binding and name not in bindings:
                directory.dead.append(kv.key)
            else:
                directory.holds.append(hold)
        directory.holds.sort(key=lambda h: h.fence)
        directory.waiters = sorted(waiters, key=lambda w: (w.create_revision, w.etcd_key))
        return directory

    def lost(self, waiter: Waiter) -> bool:
        """True when ``waiter``'s key was written before this read and is gone from it.

        A waiter written after the read (``create_revision`` above it, or 0
        while its write is under way) is simply not in it yet.
        """
        written = 0 < waiter.create_revision <= self.revision
        return written and waiter.etcd_key not in self.present

    def hold_claims(self, layout: Layout) -> list[queue.Claim]:
        return [
            queue.Claim(
                layout.hold(self.key, h.handle),
                h.fence,
                _mode(h.mode),
                h.limit,
                h.principal,
                h.owner,
            )
            for h in self.holds
        ]

    def limit_in_force(self) -> int | None:
        """The limit every request must name while the key has claims (oldest claim's)."""
        claims: list[tuple[int, int]] = [(h.fence, h.limit) for h in self.holds]
        claims += [(w.create_revision, w.limit) for w in self.waiters]
        return min(claims)[1] if claims else None

    def own_hold(self, principal: str, owner: str | None) -> Hold | None:
        """The caller's hold with this owner (a re-take takes it back), oldest first."""
        for hold in self.holds:
            if is_retake(hold.principal, hold.owner, principal, owner):
                return hold
        return None


#: records parsed lately, kept per kind. A key's queue decides from the
#: same records again at every watch event (``QueueView.directory``), and parsing
#: them (JSON, then a frozen dataclass of ~20 fields) was a tenth of a
#: daemon's CPU under B2. A record is the same record only with the same
#: key, value, revisions and lease: ``KeyValue`` (frozen) compares them all.
PARSED_KEPT = 2048


@functools.lru_cache(maxsize=PARSED_KEPT)
def _parsed_hold(key: str, handle: str, kv: KeyValue) -> Hold:
    return Hold._parse(key, handle, kv)


@functools.lru_cache(maxsize=PARSED_KEPT)
def _parsed_waiter(kv: KeyValue) -> Waiter:
    return Waiter._parse(kv)


def _mode(mode: str) -> queue.Mode:
    return SHARED if mode == SHARED else EXCLUSIVE


def _int_or_none(value: object) -> int | None:
    """A number another version may have left out (or written otherwise): None then."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
