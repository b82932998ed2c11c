"""etcd v3 JSON gateway messages: building request bodies, reading replies. No I/O.

The gateway (grpc-gateway in front of etcd's gRPC API, served on the client
port since 3.4) speaks protobuf's JSON mapping, which has three traps this
module exists to keep out of the rest of the code:

- ``bytes`` fields (keys, values) are base64 strings;
- 64-bit integers (revisions, lease ids, counts) are JSON *strings*;
- fields at their default value are left out: an absent ``count`` is 0, an
  absent ``succeeded`` is false, an absent event ``type`` is ``PUT``, an absent
  ``kvs`` is empty.

It also ignores request fields it does not know, so a misspelt field would be
dropped without a word; every body is built here, in one place, from typed
values.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Json = dict[str, Any]
KeyLike = bytes | str

# Compare targets and results, by the names this module's callers use.
CompareTarget = Literal["version", "create_revision", "mod_revision", "value", "lease"]
CompareOp = Literal["==", "!=", "<", ">"]
SortTarget = Literal["key", "version", "create_revision", "mod_revision", "value"]
SortOrder = Literal["ascend", "descend"]

_TARGETS: dict[str, tuple[str, str]] = {
    # our name -> (gateway enum, field that carries the operand)
    "version": ("VERSION", "version"),
    "create_revision": ("CREATE", "create_revision"),
    "mod_revision": ("MOD", "mod_revision"),
    "value": ("VALUE", "value"),
    "lease": ("LEASE", "lease"),
}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
_SORT_ORDERS = {"ascend": "ASCEND", "descend": "DESCEND"}
_SORT_TARGETS = {
    "key": "KEY",
    "version": "VERSION",
    "create_revision": "CREATE",
    "mod_revision": "MOD",
    "value": "VALUE",
}


def as_bytes(key: KeyLike) -> bytes:
    """Keys and values are bytes in etcd; a str is taken as UTF-8."""
    return key.encode() if isinstance(key, str) else key


def b64(data: KeyLike) -> str:
    return binascii.b2a_base64(as_bytes(data), newline=False).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: KeyLike) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``.

    etcd's rule (clientv3.GetPrefixRangeEnd): add one to the last byte that is
    not 0xff and drop what follows it; a prefix of only 0xff bytes (or empty)
    gives ``b"\\0"``, which etcd reads as "to the end of the key space".
    """
    raw = bytearray(as_bytes(prefix))
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


def _int(value: object) -> int:
    # int64 arrive as strings, int32 as numbers, defaults not at all.
    return int(value) if value is not None else 0  # type: ignore[call-overload]


# --- replies -------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """The reply header: the store revision the request saw or made, and who answered."""

    revision: int
    raft_term: int
    member_id: int

    @classmethod
    def parse(cls, doc: Mapping[str, Any] | None) -> Header:
        doc = doc or {}
        return cls(
            revision=_int(doc.get("revision")),
            raft_term=_int(doc.get("raft_term")),
            member_id=_int(doc.get("member_id")),
        )


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> KeyValue:
        return cls(
            key=unb64(doc.get("key")),
            value=unb64(doc.get("value")),
            create_revision=_int(doc.get("create_revision")),
            mod_revision=_int(doc.get("mod_revision")),
            version=_int(doc.get("version")),
            lease=_int(doc.get("lease")),
        )


@dataclass(frozen=True)
class RangeResult:
    header: Header
    kvs: list[KeyValue]
    count: int  # every key in the range, also those beyond ``limit``
    more: bool  # true when ``limit`` cut the answer short

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> RangeResult:
        return cls(
            header=Header.parse(doc.get("header")),
            kvs=[KeyValue.parse(kv) for kv in doc.get("kvs", ())],
            count=_int(doc.get("count")),
            more=bool(doc.get("more", False)),
        )


@dataclass(frozen=True)
class PutResult:
    header: Header
    prev_kv: KeyValue | None

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> PutResult:
        prev = doc.get("prev_kv")
        return cls(Header.parse(doc.get("header")), KeyValue.parse(prev) if prev else None)


@dataclass(frozen=True)
class DeleteResult:
    header: Header
    deleted: int
    prev_kvs: list[KeyValue]

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> DeleteResult:
        return cls(
            header=Header.parse(doc.get("header")),
            deleted=_int(doc.get("deleted")),
            prev_kvs=[KeyValue.parse(kv) for kv in doc.get("prev_kvs", ())],
        )


OpResult = RangeResult | PutResult | DeleteResult


@dataclass(frozen=True)
class TxnResult:
    """A transaction's outcome: which branch ran, the revision it saw or made, each op's reply."""

    header: Header
    succeeded: bool
    responses: list[OpResult]

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> TxnResult:
        responses: list[OpResult] = []
        for item in doc.get("responses", ()):
            if "response_range" in item:
                responses.append(RangeResult.parse(item["response_range"]))
            elif "response_put" in item:
                responses.append(PutResult.parse(item["response_put"]))
            elif "response_delete_range" in item:
                responses.append(DeleteResult.parse(item["response_delete_range"]))
            else:
                raise ValueError(f"unknown txn response {sorted(item)}")
        return cls(
            header=Header.parse(doc.get("header")),
            succeeded=bool(doc.get("succeeded", False)),
            responses=responses,
        )


@dataclass(frozen=True)
class LeaseGrant:
    header: Header
    id: int
    ttl: int  # the TTL etcd granted, in whole seconds (at least its minimum)

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> LeaseGrant:
        return cls(Header.parse(doc.get("header")), _int(doc.get("ID")), _int(doc.get("TTL")))


@dataclass(frozen=True)
class LeaseTimeToLive:
    header: Header
    id: int
    ttl: int  # seconds left; -1 when the lease does not exist (expired or revoked)
    granted_ttl: int
    keys: list[bytes]

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> LeaseTimeToLive:
        return cls(
            header=Header.parse(doc.get("header")),
            id=_int(doc.get("ID")),
            ttl=_int(doc.get("TTL")),
            granted_ttl=_int(doc.get("grantedTTL")),
            keys=[unb64(k) for k in doc.get("keys", ())],
        )


@dataclass(frozen=True)
class Event:
    type: Literal["PUT", "DELETE"]
    kv: KeyValue  # for a DELETE: the key and the deleting revision as mod_revision
    prev_kv: KeyValue | None

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> Event:
        prev = doc.get("prev_kv")
        return cls(
            type="DELETE" if doc.get("type") == "DELETE" else "PUT",
            kv=KeyValue.parse(doc.get("kv", {})),
            prev_kv=KeyValue.parse(prev) if prev else None,
        )


@dataclass(frozen=True)
class WatchResponse:
    header: Header
    events: list[Event]
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> WatchResponse:
        return cls(
            header=Header.parse(doc.get("header")),
            events=[Event.parse(e) for e in doc.get("events", ())],
            created=bool(doc.get("created", False)),
            canceled=bool(doc.get("canceled", False)),
            compact_revision=_int(doc.get("compact_revision")),
            cancel_reason=str(doc.get("cancel_reason", "")),
        )


# --- requests ------------------------------------------------------------------
#
# Request bodies are JSON text built here directly: every string in them is
# base64 (keys, values), a decimal integer, or one of this module's own
# constants, so nothing needs escaping, and building the text is several
# times cheaper than building dicts for json.dumps (a transaction body is on
# every lock decision's path).


@dataclass(frozen=True)
class Compare:
    """One guard of a transaction: ``target(key) op operand``.

    A key that does not exist has version, create and mod revision 0, so
    ``Compare("k", "create_revision", "==", 0)`` means "k is absent".

    With ``prefix=True`` (or a ``range_end``) the guard holds when it holds
    for every key in the range (etcd 3.3+); an empty range counts as one
    absent key. So ``create_revision == 0`` over a prefix means "no key under
    it", and ``mod_revision < R + 1`` means "no key under it was written
    after revision R" (a deleted key is simply not there: deletions pass).
    """

    key: KeyLike
    target: CompareTarget
    op: CompareOp
    operand: int | KeyLike
    range_end: KeyLike | None = None
    prefix: bool = False

    def body(self) -> str:
        """The compare as JSON text."""
        enum, operand_field = _TARGETS[self.target]
        operand = self.operand
        if self.target == "value":
            if isinstance(operand, int):
                raise TypeError("a value compare takes bytes or str")
            value = b64(operand)
        else:
            if not isinstance(operand, int):
                raise TypeError(f"a {self.target} compare takes an int")
            value = str(operand)
        key_range = _key_range(self.key, self.range_end, self.prefix)
        result = _RESULTS[self.op]
        return f'{{{key_range},"target":"{enum}","result":"{result}","{operand_field}":"{value}"}}'


@dataclass(frozen=True)
class RangeOp:
    """A read: one key, or ``[key, range_end)``; ``prefix=True`` covers every key under ``key``."""

    key: KeyLike
    range_end: KeyLike | None = None
    prefix: bool = False
    revision: int = 0  # 0: the newest; else read the store as it was at that revision
    limit: int = 0  # 0: no limit
    sort_target: SortTarget | None = None
    sort_order: SortOrder = "ascend"
    count_only: bool = False
    keys_only: bool = False
    serializable: bool = False  # True: answer from the member's copy, without a quorum read

    def body(self) -> str:
        """The read as JSON text."""
        parts = [_key_range(self.key, self.range_end, self.prefix)]
        if self.revision:
            parts.append(f'"revision":"{self.revision:d}"')
        if self.limit:
            parts.append(f'"limit":"{self.limit:d}"')
        if self.sort_target is not None:
            target, order = _SORT_TARGETS[self.sort_target], _SORT_ORDERS[self.sort_order]
            parts.append(f'"sort_target":"{target}","sort_order":"{order}"')
        if self.count_only:
            parts.append('"count_only":true')
        if self.keys_only:
            parts.append('"keys_only":true')
        if self.serializable:
            parts.append('"serializable":true')
        return "{" + ",".join(parts) + "}"


@dataclass(frozen=True)
class PutOp:
    key: KeyLike
    value: KeyLike = b""
    lease: int = 0  # 0: no lease; the key stays until deleted
    prev_kv: bool = False

    def body(self) -> str:
        """The write as JSON text."""
        text = f'{{"key":"{b64(self.key)}","value":"{b64(self.value)}"'
        if self.lease:
            text += f',"lease":"{self.lease:d}"'
        if self.prev_kv:
            text += ',"prev_kv":true'
        return text + "}"


@dataclass(frozen=True)
class DeleteOp:
    key: KeyLike
    range_end: KeyLike | None = None
    prefix: bool = False
    prev_kv: bool = False

    def body(self) -> str:
        """The deletion as JSON text."""
        key_range = _key_range(self.key, self.range_end, self.prefix)
        return "{" + key_range + (',"prev_kv":true}' if self.prev_kv else "}")


Op = RangeOp | PutOp | DeleteOp


def op_body(op: Op) -> str:
    """One entry of a transaction's ``success`` or ``failure`` list, as JSON text."""
    if isinstance(op, RangeOp):
        return '{"request_range":' + op.body() + "}"
    if isinstance(op, PutOp):
        return '{"request_put":' + op.body() + "}"
    return '{"request_delete_range":' + op.body() + "}"


def txn_body(compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> str:
    """A transaction request as JSON text."""
    guards = ",".join([c.body() for c in compares])
    then = ",".join([op_body(op) for op in success])
    otherwise = ",".join([op_body(op) for op in failure])
    return f'{{"compare":[{guards}],"success":[{then}],"failure":[{otherwise}]}}'


@dataclass(frozen=True)
class WatchRequest:
    """What a watch follows: one key or a prefix, from ``start_revision`` on (0: from now)."""

    key: KeyLike
    prefix: bool = False
    start_revision: int = 0
    prev_kv: bool = False
    progress_notify: bool = False

    def body(self, start_revision: int | None = None) -> str:
        """The watch's create request as JSON text."""
        parts = [_key_range(self.key, None, self.prefix)]
        start = self.start_revision if start_revision is None else start_revision
        if start:
            parts.append(f'"start_revision":"{start:d}"')
        if self.prev_kv:
            parts.append('"prev_kv":true')
        if self.progress_notify:
            parts.append('"progress_notify":true')
        return '{"create_request":{' + ",".join(parts) + "}}"


def _key_range(key: KeyLike, range_end: KeyLike | None, prefix: bool) -> str:
    """``key`` and, for a range, ``range_end``: the fields every ranged request shares (JSON)."""
    if prefix and range_end is not None:
        raise ValueError("give either prefix=True or range_end, not both")
    if prefix:
        range_end = prefix_end(key)
    if range_end is not None:
        return f'"key":"{b64(key)}","range_end":"{b64(range_end)}"'
    return f'"key":"{b64(key)}"'
