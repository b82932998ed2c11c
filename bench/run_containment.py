"""``lockd run --on-lost kill``: from a lost lease to every process of COMMAND gone.

.venv/bin/python bench/run_containment.py [--rounds 40] [--ttl 60s]

Each round starts ``lockd run --on-lost kill`` whose COMMAND (``sh``) starts
a ``nohup`` child and a ``setsid`` grandchild, breaks the key, and times two
intervals, each until all three pids have left /proc (killed *and* reaped):

- ``break->gone``: from sending ``break``: the daemon pushes the loss to
  ``lockd run`` (docs/contract.md §12.1), which has the guardian kill and
  reap everything.
- ``noticed->gone``: from the moment ``lockd run`` says the lease is lost on
  stderr: the containment itself (the guardian's SIGKILL, its walk of the
  tree, the reaping).

Prints p50/p99/max in ms. Keep it under a minute on a shared box.
"""

from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import LockdDaemon, percentile
from lockd_client import LockClient

ESCAPERS = r"""
d=$1
nohup sleep 600 >/dev/null 2>&1 &
echo $! > "$d/nohup"
( setsid sleep 600 & echo $! > "$d/setsid" )
echo $$ > "$d/ready"
wait
"""


def exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def wait_file(path: Path, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            return int(text)
        time.sleep(0.005)
    raise TimeoutError(f"no {path.name}")


def one_round(daemon: LockdDaemon, client: LockClient, ttl: str, n: int) -> tuple[float, float]:
    folder = Path(tempfile.mkdtemp(prefix="lockd-contain-"))
    key = f"contain-{n}"
    env = {**os.environ, "LOCKD_SOCKET": str(daemon.socket)}
    lockd_run = [sys.executable, "-m", "lockd", "run", "--ttl", ttl, "--on-lost", "kill", key]
    run = subprocess.Popen(
        [*lockd_run, "--", "sh", "-c", ESCAPERS, "sh", str(folder)],
        env=env,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert run.stderr is not None
    pids = [wait_file(folder / "ready"), wait_file(folder / "nohup"), wait_file(folder / "setsid")]
    while os.getsid(pids[2]) != pids[2]:  # the grandchild has left the session
        time.sleep(0.002)
    sel = selectors.DefaultSelector()
    sel.register(run.stderr, selectors.EVENT_READ)
    # The break answers once the key is free, which (pushed losses) is after
    # lockd run said its work stopped: send it from a thread and watch here.
    breaker = threading.Thread(target=client.break_lock, args=(key, "bench"))
    broke = time.monotonic()
    breaker.start()
    noticed = None
    while any(exists(pid) for pid in pids):
        if noticed is None and sel.select(0):
            noticed = time.monotonic()
        time.sleep(0.0005)
    gone = time.monotonic()
    if noticed is None:
        noticed = gone
    run.wait(10)
    breaker.join(10)
    sel.close()
    run.stderr.close()
    return (gone - broke) * 1000, (gone - noticed) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--ttl", default="60s")
    args = parser.parse_args()
    total: list[float] = []
    contain: list[float] = []
    with LockdDaemon().running() as daemon, LockClient(str(daemon.socket)) as client:
        for n in range(args.rounds):
            a, b = one_round(daemon, client, args.ttl, n)
            total.append(a)
            contain.append(b)
    load = os.getloadavg()[0]
    print(f"lockd run --on-lost kill, {args.rounds} rounds, --ttl {args.ttl}, load {load:.1f}")
    for name, values in (("break->gone", total), ("noticed->gone", contain)):
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        print(f"  {name:14} p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  max {max(values):7.1f} ms")


if __name__ == "__main__":
    main()
