"""B1 by CPU placement of client and server: ``.venv/bin/python bench/placement.py``.

One client (this process) runs B1's loop -- ``try_acquire`` + ``release``
of one key, back to back -- against lockd and against PostgreSQL's advisory
locks (skipped without psycopg and a PostgreSQL server, as in ``run.py``),
with the two processes placed three ways, interleaved round by round:

- ``free``: wherever the scheduler puts them (what every other bench sees);
- ``same``: both pinned to CPU 0, so a reply wakes a process on the same CPU;
- ``split``: the server on CPU 0, the client on CPU 1, so every request and
  every reply wakes a process on the other CPU.

On a VM a cross-CPU wake-up is an inter-processor interrupt (a VM exit),
and a round trip pays two; this shows what that costs each system, and so
how much of B1 is placement rather than work (bench/README.md:
"Busy-polling for the next request"). ``--busy-poll-us`` sets lockd's
``busy_poll_us`` (default: lockd's own default).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

from baselines import PgLocker, postgres_baseline
from common import LockdDaemon, LockdLocker, Locker, LockerSpec

PLACEMENTS = ("free", "same", "split")


def place(server_pid: int, how: str) -> None:
    if how == "free":
        everywhere = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(server_pid, everywhere)
        os.sched_setaffinity(0, everywhere)
    else:
        os.sched_setaffinity(server_pid, {0})
        os.sched_setaffinity(0, {0} if how == "same" else {1})


def pairs_per_s(locker: Locker, secs: float) -> float:
    warm_until = time.monotonic() + 0.2
    while time.monotonic() < warm_until:
        locker.try_pair("placement")
    pairs = 0
    start = time.monotonic()
    while time.monotonic() - start < secs:
        locker.try_pair("placement")
        pairs += 1
    return pairs / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--secs", type=float, default=2.0)
    parser.add_argument("--busy-poll-us", type=int, default=None)
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        sys.exit("placement.py needs at least 2 CPUs")
    config = None if args.busy_poll_us is None else f"busy_poll_us = {args.busy_poll_us}\n"
    results: dict[tuple[str, str], list[float]] = {}
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(LockdDaemon(config=config).running())
        systems: list[tuple[str, int, Locker]] = []
        lockd = LockdLocker(str(daemon.socket))
        lockd.prepare("placement")
        stack.callback(lockd.close)
        systems.append(("lockd", daemon.pid, lockd))
        pg = stack.enter_context(postgres_baseline())
        if isinstance(pg, LockerSpec):
            locker = pg.build()
            assert isinstance(locker, PgLocker)
            locker.prepare("placement")
            stack.callback(locker.close)
            systems.append(("postgres", locker.conn.info.backend_pid, locker))
        else:
            print(f"postgres: {pg}")
        for n in range(args.rounds):
            for how in PLACEMENTS:
                for label, pid, locker in systems:
                    place(pid, how)
                    rate = pairs_per_s(locker, args.secs)
                    results.setdefault((label, how), []).append(rate)
                    print(f"round {n + 1} {how:5} {label:8} {rate:8,.0f} pairs/s", flush=True)
        for _, pid, _ in systems:
            place(pid, "free")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nB1 pairs/s by placement: medians of {args.rounds} rounds, load {load}")
    labels = [label for label, _, _ in systems]
    print("  placement  " + "".join(f"{label:>12}" for label in labels))
    for how in PLACEMENTS:
        row = "".join(f"{statistics.median(results[(label, how)]):>12,.0f}" for label in labels)
        print(f"  {how:9}  {row}")


if __name__ == "__main__":
    main()
