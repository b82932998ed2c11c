"""The in-memory etcd (tests/fake_etcd.py) answers as a real cluster does.

One script of the requests the etcd backend makes (guarded transactions
over a key's directory, puts on leases, prefix deletes, reads at an old
revision, revokes, keepalives, a watch from a past revision, and the
refusals: a missing lease, a key written twice) runs against the fake and
against the session's real 3-member cluster; everything they answer must be
the same. Revisions are compared by their order among the script's own
writes (the cluster's revision also counts other tests' writes), lease ids
by the order they were granted.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from lockd.daemon.backends.etcd.gateway import EtcdError, EtcdGateway, GatewaySettings
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    DeleteResult,
    KeyValue,
    PutOp,
    PutResult,
    RangeOp,
    RangeResult,
    TxnResult,
    WatchRequest,
)
from lockd.testing.etcd_cluster import EtcdCluster
from tests.fake_etcd import FakeEtcd

Etcd = FakeEtcd | EtcdGateway


class Recorder:
    """Runs the script on one etcd and writes down what it answered, normalized later."""

    def __init__(self, etcd: Etcd, prefix: bytes) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.log: list[Any] = []
        self.leases: list[int] = []
        #: revisions the script's own writes made (the header of each write).
        self.written: list[int] = []

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def kv(self, kv: KeyValue) -> tuple[Any, ...]:
        lease = self.leases.index(kv.lease) if kv.lease in self.leases else kv.lease
        return (
            kv.key[len(self.prefix) :],
            kv.value,
            kv.create_revision,
            kv.mod_revision,
            kv.version,
            lease,
        )

    def result(self, result: object) -> Any:
        if isinstance(result, RangeResult):
            return ("range", [self.kv(kv) for kv in result.kvs], result.count, result.more)
        if isinstance(result, PutResult):
            return ("put", self.kv(result.prev_kv) if result.prev_kv else None)
        if isinstance(result, DeleteResult):
            return ("delete", result.deleted, [self.kv(kv) for kv in result.prev_kvs])
        assert isinstance(result, TxnResult)
        return ("txn", result.succeeded, [self.result(r) for r in result.responses])

    async def txn(
        self, compares: list[Compare], success: list[Any], failure: list[Any] = ()
    ) -> TxnResult | None:  # type: ignore[assignment]
        try:
            result = await self.etcd.txn(compares, success, failure)
        except EtcdError as exc:
            self.log.append(("refused", type(exc).__name__, exc.code, exc.message))
            return None
        self.log.append(self.result(result))
        if any(not isinstance(op, RangeOp) for op in (success if result.succeeded else failure)):
            self.written.append(result.header.revision)
        return result

    async def grant(self, ttl: int) -> int:
        grant = await self.etcd.lease_grant(ttl)
        self.leases.append(grant.id)
        self.log.append(("lease", grant.ttl))
        return grant.id

    def normalized(self) -> list[Any]:
        """The log with every revision replaced by its rank among the script's writes."""
        ranks = {rev: rank for rank, rev in enumerate(sorted(set(self.written)), 1)}

        def norm(value: Any) -> Any:
            if isinstance(value, tuple) and len(value) == 6 and isinstance(value[0], bytes):
                key, data, created, modified, version, lease = value
                return (
                    key,
                    data,
                    ranks.get(created, created),
                    ranks.get(modified, modified),
                    version,
                    lease,
                )
            if isinstance(value, tuple) and len(value) == 3 and value[0] in ("PUT", "DELETE"):
                return (value[0], value[1], ranks.get(value[2], value[2]))
            if isinstance(value, (list, tuple)):
                return type(value)(norm(v) for v in value)
            return value

        return norm(self.log)


async def script(etcd: Etcd, prefix: bytes) -> list[Any]:
    r = Recorder(etcd, prefix)
    directory = r.key("k/61/")
    hold, binding, waiter = directory + b"h/x", directory + b"b/x", directory + b"w/1"
    everything = RangeOp(directory, prefix=True)
    holds, sessions = await r.grant(30), await r.grant(1)  # etcd's minimum is 2 s
    # The fast path: a free key taken in one transaction.
    free = [Compare(directory, "create_revision", "==", 0, prefix=True)]
    first = await r.txn(
        free, [PutOp(hold, b"h1", lease=holds), PutOp(binding, b"n1", lease=sessions)], [everything]
    )
    await r.txn(free, [PutOp(hold, b"again")], [everything])  # not free now: the read comes back
    assert first is not None
    seen = first.header.revision
    # A waiter queued, then a decision guarded by the revision read before it.
    await r.txn([], [PutOp(waiter, b"w", lease=sessions), everything])
    stale = [Compare(directory, "mod_revision", "<", seen + 1, prefix=True)]
    await r.txn(
        stale, [DeleteOp(waiter), PutOp(directory + b"h/y", b"h2", lease=holds)], [everything]
    )
    current = await r.etcd.range(everything)
    fresh = [Compare(directory, "mod_revision", "<", current.header.revision + 1, prefix=True)]
    await r.txn(
        fresh, [DeleteOp(waiter), PutOp(directory + b"h/y", b"h2", lease=holds), everything]
    )
    # A rewrite keeps create_revision and counts the version; single-key compares.
    await r.txn([Compare(hold, "version", "==", 1)], [PutOp(hold, b"h1'", lease=holds)])
    await r.txn(
        [Compare(hold, "value", "==", b"h1'"), Compare(hold, "lease", "==", holds)], [RangeOp(hold)]
    )
    await r.txn(
        [Compare(directory + b"h/none", "value", "==", b"")], [RangeOp(hold)], [RangeOp(binding)]
    )
    await r.txn([Compare(directory + b"h/none", "create_revision", "==", 0)], [RangeOp(hold)])
    # Refusals apply nothing: a missing lease, a key written twice, a put inside a deletion.
    await r.txn([], [DeleteOp(hold), PutOp(directory + b"h/z", b"z", lease=0x1234_5678)])
    await r.txn([], [PutOp(waiter, b"1"), PutOp(waiter, b"2")])
    await r.txn([], [DeleteOp(directory + b"h/", prefix=True), PutOp(directory + b"h/q", b"q")])
    # A deletion of nothing makes no revision; one with prev_kv returns what it deleted.
    await r.txn([], [DeleteOp(r.key("nothing")), DeleteOp(hold, prev_kv=True), everything])
    page = await r.etcd.range(RangeOp(directory, prefix=True, limit=1))
    r.log.append(r.result(page))
    old = await r.etcd.range(RangeOp(directory, prefix=True, revision=seen))
    r.log.append(r.result(old))
    # Revoking a lease deletes its keys in one revision; a revoked lease is gone.
    await r.etcd.lease_revoke(sessions)
    after_revoke = await r.etcd.range(everything)
    r.written.append(after_revoke.header.revision)
    r.log.append(r.result(after_revoke))
    for lease in (holds, sessions):
        try:
            r.log.append(("keepalive", await r.etcd.lease_keepalive(lease)))
        except EtcdError as exc:
            r.log.append(("keepalive refused", type(exc).__name__))
    try:
        await r.etcd.lease_revoke(sessions)
    except EtcdError as exc:
        r.log.append(("revoke refused", type(exc).__name__))
    await r.etcd.lease_revoke(holds)
    r.written.append((await r.etcd.range(everything)).header.revision)
    r.log.append(r.result(await r.etcd.range(everything)))
    # A watch from the first write replays every change since, one revision at a time.
    events: list[Any] = []
    with trio.fail_after(10):
        async with r.etcd.watch(WatchRequest(directory, prefix=True, start_revision=seen)) as watch:
            async for response in watch:
                for event in response.events:
                    events.append((event.type, event.kv.key[len(prefix) :], event.kv.mod_revision))
                if events and events[-1][2] >= r.written[-1]:
                    break
    r.log.append(("watch", events))
    return r.normalized()


async def test_the_fake_answers_the_backends_requests_as_a_real_cluster_does(
    etcd_cluster: EtcdCluster,
) -> None:
    prefix = f"/test-fake/{time.monotonic_ns()}/".encode()
    async with EtcdGateway(GatewaySettings(etcd_cluster.endpoints, timeout=5.0)) as gateway:
        real = await script(gateway, prefix)
    fake = await script(FakeEtcd(), prefix)
    assert len(fake) == len(real)
    for step, (got, want) in enumerate(zip(fake, real, strict=True)):
        assert got == want, f"step {step}: fake {got!r} != real {want!r}"
