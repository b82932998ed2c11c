"""Where a live lease's bytes go: ``.venv/bin/python bench/memory_breakdown.py [--before REV]``.

For this checkout (and, with ``--before REV``, that revision from a throwaway
``git worktree``, in the same run), two daemons each take N live leases over
the socket as ``bench/memory.py`` fills them (4 connections, 200 pipelined
``tryAcquire``, distinct keys, 24 h TTL; default N 200,000):

* a plain daemon, run by ``bench/traced_serve.py`` (which runs ``python -m
  lockd serve`` in its own process beside a thread that answers over a
  FIFO: no signal, no change to lockd), asked before and after the fill:
  RSS (the real figure), pymalloc's free space, ``sqlite3_memory_used()``,
  and every object the collector tracks and what they refer to, grouped
  (``traced_serve.objects_by_kind``);
* the same under ``python -X tracemalloc=1``: tracemalloc's traced total
  and its sites (filename:lineno), its own memory, and that daemon's RSS.

Per lease, after minus before, divided by N. tracemalloc costs memory of
its own (a trace per allocation, and the malloc blocks those live in), so the
traced daemon's RSS is not the daemon's: the table anchors on the plain
daemon's RSS and shows the traced one below it, with what tracemalloc says
it uses itself. The two daemons run the same code on the same requests, so
their Python objects and SQLite's memory are alike. "rest" is the plain
daemon's RSS minus the traced objects, SQLite's memory and pymalloc's free
space: glibc malloc's free space and fragmentation, and C memory no counter
sees (trio's, the interpreter's caches).

Prints the tables and writes ``bench/results/<UTC time>-memory-breakdown.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LockdDaemon, checkout, run_meta, save_run, table
from memory import fill
from run import log
from scale import Wire, compile_bytecode

TRACED_SERVE = Path(__file__).resolve().parent / "traced_serve.py"
#: object groups shown on a line of their own at or above this many bytes per lease.
SHOWN_FROM = 2.0
#: seconds a traced daemon may take to answer (it walks every object).
ANSWER_TIMEOUT = 300.0


def _hello(daemon: LockdDaemon) -> None:
    wire = Wire(daemon.socket)
    try:
        wire.result("hello")
    finally:
        wire.close()


def ask(daemon: LockdDaemon, control: Path, name: str) -> dict[str, Any]:
    """What the traced daemon holds now (see bench/traced_serve.py)."""
    with (control / "ask").open("w", encoding="utf-8") as fifo:
        fifo.write(name + "\n")
    answer = control / f"{name}.json"
    deadline = time.monotonic() + ANSWER_TIMEOUT
    while not answer.exists():
        if daemon.proc is None or daemon.proc.poll() is not None:
            raise RuntimeError(f"traced lockd exited:\n{daemon.read_log()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"traced lockd did not answer {name!r} in {ANSWER_TIMEOUT:.0f} s")
        time.sleep(0.05)  # polling a file the daemon's thread writes: nothing to wait on
    report: dict[str, Any] = json.loads(answer.read_text())
    if "error" in report:
        raise RuntimeError(f"traced lockd failed to measure: {report.get('where')}")
    return report


def measured(tree: Path | None, count: int, tracing: bool) -> dict[str, Any]:
    """A daemon run by bench/traced_serve.py: what it holds before and after ``count`` leases."""
    with tempfile.TemporaryDirectory(prefix="lockd-breakdown-", dir="/tmp") as tmp:
        control = Path(tmp)
        os.mkfifo(control / "ask")
        wrapper: tuple[str, ...] = ("-X", "tracemalloc=1") if tracing else ()
        wrapper += (str(TRACED_SERVE), str(control))
        daemon = LockdDaemon(start_timeout=120, tree=tree, wrapper=wrapper)
        with daemon.running():
            _hello(daemon)
            before = ask(daemon, control, "before")
            fill_s = fill(daemon, count)
            after = ask(daemon, control, "after")
    return {"before": before, "after": after, "fill_s": fill_s}


def _slack(pymalloc: dict[str, int]) -> int:
    """pymalloc's bytes that hold no object: free blocks, unused pools, headers, rounding."""
    return sum(
        pymalloc.get(k, 0)
        for k in ("available", "unused_pools", "pool_headers", "quantization", "arena_alignment")
    )


def _short(site: str) -> str:
    """A site's path from its package (``lockd/daemon/x.py:12``), a stdlib one by its name."""
    path, _, line = site.rpartition(":")
    for package in ("/lockd/", "/sortedcontainers/"):
        if package in path:
            return package[1:] + path.rsplit(package, 1)[1] + ":" + line
    return Path(path).name + ":" + line


def breakdown(plain: dict[str, Any], trace: dict[str, Any], count: int) -> dict[str, Any]:
    """Bytes per lease, by row (after minus before, over ``count``)."""
    b, a = trace["before"], trace["after"]
    pb, pa = plain["before"], plain["after"]

    def per(after: float, before: float) -> float:
        return (after - before) / count

    objects: dict[str, float] = {}
    for name in set(pa["objects"]) | set(pb["objects"]):
        grown = per(
            pa["objects"].get(name, {}).get("bytes", 0), pb["objects"].get(name, {}).get("bytes", 0)
        )
        objects[name] = grown
    shown = {k: v for k, v in objects.items() if abs(v) >= SHOWN_FROM}
    other_objects = sum(v for k, v in objects.items() if k not in shown)
    traced = per(a["traced"], b["traced"])
    sqlite = per(pa["sqlite_memory_used"] or 0, pb["sqlite_memory_used"] or 0)
    pymalloc_slack = per(_slack(pa["pymalloc"]), _slack(pb["pymalloc"]))
    rss_plain = per(pa["rss"], pb["rss"])
    rss_traced = per(a["rss"], b["rss"])
    overhead = per(a["tracemalloc_overhead"], b["tracemalloc_overhead"])
    rss_less_overhead = rss_traced - overhead
    before_sites = {s["site"]: s["bytes"] for s in b["sites"]}
    sites = sorted(
        (
            (_short(s["site"]), s["line"], per(s["bytes"], before_sites.get(s["site"], 0)))
            for s in a["sites"]
        ),
        key=lambda site: -site[2],
    )
    lease_objects = pa["objects"].get("lockd objects: Lease", {}).get("count", 0) - pb[
        "objects"
    ].get("lockd objects: Lease", {}).get("count", 0)
    return {
        "rss_plain": rss_plain,
        "lease_objects": lease_objects,
        "rss_traced": rss_traced,
        "tracemalloc_overhead": overhead,
        "rss_traced_less_overhead": rss_less_overhead,
        "traced": traced,
        "objects": dict(sorted(shown.items(), key=lambda kv: -kv[1])),
        "other_objects": other_objects,
        "traced_not_walked": traced - sum(objects.values()),
        "sqlite": sqlite,
        "pymalloc_slack": pymalloc_slack,
        "rest": rss_plain - traced - sqlite - pymalloc_slack,
        "sites": sites,
    }


def report(results: dict[str, Any]) -> str:
    names = list(results["checkouts"])
    per = {name: results["checkouts"][name]["per_lease"] for name in names}
    groups: list[str] = []
    for name in names:
        groups += [g for g in per[name]["objects"] if g not in groups]

    def row(label: str, value: Any) -> list[str]:
        return [label, *(value(per[n]) for n in names)]

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    rows = [
        row("leases held as Lease objects", lambda p: f"{p['lease_objects']:,}"),
        row("RSS, plain daemon (the figure)", lambda p: num(p["rss_plain"])),
        row("Python objects (tracemalloc traced)", lambda p: num(p["traced"])),
    ]
    rows += [row(f"  {g}", lambda p, g=g: num(p["objects"].get(g))) for g in groups]
    rows += [
        row("  other objects", lambda p: num(p["other_objects"])),
        row("  traced, not found by the walk", lambda p: num(p["traced_not_walked"])),
        row("SQLite (sqlite3_memory_used)", lambda p: num(p["sqlite"])),
        row("pymalloc free space (arenas)", lambda p: num(p["pymalloc_slack"])),
        row("rest: RSS - the three above", lambda p: num(p["rest"])),
        row("traced daemon: RSS", lambda p: num(p["rss_traced"])),
        row("  of it tracemalloc's own (its count)", lambda p: num(p["tracemalloc_overhead"])),
        row("  RSS less that", lambda p: num(p["rss_traced_less_overhead"])),
    ]
    fills = ", ".join(
        f"{n}: fill {results['checkouts'][n]['plain']['fill_s']:.1f} s plain, "
        f"{results['checkouts'][n]['traced']['fill_s']:.1f} s traced"
        for n in names
    )
    out = [
        f"bytes per lease, {results['leases']:,} live leases, load {results['load']}; {fills}",
        table(["", *names], rows),
    ]
    for name in names:
        out.append(f"\n{name}: tracemalloc's sites, bytes per lease (after minus before)")
        out.append(
            table(
                ["site", "B/lease", "line"],
                [[s, f"{v:,.1f}", line[:70]] for s, line, v in per[name]["sites"][:12]],
            )
        )
    return "\n".join(out)


def measure(name: str, tree: Path | None, count: int) -> dict[str, Any]:
    compile_bytecode(tree or Path(__file__).resolve().parent.parent)
    log(f"{name}: plain daemon, {count:,} leases")
    plain = measured(tree, count, tracing=False)
    log(f"{name}: traced daemon, {count:,} leases")
    trace = measured(tree, count, tracing=True)
    per_lease = breakdown(plain, trace, count)
    log(f"{name}: {per_lease['rss_plain']:.0f} B/lease RSS, {per_lease['traced']:.0f} traced")
    return {"plain": plain, "traced": trace, "per_lease": per_lease}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=200_000, help="live leases (200,000)")
    parser.add_argument("--before", metavar="REV", help="also this revision, same run")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    results: dict[str, Any] = {
        "meta": run_meta(Path(__file__).parent / "results", "memory-breakdown", "breakdown"),
        "leases": args.leases,
        "checkouts": {},
    }
    loads = [os.getloadavg()[0]]
    with checkout(args.before) as tree:
        if tree is not None:
            results["checkouts"][f"before {args.before}"] = measure(args.before, tree, args.leases)
            loads.append(os.getloadavg()[0])
        results["checkouts"]["this checkout"] = measure("this checkout", None, args.leases)
        loads.append(os.getloadavg()[0])
    results["load"] = f"{min(loads):.1f}-{max(loads):.1f}"
    print(report(results))
    save_run(results, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
