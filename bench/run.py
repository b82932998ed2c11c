"""lockd benchmark suite: ``.venv/bin/python bench/run.py [--quick]``.

Measures lockd against baselines run in the same run, on the same box,
interleaved round by round (the machines are shared and noisy: medians over
rounds and ratios to a same-run peer are what to read, not absolute numbers):

a. uncontended try_acquire + release pairs per second, one client process;
   baselines flock, PostgreSQL advisory locks, Redis (when available);
b. hand-off latency and fairness: 4 processes contend for one key with a
   blocking acquire, each holding it ~1 ms; baselines flock, PostgreSQL;
c. 16 processes, each on its own key, try_acquire + release: aggregate
   pairs per second; baselines flock, PostgreSQL; and the floor
   (bench/floor_server.py, in (a) too): lockd's server CPU per pair over
   the floor's is what lockd's own Python adds to trio + JSON + SQLite;
store. the cost of one SQLite commit as the daemon makes it on its event
   loop (``Store.apply``, WAL, synchronous=NORMAL).

Prints a table and writes the full data to ``bench/results/<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import flock_baseline, postgres_baseline, redis_baseline
from common import (
    FloorDaemon,
    LockdDaemon,
    LockerSpec,
    analyse_handoffs,
    checkout,
    fmt_num,
    fmt_ratio,
    median,
    now_ns,
    pairs_loop,
    proc_cpu_s,
    proc_runq_wait_s,
    ratio,
    rotated,
    run_meta,
    run_workers,
    save_run,
    store_commit_costs,
    table,
)

HERE = Path(__file__).resolve().parent

#: Rounds and seconds per system per round. Full stays within ~3 minutes.
PLANS: dict[str, dict[str, Any]] = {
    "quick": {
        "a_rounds": 3,
        "a_secs": 1.0,
        "b_rounds": 1,
        "b_secs": 2.0,
        "c_rounds": 1,
        "c_secs": 2.0,
        "store_commits": 2000,
    },
    "full": {
        "a_rounds": 5,
        "a_secs": 2.0,
        "b_rounds": 3,
        "b_secs": 3.0,
        "c_rounds": 3,
        "c_secs": 3.0,
        "store_commits": 10000,
    },
}
HOLD_S = 0.001
HANDOFF_PROCS = 4
SPREAD_PROCS = 16
TARGET_PAIRS = 5000.0
TARGET_HANDOFF_P50_MS = 0.5
#: below this gap, client-side request stamps cannot order two requests.
FIFO_AMBIGUITY_MS = 0.5
SECTIONS = ("a", "b", "c", "store")


def log(msg: str) -> None:
    """Progress on stderr, so stdout carries only the report."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ (a)


def bench_single(
    systems: list[LockerSpec], plan: dict[str, Any], daemons: dict[str, int]
) -> dict[str, Any]:
    """(a) one client process, one key, try_acquire + release as fast as it goes.

    ``daemons``: the pid of each lockd by label, whose CPU per pair is measured.
    """
    secs = plan["a_secs"]
    lockers = {}
    for spec in systems:
        locker = spec.build()
        key = "bench-a"
        locker.prepare(key)
        pairs_loop(locker, key, now_ns() + int(0.2e9))  # warm-up (imports, JIT-free caches)
        lockers[spec.label] = locker
    rounds: list[dict[str, Any]] = []
    for r in range(plan["a_rounds"]):
        row: dict[str, Any] = {}
        for spec in rotated(systems, r):
            pid = daemons.get(spec.label)
            cpu0 = proc_cpu_s(pid) if pid is not None else 0.0
            wait0 = proc_runq_wait_s(pid) if pid is not None else 0.0
            out = pairs_loop(lockers[spec.label], "bench-a", now_ns() + int(secs * 1e9))
            elapsed = (out["end_ns"] - out["start_ns"]) / 1e9
            entry = {
                "pairs_per_s": out["pairs"] / elapsed,
                "pairs": out["pairs"],
                "misses": out["misses"],
                "client_cpu_us_per_pair": 1e6 * out["client_cpu_s"] / max(1, out["pairs"]),
            }
            if pid is not None:
                daemon_cpu = proc_cpu_s(pid) - cpu0
                entry["daemon_cpu_us_per_pair"] = 1e6 * daemon_cpu / max(1, out["pairs"])
                waited = proc_runq_wait_s(pid) - wait0
                entry["daemon_runq_us_per_pair"] = 1e6 * waited / max(1, out["pairs"])
            row[spec.label] = entry
        rounds.append(row)
        log(
            f"(a) round {r + 1}: "
            + ", ".join(f"{k} {v['pairs_per_s']:,.0f}/s" for k, v in row.items())
        )
    daemon_stats = lockers["lockd"].client.stats()  # type: ignore[attr-defined]
    for locker in lockers.values():
        locker.close()
    summary: dict[str, Any] = {}
    for spec in systems:
        label = spec.label
        per_round = [row[label]["pairs_per_s"] for row in rounds]
        summary[label] = {
            "median_pairs_per_s": median(per_round),
            "min_pairs_per_s": min(per_round),
            "max_pairs_per_s": max(per_round),
            "client_cpu_us_per_pair": median(
                [row[label]["client_cpu_us_per_pair"] for row in rounds]
            ),
            # lockd / this system, paired within each round, then the median.
            "lockd_ratio": median(
                [row["lockd"]["pairs_per_s"] / row[label]["pairs_per_s"] for row in rounds]
            ),
        }
    for label in daemons:
        for field in ("daemon_cpu_us_per_pair", "daemon_runq_us_per_pair"):
            summary[label][field] = median([row[label][field] for row in rounds])
    latency = daemon_stats.get("latency", {})
    return {
        "rounds": rounds,
        "summary": summary,
        "daemon_side_latency": {op: latency.get(op) for op in ("tryAcquire", "release")},
    }


# ------------------------------------------------------------------------ (b)


def bench_handoff(systems: list[LockerSpec], plan: dict[str, Any]) -> dict[str, Any]:
    """(b) 4 processes, one key, blocking acquire, hold ~1 ms, release, repeat."""
    rounds: list[dict[str, Any]] = []
    for r in range(plan["b_rounds"]):
        row: dict[str, Any] = {}
        for spec in rotated(systems, r):
            records = run_workers(
                spec, ["bench-b"] * HANDOFF_PROCS, "handoff", plan["b_secs"], hold_s=HOLD_S
            )
            row[spec.label] = analyse_handoffs(records)
        rounds.append(row)
        log(
            f"(b) round {r + 1}: "
            + ", ".join(
                f"{k} p50 {v['p50_ms']:.3f} ms FIFO {v['fifo_fraction']:.0%}"
                for k, v in row.items()
            )
        )
    summary: dict[str, Any] = {}
    for spec in systems:
        per = [row[spec.label] for row in rounds]
        handoffs = sum(x["handoffs"] for x in per)
        summary[spec.label] = {
            "p50_ms": median([x["p50_ms"] for x in per]),
            "p99_ms": median([x["p99_ms"] for x in per]),
            "max_ms": max(x["max_ms"] for x in per),
            "handoffs": handoffs,
            "fifo_fraction": _weighted(per, "fifo_fraction"),
            "regrab_fraction": _weighted(per, "regrab_fraction"),
            "min_max_ratio": median([x["min_max_ratio"] for x in per]),
            "grants_per_s": median([x["grants"] / plan["b_secs"] for x in per]),
            "overlaps": sum(x["overlaps"] for x in per),
            "non_fifo": sum(x["non_fifo"] for x in per),
            "non_fifo_max_gap_ms": max(
                (gap for x in per for gap in x["non_fifo_gaps_ms"]), default=math.nan
            ),
        }
    for entry in summary.values():
        entry["lockd_p50_ratio"] = ratio(summary["lockd"]["p50_ms"], entry["p50_ms"])
    return {"rounds": rounds, "summary": summary, "hold_s": HOLD_S, "processes": HANDOFF_PROCS}


def _weighted(per: list[dict[str, Any]], field: str) -> float:
    total = sum(x["handoffs"] for x in per)
    if not total:
        return math.nan
    return sum(x[field] * x["handoffs"] for x in per if x["handoffs"]) / total


# ------------------------------------------------------------------------ (c)


def bench_spread(
    systems: list[LockerSpec], plan: dict[str, Any], daemons: dict[str, int]
) -> dict[str, Any]:
    """(c) 16 processes, each its own key: aggregate try_acquire + release pairs/s."""
    keys = [f"bench-c:{i}" for i in range(SPREAD_PROCS)]
    # Untimed, each system once: the first round's first system must not
    # pay for the worker pool's start or another's first keys.
    for spec in systems:
        run_workers(spec, keys, "pairs", 0.2)
    rounds: list[dict[str, Any]] = []
    for r in range(plan["c_rounds"]):
        row: dict[str, Any] = {}
        for spec in rotated(systems, r):
            pid = daemons.get(spec.label)
            # The server's CPU is read from when every worker has connected
            # (and said hello): accepting and identifying 16 callers is not
            # a pair's cost, and lockd's identification (the caller's groups,
            # /proc) costs more than the floor's.
            start: list[float] = [0.0, 0.0]

            def read_start(pid: int | None = pid, start: list[float] = start) -> None:
                if pid is not None:
                    start[:] = [proc_cpu_s(pid), proc_runq_wait_s(pid)]

            outs = run_workers(spec, keys, "pairs", plan["c_secs"], on_ready=read_start)
            cpu0, wait0 = start
            total = sum(o["pairs"] / ((o["end_ns"] - o["start_ns"]) / 1e9) for o in outs)
            per_proc = [o["pairs"] for o in outs]
            entry: dict[str, Any] = {
                "pairs_per_s": total,
                "misses": sum(o["misses"] for o in outs),
                "min_max_ratio": min(per_proc) / max(per_proc) if max(per_proc) else math.nan,
                "client_cpu_us_per_pair": 1e6
                * sum(o["client_cpu_s"] for o in outs)
                / max(1, sum(per_proc)),
            }
            if pid is not None:
                pairs = sum(per_proc)
                entry["daemon_cpu_us_per_pair"] = 1e6 * (proc_cpu_s(pid) - cpu0) / pairs
                waited = proc_runq_wait_s(pid) - wait0
                entry["daemon_runq_us_per_pair"] = 1e6 * waited / pairs
            row[spec.label] = entry
        rounds.append(row)
        log(
            f"(c) round {r + 1}: "
            + ", ".join(f"{k} {v['pairs_per_s']:,.0f}/s" for k, v in row.items())
        )
    summary: dict[str, Any] = {}
    for spec in systems:
        label = spec.label
        summary[label] = {
            "median_pairs_per_s": median([row[label]["pairs_per_s"] for row in rounds]),
            "min_max_ratio": median([row[label]["min_max_ratio"] for row in rounds]),
            "client_cpu_us_per_pair": median(
                [row[label]["client_cpu_us_per_pair"] for row in rounds]
            ),
            "lockd_ratio": median(
                [row["lockd"]["pairs_per_s"] / row[label]["pairs_per_s"] for row in rounds]
            ),
        }
    for label in daemons:
        for field in ("daemon_cpu_us_per_pair", "daemon_runq_us_per_pair"):
            summary[label][field] = median([row[label][field] for row in rounds])
        if FLOOR in daemons:
            # Server CPU per pair over the floor's, paired within each round.
            summary[label]["floor_cpu_ratio"] = paired_ratio(
                rounds, label, FLOOR, "daemon_cpu_us_per_pair"
            )
    return {"rounds": rounds, "summary": summary, "processes": SPREAD_PROCS}


# --------------------------------------------------------------------- goals

#: Issue 13's goals, as ratios to same-run peers (the "goals" table).
GOAL_B1_VS_POSTGRES = 0.9
GOAL_B1_VS_REDIS = 1.2
GOAL_B2_P99_MS = 1.0
GOAL_B3_VS_POSTGRES = 1.0
#: Issue 25: lockd's server CPU per B3 pair over the floor's.
GOAL_B3_OVER_FLOOR = 1.2
#: the label of the floor server (bench/floor_server.py, stdlib JSON).
FLOOR = "floor"


def paired_ratio(rounds: list[dict[str, Any]], label: str, peer: str, field: str) -> float:
    """Median over rounds of ``label``'s ``field`` / ``peer``'s, paired within each round."""
    return median(
        [
            row[label][field] / row[peer][field]
            for row in rounds
            if label in row and peer in row and row[peer][field]
        ]
    )


def goal_rows(results: dict[str, Any], label: str) -> list[tuple[str, float, bool]]:
    """(goal, measured, met) for one lockd (this tree's, or ``lockd@REV``)."""
    rows: list[tuple[str, float, bool]] = []
    if "a" in results:
        rounds = results["a"]["rounds"]
        for peer, goal in (("postgres", GOAL_B1_VS_POSTGRES), ("redis", GOAL_B1_VS_REDIS)):
            r = paired_ratio(rounds, label, peer, "pairs_per_s")
            rows.append((f"B1 pairs/s vs {peer} >= {goal}x", r, r >= goal))
    if "b" in results:
        s = results["b"]["summary"]
        if label in s and "postgres" in s:
            r = paired_ratio(results["b"]["rounds"], label, "postgres", "p50_ms")
            rows.append(("B2 hand-off p50 vs postgres <= 1x", r, r <= 1.0))
        if label in s:
            mine = s[label]
            p99 = mine["p99_ms"]
            rows.append((f"B2 hand-off p99 <= {GOAL_B2_P99_MS} ms", p99, p99 <= GOAL_B2_P99_MS))
            regrab = mine["regrab_fraction"]
            fifo = mine["fifo_fraction"] == 1.0 or mine["non_fifo_max_gap_ms"] < FIFO_AMBIGUITY_MS
            rows.append(("B2 re-grab = 0 and strict FIFO", regrab, regrab == 0 and fifo))
    if "c" in results:
        r = paired_ratio(results["c"]["rounds"], label, "postgres", "pairs_per_s")
        rows.append(
            (f"B3 pairs/s vs postgres >= {GOAL_B3_VS_POSTGRES}x", r, r >= GOAL_B3_VS_POSTGRES)
        )
        r = paired_ratio(results["c"]["rounds"], label, FLOOR, "daemon_cpu_us_per_pair")
        rows.append(
            (f"B3 server CPU/pair vs floor <= {GOAL_B3_OVER_FLOOR}x", r, r <= GOAL_B3_OVER_FLOOR)
        )
    return rows


def _report_goals(results: dict[str, Any]) -> list[str]:
    labels = ["lockd"] + [
        label
        for label in results.get("a", results.get("c", {})).get("summary", {})
        if label.startswith("lockd@") or label.startswith("lockd-")
    ]
    per_label = {label: goal_rows(results, label) for label in labels}
    goals = [goal for goal, _, _ in per_label["lockd"]]
    if not goals:
        return []
    rows = []
    for i, goal in enumerate(goals):
        row = [goal]
        for label in labels:
            _, value, met = per_label[label][i]
            row.append("-" if math.isnan(value) else f"{value:.3g} {'MET' if met else 'no'}")
        rows.append(row)
    return [
        "goals (issue 13): ratios paired within each round, medians; re-grab as a fraction",
        table(["goal", *labels], rows),
    ]


# -------------------------------------------------------------------- report


def report(results: dict[str, Any]) -> str:
    """The human-readable tables for stdout."""
    meta = results["meta"]
    out = [
        f"lockd benchmarks ({meta['plan']} run, {meta['cpus']} CPUs, "
        f"load {meta['loadavg_start']}, git {meta['git']})",
        "medians over rounds; ratio = lockd / baseline, paired within each round",
    ]
    for section, render in (
        ("a", _report_single),
        ("b", _report_handoff),
        ("c", _report_spread),
        ("store", _report_store),
        ("goals", _report_goals),
    ):
        if section in results or (section == "goals" and results.keys() & {"a", "b", "c"}):
            out.append("")
            out += render(results)
            skipped = results["skipped"].get(section, {})
            out += [f"  {name}: {why}" for name, why in skipped.items()]
    out.append(f"\nJSON: {meta['json']}")
    return "\n".join(out)


def _report_single(results: dict[str, Any]) -> list[str]:
    a = results["a"]
    rows = [
        [
            label,
            fmt_num(s["median_pairs_per_s"]),
            f"{fmt_num(s['min_pairs_per_s'])}..{fmt_num(s['max_pairs_per_s'])}",
            fmt_num(s["client_cpu_us_per_pair"], 1),
            fmt_num(s.get("daemon_cpu_us_per_pair", math.nan), 1),
            "" if label == "lockd" else fmt_ratio(s["lockd_ratio"]),
        ]
        for label, s in a["summary"].items()
    ]
    side = ", ".join(
        f"{op} p50 {v.get('p50Ms', '-')} ms, p99 {v.get('p99Ms', '-')} ms"
        for op, v in a["daemon_side_latency"].items()
        if v
    )
    med = a["summary"]["lockd"]["median_pairs_per_s"]
    return [
        f"(a) uncontended try_acquire+release, 1 client process, "
        f"{len(a['rounds'])} rounds x {results['plan']['a_secs']} s",
        table(
            ["system", "pairs/s", "range", "client CPU us/pair", "server CPU us/pair", "ratio"],
            rows,
        ),
        f"  lockd's own per-op time (stats op, last round): {side}",
        f"  target (a) >= {TARGET_PAIRS:,.0f} pairs/s: "
        f"{'MET' if med >= TARGET_PAIRS else 'NOT MET'} ({fmt_num(med)})",
    ]


def _report_handoff(results: dict[str, Any]) -> list[str]:
    b = results["b"]
    rows = [
        [
            label,
            fmt_num(s["p50_ms"], 3),
            fmt_num(s["p99_ms"], 3),
            fmt_num(s["max_ms"], 2),
            f"{s['fifo_fraction']:.1%}",
            f"{s['regrab_fraction']:.1%}",
            f"{s['min_max_ratio']:.2f}",
            fmt_num(s["grants_per_s"]),
            str(s["overlaps"]),
            "" if label == "lockd" else fmt_ratio(s["lockd_p50_ratio"]),
        ]
        for label, s in b["summary"].items()
    ]
    headers = ["system", "p50 ms", "p99 ms", "max ms", "FIFO", "re-grab", "min/max"]
    headers += ["grants/s", "overlaps", "p50 ratio"]
    out = [
        f"(b) hand-off, {b['processes']} processes on one key, hold {b['hold_s'] * 1000:g} ms, "
        f"{len(b['rounds'])} round(s) x {results['plan']['b_secs']} s",
        table(headers, rows),
    ]
    for label, s in b["summary"].items():
        if s["non_fifo"] and label != "flock":
            out.append(
                f"  {label}: {s['non_fifo']} of {s['handoffs']:,} hand-offs not FIFO; the skipped "
                f"waiter had asked at most {s['non_fifo_max_gap_ms']:.3f} ms earlier "
                "(request times are read before the call: see README)"
            )
    s = b["summary"]["lockd"]
    # Clients stamp a request before their call sends it, so two requests
    # issued within a fraction of a millisecond can reach the daemon in the
    # other order; only a skip of a waiter that asked clearly earlier is an
    # observable FIFO violation.
    fifo = s["fifo_fraction"] == 1.0 or s["non_fifo_max_gap_ms"] < FIFO_AMBIGUITY_MS
    met = s["p50_ms"] <= TARGET_HANDOFF_P50_MS and fifo
    out.append(
        f"  target hand-off p50 <= {TARGET_HANDOFF_P50_MS} ms with strict FIFO: "
        f"{'MET' if met else 'NOT MET'} (p50 {s['p50_ms']:.3f} ms, FIFO {s['fifo_fraction']:.1%}; "
        f"a skip between requests issued < {FIFO_AMBIGUITY_MS} ms apart is an order the "
        "clients cannot observe)"
    )
    return out


SPREAD_HEADERS = [
    "system",
    "aggregate pairs/s",
    "min/max",
    "client CPU us/pair",
    "server CPU us/pair",
    "server runq us/pair",
    "server CPU / floor",
    "ratio",
]


def _report_spread(results: dict[str, Any]) -> list[str]:
    c = results["c"]
    rows = [
        [
            label,
            fmt_num(s["median_pairs_per_s"]),
            f"{s['min_max_ratio']:.2f}",
            fmt_num(s["client_cpu_us_per_pair"], 1),
            fmt_num(s.get("daemon_cpu_us_per_pair", math.nan), 1),
            fmt_num(s.get("daemon_runq_us_per_pair", math.nan), 1),
            fmt_ratio(s.get("floor_cpu_ratio", math.nan)),
            "" if label == "lockd" else fmt_ratio(s["lockd_ratio"]),
        ]
        for label, s in c["summary"].items()
    ]
    return [
        f"(c) {c['processes']} processes, one key each, try_acquire+release, "
        f"{len(c['rounds'])} round(s) x {results['plan']['c_secs']} s",
        table(SPREAD_HEADERS, rows),
    ]


def _report_store(results: dict[str, Any]) -> list[str]:
    rows = [
        [
            f"WAL synchronous={s['synchronous']}",
            fmt_num(s["p50_us"], 1),
            fmt_num(s["p99_us"], 1),
            fmt_num(s["p999_us"], 1),
            fmt_num(s["max_us"], 0),
            str(s["slow_commits"])
            + (f" (1 per {fmt_num(s['slow_every'])})" if s["slow_commits"] else ""),
            str(s["commits"]),
        ]
        for s in results["store"]
    ]
    headers = ["setting", "p50 us", "p99 us", "p99.9 us", "max us", "> 500 us", "commits"]
    out = [
        "(store) one Store.apply commit as the daemon makes it on its loop (one-row change)",
        table(headers, rows),
    ]
    if "a" in results:
        pairs = results["a"]["summary"]["lockd"]["median_pairs_per_s"]
        per_request_us = 1e6 / (2 * pairs)
        share = results["store"][0]["p50_us"] / per_request_us
        out.append(
            f"  NORMAL p50 is {share:.1%} of one lockd request in (a) ({per_request_us:.0f} us);"
            " on a quiet box the > 500 us ones are WAL auto-checkpoints (db fsync)"
        )
    return out


def _git_rev() -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(HERE), "status", "--porcelain", "--", "../lockd", "../client"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _enter(
    stack: contextlib.ExitStack,
    factory: Callable[[], contextlib.AbstractContextManager[LockerSpec | str]],
    name: str,
    sections: set[str],
    skipped: dict[str, dict[str, str]],
) -> LockerSpec | None:
    got = stack.enter_context(factory())
    if isinstance(got, str):
        log(f"{name}: {got}")
        for section in sections:
            skipped.setdefault(section, {})[name] = got
        return None
    return got


@contextlib.contextmanager
def _earlier_lockd(rev: str | None) -> Iterator[LockdDaemon | None]:
    """``--compare REV``: that revision's lockd, from a temporary git worktree."""
    with checkout(rev) as tree:
        if tree is None:
            yield None
            return
        with LockdDaemon(tree=tree, label=f"lockd@{rev}").running() as daemon:
            log(f"lockd@{rev} serving on {daemon.socket} (pid {daemon.pid})")
            yield daemon


def _bench_systems(
    only: set[str],
    plan: dict[str, Any],
    cprofile: Path | None,
    results: dict[str, Any],
    compare: str | None = None,
    variants: dict[str, str] | None = None,
    floors: tuple[str, ...] = ("stdlib",),
    without: frozenset[str] = frozenset(),
) -> None:
    """Sections a, b, c: start lockd and the baselines, run, stop them all.

    ``variants``: label -> ``lockd.toml`` text of more lockds of this
    checkout (``lockd-LABEL``); ``floors``: the floor servers' JSON codecs
    (sections a and c only: the floor has no blocking acquire).
    """
    skipped: dict[str, dict[str, str]] = results["skipped"]
    sections = only & {"a", "b", "c"}
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(LockdDaemon(cprofile=cprofile).running())
        log(f"lockd serving on {daemon.socket} (pid {daemon.pid})")
        lockd = daemon.spec()
        earlier_daemon = stack.enter_context(_earlier_lockd(compare))
        others: list[LockdDaemon | FloorDaemon] = [] if earlier_daemon is None else [earlier_daemon]
        for name, config in (variants or {}).items():
            variant = LockdDaemon(label=f"lockd-{name}", config=config)
            others.append(stack.enter_context(variant.running()))
            log(f"lockd-{name} serving on {variant.socket} (pid {variant.pid})")
        floor_daemons = []
        if only & {"a", "c"}:
            for codec in floors:
                floor = FloorDaemon(codec, FLOOR if codec == "stdlib" else f"{FLOOR}-{codec}")
                floor_daemons.append(stack.enter_context(floor.running()))
                log(f"{floor.label} serving on {floor.socket} (pid {floor.pid})")
        daemons = {d.label: d.pid for d in (daemon, *others, *floor_daemons)}
        flock = pg = redis = None
        if "flock" not in without:
            flock = _enter(stack, flock_baseline, "flock", sections, skipped)
        if "postgres" not in without:
            pg = _enter(stack, postgres_baseline, "postgres", sections, skipped)
        if "a" in only and "redis" not in without:
            redis = _enter(stack, redis_baseline, "redis", {"a"}, skipped)
        peers = [d.spec() for d in others] + [s for s in (flock, pg) if s is not None]
        floor_specs = [d.spec() for d in floor_daemons]
        if "a" in only:
            results["a"] = bench_single(
                [lockd, *peers, *floor_specs] + ([redis] if redis else []), plan, daemons
            )
        if "b" in only:
            results["b"] = bench_handoff([lockd, *peers], plan)
        if "c" in only:
            results["c"] = bench_spread([lockd, *peers, *floor_specs], plan, daemons)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~30 s run (fewer, shorter rounds)")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma list of sections ({','.join(SECTIONS)})"
    )
    parser.add_argument(
        "--cprofile",
        type=Path,
        help="run the daemon under cProfile and write its stats to this file",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results", help="folder for the JSON")
    parser.add_argument(
        "--compare",
        metavar="REV",
        help="also run the lockd of git revision REV as a same-run peer (before/after a change)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=TOML",
        help="also run this checkout's lockd with this lockd.toml text, as lockd-NAME "
        "(e.g. 'nopoll=busy_poll_us = 0'); repeatable",
    )
    parser.add_argument(
        "--floor",
        default="stdlib",
        help="comma list of the floor servers' JSON codecs (stdlib, orjson), or 'none'",
    )
    parser.add_argument(
        "--rounds", type=int, help="rounds of each of sections a, b and c (overrides the plan)"
    )
    parser.add_argument(
        "--without",
        default="",
        help="comma list of baselines not to run (flock, postgres, redis): shorter runs",
    )
    args = parser.parse_args(argv)
    without = frozenset(n.strip() for n in args.without.split(",") if n.strip())
    variants = dict(v.split("=", 1) for v in args.variant)
    floors = tuple(c for c in args.floor.split(",") if c and c != "none")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if unknown := only - set(SECTIONS):
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    plan_name = "quick" if args.quick else "full"
    plan = dict(PLANS[plan_name])
    if args.rounds is not None:
        plan.update(a_rounds=args.rounds, b_rounds=args.rounds, c_rounds=args.rounds)
    results: dict[str, Any] = {
        "meta": {**run_meta(args.out, plan_name, plan_name), "git": _git_rev()},
        "plan": plan,
        "skipped": {},
    }
    t0 = time.monotonic()
    if only & {"a", "b", "c"}:
        _bench_systems(only, plan, args.cprofile, results, args.compare, variants, floors, without)
    if "store" in only:
        log("store: timing Store.apply commits")
        results["store"] = [
            store_commit_costs(plan["store_commits"], "NORMAL"),
            store_commit_costs(plan["store_commits"] // 4, "FULL"),
        ]
    save_run(results, t0)
    print(report(results))
    log(f"done in {results['meta']['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
