"""lockd on etcd against etcd3's ``Lock``, on one real 3-member loopback cluster,
with the gateway client's floors beside them.

Issue 14's goals: lockd-on-etcd >= 2x etcd3 on B1, hand-off p50 <= 3 ms,
p99 <= 20 ms, 0 lost wake-ups and strict FIFO on B2. The ratios against
etcd3 are printed under each table.

Systems:

- ``lockd-etcd``: real ``lockd serve`` daemons with ``[backend] kind =
  "etcd"`` on the cluster, driven through the real ``lockd_client`` exactly
  like bench/run.py drives lockd on SQLite. B1 uses one daemon; B2 two
  daemons (``node`` bench-a and bench-b, standing for two hosts) with two
  of the four processes on each, so hand-offs cross hosts.

- ``etcd3``: the ``etcd3`` package's ``Lock`` (gRPC). Per pair it grants a
  lease, runs a put-if-absent transaction and a delete transaction: three
  raft writes. It waits with ``watch_once`` started *after* its failed
  attempt, from "now", so a release in between is missed until the next
  event on the key (or its timeout): a lost wake-up.
- ``gateway``: not a lock, a floor. Two guarded transactions per pair
  (put-if-absent, delete-if-still-ours) through ``EtcdGateway`` (its own
  h11 transport on the JSON gateway, under trio): the least any
  lockd-on-etcd pair costs in etcd round trips, and what our client costs
  per request.
- ``h11``: the same two transactions, same bodies, same trio loop, with
  HTTP/1.1 done by h11 directly on one trio stream: what the gateway's
  failover, pool and parsing add per request (with httpx under the
  gateway, before ``transport.py``, the gateway floor was half this one).
- ``lockd-etcd@REV`` (``--compare REV``): REV's lockd from a temporary git
  worktree, on the same cluster, B1 and B2, interleaved with this one.

Single calls (``CALLS``), timed one by one in each round: a guarded
transaction (put-if-absent, then delete-if-ours, each a raft write) and a
lease grant, through etcd3's gRPC client and through ``EtcdGateway`` on the
JSON gateway. From them the report writes down B1's ceiling: etcd3's pair is
a lease grant and two transactions, lockd's at least two gateway
transactions, so lockd-on-etcd cannot beat etcd3 by more than etcd3's
measured pair time over two gateway transactions, however little its own
CPU costs.

etcd3 is unmaintained and does not install beside the project (it needs
protobuf < 4 and tenacity < 7), so it runs in a throwaway venv of its own::

    python3 -m venv /tmp/etcd3-venv
    /tmp/etcd3-venv/bin/pip install etcd3==0.12.0 'protobuf<4' 'tenacity>=6.1,<7'
    .venv/bin/python bench/etcd_baseline.py --etcd3-python /tmp/etcd3-venv/bin/python

Without ``--etcd3-python`` (or when that interpreter cannot import etcd3)
the etcd3 rows print one ``skipped:`` line and the rest runs.

Measures (same definitions as bench/run.py):

- B1: one process, one key, acquire + release pairs per second for a fixed
  time per round; the median over rounds, systems interleaved.
- B2: 4 processes contend for one key (blocking acquire, hold 1 ms, release,
  re-request at once); hand-off latency p50/p99/max, FIFO share, overlaps.
  ``stalls`` counts hand-offs slower than 1 s while someone was waiting:
  wake-ups that were lost and only made good by a later event or a timeout;
  ``timeouts``, etcd3 acquires that slept through every release until
  etcd3's own default timeout (10 s) and then asked again.

The cluster's data lives on tmpfs (/dev/shm) when there is one, for both
systems alike: this measures the clients and etcd's raft path, not the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import (  # noqa: E402  (bench modules are run as scripts)
    LockdDaemon,
    LockdLocker,
    analyse_handoffs,
    checkout,
    fmt_num,
    fmt_ratio,
    handoff_loop,
    now_ns,
    pairs_loop,
    proc_cpu_s,
    proc_runq_wait_s,
    ratio,
    rotated,
    run_workers,
    table,
)

from lockd.testing.etcd_cluster import EtcdBackend, EtcdCluster, data_root  # noqa: E402

LOCKD = "lockd-etcd"
HANDOFF_PROCS = 4
HOLD_S = 0.001  # as bench/run.py
STALL_MS = 1000.0
WAIT_S = 60.0  # how long past its stop time a worker may take to finish
ETCD3_TIMEOUT_S = 10.0  # etcd3's own default for Lock.acquire
LOCK_TTL_S = 30
#: single etcd calls timed one by one: a guarded transaction (put-if-absent
#: and delete-if-ours in turn, each a raft write, as a lock pair's two) and a
#: lease grant (a raft write too; etcd3's Lock grants one per acquire).
CALLS = ("txn", "grant")
CALL_LEASE_TTL_S = 5  # the granted leases end by themselves soon after


# ------------------------------------------------------------------ etcd3 side


class Etcd3Locker:
    """etcd3's ``Lock``, one client per process (runs in the throwaway venv)."""

    def __init__(self, endpoint: str) -> None:
        import etcd3

        host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        self.client = etcd3.client(host=host, port=int(port))
        self._locks: dict[str, Any] = {}
        self.timeouts = 0

    def _lock(self, key: str) -> Any:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = self.client.lock(key, ttl=LOCK_TTL_S)
        return lock

    def prepare(self, key: str) -> None:
        self.client.status()
        self._lock(key)

    def try_pair(self, key: str) -> bool:
        lock = self._lock(key)
        if not lock.acquire(timeout=0):
            return False
        if not lock.release():
            raise RuntimeError(f"etcd3 release of {key!r} found the lock gone")
        return True

    def acquire(self, key: str) -> None:
        # A waiter that slept through every release until etcd3's own default
        # timeout lost its wake-up; like a caller that retries, ask again.
        lock = self._lock(key)
        while not lock.acquire(timeout=ETCD3_TIMEOUT_S):
            self.timeouts += 1

    def release(self, key: str) -> None:
        if not self._lock(key).release():
            raise RuntimeError(f"etcd3 release of {key!r} found the lock gone")

    def close(self) -> None:
        self.client.close()


def call_loop(call: Callable[[int], Any], stop_at_ns: int) -> dict[str, Any]:
    """``call(n)`` for n = 0, 1, ... until ``stop_at_ns``; each call's wall time (ns)."""
    times = []
    cpu0 = time.process_time()
    n = 0
    while now_ns() < stop_at_ns:
        start = time.perf_counter_ns()
        call(n)
        times.append(time.perf_counter_ns() - start)
        n += 1
    return {"times_ns": times, "client_cpu_s": time.process_time() - cpu0}


def etcd3_calls(client: Any, kind: str, key: str, stop_at_ns: int) -> dict[str, Any]:
    """etcd3's gRPC client, one call at a time: see ``CALLS``."""
    tx = client.transactions

    def txn(n: int) -> None:
        if n % 2 == 0:
            ok, _ = client.transaction(
                compare=[tx.create(key) == 0], success=[tx.put(key, "bench")], failure=[]
            )
        else:
            ok, _ = client.transaction(
                compare=[tx.value(key) == "bench"], success=[tx.delete(key)], failure=[]
            )
        if not ok:
            raise RuntimeError(f"etcd3 call {n} on {key!r} failed its guard")

    def grant(n: int) -> None:
        client.lease(CALL_LEASE_TTL_S)

    return call_loop(txn if kind == "txn" else grant, stop_at_ns)


def worker(args: argparse.Namespace) -> None:
    """One etcd3 process: wait for the common start, run, print the result as JSON."""
    locker = Etcd3Locker(args.endpoint)
    locker.prepare(args.key)
    time.sleep(max(0.0, (args.start_ns - now_ns()) / 1e9))
    if args.work == "pairs":
        out: Any = pairs_loop(locker, args.key, args.stop_ns)
    elif args.work in CALLS:
        out = etcd3_calls(locker.client, args.work, args.key, args.stop_ns)
    else:
        records = handoff_loop(locker, args.key, args.stop_ns, HOLD_S)
        out = {"records": records, "timeouts": locker.timeouts}
    locker.close()
    print(json.dumps(out))


def run_etcd3(
    python: str, endpoint: str, key: str, work: str, procs: int, duration_s: float
) -> list[Any]:
    """``procs`` etcd3 workers started together in the throwaway venv; their results."""
    start = now_ns() + int(3e9)  # time to import grpc and connect, not timed
    stop = start + int(duration_s * 1e9)
    cmd = [python, __file__, "worker", "--endpoint", endpoint, "--key", key, "--work", work]
    cmd += ["--start-ns", str(start), "--stop-ns", str(stop)]
    children = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(procs)
    ]
    results = []
    try:
        for child in children:
            out, err = child.communicate(timeout=duration_s + WAIT_S + 10)
            if child.returncode != 0:
                raise RuntimeError(f"etcd3 worker failed:\n{err.strip()}")
            results.append(json.loads(out))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return results


def etcd3_skip_reason(python: str | None) -> str | None:
    if python is None:
        return "skipped: no --etcd3-python (see the module docstring for the throwaway venv)"
    probe = subprocess.run(
        [python, "-c", "import etcd3, etcd3.locks"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"skipped: {python} cannot import etcd3 ({last})"
    return None


# ---------------------------------------------------------------- gateway side


async def two_txn_pairs(
    txn: Callable[[str], Awaitable[dict[str, Any]]], key: str, duration_s: float
) -> dict[str, Any]:
    """Pairs of put-if-absent and delete-if-still-ours transactions until the time is up.

    ``txn`` posts one ``/v3/kv/txn`` body (JSON text, built by the daemon's
    own ``wire.txn_body``) and returns the reply document; the floors below
    differ only in how they do that.
    """
    from lockd.daemon.backends.etcd.wire import Compare, DeleteOp, PutOp, txn_body

    absent = txn_body([Compare(key, "create_revision", "==", 0)], [PutOp(key, "bench")], [])
    pairs = 0
    cpu0 = time.process_time()
    start = now_ns()
    stop = start + int(duration_s * 1e9)
    end = start
    while end < stop:
        won = await txn(absent)
        if not won.get("succeeded"):
            raise RuntimeError(f"the floor found {key!r} taken")
        ours = Compare(key, "create_revision", "==", int(won["header"]["revision"]))
        if not (await txn(txn_body([ours], [DeleteOp(key)], []))).get("succeeded"):
            raise RuntimeError(f"the floor lost {key!r}")
        pairs += 1
        end = now_ns()
    cpu = time.process_time() - cpu0
    return {"pairs": pairs, "start_ns": start, "end_ns": end, "client_cpu_s": cpu}


def gateway_pairs(endpoint: str, key: str, duration_s: float) -> dict[str, Any]:
    """The two transactions through ``EtcdGateway.call``, one trio task."""
    import trio

    from lockd.daemon.backends.etcd.gateway import EtcdGateway, GatewaySettings

    async def run() -> dict[str, Any]:
        async with EtcdGateway(GatewaySettings([endpoint])) as etcd:
            await etcd.status()  # connect outside the timed loop

            async def txn(body: str) -> dict[str, Any]:
                return await etcd.call("/v3/kv/txn", body, idempotent=False)

            return await two_txn_pairs(txn, key, duration_s)

    return trio.run(run)


def gateway_calls(endpoint: str, kind: str, key: str, duration_s: float) -> dict[str, Any]:
    """``CALLS`` one at a time through ``EtcdGateway`` (the daemon's client), one trio task."""
    import trio

    from lockd.daemon.backends.etcd.gateway import EtcdGateway, GatewaySettings
    from lockd.daemon.backends.etcd.wire import Compare, DeleteOp, PutOp

    async def run() -> dict[str, Any]:
        async with EtcdGateway(GatewaySettings([endpoint])) as etcd:
            await etcd.status()  # connect outside the timed loop
            times = []
            cpu0 = time.process_time()
            stop = now_ns() + int(duration_s * 1e9)
            n = 0
            while now_ns() < stop:
                start = time.perf_counter_ns()
                if kind == "grant":
                    await etcd.lease_grant(CALL_LEASE_TTL_S)
                elif n % 2 == 0:
                    absent = Compare(key, "create_revision", "==", 0)
                    if not (await etcd.txn([absent], [PutOp(key, "bench")])).succeeded:
                        raise RuntimeError(f"gateway call {n} on {key!r} failed its guard")
                else:
                    ours = Compare(key, "value", "==", "bench")
                    if not (await etcd.txn([ours], [DeleteOp(key)])).succeeded:
                        raise RuntimeError(f"gateway call {n} on {key!r} failed its guard")
                times.append(time.perf_counter_ns() - start)
                n += 1
            return {"times_ns": times, "client_cpu_s": time.process_time() - cpu0}

    return trio.run(run)


def h11_pairs(endpoint: str, key: str, duration_s: float) -> dict[str, Any]:
    """The same two transactions with HTTP/1.1 done by h11 on one kept trio stream.

    The difference to ``gateway_pairs`` is what the gateway's own layers
    (failover bookkeeping, pool, JSON) cost per request.
    """
    import h11
    import trio

    host, port = endpoint.removeprefix("http://").rsplit(":", 1)

    async def run() -> dict[str, Any]:
        stream = await trio.open_tcp_stream(host, int(port))
        conn = h11.Connection(h11.CLIENT)

        async def txn(body: str) -> dict[str, Any]:
            data = body.encode()
            headers = [("Host", host), ("Content-Type", "application/json")]
            headers.append(("Content-Length", str(len(data))))
            out = conn.send(h11.Request(method="POST", target="/v3/kv/txn", headers=headers))
            out = (out or b"") + (conn.send(h11.Data(data=data)) or b"")
            await stream.send_all(out + (conn.send(h11.EndOfMessage()) or b""))
            chunks = []
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
            conn.start_next_cycle()
            doc: dict[str, Any] = json.loads(b"".join(chunks))
            return doc

        try:
            return await two_txn_pairs(txn, key, duration_s)
        finally:
            await stream.aclose()

    return trio.run(run)


# ------------------------------------------------------------------ lockd side


@contextlib.contextmanager
def lockd_on_etcd(
    endpoints: list[str], nodes: Sequence[str], tree: Path | None = None
) -> Iterator[list[LockdDaemon]]:
    """One ``lockd serve`` per node name, all on ``endpoints`` under one fresh prefix.

    ``tree``: a checkout whose lockd to run (``--compare``) instead of this one.
    """
    prefix = f"/lockd-bench/{os.getpid()}-{now_ns()}/"
    etcd = EtcdBackend(endpoints=tuple(endpoints), prefix=prefix)
    daemons = [
        LockdDaemon(label=f"lockd-etcd@{node}", config=etcd.as_node(node).toml(), tree=tree)
        for node in nodes
    ]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(daemon.running()) for daemon in daemons]


def lockd_pairs(daemon: LockdDaemon, key: str, duration_s: float) -> dict[str, Any]:
    """B1 through the real client in this process; the daemon's CPU per pair as well,
    and how long it waited for a CPU while runnable (the box's other jobs, or the
    process its own ``send`` woke)."""
    locker = LockdLocker(str(daemon.socket))
    locker.prepare(key)
    daemon_cpu, daemon_runq = proc_cpu_s(daemon.pid), proc_runq_wait_s(daemon.pid)
    result = pairs_loop(locker, key, now_ns() + int(duration_s * 1e9))
    result["daemon_cpu_s"] = proc_cpu_s(daemon.pid) - daemon_cpu
    result["daemon_runq_s"] = proc_runq_wait_s(daemon.pid) - daemon_runq
    locker.close()
    return result


def etcd_cpu_s(cluster: EtcdCluster) -> float:
    """CPU seconds the cluster's members used so far, together."""
    return sum(proc_cpu_s(m.proc.pid) for m in cluster.members if m.proc is not None)


def lockd_handoffs(daemons: Sequence[LockdDaemon], key: str, duration_s: float) -> dict[str, Any]:
    """B2: HANDOFF_PROCS processes, spread over the daemons in turn, on one key."""
    specs = [daemons[i % len(daemons)].spec() for i in range(HANDOFF_PROCS)]
    per_process = run_workers(specs, [key] * HANDOFF_PROCS, "handoff", duration_s, hold_s=HOLD_S)
    analysis = analyse_handoffs(per_process)
    analysis["stalls"] = stalls(per_process)
    analysis["timeouts"] = 0  # lockd's acquires wait LOCKD_WAIT_S; a stall would fail the run
    return analysis


# ------------------------------------------------------------------ the runs


Rounds = dict[str, list[dict[str, float]]]


def pairs_row(result: dict[str, Any]) -> dict[str, float]:
    seconds = (result["end_ns"] - result["start_ns"]) / 1e9
    pairs = max(result["pairs"], 1)
    row = {"pairs_s": result["pairs"] / seconds, "cpu_us": result["client_cpu_s"] / pairs * 1e6}
    if "daemon_cpu_s" in result:
        row["daemon_cpu_us"] = result["daemon_cpu_s"] / pairs * 1e6
        row["daemon_runq_us"] = result["daemon_runq_s"] / pairs * 1e6
    if "etcd_cpu_s" in result:
        row["etcd_cpu_us"] = result["etcd_cpu_s"] / pairs * 1e6
    return row


def stalls(per_process: Sequence[Sequence[Sequence[int]]]) -> int:
    """Hand-offs slower than STALL_MS while another process was already waiting."""
    grants = sorted(
        (granted, released, proc)
        for proc, records in enumerate(per_process)
        for _requested, granted, released in records
    )
    requests = [sorted((r[0], r[1]) for r in records) for records in per_process]
    count = 0
    for (_, released, proc), (granted, _, _) in itertools.pairwise(grants):
        if (granted - released) / 1e6 <= STALL_MS:
            continue
        waiting = any(
            requested <= released < got
            for other, spans in enumerate(requests)
            if other != proc
            for requested, got in spans
        )
        count += waiting
    return count


def _positive(text: str) -> int:
    """``--rounds``: at least 1 (0 would silently mean the default; below, no median)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    w.add_argument("--endpoint", required=True)
    w.add_argument("--key", required=True)
    w.add_argument("--work", choices=["pairs", "handoff", *CALLS], required=True)
    w.add_argument("--start-ns", type=int, required=True)
    w.add_argument("--stop-ns", type=int, required=True)
    parser.add_argument("--etcd3-python", help="python of a venv where etcd3 imports")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    parser.add_argument(
        "--compare", metavar="REV", help="also run REV's lockd (from a git worktree) on B1 and B2"
    )
    parser.add_argument(
        "--rounds", type=_positive, help="rounds of every measure (default 5, --quick 2)"
    )
    parser.add_argument("--out", type=Path, help="write every round as JSON here")
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return 0

    skip = etcd3_skip_reason(args.etcd3_python)
    root = data_root()
    cluster = EtcdCluster(root)
    cluster.start()
    try:
        print(f"etcd 3-member loopback cluster, data on {root}", file=sys.stderr)
        load = os.getloadavg()[0]
        with checkout(args.compare) as tree:
            earlier = None if tree is None else (args.compare, tree)
            b1, b2, calls = measure(
                cluster, None if skip else args.etcd3_python, args.quick, earlier, args.rounds
            )
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(report(b1, b2, calls, skip, load))
    if args.out:
        out = {"b1": b1, "b2": b2, "calls": calls, "skip": skip}
        args.out.write_text(json.dumps(out, indent=1, default=str))
    return 0


def measure(
    cluster: EtcdCluster,
    etcd3_python: str | None,
    quick: bool,
    earlier: tuple[str, Path] | None = None,
    rounds_wanted: int | None = None,
) -> tuple[Rounds, dict[str, list[dict[str, Any]]], Rounds]:
    """B1, single calls and B2 rounds, systems interleaved (each round starts with the next one).

    ``earlier``: (revision, checkout) of a lockd to run beside this one.
    ``rounds_wanted``: how many rounds instead of the default (each as long).
    """
    rounds, b1_s, b2_s, call_s = (2, 2.0, 4.0, 1.0) if quick else (5, 4.0, 10.0, 2.0)
    rounds = rounds_wanted or rounds
    lockds = [LOCKD] if earlier is None else [LOCKD, f"{LOCKD}@{earlier[0]}"]
    systems = [*lockds, "gateway", "h11"] if etcd3_python is None else ["etcd3", *lockds]
    if etcd3_python is not None:
        systems += ["gateway", "h11"]
    b2_systems = lockds if etcd3_python is None else ["etcd3", *lockds]
    # Every client talks to the leader, as a client near it would; the
    # daemons know every member (leader first), as a configured host would.
    leader = cluster.leader()
    endpoint = leader.client_url
    endpoints = [endpoint, *(m.client_url for m in cluster.members if m is not leader)]
    b1: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    b2: dict[str, list[dict[str, Any]]] = {s: [] for s in b2_systems}
    clients = ["gateway"] if etcd3_python is None else ["etcd3", "gateway"]
    calls: Rounds = {f"{client} {kind}": [] for client in clients for kind in CALLS}
    nodes = ["bench-a", "bench-b"]
    with contextlib.ExitStack() as stack:
        daemons = {LOCKD: stack.enter_context(lockd_on_etcd(endpoints, nodes))}
        if earlier is not None:
            rev, tree = earlier
            daemons[f"{LOCKD}@{rev}"] = stack.enter_context(lockd_on_etcd(endpoints, nodes, tree))
        for n in range(rounds):
            for system in rotated(systems, n):
                key = f"/bench/b1/{system}/{n}"
                etcd_cpu = etcd_cpu_s(cluster)
                if system == "etcd3":
                    assert etcd3_python is not None
                    result = run_etcd3(etcd3_python, endpoint, key, "pairs", 1, b1_s)[0]
                elif system in daemons:
                    result = lockd_pairs(daemons[system][0], f"b1:{system}:{n}", b1_s)
                elif system == "h11":
                    result = h11_pairs(endpoint, key, b1_s)
                else:
                    result = gateway_pairs(endpoint, key, b1_s)
                result["etcd_cpu_s"] = etcd_cpu_s(cluster) - etcd_cpu
                b1[system].append(pairs_row(result))
                print(f"round {n + 1}/{rounds} B1 {system}: {b1[system][-1]}", file=sys.stderr)
            for call in rotated(list(calls), n):
                client, kind = call.split()
                key = f"/bench/calls/{client}/{kind}/{n}"
                if client == "etcd3":
                    assert etcd3_python is not None
                    timed = run_etcd3(etcd3_python, endpoint, key, kind, 1, call_s)[0]
                else:
                    timed = gateway_calls(endpoint, kind, key, call_s)
                calls[call].append(calls_row(timed))
                print(f"round {n + 1}/{rounds} call {call}: {calls[call][-1]}", file=sys.stderr)
            for system in rotated(b2_systems, n):
                if system in daemons:
                    analysis = lockd_handoffs(daemons[system], f"b2:{system}:{n}", b2_s)
                else:
                    assert etcd3_python is not None
                    analysis = etcd3_handoffs(etcd3_python, endpoint, f"/bench/b2/{n}", b2_s)
                b2[system].append(analysis)
                p50 = analysis["p50_ms"]
                print(f"round {n + 1}/{rounds} B2 {system}: p50 {p50:.2f} ms", file=sys.stderr)
    return b1, b2, calls


def calls_row(result: dict[str, Any]) -> dict[str, float]:
    times = sorted(result["times_ns"])
    return {
        "p50_ms": statistics.median(times) / 1e6,
        "p90_ms": times[int(len(times) * 0.9)] / 1e6,
        "cpu_us": result["client_cpu_s"] / len(times) * 1e6,
        "calls": len(times),
    }


def etcd3_handoffs(python: str, endpoint: str, key: str, duration_s: float) -> dict[str, Any]:
    workers = run_etcd3(python, endpoint, key, "handoff", HANDOFF_PROCS, duration_s)
    per_process = [w["records"] for w in workers]
    analysis = analyse_handoffs(per_process)
    analysis["stalls"] = stalls(per_process)
    analysis["timeouts"] = sum(w["timeouts"] for w in workers)
    return analysis


def report(
    b1: Rounds,
    b2: dict[str, list[dict[str, Any]]],
    calls: Rounds,
    skip: str | None,
    load: float,
) -> str:
    lines = [f"lockd on etcd and etcd baselines (3 members on loopback; load {load:.1f} at start)"]
    lines += ["", "B1 uncontended acquire+release pairs/s, one process (median over rounds)"]
    rows = []
    for system, results in b1.items():
        rows.append(
            [
                system,
                fmt_num(statistics.median(r["pairs_s"] for r in results)),
                fmt_num(statistics.median(r["cpu_us"] for r in results)),
                _median_of(results, "daemon_cpu_us"),
                _median_of(results, "daemon_runq_us"),
                _median_of(results, "etcd_cpu_us"),
                str(len(results)),
            ]
        )
    headers = ["system", "pairs/s", "client CPU us/pair", "daemon CPU us/pair"]
    headers += ["daemon run-queue wait us/pair", "etcd CPU us/pair (3 members)", "rounds"]
    lines.append(table(headers, rows))
    pairs = {s: statistics.median(r["pairs_s"] for r in results) for s, results in b1.items()}
    if skip:
        lines += ["", f"  etcd3: {skip}"]
    else:
        lines.append(f"  {LOCKD} / etcd3: {_b1_ratio(b1, LOCKD, 'etcd3')} (goal: >= 2x)")
    for other in [s for s in b1 if s.startswith(f"{LOCKD}@")] + ["gateway"]:
        lines.append(f"  {LOCKD} / {other}: {_b1_ratio(b1, LOCKD, other)}")
    lines += calls_report(calls, pairs)
    lines += ["", f"B2 hand-off, {HANDOFF_PROCS} processes (median over rounds; {LOCKD}: "]
    lines[-1] += "two daemons, two processes on each)"
    rows = [_b2_row(system, results) for system, results in b2.items()]
    headers = ["system", "p50 ms", "p99 ms", "max ms", "FIFO", "re-grab", "stalls"]
    headers += ["timeouts", "overlaps", "hand-offs"]
    lines.append(table(headers, rows))
    p50 = {s: statistics.median(r["p50_ms"] for r in b2[s]) for s in b2}
    for earlier in (s for s in b2 if s.startswith(f"{LOCKD}@")):
        lines.append(f"  p50 {earlier} / {LOCKD}: {fmt_ratio(ratio(p50[earlier], p50[LOCKD]))}")
    if not skip:
        lines.append(
            f"  p50 etcd3 / {LOCKD}: {fmt_ratio(ratio(p50['etcd3'], p50[LOCKD]))}"
            " (goal: p50 <= 3 ms, p99 <= 20 ms, 0 stalls, FIFO 100 %)"
        )
    return "\n".join(lines)


def _median_of(results: list[dict[str, float]], field: str) -> str:
    values = [r[field] for r in results if field in r]
    return fmt_num(statistics.median(values)) if values else "-"


def _b1_ratio(b1: Rounds, system: str, other: str) -> str:
    """Medians' ratio, then the median of the rounds' own ratios (the two ran minutes
    apart at most, on the same load) and their range: on a shared box the paired
    ratio is the one to read."""
    medians = ratio(
        statistics.median(r["pairs_s"] for r in b1[system]),
        statistics.median(r["pairs_s"] for r in b1[other]),
    )
    paired = [ratio(a["pairs_s"], b["pairs_s"]) for a, b in zip(b1[system], b1[other], strict=True)]
    return (
        f"{fmt_ratio(medians)}; per round {fmt_ratio(statistics.median(paired))}"
        f" ({fmt_ratio(min(paired))} to {fmt_ratio(max(paired))})"
    )


def calls_report(calls: Rounds, pairs: dict[str, float]) -> list[str]:
    """The single-call table, and what it says about B1's ceiling against etcd3."""
    med = {
        call: {f: statistics.median(r[f] for r in results) for f in ("p50_ms", "p90_ms", "cpu_us")}
        for call, results in calls.items()
    }
    lines = ["", "Single etcd calls, one at a time (medians over rounds of each round's)"]
    rows = [
        [call, f"{m['p50_ms']:.2f}", f"{m['p90_ms']:.2f}", fmt_num(m["cpu_us"])]
        for call, m in med.items()
    ]
    lines.append(table(["call", "p50 ms", "p90 ms", "client CPU us/call"], rows))
    if "etcd3 txn" not in med:
        return lines
    grpc_txn, grant = med["etcd3 txn"]["p50_ms"], med["etcd3 grant"]["p50_ms"]
    gateway_txn = med["gateway txn"]["p50_ms"]
    etcd3_pair = 1000 / pairs["etcd3"]
    floor = 2 * gateway_txn
    lines += [
        f"  etcd3 pair: lease grant + 2 txns = {grant:.2f} + 2 x {grpc_txn:.2f}"
        f" = {grant + 2 * grpc_txn:.2f} ms (measured pair {etcd3_pair:.2f} ms)",
        f"  lockd pair: at least 2 gateway txns = 2 x {gateway_txn:.2f} = {floor:.2f} ms"
        f" (measured {1000 / pairs[LOCKD]:.2f} ms)",
        f"  B1 ceiling against etcd3: {etcd3_pair:.2f} / {floor:.2f}"
        f" = {fmt_ratio(ratio(etcd3_pair, floor))} (goal: >= 2x)",
    ]
    return lines


def _b2_row(system: str, results: list[dict[str, Any]]) -> list[str]:
    def med(field: str) -> float:
        return statistics.median(r[field] for r in results)

    return [
        system,
        f"{med('p50_ms'):.2f}",
        f"{med('p99_ms'):.2f}",
        f"{max(r['max_ms'] for r in results):.1f}",
        f"{med('fifo_fraction'):.0%}",
        f"{med('regrab_fraction'):.0%}",
        str(sum(r["stalls"] for r in results)),
        str(sum(r["timeouts"] for r in results)),
        str(sum(r["overlaps"] for r in results)),
        str(sum(r["handoffs"] for r in results)),
    ]


if __name__ == "__main__":
    sys.exit(main())
