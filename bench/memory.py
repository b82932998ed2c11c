"""lockd's memory per lease: ``.venv/bin/python bench/memory.py [--quick] [--leases N]``.

Fills a real ``lockd serve`` with N live leases (1,000,000; ``--quick``:
100,000) over its socket, the way clients would make them: 4 connections,
200 pipelined ``tryAcquire`` each (more in flight can fill both sides'
socket buffers), distinct keys, 24 h TTL. Then:

* RSS of the daemon that took them (and its peak), and bytes per lease
  over the same daemon's RSS before the fill;
* the daemon stopped and started again on the same database: time from the
  exec until ``hello`` answers, RSS then, and after every lease has been
  asked about once more (``--probe`` of them, spread over the keys);
* a held key from the fill answers ``status`` as held, before and after;
* RSS once a ``stats`` answered (it waits for every chunk of the restore),
  and once a grant did (it waits for the integrity check);
* the highest RSS sampled every 20 ms from ``hello`` until that grant
  answered (the peak while the check runs), the CPU of the check's thread
  and the database file's pages resident in mappings (``CheckWatch``).

Goals (issue 26): <= 150 MB live and after restart at 1 M, restart <= 1 s.
Prints a table and writes ``bench/results/<UTC time>-memory-<plan>.json``.

``--restart-only`` skips the fill over the socket: the leases are written
straight into a database (lockd's schema, rows as the daemon writes them,
checksums included; kept in ``--db`` for the next invocation), then a copy
is started ``--runs`` times by this checkout and, with ``--baseline TREE``,
by that one, alternately: time to ``hello``, RSS then, time to the first
grant (a write: it waits for the integrity check), the check thread's CPU,
the highest RSS sampled until that grant and RSS once it answered, and RSS
after ``--probes`` ``status`` calls; medians per checkout, load average beside.
``--hello-only`` stops each start at ``hello`` (no grant, no probes): more
starts fit in a minute, for the restart time alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LockdDaemon, proc_cpu_s, run_meta, save_run, table
from run import log
from scale import Wire, boot_ms, compile_bytecode, rss_mb, start_timed, workdir
from scale import fill as fill_directly
from scale import key_of as scale_key

TTL_MS = 24 * 3600 * 1000
CONNECTIONS = 4
PIPELINE = 200


def key_of(i: int) -> str:
    return f"mem:{i:07d}"


def _fill_part(socket: Path, start: int, count: int, errors: list[str]) -> None:
    """Take keys ``start`` .. ``start + count`` on one connection, PIPELINE in flight."""
    wire = Wire(socket)
    try:
        wire.result("hello")
        sent = done = 0
        while done < count:
            batch = []
            while sent < count and sent - done < PIPELINE:
                batch.append(
                    wire.line(sent + 1, "tryAcquire", key=key_of(start + sent), ttlMs=TTL_MS)
                )
                sent += 1
            if batch:
                wire.sock.sendall(b"".join(batch))
            for reply in wire.ready_replies():
                done += 1
                if not reply.get("ok") or not reply["result"]:
                    errors.append(str(reply))
    finally:
        wire.close()


def fill(daemon: LockdDaemon, count: int) -> float:
    """``count`` leases over CONNECTIONS connections; seconds taken."""
    errors: list[str] = []
    per = -(-count // CONNECTIONS)
    parts = [(i * per, min(per, count - i * per)) for i in range(CONNECTIONS)]
    threads = [
        threading.Thread(target=_fill_part, args=(daemon.socket, start, n, errors))
        for start, n in parts
        if n > 0
    ]
    t0 = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{len(errors)} tryAcquire failed, e.g. {errors[0]}")
    return time.monotonic() - t0


def check_held(
    daemon: LockdDaemon, count: int, probes: int, key: Callable[[int], str] = key_of
) -> float:
    """``status`` of ``probes`` filled keys spread over all: each must be held; seconds."""
    wire = Wire(daemon.socket)
    t0 = time.monotonic()
    try:
        step = max(1, count // max(1, probes))
        for i in range(0, count, step):
            st = wire.result("status", key=key(i))
            if not st.get("held"):
                raise RuntimeError(f"{key(i)} is not held: {st}")
    finally:
        wire.close()
    return time.monotonic() - t0


class CheckWatch:
    """RSS and the integrity check of a restarted daemon, sampled every ``every`` s.

    From :meth:`start` (just after ``hello``) until :meth:`stop`: the
    highest VmRSS seen (the peak while the check runs, rather than the
    whole life's VmHWM), and the check's thread: the thread other than the
    main one that used the most CPU (the daemon's others, a thread waiting
    for the check, use next to none), when it was last seen (seconds after
    ``start``) and the CPU it had used then (its own user + system ticks);
    and every fifth sample, the most of ``db`` (the database file) found
    resident in the daemon's mappings of it (``/proc/PID/smaps``).
    """

    def __init__(self, pid: int, db: Path, every: float = 0.02) -> None:
        self.pid = pid
        self.db = str(db.resolve())
        self.every = every
        self.peak_rss_mb = 0.0
        self.mapped_db_mb = 0.0
        self._samples = 0
        #: thread id: (its CPU s, seconds after start when last seen), main thread aside.
        self._threads: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def start(self) -> CheckWatch:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> CheckWatch:
        self._stop.set()
        self._thread.join()
        return self

    def _mapped_db_mb(self) -> float:
        """Resident kB of the mappings of ``db`` in smaps, as MB."""
        resident_kb = 0
        in_db = False
        with open(f"/proc/{self.pid}/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line[:1].isupper():  # a mapping's first line: "start-end perms ... path"
                    in_db = line.rstrip("\n").endswith(self.db)
                elif in_db and line.startswith("Rss:"):
                    resident_kb += int(line.split()[1])
        return resident_kb * 1024 / 1e6

    def _sample(self) -> None:
        self.peak_rss_mb = max(self.peak_rss_mb, rss_mb(self.pid)[0])
        if self._samples % 5 == 0:  # smaps is slower to make: not every time
            self.mapped_db_mb = max(self.mapped_db_mb, self._mapped_db_mb())
        self._samples += 1
        tick = os.sysconf("SC_CLK_TCK")
        for task in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{task}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue  # the thread ended meanwhile
            if task != str(self.pid):
                cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
                self._threads[task] = (cpu, time.monotonic() - self._t0)

    @property
    def check_cpu_s(self) -> float:
        """The CPU of the busiest thread beside the main one: the check's."""
        return max(self._threads.values(), default=(0.0, 0.0))[0]

    @property
    def check_seen_s(self) -> float | None:
        """When the check's thread was last seen (seconds after :meth:`start`)."""
        return max(self._threads.values())[1] if self._threads else None

    def _run(self) -> None:
        while True:
            try:
                self._sample()
            except FileNotFoundError:
                return  # the daemon is gone
            if self._stop.wait(self.every):
                self._sample()
                return


def measure(count: int, probes: int, tree: Path | None = None) -> dict[str, Any]:
    with workdir() as root:
        db = root / "lockd.db"
        live = LockdDaemon(db=db, start_timeout=120, tree=tree)
        with live.running():
            base_rss, _ = rss_mb(live.pid)
            log(f"live: empty daemon RSS {base_rss:.0f} MB; filling {count:,} leases")
            cpu0 = proc_cpu_s(live.pid)
            fill_s = fill(live, count)
            fill_cpu_s = proc_cpu_s(live.pid) - cpu0
            rss, peak = rss_mb(live.pid)
            log(f"live: {count:,} leases in {fill_s:.1f} s; RSS {rss:.0f} MB (peak {peak:.0f} MB)")
            probe_s = check_held(live, count, probes)
            probed_rss, _ = rss_mb(live.pid)
        restarted = LockdDaemon(db=db, start_timeout=120, tree=tree)
        start_s = start_timed(restarted)
        try:
            r_rss, r_peak = rss_mb(restarted.pid)
            watch = CheckWatch(restarted.pid, db).start()
            log(f"restart: hello after {start_s:.2f} s, RSS {r_rss:.0f} MB (peak {r_peak:.0f} MB)")
            r_probe_s = check_held(restarted, count, probes)
            r_probed_rss, _ = rss_mb(restarted.pid)
            # A stats answer waits for every chunk of the restore (each lease
            # known), and since requests other than hello and status wait for
            # the integrity check, for the check too; a grant, for the check.
            wire = Wire(restarted.socket)
            try:
                wire.result("stats")
                r_checking_rss, _ = rss_mb(restarted.pid)
                if not wire.result("tryAcquire", key="restart:new", ttlMs=TTL_MS):
                    raise RuntimeError("restart:new was not granted")
            finally:
                wire.close()
            r_loaded_rss, r_loaded_peak = rss_mb(restarted.pid)
            watch.stop()
            log(
                f"restart: every lease loaded, RSS {r_checking_rss:.0f} MB once stats "
                f"answered, {r_loaded_rss:.0f} MB after a grant (peak {r_loaded_peak:.0f} MB); "
                f"sampled peak from hello to the grant {watch.peak_rss_mb:.0f} MB; check thread "
                f"last seen {watch.check_seen_s} s after hello, {watch.check_cpu_s:.2f} s CPU; "
                f"at most {watch.mapped_db_mb:.0f} MB of the database file mapped"
            )
        finally:
            restarted.stop()
    per_lease = 1e6 / count
    return {
        "leases": count,
        "base_rss_mb": base_rss,
        "fill_s": fill_s,
        "fill_per_s": count / fill_s,
        "fill_cpu_us_per_lease": fill_cpu_s * 1e6 / count,
        "live_rss_mb": rss,
        "live_peak_mb": peak,
        "live_bytes_per_lease": (rss - base_rss) * per_lease,
        "live_probed_rss_mb": probed_rss,
        "probe_s": probe_s,
        "restart_s": start_s,
        "restart_rss_mb": r_rss,
        "restart_peak_mb": r_peak,
        "restart_bytes_per_lease": (r_rss - base_rss) * per_lease,
        "restart_probed_rss_mb": r_probed_rss,
        "restart_probe_s": r_probe_s,
        "restart_loaded_rss_mb": r_loaded_rss,
        "restart_loaded_peak_mb": r_loaded_peak,
        "restart_checking_rss_mb": r_checking_rss,
        "restart_check_peak_mb": watch.peak_rss_mb,
        "restart_check_seen_s": watch.check_seen_s,
        "restart_check_cpu_s": watch.check_cpu_s,
        "restart_mapped_db_mb": watch.mapped_db_mb,
        "restart_loaded_bytes_per_lease": (r_loaded_rss - base_rss) * per_lease,
        "probes": probes,
    }


def restart_once(
    source: Path, count: int, probes: int, tree: Path | None, hello_only: bool = False
) -> dict[str, float]:
    """Start ``tree``'s lockd on a copy of ``source``: hello, first grant, RSS (s, MB)."""
    with workdir() as root:
        db = root / "lockd.db"
        shutil.copyfile(source, db)
        daemon = LockdDaemon(db=db, start_timeout=120, tree=tree)
        t0 = time.monotonic()
        daemon.start()
        try:
            wire = Wire(daemon.socket)
            try:
                wire.result("hello")
                hello_s = time.monotonic() - t0
                hello_cpu_s = proc_cpu_s(daemon.pid)  # steadier than wall time on a busy box
                hello_rss, _ = rss_mb(daemon.pid)
                if hello_only:
                    return {
                        "hello_s": hello_s,
                        "hello_cpu_s": hello_cpu_s,
                        "hello_rss_mb": hello_rss,
                    }
                watch = CheckWatch(daemon.pid, db).start()
                # A write: answered once the integrity check has passed.
                granted = wire.result("tryAcquire", key="restart:new", ttlMs=TTL_MS)
                grant_s = time.monotonic() - t0
                watch.stop()
                if not granted:
                    raise RuntimeError("restart:new was not granted")
                granted_rss, _ = rss_mb(daemon.pid)
            finally:
                wire.close()
            check_held(daemon, count, probes, scale_key)  # the keys fill_directly wrote
            used_rss, peak = rss_mb(daemon.pid)
        finally:
            daemon.stop()
    return {
        "hello_s": hello_s,
        "hello_cpu_s": hello_cpu_s,
        "hello_rss_mb": hello_rss,
        "grant_s": grant_s,
        "check_peak_mb": watch.peak_rss_mb,
        "check_cpu_s": watch.check_cpu_s,
        "mapped_db_mb": watch.mapped_db_mb,
        "granted_rss_mb": granted_rss,
        "used_rss_mb": used_rss,
        "peak_mb": peak,
    }


def restart_only(
    db: Path,
    count: int,
    probes: int,
    runs: int,
    trees: dict[str, Path | None],
    hello_only: bool = False,
) -> dict[str, Any]:
    """Restarts of each checkout on the same database, alternately; every sample kept."""
    if not db.exists():
        # As a daemon leaves them: this boot, TTL 1 h, deadlines over 20-21 h from now.
        fill_s = fill_directly(
            Path(__file__).resolve().parent.parent, db, count, boot_ms() + 20 * 3_600_000, 3_600_000
        )
        log(f"restart: {count:,} leases written into {db} in {fill_s:.1f} s")
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    loads: list[float] = []
    empty: dict[str, float] = {}
    for name, tree in trees.items():  # what a lease adds is measured over this
        bare = LockdDaemon(start_timeout=60, tree=tree)
        start_timed(bare)
        try:
            empty[name], _ = rss_mb(bare.pid)
        finally:
            bare.stop()
    for i in range(runs):
        for name, tree in trees.items():
            loads.append(os.getloadavg()[0])
            sample = restart_once(db, count, probes, tree, hello_only)
            samples[name].append(sample)
            line = (
                f"restart {i + 1}/{runs} {name}: hello {sample['hello_s']:.2f} s "
                f"({sample['hello_cpu_s']:.2f} s CPU) (RSS {sample['hello_rss_mb']:.0f} MB)"
            )
            if not hello_only:
                line += (
                    f", grant {sample['grant_s']:.2f} s (check {sample['check_cpu_s']:.2f} s "
                    f"CPU, RSS peak {sample['check_peak_mb']:.0f} MB, the file "
                    f"mapped at most {sample['mapped_db_mb']:.0f} MB, after "
                    f"{sample['granted_rss_mb']:.0f} MB), "
                    f"after {probes:,} status {sample['used_rss_mb']:.0f} MB"
                )
            log(f"{line}, load {loads[-1]:.1f}")
    for name, sample_list in samples.items():
        for sample in sample_list:
            if not hello_only:
                sample["bytes_per_lease"] = (sample["used_rss_mb"] - empty[name]) * 1e6 / count
    medians = {
        name: {field: statistics.median(s[field] for s in runs_) for field in runs_[0]}
        for name, runs_ in samples.items()
    }
    return {
        "leases": count,
        "probes": probes,
        "empty_rss_mb": empty,
        "samples": samples,
        "medians": medians,
        "load_1min": loads,
    }


def restart_report(r: dict[str, Any]) -> str:
    def shown(m: dict[str, float], field: str, form: str) -> str:
        return form.format(m[field]) if field in m else "-"  # --hello-only measures less

    rows = [
        [
            name,
            shown(m, "hello_s", "{:.2f} s"),
            shown(m, "hello_cpu_s", "{:.2f} s"),
            shown(m, "hello_rss_mb", "{:.0f} MB"),
            shown(m, "grant_s", "{:.2f} s"),
            shown(m, "check_cpu_s", "{:.2f} s"),
            shown(m, "check_peak_mb", "{:.0f} MB"),
            shown(m, "granted_rss_mb", "{:.0f} MB"),
            shown(m, "used_rss_mb", "{:.0f} MB"),
            shown(m, "bytes_per_lease", "{:.0f}"),
        ]
        for name, m in r["medians"].items()
    ]
    loads = r["load_1min"]
    head = f"{r['leases']:,} leases, medians of {len(next(iter(r['samples'].values())))} runs, "
    head += f"load {min(loads):.1f}-{max(loads):.1f}\n"
    return head + table(
        [
            "lockd",
            "hello",
            "CPU",
            "RSS",
            "1st grant",
            "check CPU",
            "peak in check",
            "after check",
            f"after {r['probes']:,}",
            "B/lease",
        ],
        rows,
    )


def report(r: dict[str, Any]) -> str:
    def mb(value: float) -> str:
        return f"{value:.0f} MB"

    rows = [
        ["empty daemon", mb(r["base_rss_mb"]), "", ""],
        [
            f"{r['leases']:,} live leases ({r['fill_per_s']:,.0f}/s, "
            f"{r['fill_cpu_us_per_lease']:.0f} us CPU each)",
            mb(r["live_rss_mb"]),
            mb(r["live_peak_mb"]),
            f"{r['live_bytes_per_lease']:.0f}",
        ],
        [f"  after {r['probes']:,} status", mb(r["live_probed_rss_mb"]), "", ""],
        [
            f"restarted (hello after {r['restart_s']:.2f} s)",
            mb(r["restart_rss_mb"]),
            mb(r["restart_peak_mb"]),
            f"{r['restart_bytes_per_lease']:.0f}",
        ],
        [f"  after {r['probes']:,} status", mb(r["restart_probed_rss_mb"]), "", ""],
        ["  after stats (every lease loaded)", mb(r["restart_checking_rss_mb"]), "", ""],
        [
            f"  sampled from hello to the grant (check thread {r['restart_check_cpu_s']:.2f} "
            f"s CPU, last seen {r['restart_check_seen_s'] or 0:.1f} s after hello; "
            f"file mapped {r['restart_mapped_db_mb']:.0f} MB)",
            "",
            mb(r["restart_check_peak_mb"]),
            "",
        ],
        [
            "  after a grant (the check done)",
            mb(r["restart_loaded_rss_mb"]),
            mb(r["restart_loaded_peak_mb"]),
            f"{r['restart_loaded_bytes_per_lease']:.0f}",
        ],
    ]
    return table(["daemon", "RSS", "peak", "B/lease"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100,000 leases")
    parser.add_argument("--leases", type=int, help="leases to fill (default 1,000,000)")
    parser.add_argument("--probes", type=int, default=2_000, help="status calls after the fill")
    parser.add_argument("--tree", type=Path, help="measure the lockd of this checkout instead")
    parser.add_argument(
        "--restart-only", action="store_true", help="restarts on a database written directly"
    )
    parser.add_argument("--db", type=Path, help="--restart-only: the database (made if missing)")
    parser.add_argument("--runs", type=int, default=3, help="--restart-only: restarts of each")
    parser.add_argument("--baseline", type=Path, help="--restart-only: also this checkout")
    parser.add_argument(
        "--hello-only", action="store_true", help="--restart-only: each start until hello only"
    )
    args = parser.parse_args(argv)
    count = args.leases or (100_000 if args.quick else 1_000_000)
    t0 = time.monotonic()
    plan = "restart" if args.restart_only else "quick" if args.quick else "full"
    results: dict[str, Any] = {
        "meta": run_meta(Path(__file__).parent / "results", f"memory-{plan}", plan)
    }
    # As an installed lockd starts: from bytecode, not compiling its source.
    compile_bytecode(args.tree or Path(__file__).resolve().parent.parent)
    if args.restart_only:
        trees: dict[str, Path | None] = {"this": args.tree}
        if args.baseline is not None:
            compile_bytecode(args.baseline)
            trees["baseline"] = args.baseline
        db = args.db or Path(f"/tmp/lockd-memory-{count}.db")
        results["restart"] = restart_only(db, count, args.probes, args.runs, trees, args.hello_only)
        print(restart_report(results["restart"]))
    else:
        results["memory"] = measure(count, args.probes, args.tree)
        print(report(results["memory"]))
    save_run(results, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
