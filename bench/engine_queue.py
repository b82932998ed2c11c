"""Engine-level queue costs: ``.venv/bin/python bench/engine_queue.py [--waiters N]``.

No daemon, no I/O: the pure engine with a fake clock, so the numbers are the
data structures alone (issue 10 item 4: a dict used as a FIFO made a long
queue drain O(n^2); issue 12: granting from the queue is O(number granted)).

* ``drain``: N waiters parked on one key; release the holder N times. Rate of
  the first and the last ``--window`` hand-offs, and their ratio (1.0 = flat).
* ``drain, every other waiter cancelled``: the same after cancelling every
  second waiter in the middle of the queue first (cancellation is O(1) and
  leaves nothing for the drain to skip).
* ``readers``: N shared waiters behind one writer are granted in one step
  (µs per reader granted, their queue deadlines dropped included), then
  one reader among N is released (O(1): no scan of the holders).

Medians of ``--rounds`` runs; read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lockd.daemon.engine import SHARED, Lease, LockEngine, Parked, Waiter


def _engine_with_queue(n: int) -> tuple[LockEngine, Lease, list[Waiter]]:
    counter = iter(range(10**9))
    engine = LockEngine(handle_factory=lambda: f"h{next(counter)}")
    holder = engine.acquire(0, "k", ttl_ms=10**9, principal="user:a")
    assert isinstance(holder, Lease)
    waiters = []
    for i in range(n):
        parked = engine.acquire(0, "k", ttl_ms=10**9, principal="user:w", conn=i, wait_ms=10**9)
        assert isinstance(parked, Parked)
        waiters.append(parked.waiter)
    engine.drain()
    return engine, holder, waiters


def drain(n: int, window: int, cancel_every_other: bool) -> tuple[float, float]:
    """Hand-offs per second over the first and the last ``window`` of the drain."""
    engine, holder, waiters = _engine_with_queue(n)
    if cancel_every_other:
        for waiter in waiters[1:-1:2]:
            engine.cancel_waiter(0, waiter)
        engine.drain()
    current = holder
    stamps = [time.perf_counter()]
    now = 1
    while True:
        assert engine.release(now, "k", current.handle)
        resolved = engine.drain().resolved
        stamps.append(time.perf_counter())
        if not resolved:
            break
        lease = resolved[0].lease
        assert lease is not None
        current = lease
        now += 1
    handoffs = len(stamps) - 2
    first = window / (stamps[window] - stamps[0])
    last = window / (stamps[handoffs] - stamps[handoffs - window])
    return first, last


def readers(n: int) -> tuple[float, float]:
    """µs per shared waiter granted together; µs to release one reader among n."""
    counter = iter(range(10**9))
    engine = LockEngine(handle_factory=lambda: f"h{next(counter)}")
    writer = engine.acquire(0, "k", ttl_ms=10**9, principal="user:w")
    assert isinstance(writer, Lease)
    for i in range(n):
        engine.acquire(0, "k", ttl_ms=10**9, principal=f"user:{i}", mode=SHARED, wait_ms=10**9)
    engine.drain()
    t0 = time.perf_counter()
    engine.release(1, "k", writer.handle)
    granted = engine.drain().resolved
    engine.next_deadline()  # drops the granted waiters' deadlines: part of granting them
    t1 = time.perf_counter()
    assert len(granted) == n
    middle = granted[n // 2].lease
    assert middle is not None
    t2 = time.perf_counter()
    engine.release(2, "k", middle.handle)
    t3 = time.perf_counter()
    return 1e6 * (t1 - t0) / n, 1e6 * (t3 - t2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waiters", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    gc.freeze()
    print(
        f"engine queue, {args.waiters:,} waiters, windows of {args.window:,}, "
        f"medians of {args.rounds} rounds"
    )
    for label, cancel in (("drain", False), ("drain, every other waiter cancelled", True)):
        runs = [drain(args.waiters, args.window, cancel) for _ in range(args.rounds)]
        first = statistics.median(r[0] for r in runs)
        last = statistics.median(r[1] for r in runs)
        ratio = statistics.median(r[1] / r[0] for r in runs)
        print(f"  {label}: first {first:,.0f}/s, last {last:,.0f}/s, last/first {ratio:.2f}")
    runs_r = [readers(args.waiters) for _ in range(args.rounds)]
    print(
        f"  readers: {statistics.median(r[0] for r in runs_r):.2f} us per reader granted "
        f"together, release of one reader among {args.waiters:,}: "
        f"{statistics.median(r[1] for r in runs_r):.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
