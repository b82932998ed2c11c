"""What deleted keys under a lock key's directory cost etcd's guards, until it compacts.

    .venv/bin/python bench/etcd_dead_keys.py              # 0, 1k, 5k, 20k dead keys
    .venv/bin/python bench/etcd_dead_keys.py --dead 0 50000 --calls 100

Every grant on etcd writes a key of its own (``h/<handle>``; a waiter
``w/...``, a binding ``b/...``), and the fast path's guard ("the key's
directory is empty", docs/etcd-design.md §3) is a compare over the whole
directory. etcd evaluates it by walking its in-memory index of every key
ever written under that range since the last compaction, deleted ones
included. This starts a 3-member loopback cluster, fills one directory
with N keys and deletes them (as N grants and releases would leave it),
then times the fast path's transaction -- range guard, a hold put, the
failure branch's range read -- followed by a delete, one pair at a time:
the guarded put's p50 per N. No compaction runs meanwhile (etcd's default).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio

from lockd.daemon.backends.etcd.gateway import EtcdGateway, GatewaySettings
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    PutOp,
    RangeOp,
    txn_body,
)
from lockd.testing.etcd_cluster import EtcdCluster, data_root

#: keys put per transaction while filling (etcd's default limit is 128 ops).
BATCH = 100
#: a hold record's size, about (docs/etcd-design.md §2).
RECORD = "r" * 300


async def guarded_put_p50(etcd: EtcdGateway, directory: str, calls: int) -> float:
    """The fast path's transaction on ``directory``, ``calls`` times (each undone): p50 ms."""
    hold = f"{directory}h/live"
    take = txn_body(
        [Compare(directory, "create_revision", "==", 0, prefix=True)],
        [PutOp(hold, RECORD)],
        [RangeOp(directory, prefix=True)],
    )
    undo = txn_body([], [DeleteOp(hold)], [])
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        taken = await etcd.call("/v3/kv/txn", take, idempotent=False)
        times.append(time.perf_counter() - start)
        if not taken.get("succeeded"):
            raise RuntimeError(f"{directory} was not empty")
        await etcd.call("/v3/kv/txn", undo, idempotent=False)
    return statistics.median(times) * 1000


async def measure(endpoint: str, dead_counts: list[int], calls: int) -> list[tuple[int, float]]:
    rows = []
    async with EtcdGateway(GatewaySettings([endpoint])) as etcd:
        await etcd.status()
        for dead in dead_counts:
            directory = f"/bench-dead/{dead}/"
            for first in range(0, dead, BATCH):
                puts = [PutOp(f"{directory}h/{n:08d}", RECORD) for n in range(first, first + BATCH)]
                await etcd.call(
                    "/v3/kv/txn", txn_body([], puts[: dead - first], []), idempotent=False
                )
            await etcd.call(
                "/v3/kv/txn", txn_body([], [DeleteOp(directory, prefix=True)], []), idempotent=False
            )
            rows.append((dead, await guarded_put_p50(etcd, directory, calls)))
            print(f"{dead:>7,} dead keys: guarded put p50 {rows[-1][1]:.2f} ms", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dead", type=int, nargs="+", default=[0, 1000, 5000, 20000])
    parser.add_argument("--calls", type=int, default=200, help="guarded puts timed per count")
    args = parser.parse_args(argv)
    root = data_root()
    cluster = EtcdCluster(root)
    try:
        cluster.start()  # inside: a failed start still removes the data root
        rows = trio.run(measure, cluster.leader().client_url, args.dead, args.calls)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print("dead keys under the directory | guarded put (fast path's txn) p50 ms")
    for dead, p50 in rows:
        print(f"{dead:>29,} | {p50:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
