"""Where a B1 pair's time goes, on both sides: ``.venv/bin/python bench/pair_costs.py``.

One client (this process, through the real ``lockd_client``) runs B1's loop
-- ``try_acquire`` + ``release`` of one key, back to back -- against a real
``lockd serve``, and per pair it reports:

- wall time, and the CPU time of each side split into user and system
  (the client from ``getrusage``, the daemon from ``/proc/PID/stat``);
- how long each side waited for a CPU while runnable (run-queue wait,
  ``/proc/PID/schedstat``): behind the box's other jobs, or behind its own
  peer (a daemon preempted inside ``send`` by the client it woke waits
  while that client runs);
- context switches of each side: voluntary (it waited: for the peer, for
  I/O) and involuntary (it was preempted; on 2 shared cores mostly by the
  process its own ``send`` just woke);
- ``--strace``: system calls per request of each side (``strace -c``) in
  one extra round; the daemon's ``epoll_wait`` calls are trio's scheduler
  passes (one per pass) plus the group commit's "anyone else waiting?"
  polls, which a lone connection never makes;
- ``--py-spy``: where each side's Python time goes (py-spy ``--gil``, not
  a project dependency: ``.venv/bin/pip install py-spy``), by file (own
  time) and by function (inclusive). Time in system calls and inside SQLite
  is not sampled (the GIL is released there): see ``--strace`` and the
  user/system split.

``--compare REV`` runs REV's daemon with REV's own client as a second
system, interleaved round by round with this checkout's, so a change on
either side shows as a same-run before/after (read the ratios: the box is
shared). Tracing slows both sides several times over: read strace's counts,
not its timings.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    LockdDaemon,
    LockdLocker,
    checkout,
    now_ns,
    pairs_loop,
    proc_runq_wait_s,
    rotated,
    table,
)

Counter = collections.Counter
KEY = "bench-pair"
TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    """CPU seconds, context switches and run-queue wait of one process so far."""

    user: float
    system: float
    voluntary: int
    involuntary: int
    #: seconds runnable but waiting for a CPU (main thread).
    runq: float

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            self.user - other.user,
            self.system - other.system,
            self.voluntary - other.voluntary,
            self.involuntary - other.involuntary,
            self.runq - other.runq,
        )


def own_usage() -> Usage:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return Usage(ru.ru_utime, ru.ru_stime, ru.ru_nvcsw, ru.ru_nivcsw, proc_runq_wait_s(os.getpid()))


def daemon_usage(pid: int) -> Usage:
    """From ``/proc``: utime and stime (tick resolution) and the switch counts."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    switches = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name.endswith("ctxt_switches"):
                switches[name] = int(value)
    return Usage(
        int(fields[11]) / TICK,
        int(fields[12]) / TICK,
        switches["voluntary_ctxt_switches"],
        switches["nonvoluntary_ctxt_switches"],
        proc_runq_wait_s(pid),
    )


@dataclass
class System:
    """One lockd (daemon + its own client) under measurement."""

    label: str
    daemon: LockdDaemon
    locker: LockdLocker


def measure_round(system: System, secs: float) -> dict[str, float]:
    """One timed round of B1's loop: per-pair figures of both sides."""
    pid = system.daemon.pid
    client0, daemon0 = own_usage(), daemon_usage(pid)
    out = pairs_loop(system.locker, KEY, now_ns() + int(secs * 1e9))
    client, daemon = own_usage() - client0, daemon_usage(pid) - daemon0
    pairs = max(1, out["pairs"])
    wall = (out["end_ns"] - out["start_ns"]) / 1e9
    return {
        "pairs_per_s": out["pairs"] / wall,
        "wall_us": 1e6 * wall / pairs,
        "client_user_us": 1e6 * client.user / pairs,
        "client_sys_us": 1e6 * client.system / pairs,
        "daemon_user_us": 1e6 * daemon.user / pairs,
        "daemon_sys_us": 1e6 * daemon.system / pairs,
        "client_vcs": client.voluntary / pairs,
        "client_ivcs": client.involuntary / pairs,
        "daemon_vcs": daemon.voluntary / pairs,
        "daemon_ivcs": daemon.involuntary / pairs,
        "client_runq_us": 1e6 * client.runq / pairs,
        "daemon_runq_us": 1e6 * daemon.runq / pairs,
    }


# --------------------------------------------------------------------- strace


def parse_strace_summary(text: str) -> dict[str, int]:
    """``strace -c`` output -> calls per system call."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        # "% time  seconds  usecs/call  calls  [errors]  syscall"
        if len(parts) in (5, 6) and parts[3].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3])
    return calls


@contextlib.contextmanager
def traced(pids: dict[str, int], folder: Path) -> Iterator[dict[str, Path]]:
    """``strace -c -f`` attached to each pid while the block runs."""
    outputs = {side: folder / f"strace-{side}.txt" for side in pids}
    procs = [
        subprocess.Popen(
            ["strace", "-c", "-f", "-p", str(pid), "-o", str(outputs[side])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for side, pid in pids.items()
    ]
    time.sleep(0.5)  # attached (strace has no ready signal)
    try:
        yield outputs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def syscalls_per_request(system: System, secs: float, folder: Path) -> dict[str, dict[str, float]]:
    """System calls per request (half a pair) of each side, under strace."""
    pids = {"client": os.getpid(), "daemon": system.daemon.pid}
    with traced(pids, folder) as outputs:
        out = pairs_loop(system.locker, KEY, now_ns() + int(secs * 1e9))
    requests = max(1, 2 * out["pairs"])
    return {
        side: {
            name: calls / requests for name, calls in parse_strace_summary(path.read_text()).items()
        }
        for side, path in outputs.items()
    }


# --------------------------------------------------------------------- py-spy


def spy(system: System, secs: float, folder: Path) -> dict[str, dict[str, Counter]]:
    """py-spy samples of both sides for one round: by file (self) and by function (inclusive)."""
    exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if exe is None:
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")
    pids = {"client": os.getpid(), "daemon": system.daemon.pid}
    outputs = {side: folder / f"spy-{side}.txt" for side in pids}
    # --gil: samples of Python code running. Waits (poll, epoll) and the
    # time inside SQLite or a syscall are left out: strace counts those.
    record = [exe, "record", "--gil", "-d", str(int(secs)), "-r", "400", "-f", "raw"]
    procs = [
        subprocess.Popen(
            [*record, "-p", str(pid), "-o", str(outputs[side])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for side, pid in pids.items()
    ]
    time.sleep(0.5)
    pairs_loop(system.locker, KEY, now_ns() + int(secs * 1e9))
    for proc in procs:
        proc.wait(secs + 30)
    return {side: fold_samples(path.read_text()) for side, path in outputs.items()}


def fold_samples(raw: str) -> dict[str, Counter]:
    """py-spy's raw (collapsed) stacks -> samples by file (own time) and function (inclusive)."""
    by_file: Counter = collections.Counter()
    by_function: Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        where = re.search(r"\((.*?):\d+\)", frames[-1])
        by_file[_short(where.group(1)) if where else frames[-1]] += n
        for function in {re.sub(r":\d+\)", ")", frame) for frame in frames}:
            by_function[_short(function)] += n
        by_file["<total>"] += n
    return {"file": by_file, "function": by_function}


def _short(text: str) -> str:
    """Library paths without their site-packages/stdlib prefix."""
    return re.sub(r"[^ (]*/(site-packages|python3\.\d+)/", "", text)


# -------------------------------------------------------------------- report


#: (row name, field(s) shown "a / b", digits); a ratio column for single fields.
FIGURES: list[tuple[str, tuple[str, ...], int]] = [
    ("pairs/s", ("pairs_per_s",), 0),
    ("wall us/pair", ("wall_us",), 0),
    ("client user us", ("client_user_us",), 0),
    ("client sys us", ("client_sys_us",), 0),
    ("daemon user us", ("daemon_user_us",), 0),
    ("daemon sys us", ("daemon_sys_us",), 0),
    ("client run-queue wait us", ("client_runq_us",), 0),
    ("daemon run-queue wait us", ("daemon_runq_us",), 0),
    ("client vol/invol switches", ("client_vcs", "client_ivcs"), 2),
    ("daemon vol/invol switches", ("daemon_vcs", "daemon_ivcs"), 2),
]


def report_rounds(labels: list[str], rounds: list[dict[str, dict[str, float]]]) -> str:
    """Medians over rounds, one column per system (+ this / the first peer, paired per round)."""
    headers = ["per pair (medians)", *labels]
    if len(labels) > 1:
        headers.append(f"{labels[0]} / {labels[1]}")
    rows = []
    for name, fields, digits in FIGURES:
        row = [name]
        for label in labels:
            medians = (statistics.median(r[label][f] for r in rounds) for f in fields)
            row.append(" / ".join(f"{m:,.{digits}f}" for m in medians))
        if len(labels) > 1:
            ratios = [
                r[labels[0]][fields[0]] / r[labels[1]][fields[0]]
                for r in rounds
                if len(fields) == 1 and r[labels[1]][fields[0]]
            ]
            row.append(f"{statistics.median(ratios):.3f}x" if ratios else "")
        rows.append(row)
    return table(headers, rows)


def report_syscalls(per_system: dict[str, dict[str, dict[str, float]]], top: int = 12) -> str:
    lines = ["system calls per request (strace -c -f, one round; a pair is 2 requests)"]
    for side in ("client", "daemon"):
        names: Counter = collections.Counter()
        for sides in per_system.values():
            names.update(sides[side])
        shown = [name for name, _ in names.most_common(top)]
        rows = [
            [name, *(f"{sides[side].get(name, 0):.2f}" for sides in per_system.values())]
            for name in shown
        ]
        rows.append(["all", *(f"{sum(sides[side].values()):.2f}" for sides in per_system.values())])
        lines += [f"  {side}:", table([side, *per_system], rows, indent="    ")]
    return "\n".join(lines)


def report_spy(label: str, folded: dict[str, dict[str, Counter]], top: int) -> str:
    lines = [f"py-spy samples of {label} (share of each side's samples)"]
    for side, kinds in folded.items():
        total = kinds["file"].pop("<total>", 0) or 1
        lines.append(f"  {side}: {total} samples; own time by file:")
        lines += [
            f"    {100 * n / total:5.1f}%  {name}" for name, n in kinds["file"].most_common(top)
        ]
        lines.append(f"  {side}: inclusive by function (below the loop's own frames):")
        below = [(name, n) for name, n in kinds["function"].most_common() if n < 0.9 * total]
        lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in below[:top]]
    return "\n".join(lines)


# ----------------------------------------------------------------------- main


def open_system(stack: contextlib.ExitStack, daemon: LockdDaemon) -> System:
    stack.enter_context(daemon.running())
    locker = LockdLocker(*daemon.spec().args)
    stack.callback(locker.close)
    locker.prepare(KEY)
    pairs_loop(locker, KEY, now_ns() + int(0.3e9))  # warm-up
    return System(daemon.label, daemon, locker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--secs", type=float, default=2.0, help="seconds per round and system")
    parser.add_argument("--compare", metavar="REV", help="also REV's daemon with REV's client")
    parser.add_argument("--strace", action="store_true", help="system calls per request")
    parser.add_argument("--py-spy", action="store_true", help="py-spy samples of both sides")
    parser.add_argument("--top", type=int, default=15, help="lines per py-spy list")
    args = parser.parse_args()
    print(
        f"B1 pair costs: {args.rounds} rounds x {args.secs} s, "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    with contextlib.ExitStack() as stack:
        systems = [open_system(stack, LockdDaemon())]
        if args.compare:
            tree = stack.enter_context(checkout(args.compare))
            assert tree is not None
            systems.append(
                open_system(stack, LockdDaemon(tree=tree, label=f"lockd@{args.compare}"))
            )
        labels = [s.label for s in systems]
        rounds = []
        for r in range(args.rounds):
            rounds.append({s.label: measure_round(s, args.secs) for s in rotated(systems, r)})
        print(report_rounds(labels, rounds))
        folder = Path(tempfile.mkdtemp(prefix="lockd-pair-", dir="/tmp"))
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        if args.strace:
            per_system = {s.label: syscalls_per_request(s, args.secs, folder) for s in systems}
            print(report_syscalls(per_system))
        if args.py_spy:
            for s in systems:
                print(report_spy(s.label, spy(s, max(args.secs, 4.0), folder), args.top))
    print(f"load at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
