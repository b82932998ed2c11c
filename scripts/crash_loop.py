"""Kill the daemon with ``kill -9`` at random moments under load, and check each restart.

``.venv/bin/python scripts/crash_loop.py --rounds 200 --seconds 900``

Each round starts ``lockd serve`` on the same socket and database, lets two
clients grant, renew and release leases on it as fast as they can, and
kills the daemon with SIGKILL after a random delay (20-300 ms). Then the
next round's start must either refuse (it never should after a plain
crash: that counts as a failure too) or come back with:

- every lease whose grant (or last renew) was acknowledged and whose
  release was not sent, with its fence;
- fences strictly increasing: no fence ever acknowledged twice, and the
  first grant after the restart above every fence acknowledged before.

It prints one line per failure and a summary; the exit status is 0 only
when every round passed. ``tests/system/test_crash_loop.py`` runs a short version.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lockd_client import Handle, LockClient, LockdError

#: Leases a client keeps at most; older ones are released (keeps ``list`` cheap).
KEEP = 40
#: The longest TTL there is (24 h): a lease must not run out during the run,
#: or its expiry would read as a loss (a 600 s TTL did, 600 s into a run).
TTL = 86_400


@dataclass
class Ledger:
    """What the clients were told, across every round."""

    #: key -> fence of each lease acknowledged and not released (nor being released).
    held: dict[str, int] = field(default_factory=dict)
    #: keys whose release was sent but not acknowledged: present or not, both fine.
    unsure: set[str] = field(default_factory=set)
    #: every fence ever acknowledged (a repeat is a failure).
    fences: set[int] = field(default_factory=set)
    highest: int = 0
    grants: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def granted(self, handle: Handle) -> None:
        with self.lock:
            if handle.fence in self.fences:
                self.failures.append(f"fence {handle.fence} acknowledged twice ({handle.key})")
            self.fences.add(handle.fence)
            self.held[handle.key] = handle.fence
            self.highest = max(self.highest, handle.fence)
            self.grants += 1


class Daemon:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "lockd.sock"
        self.db = root / "state" / "lockd.db"
        self.log = root / "lockd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> str | None:
        """Start and wait until it answers; the refusal's last line if it exits instead."""
        command = [sys.executable, "-m", "lockd", "serve", "--socket", str(self.socket)]
        command += ["--db", str(self.db), "--config", str(self.root / "config")]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                lines = self.log.read_text(errors="replace").strip().splitlines()
                return lines[-1] if lines else f"exited {self.proc.returncode}"
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(self.socket))
                return None
            except OSError:
                time.sleep(0.01)
        self.kill()
        return "did not come up"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)


def _load(sock: str, ledger: Ledger, name: str, stop: threading.Event, rng: random.Random) -> None:
    """Grant, renew and release until the daemon dies (or ``stop``)."""
    mine: list[Handle] = []
    try:
        client = LockClient(sock, retry_window=0, request_timeout=5)
        i = 0
        while not stop.is_set():
            roll = rng.random()
            if roll < 0.6 or not mine:
                handle = client.try_acquire(f"{name}:{time.monotonic_ns()}:{i}", ttl=TTL)
                i += 1
                if handle is not None:
                    ledger.granted(handle)
                    mine.append(handle)
            elif roll < 0.75:
                client.renew(rng.choice(mine), ttl=TTL)
            if len(mine) > KEEP or (roll >= 0.75 and mine):
                gone = mine.pop(0)
                with ledger.lock:
                    ledger.held.pop(gone.key, None)
                    ledger.unsure.add(gone.key)
                client.release(gone)
                with ledger.lock:
                    ledger.unsure.discard(gone.key)
    except (LockdError, OSError):
        return  # the daemon was killed
    finally:
        with contextlib.suppress(LockdError, OSError, UnboundLocalError):
            client.close()


def _check(daemon: Daemon, ledger: Ledger, round_: int) -> None:
    """Every acknowledged lease is back with its fence; the next fence is above all."""
    with LockClient(str(daemon.socket), retry_window=0) as client:
        present = {lock.key: lock.fence for lock in client.list()}
        for key, fence in ledger.held.items():
            if key not in present:
                ledger.failures.append(f"round {round_}: {key} (fence {fence}) acknowledged, lost")
            elif present[key] != fence:
                ledger.failures.append(
                    f"round {round_}: {key} came back with fence {present[key]}, not {fence}"
                )
        probe = client.try_acquire(f"probe:{round_}", ttl=1)
        if probe is None or probe.fence <= ledger.highest:
            ledger.failures.append(
                f"round {round_}: a new grant got fence {probe and probe.fence}, "
                f"not above {ledger.highest}"
            )
        elif probe is not None:
            ledger.granted(probe)
            client.release(probe)
            ledger.held.pop(probe.key, None)
    for key in list(ledger.unsure):
        if key not in present:
            ledger.unsure.discard(key)


def run(rounds: int, seconds: float, root: Path, seed: int | None = None) -> Ledger:
    rng = random.Random(seed)
    ledger = Ledger()
    daemon = Daemon(root)
    (root / "config").mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + seconds
    done = 0
    try:
        for round_ in range(rounds):
            if time.monotonic() > end:
                ledger.failures.append(f"out of time after {done} of {rounds} rounds")
                break
            refusal = daemon.start()
            if refusal is not None:
                ledger.failures.append(f"round {round_}: start refused after a crash: {refusal}")
                break
            if round_:
                _check(daemon, ledger, round_)
            stop = threading.Event()
            workers = [
                threading.Thread(
                    target=_load,
                    args=(str(daemon.socket), ledger, f"c{n}", stop, random.Random(rng.random())),
                    daemon=True,
                )
                for n in range(2)
            ]
            for worker in workers:
                worker.start()
            time.sleep(rng.uniform(0.02, 0.3))
            daemon.kill()
            stop.set()
            for worker in workers:
                worker.join(30)
            done += 1
        else:
            if daemon.start() is None:
                _check(daemon, ledger, rounds)
    finally:
        daemon.stop()
        daemon.kill()
    return ledger


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=900, help="give up after this long")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    if args.seconds >= TTL:
        parser.error(f"--seconds must stay below the leases' TTL ({TTL} s)")
    root = Path(tempfile.mkdtemp(prefix="lockd-crash-", dir="/tmp"))
    started = time.monotonic()
    ledger = run(args.rounds, args.seconds, root, args.seed)
    for failure in ledger.failures:
        print("FAIL", failure)
    print(
        f"{args.rounds} rounds requested, {ledger.grants} grants acknowledged, "
        f"highest fence {ledger.highest}, {len(ledger.failures)} failures, "
        f"{time.monotonic() - started:.0f} s ({root})"
    )
    if not args.keep and not ledger.failures:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 1 if ledger.failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
