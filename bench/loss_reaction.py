"""How long a holder takes to learn that its lock is gone (docs/contract.md §12, issue 20).

    .venv/bin/python bench/loss_reaction.py            # 30 trials per cell, ~20 s
    .venv/bin/python bench/loss_reaction.py -n 100     # more trials, steadier p99

Starts its own ``lockd serve`` (embedded SQLite backend, default settings)
and measures, for the sync, asyncio and trio clients inside ``lock()``, the
time from the cause of the loss to the moment the holder's code sees it:

* ``break``  -- from just before another client sends ``break`` to
  ``on_lost`` (sync) or the cancelled block's ``LockLostError`` (async);
* ``retake`` -- from just before the same principal sends an ``acquire``
  with the hold's owner, to the same;
* ``expired`` -- from the lease's end (the acquire's send time plus its TTL:
  the daemon's deadline is no earlier, so this is an upper bound) to the
  same. The holder does not renew: the sync client's renewer is told a
  minute-long lease, the async blocks run without ``auto_renew``.

The holds otherwise last a minute, so no renewal (every 20 s) can be what
told the holder: every number is the daemon's pushed event. Goal: p99 within
100 ms.

``--etcd``: a 3-member etcd cluster and two daemons on it (``host-a``,
``host-b``); the holder (sync client) is on ``host-a``, the ``break`` and
the re-take are sent to ``host-b``, so ``host-a`` learns from its watch of
the holds (docs/etcd-design.md §6a). ``break answered``: until the break's
reply, which comes once the holder stopped (its ``lock()`` block ends and
releases: its stop) and its daemon ended the hold, the key free for the
next holder (embedded: the same on one daemon). The embedded cells of the sync client
run first in the same run, as the baseline. Expiry on etcd is measured from
``leaseExpiresAt`` (2 s at least); etcd's lease is granted a second longer
and etcd checks expiries every ~0.5 s, so that cell is an upper bound made
mostly of etcd's own timing (``--etcd-expiries`` trials, default 5, ~3 s each).

``lockd run`` (``--run N`` trials, default 10; each starts a ``lockd run``):
``lockd run --on-lost kill K -- sleep``, then a ``break``: the time until
COMMAND's pid is gone (polled every millisecond), and until the ``break``
is answered (the key handed on: after COMMAND was reaped and ``lockd run``
said ``stopped``). Issue 20 asks p99 <= 200 ms for the first.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lockd_client import AutoRenewer, LockClient, LockLostError
from lockd_client.aio import AsyncLockClient
from lockd_client.trio import TrioLockClient

from bench.common import LockdDaemon, percentile, table

CAUSES = ("break", "retake", "expired")
CLIENTS = ("sync", "asyncio", "trio")
LONG_TTL = 60.0
#: the TTL of the holds that are left to run out.
SHORT_TTL = 0.1
OWNER = "bench-owner"


class Actor:
    """Another client of the same user, in a thread: breaks or re-takes on request."""

    def __init__(self, socket: str) -> None:
        self.client = LockClient(socket)
        #: when each break was answered (the key handed on: after the holder stopped).
        self.answered: list[float] = []

    def act(self, cause: str, key: str, started: list[float]) -> threading.Thread:
        def run() -> None:
            started.append(time.monotonic())
            if cause == "break":
                self.client.break_lock(key, "bench")
                self.answered.append(time.monotonic() - started[-1])
            else:
                handle = self.client.acquire(key, LONG_TTL, 5, owner=OWNER)
                self.client.release(handle)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def sync_trial(client: LockClient, actor: Actor, cause: str, key: str) -> float:
    seen: list[float] = []
    told = threading.Event()

    def on_lost(_handle: object) -> None:
        seen.append(time.monotonic())
        told.set()

    if cause == "expired":
        client.listen_for_losses()
        sent = time.monotonic()
        handle = client.acquire(key, SHORT_TTL, 5)
        # Told a minute-long lease, the renewer does not renew in time: only
        # the daemon's event can tell it.
        slow = dataclasses.replace(handle, ttl_ms=int(LONG_TTL * 1000))
        renewer = AutoRenewer(client, slow, slow.ttl_ms, on_lost, expires_at=sent + LONG_TTL)
        renewer.start()
        try:
            if not told.wait(10):
                raise RuntimeError("no loss seen")
        finally:
            renewer.stop()
        return seen[0] - (sent + handle.ttl_ms / 1000)  # the TTL in force (etcd: whole seconds)
    started: list[float] = []
    thread: threading.Thread | None = None
    owner = OWNER if cause == "retake" else None
    try:
        with client.lock(key, LONG_TTL, 5, owner=owner, on_lost=on_lost):
            thread = actor.act(cause, key, started)
            if not told.wait(10):
                raise RuntimeError("no loss seen")
    except LockLostError:
        pass
    if thread is not None:
        thread.join(10)
    return seen[0] - started[0]


async def async_trial(
    client: AsyncLockClient | TrioLockClient,
    actor: Actor,
    cause: str,
    key: str,
    *,
    sleep: Callable[[float], Awaitable[object]],
    join: Callable[[threading.Thread], Awaitable[object]],
) -> float:
    """One trial with an async client; ``sleep`` and ``join`` are its library's (asyncio, trio)."""
    started: list[float] = []
    thread: threading.Thread | None = None
    owner = OWNER if cause == "retake" else None
    expiring = cause == "expired"
    sent = time.monotonic()
    try:
        async with client.lock(
            key, SHORT_TTL if expiring else LONG_TTL, 5, owner=owner, auto_renew=not expiring
        ):
            if not expiring:
                thread = actor.act(cause, key, started)
            await sleep(10)
        raise RuntimeError("the block was not cancelled")
    except LockLostError:
        seen = time.monotonic()
    if thread is not None:
        await join(thread)
    return seen - (sent + SHORT_TTL if expiring else started[0])


async def asyncio_trial(client: AsyncLockClient, actor: Actor, cause: str, key: str) -> float:
    def join(thread: threading.Thread) -> Awaitable[object]:
        return asyncio.get_running_loop().run_in_executor(None, thread.join, 10)

    return await async_trial(client, actor, cause, key, sleep=asyncio.sleep, join=join)


async def trio_trial(client: TrioLockClient, actor: Actor, cause: str, key: str) -> float:
    def join(thread: threading.Thread) -> Awaitable[object]:
        return trio.to_thread.run_sync(thread.join, 10)

    return await async_trial(client, actor, cause, key, sleep=trio.sleep, join=join)


def measure(socket: str, trials: int, progress: Callable[[str], None]) -> dict[str, list[float]]:
    """Seconds from cause to the holder seeing it, per ``client/cause`` cell."""
    actor = Actor(socket)
    results: dict[str, list[float]] = {}
    with LockClient(socket) as client:
        for cause in CAUSES:
            progress(f"sync {cause}")
            results[f"sync/{cause}"] = [
                sync_trial(client, actor, cause, f"bench:sync:{cause}:{i}") for i in range(trials)
            ]

    async def all_trials(client_class: Any, name: str, tag: str, trial: Any) -> None:
        """Every cause, ``trials`` times, with one async client (asyncio's or trio's)."""
        async with client_class(socket) as client:
            for cause in CAUSES:
                progress(f"{name} {cause}")
                cell = results.setdefault(f"{name}/{cause}", [])
                for i in range(trials):
                    cell.append(await trial(client, actor, cause, f"bench:{tag}:{cause}:{i}"))

    asyncio.run(all_trials(AsyncLockClient, "asyncio", "aio", asyncio_trial))
    trio.run(all_trials, TrioLockClient, "trio", "trio", trio_trial)
    actor.client.close()
    return results


def measure_sync(
    holder_socket: str, actor_socket: str, causes: dict[str, int], label: str
) -> dict[str, list[float]]:
    """The sync client holds on ``holder_socket``; breaks, re-takes go to ``actor_socket``."""
    actor = Actor(actor_socket)
    results: dict[str, list[float]] = {}
    try:
        with LockClient(holder_socket) as client:
            for cause, trials in causes.items():
                print(f"{label} {cause}", file=sys.stderr)
                results[f"{label}/{cause}"] = [
                    sync_trial(client, actor, cause, f"bench:{label}:{cause}:{i}")
                    for i in range(trials)
                ]
        if actor.answered:
            results[f"{label}/break answered"] = actor.answered
    finally:
        actor.client.close()
    return results


def measure_etcd(trials: int, expiries: int) -> dict[str, list[float]]:
    """Embedded baseline, then etcd with the loss made through the other daemon."""
    from lockd.testing.etcd_cluster import EtcdBackend, EtcdCluster, data_root

    baseline = LockdDaemon()
    with baseline.running():
        sock = str(baseline.socket)
        results = measure_sync(sock, sock, {"break": trials, "retake": trials}, "sync embedded")
    root = data_root()
    cluster = EtcdCluster(root).start()
    try:
        etcd = EtcdBackend(endpoints=tuple(cluster.endpoints), prefix=f"/lockd-loss/{os.getpid()}/")
        a = LockdDaemon(label="host-a", config=etcd.as_node("host-a").toml())
        b = LockdDaemon(label="host-b", config=etcd.as_node("host-b").toml())
        with a.running(), b.running():
            causes = {"break": trials, "retake": trials, "expired": expiries}
            results.update(measure_sync(str(a.socket), str(b.socket), causes, "sync etcd a<-b"))
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return results


LOCKD_RUN = [sys.executable, "-m", "lockd", "run"]


def run_trial(socket: str, key: str) -> tuple[float, float]:
    """``lockd run --on-lost kill`` broken: (until COMMAND is gone, until the break's reply)."""
    folder = Path(tempfile.mkdtemp(prefix="lockd-bench-run-"))
    pid_file = folder / "pid"
    command = ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 600"]
    proc = subprocess.Popen(
        [*LOCKD_RUN, "--socket", socket, "--ttl", "60s", "--on-lost", "kill", key, "--", *command],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text().strip()):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("lockd run did not start COMMAND")
            time.sleep(0.005)
        stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
        gone: list[float] = []

        def watch() -> None:
            while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                time.sleep(0.001)
            gone.append(time.monotonic())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with LockClient(socket) as admin:
            started = time.monotonic()
            admin.break_lock(key, "bench")
            answered = time.monotonic()
        watcher.join(20)
        proc.wait(20)
        return gone[0] - started, answered - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pid_file.unlink(missing_ok=True)
        folder.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--trials", type=int, default=30, help="trials per cell")
    parser.add_argument("--run", type=int, default=10, help="lockd run trials (0: none)")
    parser.add_argument("--json", type=Path, help="also write the raw seconds here")
    parser.add_argument(
        "--etcd", action="store_true", help="two daemons on etcd, loss made on the other one"
    )
    parser.add_argument("--etcd-expiries", type=int, default=5, help="expiry trials on etcd")
    args = parser.parse_args()
    # The clients warn of every loss; here losses are the point.
    logging.getLogger("lockd_client").addHandler(logging.NullHandler())
    logging.getLogger("lockd_client").propagate = False
    if args.etcd:
        results = measure_etcd(args.trials, args.etcd_expiries)
        report(results, args.trials, args.json)
        return
    daemon = LockdDaemon()
    with daemon.running():
        results = measure(str(daemon.socket), args.trials, lambda s: print(s, file=sys.stderr))
        if args.run:
            print("lockd run break", file=sys.stderr)
            trials = [run_trial(str(daemon.socket), f"bench:run:{i}") for i in range(args.run)]
            results["lockd run/break: COMMAND gone"] = [gone for gone, _ in trials]
            results["lockd run/break: answered"] = [answered for _, answered in trials]
    report(results, args.trials, args.json)


def report(results: dict[str, list[float]], trials: int, raw: Path | None) -> None:
    load = os.getloadavg()[0]
    print(f"loss reaction, {trials} trials per cell, load {load:.1f} (ms)")
    rows = []
    for cell, values in results.items():
        client, cause = cell.split("/")
        ms = [v * 1000 for v in values]
        rows.append(
            [
                client,
                cause,
                f"{percentile(ms, 0.50):.1f}",
                f"{percentile(ms, 0.99):.1f}",
                f"{max(ms):.1f}",
            ]
        )
    print(table(["client", "cause", "p50", "p99", "max"], rows))
    if raw is not None:
        raw.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
