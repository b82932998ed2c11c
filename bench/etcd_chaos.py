"""Chaos on lockd-on-etcd: real etcd members and lockd daemons, faults one after another.

Issue 23. Three etcd members (``lockd/testing/etcd_cluster.py``) and three ``lockd
serve`` daemons on them; workers (threads, each with its own
``lockd_client.LockClient``, spread over the daemons) take two hot keys over
and over: a blocking acquire, a hold of a few milliseconds, a release. Meanwhile
the faults run in turn, each followed by a quiet spell:

- ``leader-kill``: SIGKILL the etcd leader, start it again after the spell;
- ``leader-stop``: SIGSTOP the leader for 3 s, then SIGCONT;
- ``member-restart``: SIGTERM one member (etcd's graceful stop: its gateway
  answers "the client connection is closing" meanwhile), start it again;
- ``quorum-loss``: SIGKILL two members for 5 s, then start them again;
- ``daemon-kill``: SIGKILL a lockd daemon, start it again;
- ``daemon-stop``: SIGSTOP a lockd daemon for 3 s, then SIGCONT.

It counts, and fails (exit 1) on any of the first three:

- **overlaps**: per key, the hold intervals ``[acquire returned, release
  called]`` must not overlap, and fences must rise with them. Each interval
  lies inside the true hold (a release whose outcome is unknown ended the
  hold at its commit or at the lease's end, after the call either way), so
  true holds that never overlap give recorded ones that never do.
- **stalls**: a monitor reads each key's etcd directory every 50 ms (its own
  stdlib client, not the daemon's); a key free (no hold) while waiters are
  queued for more than ``--stall`` seconds, starting outside a fault window
  (the fault, then ``--grace`` seconds), is a stall.
- **crashes**: a daemon that exits without being killed by the script.

and measures, per fault, the longest pause in grants (workers of daemons the
fault did not hit) from the fault's start (for a quorum loss: from the moment
a leader is elected again) to the end of its window: how long service froze.
Run it niced, in bounded runs (the box is shared); the table at the end is
what the README quotes::

    nice -n 10 .venv/bin/python bench/etcd_chaos.py --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client"))

from lockd_client import Handle, LockClient, LockdError

from bench.common import LockdDaemon
from lockd.testing.etcd_cluster import ETCD_FLAGS, EtcdBackend, EtcdCluster, EtcdMember

KEYS = ("hot-a", "hot-b")
#: the faults of one round, in order (leader kills three times as often: the
#: issue asks for more of them).
ROUND = (
    "leader-kill",
    "member-restart",
    "leader-kill",
    "leader-stop",
    "leader-kill",
    "quorum-loss",
    "member-restart",
    "daemon-kill",
    "daemon-stop",
)
HOLD_TTL_S = 4.0


@dataclass
class Grant:
    key: str
    worker: str
    daemon: int
    fence: int
    start: float  # acquire returned (time.monotonic)
    end: float | None = None  # release called, or the lease's reported end


@dataclass
class Fault:
    kind: str
    start: float  # the fault began
    repaired: float  # the fault was undone (== start for a kill of the leader)
    end: float  # the fault window ends (repair + grace)
    hurt_daemon: int | None  # a daemon the fault hit (its workers do not count for recovery)
    measure_from: float  # pauses in grants are counted from here to ``end``
    pause: float | None = None  # the longest of them (None: no grant at all)
    #: a leader kill: when a surviving member first named a new leader (None: not seen)
    elected: float | None = None
    #: the first grant after ``elected`` (workers of daemons the fault did not hit)
    resumed: float | None = None


@dataclass
class Run:
    grants: list[Grant] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    faults: list[Fault] = field(default_factory=list)
    stalls: list[tuple[str, float, float]] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)


def worker(run: Run, name: str, daemons: list[LockdDaemon], index: int, key: str) -> None:
    client: LockClient | None = None
    while not run.stop.is_set():
        try:
            if client is None:
                client = LockClient(str(daemons[index].socket), request_timeout=15)
            handle = client.acquire(key, ttl=HOLD_TTL_S, timeout=30)
        except (LockdError, OSError) as exc:
            with run.lock:
                run.errors[getattr(exc, "code", type(exc).__name__)] += 1
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            client = None
            time.sleep(0.1)
            continue
        grant = Grant(key, name, index, handle.fence, time.monotonic())
        with run.lock:
            run.grants.append(grant)
        time.sleep(random.uniform(0.002, 0.02))
        grant.end = time.monotonic()
        client = release(run, client, handle, daemons, index)
        time.sleep(random.uniform(0.005, 0.03))
    if client is not None:
        client.close()


def release(
    run: Run, client: LockClient, handle: Handle, daemons: list[LockdDaemon], index: int
) -> LockClient | None:
    """Release, retrying while the answer is BACKEND_UNAVAILABLE (retry safe) or the daemon is
    away, as a client that wants its key to move on does, up to the hold's TTL.

    A release whose outcome is unknown ended the hold at its commit or at its
    lease's end: after ``grant.end`` either way, so the interval stays sound.
    """
    deadline = time.monotonic() + HOLD_TTL_S
    current: LockClient | None = client
    while time.monotonic() < deadline and not run.stop.is_set():
        try:
            if current is None:
                current = LockClient(str(daemons[index].socket), request_timeout=15)
            current.release(handle)
            return current
        except LockdError as exc:
            with run.lock:
                run.errors["release:" + exc.code] += 1
            if exc.code not in ("BACKEND_UNAVAILABLE", "DAEMON_UNAVAILABLE"):
                return current
        except OSError as exc:
            with run.lock:
                run.errors["release:" + type(exc).__name__] += 1
        if current is not None:
            with contextlib.suppress(Exception):
                current.close()
        current = None
        time.sleep(0.1)
    return current


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def monitor(run: Run, cluster: EtcdCluster, prefix: str, stall_s: float) -> None:
    """Sample each key's directory: free with waiters queued for longer than ``stall_s``."""
    free_since: dict[str, float | None] = dict.fromkeys(KEYS)
    while not run.stop.is_set():
        for key in KEYS:
            directory = f"{prefix}k/{key.encode().hex()}/".encode()
            end = directory[:-1] + b"0"
            doc = None
            for member in cluster.members:
                if not member.running:
                    continue
                doc = member.post(
                    "/v3/kv/range",
                    {"key": _b64(directory), "range_end": _b64(end), "keys_only": True},
                    timeout=0.5,
                )
                if doc is not None and "header" in doc:
                    break
            if doc is None or "header" not in doc:
                free_since[key] = None  # etcd did not answer: not a stall of ours
                continue
            keys = [base64.b64decode(kv["key"])[len(directory) :] for kv in doc.get("kvs", [])]
            held = any(k.startswith(b"h/") for k in keys)
            waiting = any(k.startswith(b"w/") for k in keys)
            now = time.monotonic()
            if held or not waiting:
                since = free_since[key]
                if since is not None and now - since > stall_s and not in_fault(run, since):
                    with run.lock:
                        run.stalls.append((key, since, now))
                free_since[key] = None
            elif free_since[key] is None:
                free_since[key] = now
        time.sleep(0.05)


def in_fault(run: Run, at: float) -> bool:
    with run.lock:
        return any(f.start - 0.5 <= at <= f.end for f in run.faults)


def watch_daemons(run: Run, daemons: list[LockdDaemon], expected_down: set[int]) -> None:
    while not run.stop.is_set():
        for i, daemon in enumerate(daemons):
            if (
                daemon.proc is not None
                and daemon.proc.poll() is not None
                and i not in expected_down
            ):
                run.crashes.append(f"d{i} exited {daemon.proc.returncode}")
                expected_down.add(i)
        time.sleep(0.1)


def longest_pause(run: Run, fault: Fault) -> float | None:
    """The longest time without a grant from ``measure_from`` to the window's end, counting
    only workers of daemons the fault did not hit; None when there was no grant at all."""
    with run.lock:
        times = sorted(
            g.start
            for g in run.grants
            if fault.measure_from < g.start <= fault.end and g.daemon != fault.hurt_daemon
        )
    if not times:
        return None
    points = [fault.measure_from, *times]
    return max(b - a for a, b in itertools.pairwise(points))


def first_grant_after(run: Run, fault: Fault) -> float | None:
    """The first grant after a leader kill's election (daemons the fault did not hit)."""
    if fault.elected is None:
        return None
    elected = fault.elected
    with run.lock:
        times = [g.start for g in run.grants if g.start > elected and g.daemon != fault.hurt_daemon]
    return min(times, default=None)


def restart_daemon(daemon: LockdDaemon) -> None:
    """Start a killed daemon again (a new folder and socket; same config and node name)."""
    old = daemon.root
    daemon.start()
    shutil.rmtree(old, ignore_errors=True)


def signal_member(member: EtcdMember, sig: signal.Signals) -> None:
    assert member.proc is not None
    member.proc.send_signal(sig)


def _member_id(member: EtcdMember) -> str | None:
    status = member.status()
    header = status.get("header") if status is not None else None
    return str(header["member_id"]) if isinstance(header, dict) else None


def wait_for_new_leader(cluster: EtcdCluster, old: str | None, until: float) -> float | None:
    """Poll the running members every 20 ms until one names a leader other than ``old``;
    when that was first seen (None: not before ``until``). Splits a leader kill's pause
    into etcd's election and what lockd adds after it."""
    while time.monotonic() < until:
        for member in cluster.members:
            if not member.running:
                continue
            status = member.status(timeout=0.2)
            leader = str(status.get("leader", "0")) if status is not None else "0"
            if leader not in ("0", old):
                return time.monotonic()
        time.sleep(0.02)
    return None


def inject(
    run: Run,
    kind: str,
    cluster: EtcdCluster,
    daemons: list[LockdDaemon],
    down: set[int],
    grace: float,
) -> None:
    start = time.monotonic()
    hurt: int | None = None
    fault = Fault(kind, start, start, float("inf"), None, start)
    with run.lock:
        run.faults.append(fault)
    if kind == "leader-kill":
        leader = cluster.leader()
        old = _member_id(leader)
        # From the kill itself: finding the leader takes a while on a loaded box.
        start = fault.start = fault.measure_from = time.monotonic()
        cluster.kill(leader)
        fault.elected = wait_for_new_leader(cluster, old, until=start + 3.0)
        time.sleep(max(0.0, start + 3.0 - time.monotonic()))
        cluster.restart(leader, wait=False)
        repaired = time.monotonic()
    elif kind == "leader-stop":
        leader = cluster.leader()
        start = fault.start = fault.measure_from = time.monotonic()
        signal_member(leader, signal.SIGSTOP)
        time.sleep(3.0)
        signal_member(leader, signal.SIGCONT)
        repaired = time.monotonic()
    elif kind == "member-restart":
        member = random.choice([m for m in cluster.members if m.running])
        signal_member(member, signal.SIGTERM)
        assert member.proc is not None
        member.proc.wait(15)
        cluster.restart(member, wait=False)
        repaired = time.monotonic()
    elif kind == "quorum-loss":
        victims = random.sample([m for m in cluster.members if m.running], 2)
        for member in victims:
            cluster.kill(member)
        time.sleep(5.0)
        for member in victims:
            cluster.restart(member, wait=False)
        cluster.leader(timeout=30)  # quorum is back once a leader is elected
        repaired = time.monotonic()
        fault.measure_from = repaired
    elif kind == "daemon-kill":
        hurt = random.randrange(len(daemons))
        down.add(hurt)
        daemon = daemons[hurt]
        assert daemon.proc is not None
        daemon.proc.kill()
        daemon.proc.wait()
        time.sleep(1.0)
        restart_daemon(daemon)
        down.discard(hurt)
        repaired = time.monotonic()
    elif kind == "daemon-stop":
        hurt = random.randrange(len(daemons))
        daemon = daemons[hurt]
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        daemon.proc.send_signal(signal.SIGCONT)
        repaired = time.monotonic()
    else:
        raise ValueError(kind)
    fault.repaired, fault.hurt_daemon = repaired, hurt
    fault.end = repaired + grace
    time.sleep(grace)


def _end(grant: Grant) -> float:
    return grant.end if grant.end is not None else float("inf")


def check_overlaps(run: Run) -> list[str]:
    problems = []
    for key in KEYS:
        grants = sorted((g for g in run.grants if g.key == key), key=lambda g: g.start)
        latest: Grant | None = None  # the grant whose hold ends last so far
        for before, after in itertools.pairwise(grants):
            if latest is None or _end(before) > _end(latest):
                latest = before
            if after.start < _end(latest):
                problems.append(
                    f"{key}: {after.worker} (fence {after.fence}) granted at {after.start:.3f}"
                    f" while {latest.worker} (fence {latest.fence}) held until"
                    f" {_end(latest):.3f}"
                )
            if after.fence <= before.fence:
                problems.append(f"{key}: fence {after.fence} after {before.fence}")
    return problems


@contextlib.contextmanager
def system(
    daemon_count: int, etcd_flags: tuple[str, ...] = ETCD_FLAGS
) -> Iterator[tuple[EtcdCluster, list[LockdDaemon], str]]:
    root = Path(tempfile.mkdtemp(prefix="lockd-chaos-", dir="/tmp"))
    cluster = EtcdCluster(root, flags=etcd_flags).start()
    prefix = f"/lockd-chaos/{os.getpid()}/"
    etcd = EtcdBackend(endpoints=tuple(cluster.endpoints), prefix=prefix)
    daemons = [
        LockdDaemon(label=f"d{i}", config=etcd.as_node(f"d{i}").toml()) for i in range(daemon_count)
    ]
    try:
        for daemon in daemons:
            daemon.start()
        yield cluster, daemons, prefix
    finally:
        for daemon in daemons:
            if daemon.proc is not None and daemon.proc.poll() is None:
                with contextlib.suppress(OSError):
                    daemon.proc.send_signal(signal.SIGCONT)
            daemon.stop()
        for member in cluster.members:
            if member.proc is not None and member.proc.poll() is None:
                with contextlib.suppress(OSError):
                    member.proc.send_signal(signal.SIGCONT)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def chaos(
    faults: list[str],
    *,
    workers: int = 6,
    grace: float = 4.0,
    stall_s: float = 2.0,
    log_to: Path | None = None,
    etcd_flags: tuple[str, ...] = ETCD_FLAGS,
) -> tuple[Run, list[str]]:
    """Run ``faults`` in order against a fresh system; the run and its problems."""
    run = Run()
    down: set[int] = set()
    with system(3, etcd_flags) as (cluster, daemons, prefix):
        threads = [
            threading.Thread(
                target=worker,
                args=(run, f"w{i}", daemons, i % len(daemons), KEYS[i % len(KEYS)]),
                daemon=True,
            )
            for i in range(workers)
        ]
        threads.append(
            threading.Thread(target=monitor, args=(run, cluster, prefix, stall_s), daemon=True)
        )
        threads.append(
            threading.Thread(target=watch_daemons, args=(run, daemons, down), daemon=True)
        )
        for thread in threads:
            thread.start()
        time.sleep(grace)
        for kind in faults:
            inject(run, kind, cluster, daemons, down, grace)
            cluster.wait_healthy()
        run.stop.set()
        for thread in threads:
            thread.join(40)
        for fault in run.faults:
            fault.pause = longest_pause(run, fault)
            fault.resumed = first_grant_after(run, fault)
        logs = "\n".join(f"--- {d.label}\n{d.read_log()}" for d in daemons)
        if log_to is not None:
            log_to.write_text(logs)
    problems = check_overlaps(run)
    problems += [f"stall: {k} free with waiters {b:.1f}-{e:.1f}" for k, b, e in run.stalls]
    problems += [f"crash: {c}" for c in run.crashes]
    if "Traceback" in logs and "task_failed" not in logs:
        problems.append("a traceback in a daemon's log")
    return run, problems


def _spread(values: list[float]) -> str:
    """median / p90 / max of ``values`` (p90: the value 90 % of them do not exceed)."""
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return f"{statistics.median(ordered):.2f} / {p90:.2f} / {ordered[-1]:.2f}"


def table(run: Run) -> str:
    rows = [
        "| fault | count | longest pause in grants, median / p90 / max (s) | over 2 s | no grant |",
        "|---|---|---|---|---|",
    ]
    by_kind: dict[str, list[Fault]] = defaultdict(list)
    for fault in run.faults:
        by_kind[fault.kind].append(fault)
    for kind, faults in by_kind.items():
        times = [f.pause for f in faults if f.pause is not None]
        missing = sum(f.pause is None for f in faults)
        over = sum(t > 2.0 for t in times)
        rows.append(f"| {kind} | {len(faults)} | {_spread(times)} | {over} | {missing} |")
    kills = [f for f in by_kind.get("leader-kill", []) if f.elected is not None]
    if kills:
        elections = [f.elected - f.start for f in kills if f.elected is not None]
        after = [f.resumed - f.elected for f in kills if f.resumed and f.elected]
        rows += [
            "",
            "| leader kill, split | median / p90 / max (s) |",
            "|---|---|",
            f"| kill -> a member names the new leader (etcd's election) | {_spread(elections)} |",
            f"| that -> the first grant (lockd) | {_spread(after)} |",
        ]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help=f"rounds of {len(ROUND)} faults")
    parser.add_argument("--only", help="one fault kind, --rounds times")
    parser.add_argument("--grace", type=float, default=4.0, help="quiet seconds after each fault")
    parser.add_argument("--stall", type=float, default=2.0, help="seconds free with waiters")
    parser.add_argument("--logs", type=Path, help="write the daemons' logs here")
    parser.add_argument(
        "--election-ms",
        type=int,
        default=1000,
        help="etcd's --election-timeout (its default; a member waits 1-2x this for a leader)",
    )
    parser.add_argument(
        "--heartbeat-ms", type=int, default=100, help="etcd's --heartbeat-interval (its default)"
    )
    args = parser.parse_args()
    faults = [args.only] * args.rounds if args.only else list(ROUND) * args.rounds
    etcd_flags = (
        f"--heartbeat-interval={args.heartbeat_ms}",
        f"--election-timeout={args.election_ms}",
        "--pre-vote=true",
    )
    started = time.monotonic()
    run, problems = chaos(
        faults, grace=args.grace, stall_s=args.stall, log_to=args.logs, etcd_flags=etcd_flags
    )
    to_wall = time.time() - time.monotonic()  # the daemons' logs show wall-clock times
    for fault in run.faults:
        pause = "-" if fault.pause is None else f"{fault.pause:.2f}"
        split = ""
        if fault.elected is not None:
            resumed = "-" if fault.resumed is None else f"{fault.resumed - fault.elected:.2f}"
            split = f"  (election {fault.elected - fault.start:.2f}, then grants in {resumed})"
        wall = fault.start + to_wall
        stamp = time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"
        print(
            f"# {fault.start - run.faults[0].start:7.1f} s ({stamp})"
            f"  {fault.kind:15} pause {pause}{split}"
        )
    print(table(run))
    print(
        f"\n{len(run.grants)} grants in {time.monotonic() - started:.0f} s;"
        f" overlaps {sum('granted at' in p or 'fence' in p for p in problems)},"
        f" stalls {len(run.stalls)}, crashes {len(run.crashes)};"
        f" client errors {dict(run.errors)}"
    )
    for problem in problems:
        print("PROBLEM:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
