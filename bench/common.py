"""Shared machinery of the benchmark suite: clocks, statistics, worker
processes, the lockd daemon under test, and the lockd side of each workload.

Every system (lockd and each baseline) is driven through the same small
*locker* interface (``prepare``, ``try_pair``, ``acquire``, ``release``,
``close``) by the same workload functions, so the harness costs every system
the same and only the lock itself differs. Lockers are built inside the
worker process from a picklable :class:`LockerSpec`, because a socket or a
database connection must not cross a fork.

Timestamps come from ``CLOCK_MONOTONIC``, which is one clock for every
process of the host: a release recorded in one process and a grant recorded
in another can be subtracted directly.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

#: Lease length for every lockd grant: long enough never to expire mid-run.
LOCKD_TTL_S = 30.0
#: Blocking acquire timeout: a hand-off run that stalls this long is a failure.
LOCKD_WAIT_S = 60.0


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: shared by all processes of the host."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ----------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """Median, NaN for no values (a skipped baseline has none)."""
    return statistics.median(values) if values else math.nan


def rotated(items: list[Any], by: int) -> list[Any]:
    """The same systems in a different order each round: no position bias."""
    if not items:
        return items
    k = by % len(items)
    return items[k:] + items[:k]


@contextlib.contextmanager
def checkout(rev: str | None) -> Iterator[Path | None]:
    """``--compare REV``: that revision in a temporary git worktree (None: no comparison)."""
    if rev is None:
        yield None
        return
    tree = Path(tempfile.mkdtemp(prefix="lockd-bench-rev-", dir="/tmp"))
    git = ["git", "-C", str(Path(__file__).resolve().parent.parent), "worktree"]
    subprocess.run([*git, "add", "--detach", str(tree), rev], check=True, capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run([*git, "remove", "--force", str(tree)], check=False, capture_output=True)


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either side is missing or b is zero."""
    if not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


# --------------------------------------------------------------------- lockers


class Locker(Protocol):
    """One client of one lock system, owned by one process."""

    def prepare(self, key: str) -> None:
        """Connect / open whatever ``key`` needs, outside the timed loop."""

    def try_pair(self, key: str) -> bool:
        """One non-blocking acquire of ``key`` and, if won, its release."""

    def acquire(self, key: str) -> None:
        """Blocking acquire of ``key``; returns holding it."""

    def release(self, key: str) -> None:
        """Release ``key`` taken by :meth:`acquire`."""

    def close(self) -> None:
        """Disconnect."""


@dataclass(frozen=True)
class LockerSpec:
    """How a worker process builds its locker: ``factory(*args)``.

    ``factory`` must be a module-level class or function (it is pickled by
    reference), ``args`` plain data such as paths.
    """

    label: str
    factory: Callable[..., Locker]
    args: tuple[Any, ...] = ()

    def build(self) -> Locker:
        return self.factory(*self.args)


def lockd_client_class(client_dir: str | None = None) -> Any:
    """``LockClient`` of this checkout, or of another checkout's ``client/`` folder.

    An earlier revision's client (``--compare REV``) is imported under a
    name of its own, beside this checkout's, so a before/after run measures
    each lockd with its own client.
    """
    if client_dir is None:
        from lockd_client import LockClient

        return LockClient
    folder = Path(client_dir) / "lockd_client"
    name = f"lockd_client_{abs(hash(str(folder.resolve()))):x}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module.LockClient


class LockdLocker:
    """The system under test, through the real ``lockd_client`` (or ``client_dir``'s)."""

    def __init__(self, socket_path: str, client_dir: str | None = None) -> None:
        self.client = lockd_client_class(client_dir)(socket_path, request_timeout=LOCKD_WAIT_S)
        self._handles: dict[str, Any] = {}

    def prepare(self, key: str) -> None:
        self.client.hello()  # opens the connection

    def try_pair(self, key: str) -> bool:
        handle = self.client.try_acquire(key, ttl=LOCKD_TTL_S)
        if handle is None:
            return False
        if not self.client.release(handle).released:
            raise RuntimeError(f"release of {key!r} answered not_holder")
        return True

    def acquire(self, key: str) -> None:
        self._handles[key] = self.client.acquire(key, ttl=LOCKD_TTL_S, timeout=LOCKD_WAIT_S)

    def release(self, key: str) -> None:
        if not self.client.release(self._handles.pop(key)).released:
            raise RuntimeError(f"release of {key!r} answered not_holder")

    def close(self) -> None:
        self.client.close()


# ------------------------------------------------------------------- workloads


def pairs_loop(locker: Locker, key: str, stop_at_ns: int) -> dict[str, Any]:
    """try_acquire + release of ``key`` until ``stop_at_ns``; counts and CPU.

    The clock is read once per pair (~0.1 us), which every system pays alike.
    """
    pairs = misses = 0
    cpu0 = time.process_time()
    start = now_ns()
    end = start
    try_pair = locker.try_pair
    while end < stop_at_ns:
        if try_pair(key):
            pairs += 1
        else:
            misses += 1
        end = now_ns()
    return {
        "pairs": pairs,
        "misses": misses,
        "start_ns": start,
        "end_ns": end,
        "client_cpu_s": time.process_time() - cpu0,
    }


def handoff_loop(
    locker: Locker, key: str, stop_at_ns: int, hold_s: float
) -> list[tuple[int, int, int]]:
    """Blocking acquire, hold ``hold_s``, release, re-request at once.

    Returns one ``(requested, granted, release_called)`` triple (monotonic ns)
    per grant. The release time is read *before* the release call, so a
    hand-off latency measured against it includes the releaser's own request.
    """
    records: list[tuple[int, int, int]] = []
    while True:
        requested = now_ns()
        locker.acquire(key)
        granted = now_ns()
        time.sleep(hold_s)
        release_called = now_ns()
        locker.release(key)
        records.append((requested, granted, release_called))
        if now_ns() >= stop_at_ns:
            return records


# ------------------------------------------------------------ worker processes


def _mp_context() -> Any:
    """forkserver: children start in ~ms without inheriting sockets or threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["common", "baselines", "lockd_client"])
    return ctx


def _worker_main(
    index: int,
    spec: LockerSpec,
    key: str,
    work: str,
    params: dict[str, Any],
    results: Any,
    go: Any,
    stop_at: Any,
) -> None:
    try:
        locker = spec.build()
        locker.prepare(key)
        results.put(("ready", index, None))
        if not go.wait(60):
            raise RuntimeError("no start signal within 60 s")
        stop_at_ns = stop_at.value
        if work == "pairs":
            out: Any = pairs_loop(locker, key, stop_at_ns)
        elif work == "handoff":
            out = handoff_loop(locker, key, stop_at_ns, params["hold_s"])
        else:
            raise ValueError(f"unknown work {work!r}")
        locker.close()
        results.put(("done", index, out))
    except BaseException:
        results.put(("error", index, traceback.format_exc()))


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its traceback."""


def run_workers(
    spec: LockerSpec | Sequence[LockerSpec],
    keys: Sequence[str],
    work: str,
    duration_s: float,
    on_ready: Callable[[], None] | None = None,
    **params: Any,
) -> list[Any]:
    """Run one worker process per key, started together, for ``duration_s``.

    ``spec`` builds every worker's locker, or, as a sequence, worker ``i``'s
    is ``spec[i]`` (workers of one system on several daemons). Workers
    connect first and report ready; only then is the stop time fixed and the
    start signal given, so connection set-up is never timed; ``on_ready``
    is called then, just before the start signal (to read a server's CPU
    from there: its share of the set-up is not a pair's). Returns each
    worker's result in key order.
    """
    specs = [spec] * len(keys) if isinstance(spec, LockerSpec) else list(spec)
    if len(specs) != len(keys):
        raise ValueError(f"{len(specs)} locker specs for {len(keys)} workers")
    ctx = _mp_context()
    results = ctx.Queue()
    go = ctx.Event()
    stop_at = ctx.Value("q", 0)
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(i, specs[i], key, work, params, results, go, stop_at),
            daemon=True,
        )
        for i, key in enumerate(keys)
    ]
    for proc in procs:
        proc.start()
    try:
        _collect(results, "ready", len(procs), timeout=60)
        if on_ready is not None:
            on_ready()
        stop_at.value = now_ns() + int(duration_s * 1e9)
        go.set()
        done = _collect(results, "done", len(procs), timeout=duration_s + LOCKD_WAIT_S)
        return [done[i] for i in range(len(procs))]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _collect(results: Any, kind: str, count: int, timeout: float) -> dict[int, Any]:
    deadline = time.monotonic() + timeout
    got: dict[int, Any] = {}
    while len(got) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerError(f"only {len(got)}/{count} workers reported {kind!r} in time")
        try:
            what, index, payload = results.get(timeout=left)
        except queue.Empty:
            continue
        if what == "error":
            raise WorkerError(f"worker {index} failed:\n{payload}")
        if what != kind:
            raise WorkerError(f"worker {index} sent {what!r}, expected {kind!r}")
        got[index] = payload
    return got


# ---------------------------------------------------------------- the daemon


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (from /proc, tick resolution)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def proc_runq_wait_s(pid: int) -> float:
    """Seconds ``pid``'s main thread has spent runnable but waiting for a CPU.

    From ``/proc/PID/schedstat`` (nanoseconds). A daemon that waits here while
    its clients wait for it is short of CPU (on a shared box, the other jobs
    take it); one preempted by a client it just woke waits here too.
    """
    with open(f"/proc/{pid}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[1]) / 1e9


@dataclass
class LockdDaemon:
    """A real ``lockd serve`` with socket, database and config in a /tmp folder.

    Default settings (no ``lockd.toml``): what a user gets, unless
    ``config`` gives its text (e.g. a ``[backend]`` table: lockd on etcd).
    The benchmark runs as the daemon's own user, so its role is ``owner`` and
    the rate limit never counts it. ``cprofile`` runs the daemon under
    cProfile and writes the stats there when it stops.
    """

    cprofile: Path | None = None
    #: a database to serve (e.g. one filled beforehand); it outlives :meth:`stop`.
    db: Path | None = None
    #: seconds to wait for the socket (a big database takes a while to load).
    start_timeout: float = 20.0
    #: a checkout whose lockd to run instead of the one this bench imports.
    tree: Path | None = None
    #: the name it goes by in the tables (``lockd@REV`` for an earlier one).
    label: str = "lockd"
    #: the text of its ``lockd.toml`` (None: no file, every default).
    config: str | None = None
    #: interpreter options and a script put before ``-m lockd`` (e.g. bench/traced_serve.py's).
    wrapper: tuple[str, ...] = ()
    root: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)

    @property
    def socket(self) -> Path:
        return self.root / "lockd.sock"

    @property
    def db_path(self) -> Path:
        return self.db if self.db is not None else self.root / "state" / "lockd.db"

    @property
    def log(self) -> Path:
        return self.root / "lockd.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="lockd-bench-", dir="/tmp"))
        if self.config is not None:
            (self.root / "cfg").mkdir()
            (self.root / "cfg" / "lockd.toml").write_text(self.config)
        cmd = [sys.executable, *self.wrapper]
        if self.cprofile is not None:
            cmd += ["-m", "cProfile", "-o", str(self.cprofile)]
        cmd += ["-m", "lockd", "serve", "--socket", str(self.socket)]
        cmd += ["--db", str(self.db_path), "--config", str(self.root / "cfg")]
        with self.log.open("wb") as log:
            env = None if self.tree is None else {**os.environ, "PYTHONPATH": str(self.tree)}
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=self.tree,
                env=env,
            )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lockd exited with {self.proc.returncode}:\n{self.read_log()}")
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(self.socket))
                    return
                except OSError:
                    time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"lockd did not come up within {self.start_timeout} s:\n{self.read_log()}"
        )

    def read_log(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[LockdDaemon]:
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def spec(self) -> LockerSpec:
        """Clients of this daemon: its own checkout's ``lockd_client`` (``tree``'s, if given)."""
        client_dir = None if self.tree is None else str(self.tree / "client")
        return LockerSpec(self.label, LockdLocker, (str(self.socket), client_dir))


@dataclass
class FloorDaemon:
    """``bench/floor_server.py``: the floor lockd's CPU per pair is compared to.

    Speaks only hello / tryAcquire / release, stores rows through lockd's
    own ``Store`` with the daemon's group commit (see its docstring); the
    real ``lockd_client`` drives it, so the clients cost what they cost
    against lockd.
    """

    #: "stdlib" or "orjson": the floor's JSON codec.
    codec: str = "stdlib"
    label: str = "floor"
    root: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)

    @property
    def socket(self) -> Path:
        return self.root / "floor.sock"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @contextlib.contextmanager
    def running(self) -> Iterator[FloorDaemon]:
        self.root = Path(tempfile.mkdtemp(prefix="lockd-floor-", dir="/tmp"))
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "floor_server.py")]
        cmd += ["--socket", str(self.socket), "--db", str(self.root / "state" / "floor.db")]
        cmd += ["--json", self.codec]
        log = self.root / "floor.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while True:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the floor server did not start:\n{log.read_text()}")
                with socket.socket(socket.AF_UNIX) as probe:
                    try:
                        probe.connect(str(self.socket))
                        break
                    except OSError:
                        time.sleep(0.02)
            yield self
        finally:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            shutil.rmtree(self.root, ignore_errors=True)

    def spec(self) -> LockerSpec:
        return LockerSpec(self.label, LockdLocker, (str(self.socket), None))


# ------------------------------------------------------------------ reporting


def fmt_num(value: float, digits: int = 0) -> str:
    """Thousands separators; a dash for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def fmt_ratio(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.3g}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """A plain left/right aligned text table (first column left, others right)."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [cells[0].ljust(widths[0])]
        parts += [cell.rjust(w) for cell, w in zip(cells[1:], widths[1:], strict=True)]
        return indent + "  ".join(parts).rstrip()

    out = [line(headers), indent + "  ".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    return "\n".join(out)


# ------------------------------------------------------------ hand-off analysis


def analyse_handoffs(per_process: Sequence[Sequence[tuple[int, int, int]]]) -> dict[str, Any]:
    """Merge every process's ``(requested, granted, release_called)`` records.

    Sorted by grant time, grant ``i + 1`` follows release ``i``. A *hand-off*
    is such a step while at least one other process was already waiting (its
    request made before the release call and granted after it); steps with
    nobody waiting (start-up, wind-down) are not hand-offs. For each hand-off:

    - latency = next grant - release call (both read in user space, so it
      includes both processes' client code and the daemon's round trip);
    - FIFO = the next holder is the waiter whose request is oldest;
    - re-grab = the releaser itself won again (it re-requested after release).

    Request times are read before the client call, so a client descheduled
    between that read and its send can look overtaken by a later request;
    so can two requests that reach a daemon in the same read batch. For each
    non-FIFO hand-off ``gap`` is how much earlier the skipped waiter asked:
    gaps far below the hold time point at such ambiguity, gaps of several
    hold times at a real queue-order fault.

    ``overlaps`` counts grants made before the previous holder's release call:
    a mutual-exclusion violation, which must stay 0.
    """
    import bisect

    grants = sorted(
        (granted, requested, released, proc)
        for proc, records in enumerate(per_process)
        for requested, granted, released in records
    )
    by_proc_grants = [[r[1] for r in records] for records in per_process]
    latencies_ms: list[float] = []
    fifo = regrab = overlaps = 0
    gaps_ms: list[float] = []
    for (_, _, released, proc), (granted, nxt_requested, _, nxt_proc) in itertools.pairwise(grants):
        if granted < released:
            overlaps += 1
        oldest: tuple[int, int] | None = None  # (requested, proc) of the longest waiter
        for other, records in enumerate(per_process):
            if other == proc:
                continue
            i = bisect.bisect_right(by_proc_grants[other], released)
            if (
                i < len(records)
                and records[i][0] <= released
                and (oldest is None or records[i][0] < oldest[0])
            ):
                oldest = (records[i][0], other)
        if oldest is None:
            continue  # nobody was waiting: not a hand-off
        latencies_ms.append((granted - released) / 1e6)
        regrab += nxt_proc == proc
        if nxt_proc == oldest[1]:
            fifo += 1
        else:
            gaps_ms.append((nxt_requested - oldest[0]) / 1e6)
    counts = [len(records) for records in per_process]
    handoffs = len(latencies_ms)
    return {
        "grants": len(grants),
        "handoffs": handoffs,
        "p50_ms": percentile(latencies_ms, 0.50),
        "p99_ms": percentile(latencies_ms, 0.99),
        "max_ms": max(latencies_ms) if latencies_ms else math.nan,
        "fifo_fraction": fifo / handoffs if handoffs else math.nan,
        "regrab_fraction": regrab / handoffs if handoffs else math.nan,
        "non_fifo": len(gaps_ms),
        "non_fifo_gaps_ms": sorted(gaps_ms)[-20:],
        "grants_per_process": counts,
        "min_max_ratio": min(counts) / max(counts) if counts and max(counts) else math.nan,
        "overlaps": overlaps,
    }


# ----------------------------------------------------------- SQLite commit cost


#: A commit slower than this stalls the loop noticeably (a WAL checkpoint).
SLOW_COMMIT_US = 500.0


def store_commit_costs(count: int, synchronous: str = "NORMAL") -> dict[str, Any]:
    """Time :meth:`lockd.daemon.store.Store.apply` as the daemon calls it on its loop.

    Alternates a grant (one INSERT OR REPLACE + the fence bump) and a release
    (one DELETE), each its own transaction, on a fresh WAL database in /tmp.
    """
    from lockd.daemon.engine import Changes, Lease, new_handle_id
    from lockd.daemon.store import Store, read_boot_id

    root = Path(tempfile.mkdtemp(prefix="lockd-bench-store-", dir="/tmp"))
    store = Store(root / "state" / "lockd.db", read_boot_id(), synchronous=synchronous)
    grant_us: list[float] = []
    release_us: list[float] = []
    try:
        store.load()
        for fence in range(1, count + 1):
            key = f"bench:{fence % 64}"
            lease = Lease(key, new_handle_id(), fence, None, "user:bench", 30_000, fence, None)
            grant = Changes(rows={(key, 0): lease}, fence=fence)
            release = Changes(rows={(key, 0): None})
            t0 = time.perf_counter_ns()
            store.apply(grant)
            t1 = time.perf_counter_ns()
            store.apply(release)
            t2 = time.perf_counter_ns()
            grant_us.append((t1 - t0) / 1e3)
            release_us.append((t2 - t1) / 1e3)
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    both = grant_us + release_us
    slow = sum(t > SLOW_COMMIT_US for t in both)
    return {
        "synchronous": synchronous,
        "commits": len(both),
        "p50_us": percentile(both, 0.50),
        "p99_us": percentile(both, 0.99),
        "p999_us": percentile(both, 0.999),
        "max_us": max(both),
        "grant_p50_us": percentile(grant_us, 0.50),
        "release_p50_us": percentile(release_us, 0.50),
        "slow_commits": slow,
        "slow_every": len(both) / slow if slow else math.nan,
    }


# ----------------------------------------------------------------- results file


def no_nan(value: Any) -> Any:
    """NaN (a missing measurement) becomes null: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [no_nan(v) for v in value]
    return value


def run_meta(out: Path, name: str, plan_name: str) -> dict[str, Any]:
    """The ``meta`` block of a results file: the command, the box, the load at the start.

    The file is ``out/<UTC time>-<name>.json`` (``out`` is created).
    """
    started = dt.datetime.now(dt.UTC)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{started.strftime('%Y%m%dT%H%M%SZ')}-{name}.json"
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "plan": plan_name,
        "started": started.isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "json": str(json_path),
    }


def save_run(results: dict[str, Any], started_monotonic: float) -> None:
    """Close ``results["meta"]`` (seconds taken, load at the end) and write the file."""
    meta = results["meta"]
    meta["seconds"] = round(time.monotonic() - started_monotonic, 1)
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    Path(meta["json"]).write_text(json.dumps(no_nan(results), indent=2, default=str) + "\n")
