"""A ``kill -9`` and a restart on a large database: time to ``hello``, and a renew's fate.

After a restart the daemon answers at once and checks the whole database
in a thread; every write waits for that check (docs/operations.md, "Restart
time"), after a crash too (``Store._read_crash_first``). A holder whose
lease runs out *during* the check sends its renew in time, but it is
judged after the check; leases are held while requests wait for it
(``Expiry.hold_leases``), so it finds its lease.

Each run, for each checkout: a database of ``--leases`` leases (written
directly, as bench/scale.py does), a daemon takes ``probe``, is killed
(``kill -9``) and started again; as soon as it answers ``hello`` the bench
sends ``renew probe``. It reports the time from the kill to ``hello``, how
long the renew waited, how long the lease had left when the renew was
sent, and whether it was renewed. The probe's TTL is chosen so that its
deadline falls inside the check's wait of this checkout (a first run with
a 10-minute TTL measures both). With ``--baseline REV`` the same runs on
REV, in the same rounds (same TTL). After ``kill -9`` a baseline that
checked everything before ``hello`` may have lost the lease before it
answered: then its "renewed" column compares restart times, not the hold.

    .venv/bin/python bench/renew_during_check.py [--leases 1000000] [--runs 3]
        [--stop kill|term] [--baseline 082c9d3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LockdDaemon, checkout, table
from run import log
from scale import Wire, boot_ms, workdir
from scale import fill as fill_directly

REPO = Path(__file__).resolve().parent.parent


def one_run(source: Path, tree: Path | None, ttl_ms: int, stop: str = "kill") -> dict[str, Any]:
    """Take ``probe``, stop the daemon (``kill -9``, or SIGTERM with ``stop="term"``),
    start it again, renew at once: what happened (ms)."""
    with workdir() as root:
        db = root / "lockd.db"
        shutil.copyfile(source, db)
        daemon = LockdDaemon(db=db, start_timeout=120, tree=tree)
        daemon.start()
        first_root = daemon.root
        wire = Wire(daemon.socket)
        try:
            wire.result("hello")
            # A write: answered once this start's own check has passed.
            grant = wire.result("tryAcquire", key="probe", ttlMs=ttl_ms)
            granted_at = time.monotonic()
        finally:
            wire.close()
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGKILL if stop == "kill" else signal.SIGTERM)
        daemon.proc.wait()
        killed_at = time.monotonic()
        shutil.rmtree(first_root, ignore_errors=True)
        daemon.start()
        try:
            wire = Wire(daemon.socket)
            try:
                wire.result("hello")
                sent_at = time.monotonic()
                renewed = wire.result("renew", key="probe", handle=grant["handle"], ttlMs=ttl_ms)
                answered_at = time.monotonic()
            finally:
                wire.close()
        finally:
            daemon.stop()
    return {
        "ttl_ms": ttl_ms,
        "hello_after_kill_ms": (sent_at - killed_at) * 1000,  # from the end of the stop
        "left_at_send_ms": ttl_ms - (sent_at - granted_at) * 1000,
        "answered_after_ms": (answered_at - sent_at) * 1000,
        "renewed": bool(renewed.get("renewed")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=1_000_000)
    parser.add_argument(
        "--stop",
        choices=("kill", "term"),
        default="kill",
        help="kill -9 (a crash: a WAL is left) or SIGTERM (a clean stop); default kill",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV", help="also run this revision, alternately")
    args = parser.parse_args(argv)

    folder = Path(tempfile.mkdtemp(prefix="lockd-renew-check-", dir="/tmp"))
    try:
        source = folder / "lockd.db"
        # This boot's leases, 1 h TTLs, deadlines ~20 h away: a daemon's own.
        fill_s = fill_directly(REPO, source, args.leases, boot_ms() + 20 * 3_600_000, 3_600_000)
        log(f"{args.leases:,} leases written in {fill_s:.1f} s")
        with checkout(args.baseline) as base:
            trees: dict[str, Path | None] = {"this checkout": None}
            if base is not None:
                trees[f"lockd@{args.baseline}"] = base
            first = one_run(source, None, 600_000, args.stop)
            # The deadline in the middle of this checkout's wait for the check.
            ttl_ms = max(1_000, int(first["hello_after_kill_ms"] + first["answered_after_ms"] / 2))
            log(
                f"calibration: hello {first['hello_after_kill_ms']:.0f} ms after the kill, "
                f"the renew waited {first['answered_after_ms']:.0f} ms: probe TTL {ttl_ms} ms"
            )
            results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
            for i in range(args.runs):
                for name, tree in trees.items():
                    r = one_run(source, tree, ttl_ms, args.stop)
                    results[name].append(r)
                    log(
                        f"run {i + 1}/{args.runs} {name}: hello "
                        f"{r['hello_after_kill_ms']:.0f} ms after the kill; renew sent "
                        f"{r['left_at_send_ms']:.0f} ms before the deadline, answered "
                        f"{r['answered_after_ms']:.0f} ms later: "
                        f"{'renewed' if r['renewed'] else 'lease_lost'} "
                        f"(load {os.getloadavg()[0]:.1f})"
                    )
        rows = []
        for name, runs in results.items():
            rows.append(
                [
                    name,
                    f"{len(runs)}",
                    f"{statistics.median(r['hello_after_kill_ms'] for r in runs):.0f}",
                    f"{statistics.median(r['left_at_send_ms'] for r in runs):.0f}",
                    f"{statistics.median(r['answered_after_ms'] for r in runs):.0f}",
                    f"{sum(r['renewed'] for r in runs)} / {len(runs)}",
                ]
            )
        how = "kill -9" if args.stop == "kill" else "SIGTERM"
        print(f"{args.leases:,} leases, stopped by {how}, probe TTL {ttl_ms} ms; medians")
        print(
            table(
                [
                    "lockd",
                    "runs",
                    "stop to hello ms",
                    "lease left at renew ms",
                    "renew waited ms",
                    "renewed",
                ],
                rows,
            )
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
