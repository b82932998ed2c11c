"""Typed results decoded from the daemon's replies (docs/contract.md §3 "Results").

Every result keeps the daemon's JSON object as ``raw``. Times are parsed into
timezone-aware :class:`~datetime.datetime` objects (UTC).
"""

from __future__ import annotations

# The C datetime, whose classes ``datetime`` re-exports: the ``datetime``
# module runs its pure-Python twin first, a cost every ``lockd`` command paid
# at start-up (issue 24).
try:
    from _datetime import UTC, datetime
except ImportError:  # an interpreter without the C module
    from datetime import UTC, datetime

from ._errors import LockdError
from ._record import Frozen, Record

TYPE_CHECKING = False  # ``typing`` only for the type checker (start-up cost, issue 24)
if TYPE_CHECKING:
    from typing import Any

#: fills a frozen record's slots (its own ``__setattr__`` refuses)
_fill = object.__setattr__
#: an instance with empty slots, for the ``from_result`` fast paths that fill them
_new = object.__new__

__all__ = ["BreakResult", "Handle", "Holder", "LockStatus", "ReleaseResult", "RenewResult"]


class Handle(Record):
    """A granted lease: what ``acquire``/``try_acquire`` return.

    ``handle`` is the secret handle id that proves the hold (it is left out
    of ``repr``). ``lease_expires_at`` and ``ttl_ms`` are updated in place by a
    successful :meth:`LockClient.renew`. ``lost`` is set to ``True`` by
    auto-renew (see :meth:`LockClient.lock`) when the lease is known to be gone.
    """

    __slots__ = ("fence", "handle", "key", "lease_expires_at", "lost", "owner", "raw", "ttl_ms")
    __match_args__ = (
        "key",
        "handle",
        "fence",
        "owner",
        "ttl_ms",
        "lease_expires_at",
        "raw",
        "lost",
    )
    _hidden = frozenset({"handle", "raw"})
    _fields = __match_args__

    key: str
    handle: str
    fence: int
    owner: str | None
    ttl_ms: int
    lease_expires_at: datetime | None
    raw: dict[str, Any]
    lost: bool

    def __init__(
        self,
        key: str,
        handle: str,
        fence: int,
        owner: str | None,
        ttl_ms: int,
        lease_expires_at: datetime | None,
        raw: dict[str, Any] | None = None,
        lost: bool = False,
    ) -> None:
        self.key = key
        self.handle = handle
        self.fence = fence
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.lease_expires_at = lease_expires_at
        self.raw = {} if raw is None else raw
        self.lost = lost

    @classmethod
    def from_result(cls, result: object) -> Handle:
        """Build a Handle from a grant result object."""
        # The common, well-formed grant is checked in one expression (it is on
        # every try_acquire's path); anything else takes the field-by-field
        # checks below, which name what is wrong.
        if type(result) is dict:
            key = result.get("key")
            handle = result.get("handle")
            fence = result.get("fence")
            ttl_ms = result.get("ttlMs")
            owner = result.get("owner")
            if (
                type(key) is str
                and type(handle) is str
                and type(fence) is int
                and type(ttl_ms) is int
                and (owner is None or type(owner) is str)
            ):
                expires = result.get("leaseExpiresAt")
                lease: datetime | None = None
                if type(expires) is str and expires[-1:] == "Z":
                    # The daemon's own form, parse_time's common case inline:
                    # fromisoformat reads the "Z" as UTC (Python >= 3.11).
                    try:
                        lease = datetime.fromisoformat(expires)
                    except ValueError:
                        lease = parse_time(expires)  # raises the PROTOCOL_ERROR
                else:
                    lease = parse_time(expires)
                if cls is not Handle:  # a subclass: its own __init__ runs
                    return cls(key, handle, fence, owner, ttl_ms, lease, result)
                # What __init__ does, without the call through type() and
                # __init__ (a fifth of building the result, every try_acquire).
                made = _new(Handle)
                made.key = key
                made.handle = handle
                made.fence = fence
                made.owner = owner
                made.ttl_ms = ttl_ms
                made.lease_expires_at = lease
                made.raw = result
                made.lost = False
                return made
        obj = _object(result, "handle")
        return cls(
            key=_req(obj, "key", str),
            handle=_req(obj, "handle", str),
            fence=_req(obj, "fence", int),
            owner=_opt(obj, "owner", str),
            ttl_ms=_req(obj, "ttlMs", int),
            lease_expires_at=parse_time(obj.get("leaseExpiresAt")),
            raw=obj,
        )


class RenewResult(Frozen):
    """Outcome of ``renew``: ``renewed``; ``reason`` (e.g. ``"lease_lost"``) when not."""

    __slots__ = ("lease_expires_at", "raw", "reason", "renewed")
    __match_args__ = ("renewed", "reason", "lease_expires_at", "raw")
    _hidden = frozenset({"raw"})
    _fields = __match_args__

    renewed: bool
    reason: str | None
    lease_expires_at: datetime | None
    raw: dict[str, Any]

    def __init__(
        self,
        renewed: bool,
        reason: str | None = None,
        lease_expires_at: datetime | None = None,
        raw: dict[str, Any] | None = None,
    ) -> None:
        _fill(self, "renewed", renewed)
        _fill(self, "reason", reason)
        _fill(self, "lease_expires_at", lease_expires_at)
        _fill(self, "raw", {} if raw is None else raw)

    @classmethod
    def from_result(cls, result: object) -> RenewResult:
        """Build a RenewResult from a ``renew`` result object."""
        obj = _object(result, "renew")
        return cls(
            renewed=_req(obj, "renewed", bool),
            reason=_opt(obj, "reason", str),
            lease_expires_at=parse_time(obj.get("leaseExpiresAt")),
            raw=obj,
        )

    def apply_to(self, handle: object, ttl_ms: int) -> None:
        """After a successful renew, bring a Handle's ``ttl_ms`` and expiry up to date."""
        if self.renewed and isinstance(handle, Handle):
            handle.ttl_ms = ttl_ms
            if self.lease_expires_at is not None:
                handle.lease_expires_at = self.lease_expires_at


class ReleaseResult(Frozen):
    """Outcome of ``release``: ``released``; ``reason`` (e.g. ``"not_holder"``) when not."""

    __slots__ = ("raw", "reason", "released")
    __match_args__ = ("released", "reason", "raw")
    _hidden = frozenset({"raw"})
    _fields = __match_args__

    released: bool
    reason: str | None
    raw: dict[str, Any]

    def __init__(
        self, released: bool, reason: str | None = None, raw: dict[str, Any] | None = None
    ) -> None:
        _fill(self, "released", released)
        _fill(self, "reason", reason)
        _fill(self, "raw", {} if raw is None else raw)

    @classmethod
    def from_result(cls, result: object) -> ReleaseResult:
        """Build a ReleaseResult from a ``release`` result object."""
        if type(result) is dict:  # the common case in one test, as for Handle
            released = result.get("released")
            reason = result.get("reason")
            if type(released) is bool and (reason is None or type(reason) is str):
                if cls is not ReleaseResult:  # a subclass: its own __init__ runs
                    return cls(released, reason, result)
                made = _new(ReleaseResult)  # __init__'s work without the call, as for Handle
                _fill(made, "released", released)
                _fill(made, "reason", reason)
                _fill(made, "raw", result)
                return made
        obj = _object(result, "release")
        return cls(
            released=_req(obj, "released", bool),
            reason=_opt(obj, "reason", str),
            raw=obj,
        )


class Holder(Frozen):
    """One current hold of a key (an entry of ``status().holders``); never its handle id.

    ``pid`` and ``process`` are the holder's process id and name
    (``/proc/PID/comm``) as the daemon saw them at the grant; ``node`` the
    host that granted it (etcd backend; ``None`` otherwise).
    """

    __slots__ = (
        "expires_in_ms",
        "fence",
        "held_by",
        "lease_expires_at",
        "node",
        "owner",
        "pid",
        "process",
        "raw",
    )
    __match_args__ = (
        "held_by",
        "owner",
        "fence",
        "lease_expires_at",
        "expires_in_ms",
        "pid",
        "process",
        "node",
        "raw",
    )
    _hidden = frozenset({"raw"})
    _fields = __match_args__

    held_by: str | None
    owner: str | None
    fence: int | None
    lease_expires_at: datetime | None
    expires_in_ms: int | None
    pid: int | None
    process: str | None
    node: str | None
    raw: dict[str, Any]

    def __init__(
        self,
        held_by: str | None,
        owner: str | None,
        fence: int | None,
        lease_expires_at: datetime | None,
        expires_in_ms: int | None,
        pid: int | None,
        process: str | None,
        node: str | None,
        raw: dict[str, Any] | None = None,
    ) -> None:
        _fill(self, "held_by", held_by)
        _fill(self, "owner", owner)
        _fill(self, "fence", fence)
        _fill(self, "lease_expires_at", lease_expires_at)
        _fill(self, "expires_in_ms", expires_in_ms)
        _fill(self, "pid", pid)
        _fill(self, "process", process)
        _fill(self, "node", node)
        _fill(self, "raw", {} if raw is None else raw)

    @classmethod
    def from_result(cls, result: object) -> Holder:
        """Build a Holder from one entry of ``holders``."""
        obj = _object(result, "holder")
        return cls(
            held_by=_opt(obj, "heldBy", str),
            owner=_opt(obj, "owner", str),
            fence=_opt(obj, "fence", int),
            lease_expires_at=parse_time(obj.get("leaseExpiresAt")),
            expires_in_ms=_opt(obj, "expiresInMs", int),
            pid=_opt(obj, "pid", int),
            process=_opt(obj, "process", str),
            node=_opt(obj, "node", str),
            raw=obj,
        )


class Waiter(Frozen):
    """One queued request for a key (an entry of ``status().waiter_list``, docs/contract.md §12).

    ``position`` 1 is next; ``since`` is when the request came and
    ``waiting_ms`` how long it has waited; ``node`` the host it waits on
    (etcd backend; ``None`` otherwise). Never a handle id.
    """

    __slots__ = (
        "limit",
        "mode",
        "node",
        "pid",
        "position",
        "principal",
        "process",
        "raw",
        "since",
        "waiting_ms",
    )
    __match_args__ = (
        "principal",
        "pid",
        "process",
        "mode",
        "limit",
        "since",
        "waiting_ms",
        "position",
        "node",
        "raw",
    )
    _hidden = frozenset({"raw"})
    _fields = __match_args__

    principal: str | None
    pid: int | None
    process: str | None
    mode: str | None
    limit: int | None
    since: datetime | None
    waiting_ms: int | None
    position: int | None
    node: str | None
    raw: dict[str, Any]

    def __init__(
        self,
        principal: str | None,
        pid: int | None,
        process: str | None,
        mode: str | None,
        limit: int | None,
        since: datetime | None,
        waiting_ms: int | None,
        position: int | None,
        node: str | None = None,
        raw: dict[str, Any] | None = None,
    ) -> None:
        _fill(self, "principal", principal)
        _fill(self, "pid", pid)
        _fill(self, "process", process)
        _fill(self, "mode", mode)
        _fill(self, "limit", limit)
        _fill(self, "since", since)
        _fill(self, "waiting_ms", waiting_ms)
        _fill(self, "position", position)
        _fill(self, "node", node)
        _fill(self, "raw", {} if raw is None else raw)

    @classmethod
    def from_result(cls, result: object) -> Waiter:
        """Build a Waiter from one entry of ``waiterList``."""
        obj = _object(result, "waiter")
        return cls(
            principal=_opt(obj, "principal", str),
            pid=_opt(obj, "pid", int),
            process=_opt(obj, "process", str),
            mode=_opt(obj, "mode", str),
            limit=_opt(obj, "limit", int),
            since=parse_time(obj.get("since")),
            waiting_ms=_opt(obj, "waitingMs", int),
            position=_opt(obj, "position", int),
            node=_opt(obj, "node", str),
            raw=obj,
        )


class LockStatus(Frozen):
    """Who holds a key (``status``, and each entry of ``list``); ``None`` fields when free.

    The single-holder fields (``held_by``, ``owner``, ``fence``,
    ``lease_expires_at``, ``expires_in_ms``, ``pid``, ``process``, ``node``)
    describe the oldest current grant; ``holders`` lists every hold (up to
    100, oldest first) and ``holder_count`` counts them all. ``mode`` is
    ``"exclusive"`` or ``"shared"`` (``None`` when free), ``limit`` the
    semaphore size in force. A daemon that predates shared holds sends none
    of these; they are then derived from the single-holder fields.
    """

    __slots__ = (
        "expires_in_ms",
        "fence",
        "held",
        "held_by",
        "holder_count",
        "holders",
        "key",
        "lease_expires_at",
        "limit",
        "mode",
        "node",
        "owner",
        "pid",
        "process",
        "raw",
        "waiter_list",
        "waiters",
    )
    __match_args__ = (
        "key",
        "held",
        "held_by",
        "owner",
        "fence",
        "lease_expires_at",
        "expires_in_ms",
        "waiters",
        "pid",
        "process",
        "node",
        "mode",
        "limit",
        "holder_count",
        "holders",
        "waiter_list",
        "raw",
    )
    _hidden = frozenset({"raw"})
    _fields = __match_args__

    key: str
    held: bool
    held_by: str | None
    owner: str | None
    fence: int | None
    lease_expires_at: datetime | None
    expires_in_ms: int | None
    waiters: int
    pid: int | None
    process: str | None
    node: str | None
    mode: str | None
    limit: int | None
    holder_count: int
    holders: tuple[Holder, ...]
    #: the first waiters in queue order (up to 100; docs/contract.md §12); ``waiters`` counts all.
    waiter_list: tuple[Waiter, ...]
    raw: dict[str, Any]

    def __init__(
        self,
        key: str,
        held: bool,
        held_by: str | None,
        owner: str | None,
        fence: int | None,
        lease_expires_at: datetime | None,
        expires_in_ms: int | None,
        waiters: int,
        pid: int | None = None,
        process: str | None = None,
        node: str | None = None,
        mode: str | None = None,
        limit: int | None = None,
        holder_count: int = 0,
        holders: tuple[Holder, ...] = (),
        waiter_list: tuple[Waiter, ...] = (),
        raw: dict[str, Any] | None = None,
    ) -> None:
        _fill(self, "key", key)
        _fill(self, "held", held)
        _fill(self, "held_by", held_by)
        _fill(self, "owner", owner)
        _fill(self, "fence", fence)
        _fill(self, "lease_expires_at", lease_expires_at)
        _fill(self, "expires_in_ms", expires_in_ms)
        _fill(self, "waiters", waiters)
        _fill(self, "pid", pid)
        _fill(self, "process", process)
        _fill(self, "node", node)
        _fill(self, "mode", mode)
        _fill(self, "limit", limit)
        _fill(self, "holder_count", holder_count)
        _fill(self, "holders", holders)
        _fill(self, "waiter_list", waiter_list)
        _fill(self, "raw", {} if raw is None else raw)

    @classmethod
    def from_result(cls, result: object) -> LockStatus:
        """Build a LockStatus from a ``status`` result object."""
        obj = _object(result, "status")
        waiters = _opt(obj, "waiters", int)
        held = _req(obj, "held", bool)
        raw_holders = obj.get("holders")
        if raw_holders is None:  # an older daemon: one holder at most
            holders: tuple[Holder, ...] = (Holder.from_result(obj),) if held else ()
        elif isinstance(raw_holders, list):
            holders = tuple(Holder.from_result(h) for h in raw_holders)
        else:
            raise _bad(f"field 'holders' should be a list, got {raw_holders!r}")
        count = _opt(obj, "holderCount", int)
        mode = _opt(obj, "mode", str)
        return cls(
            key=_req(obj, "key", str),
            held=held,
            held_by=_opt(obj, "heldBy", str),
            owner=_opt(obj, "owner", str),
            fence=_opt(obj, "fence", int),
            lease_expires_at=parse_time(obj.get("leaseExpiresAt")),
            expires_in_ms=_opt(obj, "expiresInMs", int),
            waiters=waiters if waiters is not None else 0,
            pid=_opt(obj, "pid", int),
            process=_opt(obj, "process", str),
            node=_opt(obj, "node", str),
            mode=mode if mode is not None or not held else "exclusive",
            limit=_opt(obj, "limit", int) if "limit" in obj else (1 if held else None),
            holder_count=count if count is not None else len(holders),
            holders=holders,
            waiter_list=_waiters(obj.get("waiterList")),
            raw=obj,
        )


def _waiters(value: object) -> tuple[Waiter, ...]:
    if value is None:  # a daemon before docs/contract.md §12
        return ()
    if not isinstance(value, list):
        raise _bad(f"field 'waiterList' should be a list, got {value!r}")
    return tuple(Waiter.from_result(w) for w in value)


class BreakResult(Frozen):
    """Outcome of ``break``: ``broken`` and, when it was held, who held it."""

    __slots__ = ("broken", "fence", "held_by", "holders", "owner", "raw")
    __match_args__ = ("broken", "held_by", "owner", "fence", "holders", "raw")
    _hidden = frozenset({"raw"})
    _fields = __match_args__

    broken: bool
    held_by: str | None
    owner: str | None
    fence: int | None
    holders: int | None
    raw: dict[str, Any]

    def __init__(
        self,
        broken: bool,
        held_by: str | None = None,
        owner: str | None = None,
        fence: int | None = None,
        holders: int | None = None,
        raw: dict[str, Any] | None = None,
    ) -> None:
        _fill(self, "broken", broken)
        _fill(self, "held_by", held_by)
        _fill(self, "owner", owner)
        _fill(self, "fence", fence)
        _fill(self, "holders", holders)
        _fill(self, "raw", {} if raw is None else raw)

    @classmethod
    def from_result(cls, result: object) -> BreakResult:
        """Build a BreakResult from a ``break`` result object."""
        obj = _object(result, "break")
        return cls(
            broken=_req(obj, "broken", bool),
            held_by=_opt(obj, "heldBy", str),
            owner=_opt(obj, "owner", str),
            fence=_opt(obj, "fence", int),
            holders=_opt(obj, "holders", int),
            raw=obj,
        )


def parse_time(value: object) -> datetime | None:
    """Parse an RFC 3339 time from the wire (``...Z``) into an aware datetime; None stays None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(f"expected an RFC 3339 time, got {value!r}")
    # fromisoformat reads an upper-case "Z" itself (Python >= 3.11), not "z".
    text = value[:-1] + "+00:00" if value.endswith("z") else value
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise _bad(f"expected an RFC 3339 time, got {value!r}") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _bad(message: str) -> LockdError:
    return LockdError(f"malformed reply from lockd: {message}", code="PROTOCOL_ERROR")


def _object(result: object, what: str) -> dict[str, Any]:
    if not isinstance(result, dict):
        raise _bad(f"expected a {what} object, got {result!r}")
    return result


def _check(name: str, kind: type[Any], value: object) -> Any:
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise _bad(f"field {name!r} should be {kind.__name__}, got {value!r}")
    return value


def _req(obj: dict[str, Any], name: str, kind: type[Any]) -> Any:
    if name not in obj:
        raise _bad(f"field {name!r} is missing")
    return _check(name, kind, obj[name])


def _opt(obj: dict[str, Any], name: str, kind: type[Any]) -> Any:
    value = obj.get(name)
    return None if value is None else _check(name, kind, value)
