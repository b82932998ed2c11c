"""Where one request's daemon time goes, without sockets (one process, no trio).

``.venv/bin/python bench/request_phases.py``

Runs the daemon's own request path in one process -- parse, the service's
decision (access, engine), the commit (``Store.apply`` on a WAL database in
a temporary folder, as the daemon makes it), encode -- for tryAcquire +
release pairs, and prints each phase's median and 10th percentile in
microseconds. What is left of a B1 round trip on top of these is the trio
loop, the socket syscalls and the client (see README: "Profiling").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from lockd.daemon.clock import SystemClock
from lockd.daemon.engine import LockEngine
from lockd.daemon.protocol import Acquire, encode_result, parse_request
from lockd.daemon.ratelimit import RateLimiter
from lockd.daemon.service import LockService, Reply
from lockd.daemon.store import Store
from lockd.identity import Caller
from lockd.rules.policy import PolicyManager

OWNER = Caller("user", "root", "owner", 0, 0, 1, frozenset({"root"}))
TRY_LINE = (
    b'{"id":17,"op":"tryAcquire","key":"bench-a","ttlMs":30000,"owner":null,"releaseOnClose":false}'
)


def measure(pairs: int, warmup: int) -> dict[str, list[float]]:
    folder = Path(tempfile.mkdtemp(prefix="lockd-phases-"))
    store = Store(folder / "lockd.db", "bench-boot")
    # The daemon's own policy without rule sets (open) and rate limiter
    # (root, an owner, is not counted by it).
    policy = PolicyManager(folder / "rules.d")
    service = LockService(LockEngine(), store, policy, RateLimiter(1000), SystemClock())
    service.group_commit = True  # as the server runs it: the commit is a phase of its own
    clock = time.perf_counter_ns
    phases: dict[str, list[float]] = {}
    try:
        for i in range(warmup + pairs):
            t0 = clock()
            req = parse_request(TRY_LINE)
            t1 = clock()
            assert isinstance(req, Acquire)
            step = service.acquire(OWNER, 1, req, pending=0)
            t2 = clock()
            service.commit_fact("bench")
            t3 = clock()
            assert isinstance(step, Reply) and step.result is not None
            encode_result(req.id, step.result)
            t4 = clock()
            handle = step.result["handle"]
            rel = parse_request(
                b'{"id":18,"op":"release","key":"bench-a","handle":"%s"}' % handle.encode()
            )
            t5 = clock()
            result = service.answer(OWNER, rel)
            t6 = clock()
            service.commit_fact("bench")
            t7 = clock()
            encode_result(rel.id, result)
            t8 = clock()
            if i < warmup:
                continue
            for name, start, end in (
                ("parse tryAcquire", t0, t1),
                ("decide tryAcquire", t1, t2),
                ("commit grant", t2, t3),
                ("encode grant", t3, t4),
                ("parse release", t4, t5),
                ("decide release", t5, t6),
                ("commit release", t6, t7),
                ("encode release", t7, t8),
            ):
                phases.setdefault(name, []).append((end - start) / 1000)
    finally:
        store.close()
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=20_000)
    args = parser.parse_args()
    phases = measure(args.pairs, warmup=2_000)
    total = 0.0
    print(f"{'phase':20s} {'p50 us':>8s} {'p10 us':>8s}")
    for name, values in phases.items():
        values.sort()
        p50 = statistics.median(values)
        total += p50
        print(f"{name:20s} {p50:8.1f} {values[len(values) // 10]:8.1f}")
    print(f"{'sum of medians':20s} {total:8.1f}   (one try_acquire + release pair)")


if __name__ == "__main__":
    main()
