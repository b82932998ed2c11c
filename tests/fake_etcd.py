"""An in-memory etcd for the backend's fast tests: KV with history, transactions, leases, watches.

It has the methods of :class:`lockd.daemon.backends.etcd.gateway.EtcdGateway`
that the etcd backend calls, answering with the same wire types, and keeps
etcd's semantics where the backend depends on them (checked against a real
cluster in tests/etcd/test_fake_etcd.py):

- one revision per transaction that changes something (a deletion that
  deletes nothing changes nothing); every key written by it gets that
  revision; ``create_revision`` stays while a key lives, ``version`` counts;
- a compare over a range holds when it holds for every key in it, and an
  empty range compares as one absent key (revisions 0; a value compare fails);
- a transaction writing one key twice is refused ("duplicate key"), a put on
  a lease that does not exist too (``LeaseNotFound``); nothing is applied;
- reads at an older revision, from the full history (nothing is compacted);
- revoking a lease deletes its keys in one revision; leases never run out by
  themselves here: the test decides when time passes (revoke);
- a watch replays history from its start revision, then follows, one
  response per revision, after a first ``created`` response.

Every call takes one trio checkpoint, as a network call would.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import trio

from lockd.daemon.backends.etcd.gateway import GRPC_NOT_FOUND, EtcdError, LeaseNotFound
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    DeleteResult,
    Event,
    Header,
    KeyLike,
    KeyValue,
    LeaseGrant,
    LeaseTimeToLive,
    Op,
    OpResult,
    PutOp,
    PutResult,
    RangeOp,
    RangeResult,
    TxnResult,
    WatchRequest,
    WatchResponse,
    as_bytes,
    prefix_end,
)

GRPC_INVALID_ARGUMENT = 3
#: etcd 3.4 grants no lease shorter than this.
MIN_LEASE_TTL = 2


@dataclass
class _Lease:
    ttl: int
    keys: set[bytes] = field(default_factory=set)


def _bounds(key: KeyLike, range_end: KeyLike | None, prefix: bool) -> tuple[bytes, bytes | None]:
    """[low, high) of a request; high None: the one key ``low``."""
    low = as_bytes(key)
    if prefix:
        return low, prefix_end(low)
    return low, as_bytes(range_end) if range_end is not None else None


def _in(key: bytes, low: bytes, high: bytes | None) -> bool:
    if high is None:
        return key == low
    return low <= key and (high == b"\0" or key < high)


def _holds(kv: KeyValue | None, compare: Compare) -> bool:
    if kv is None:
        if compare.target == "value":
            return False  # etcd: a value compare on a missing key always fails
        kv = KeyValue(as_bytes(compare.key), b"", 0, 0, 0, 0)
    actual: int | bytes
    operand: int | bytes
    if compare.target == "value":
        actual, operand = kv.value, as_bytes(compare.operand)  # type: ignore[arg-type]
    else:
        actual, operand = getattr(kv, compare.target), compare.operand  # type: ignore[assignment]
    if compare.op == "==":
        return actual == operand
    if compare.op == "!=":
        return actual != operand
    if compare.op == "<":
        return actual < operand  # type: ignore[operator]
    return actual > operand  # type: ignore[operator]


class FakeEtcd:
    def __init__(self) -> None:
        self.revision = 1  # a new etcd's store starts at revision 1
        self._kv: dict[bytes, KeyValue] = {}
        #: every change: (revision, key, the new KeyValue, or None for a deletion).
        self._history: list[tuple[int, bytes, KeyValue | None]] = []
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x7E57_0000_0001)
        self._watchers: list[_FakeWatch] = []
        self.calls = 0

    def _header(self) -> Header:
        return Header(self.revision, 1, 1)

    async def _call(self) -> None:
        self.calls += 1
        await trio.lowlevel.checkpoint()

    # --- reads -------------------------------------------------------------------

    def _state_at(self, revision: int) -> dict[bytes, KeyValue]:
        if revision == 0 or revision >= self.revision:
            return self._kv
        state: dict[bytes, KeyValue] = {}
        for rev, key, kv in self._history:
            if rev > revision:
                break
            if kv is None:
                state.pop(key, None)
            else:
                state[key] = kv
        return state

    def _range(self, op: RangeOp, state: dict[bytes, KeyValue] | None = None) -> RangeResult:
        low, high = _bounds(op.key, op.range_end, op.prefix)
        source = state if state is not None else self._state_at(op.revision)
        found = sorted((kv for key, kv in source.items() if _in(key, low, high)), key=_key_of)
        kvs = found[: op.limit] if op.limit else found
        if op.count_only:
            kvs = []
        elif op.keys_only:
            kvs = [replace(kv, value=b"") for kv in kvs]
        more = bool(op.limit) and len(found) > op.limit
        return RangeResult(self._header(), kvs, len(found), more)

    async def range(self, op: RangeOp) -> RangeResult:
        await self._call()
        return self._range(op)

    async def get(self, key: KeyLike) -> RangeResult:
        return await self.range(RangeOp(key))

    # --- writes ------------------------------------------------------------------

    async def put(self, key: KeyLike, value: KeyLike, *, lease: int = 0) -> PutResult:
        result = await self.txn([], [PutOp(key, value, lease=lease, prev_kv=True)])
        response = result.responses[0]
        assert isinstance(response, PutResult)
        return replace(response, header=result.header)

    async def delete(self, op: DeleteOp) -> DeleteResult:
        result = await self.txn([], [op])
        response = result.responses[0]
        assert isinstance(response, DeleteResult)
        return replace(response, header=result.header)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op] = (), failure: Sequence[Op] = ()
    ) -> TxnResult:
        await self._call()
        succeeded = all(self._compare(c) for c in compares)
        ops = success if succeeded else failure
        self._check(ops)
        # Applied to a copy: the ops see each other's writes, and a refusal
        # part-way (a missing lease) leaves the store as it was.
        state = dict(self._kv)
        revision = self.revision + 1
        changes: list[tuple[bytes, KeyValue | None]] = []
        responses: list[OpResult] = []
        for op in ops:
            if isinstance(op, RangeOp):
                responses.append(self._range(op, state))
            elif isinstance(op, PutOp):
                if op.lease and op.lease not in self._leases:
                    raise LeaseNotFound(GRPC_NOT_FOUND, "etcdserver: requested lease not found")
                key = as_bytes(op.key)
                prev = state.get(key)
                kv = KeyValue(
                    key,
                    as_bytes(op.value),
                    prev.create_revision if prev is not None else revision,
                    revision,
                    prev.version + 1 if prev is not None else 1,
                    op.lease,
                )
                state[key] = kv
                changes.append((key, kv))
                responses.append(PutResult(self._header(), prev if op.prev_kv else None))
            else:
                low, high = _bounds(op.key, op.range_end, op.prefix)
                gone = sorted((kv for k, kv in state.items() if _in(k, low, high)), key=_key_of)
                for kv in gone:
                    del state[kv.key]
                    changes.append((kv.key, None))
                prev_kvs = gone if op.prev_kv else []
                responses.append(DeleteResult(self._header(), len(gone), prev_kvs))
        if changes:
            self._commit(state, changes, revision)
        # Responses carry the header of the revision the transaction made.
        header = self._header()
        responses = [replace(r, header=header) for r in responses]
        return TxnResult(header, succeeded, responses)

    def _compare(self, compare: Compare) -> bool:
        low, high = _bounds(compare.key, compare.range_end, compare.prefix)
        found = [kv for key, kv in self._kv.items() if _in(key, low, high)]
        if not found:
            return _holds(None, compare)
        return all(_holds(kv, compare) for kv in found)

    @staticmethod
    def _check(ops: Sequence[Op]) -> None:
        """etcd refuses a transaction that writes one key twice (puts, or a put and a delete)."""
        puts = [as_bytes(op.key) for op in ops if isinstance(op, PutOp)]
        deletes = [
            _bounds(op.key, op.range_end, op.prefix) for op in ops if isinstance(op, DeleteOp)
        ]
        clash = len(set(puts)) != len(puts) or any(
            _in(key, low, high) for key in puts for low, high in deletes
        )
        if clash:
            raise EtcdError(GRPC_INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request")

    def _commit(
        self, state: dict[bytes, KeyValue], changes: list[tuple[bytes, KeyValue | None]], rev: int
    ) -> None:
        for key, kv in changes:
            old = self._kv.get(key)
            if old is not None and old.lease in self._leases:
                self._leases[old.lease].keys.discard(key)
            if kv is not None and kv.lease:
                self._leases[kv.lease].keys.add(key)
        self._kv = state
        self.revision = rev
        events: list[Event] = []
        for key, kv in changes:
            self._history.append((rev, key, kv))
            if kv is None:
                events.append(Event("DELETE", KeyValue(key, b"", 0, rev, 0, 0), None))
            else:
                events.append(Event("PUT", kv, None))
        for watcher in self._watchers:
            watcher.offer(rev, events)

    # --- leases ------------------------------------------------------------------

    async def lease_grant(self, ttl: int) -> LeaseGrant:
        await self._call()
        lease_id = next(self._lease_ids)
        granted = max(ttl, MIN_LEASE_TTL)
        self._leases[lease_id] = _Lease(granted)
        return LeaseGrant(self._header(), lease_id, granted)

    async def lease_keepalive(self, lease_id: int) -> int:
        await self._call()
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(GRPC_NOT_FOUND, f"lease {lease_id:x} not found")
        return lease.ttl

    async def lease_revoke(self, lease_id: int) -> None:
        await self._call()
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseNotFound(GRPC_NOT_FOUND, "etcdserver: requested lease not found")
        doomed = sorted(lease.keys)
        if doomed:
            state = dict(self._kv)
            for key in doomed:
                del state[key]
            self._commit(state, [(key, None) for key in doomed], self.revision + 1)

    async def lease_time_to_live(self, lease_id: int, *, keys: bool = False) -> LeaseTimeToLive:
        await self._call()
        lease = self._leases.get(lease_id)
        if lease is None:
            return LeaseTimeToLive(self._header(), lease_id, -1, 0, [])
        listed = sorted(lease.keys) if keys else []
        return LeaseTimeToLive(self._header(), lease_id, lease.ttl, lease.ttl, listed)

    def leases(self) -> set[int]:
        """The leases that exist (for tests)."""
        return set(self._leases)

    # --- watches -----------------------------------------------------------------

    @asynccontextmanager
    async def watch(self, request: WatchRequest) -> AsyncIterator[_FakeWatch]:
        await self._call()
        watcher = _FakeWatch(self, request)
        self._watchers.append(watcher)
        try:
            yield watcher
        finally:
            self._watchers.remove(watcher)


class _FakeWatch:
    def __init__(self, etcd: FakeEtcd, request: WatchRequest) -> None:
        self._low, self._high = _bounds(request.key, None, request.prefix)
        start = request.start_revision or etcd.revision + 1
        self.next_revision = start
        self._etcd = etcd
        self._send, self._receive = trio.open_memory_channel[WatchResponse](math.inf)
        self._send.send_nowait(WatchResponse(etcd._header(), [], created=True))
        by_revision: dict[int, list[Event]] = {}
        for rev, key, kv in etcd._history:
            if rev >= start:
                event = Event("PUT", kv, None) if kv is not None else None
                if event is None:
                    event = Event("DELETE", KeyValue(key, b"", 0, rev, 0, 0), None)
                by_revision.setdefault(rev, []).append(event)
        for rev, events in by_revision.items():
            self.offer(rev, events)

    def offer(self, revision: int, events: list[Event]) -> None:
        mine = [e for e in events if _in(e.kv.key, self._low, self._high)]
        if mine:
            self._send.send_nowait(WatchResponse(Header(revision, 1, 1), mine))

    def __aiter__(self) -> _FakeWatch:
        return self

    async def __anext__(self) -> WatchResponse:
        response = await self._receive.receive()
        if response.events:
            self.next_revision = response.events[-1].kv.mod_revision + 1
        return response


def _key_of(kv: KeyValue) -> bytes:
    return kv.key
