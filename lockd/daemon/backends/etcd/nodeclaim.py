"""One daemon per node name on a cluster and prefix: the claim ``<prefix>n/<node>``.

Waiter keys (``w/<session lease>/...``) and ``releaseOnClose`` bindings are
a daemon's own, and ``status`` tells hosts apart by ``node``; two daemons
configured with one node name would both look like one host. So each
daemon, once it has a session lease, puts ``n/<node>`` on that lease,
guarded "absent" (docs/etcd-design.md §2). The key says who holds the name:
host, boot id, pid namespace, pid and the process's start time.

When the key is there already, the daemon decides:

- **the holder is provably gone**: same boot of the same host and same pid
  namespace, and no process with that pid and start time runs (a daemon
  restarted after ``kill -9``, or this very process's earlier session):
  its session lease is revoked at once (its waiters and bindings were dead
  anyway) and the name claimed;
- **the holder is alive**: its lease's time to live went up (a keepalive
  came), or it outlived its whole TTL and more: :class:`NodeTaken`, the
  daemon does not start;
- otherwise (another host, so no proof either way) it waits, at most the
  lease's granted TTL and a margin, for the lease to run out: a daemon that
  died elsewhere frees the name within its session TTL (at most 10 s).

No I/O but through the gateway and ``/proc`` of this host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from lockd.daemon.backends.etcd.gateway import EtcdGateway, LeaseNotFound
from lockd.daemon.backends.etcd.wire import Compare, KeyValue, PutOp, RangeOp, RangeResult
from lockd.logfmt import kv

log = logging.getLogger("lockd.etcd")

#: seconds between looks at a claim whose holder may be dying.
POLL_INTERVAL = 0.25
#: seconds past the holder's granted TTL before a claim that never ran out
#: counts as alive (etcd may extend a lease by an election after a leader change).
EXPIRY_MARGIN = 2.0


class NodeTaken(Exception):
    """Another live lockd holds this node name on the cluster and prefix."""


@dataclass(frozen=True)
class Claimant:
    """The process a node claim names."""

    host: str
    boot: str
    pidns: str
    pid: int
    #: the process's start time (clock ticks since boot, /proc/PID/stat field 22).
    start: int
    #: when it claimed the name, epoch ms (for the operator).
    since: int

    def value(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def parse(cls, value: bytes) -> Claimant | None:
        try:
            doc: dict[str, Any] = json.loads(value)
            return cls(
                str(doc["host"]),
                str(doc["boot"]),
                str(doc["pidns"]),
                int(doc["pid"]),
                int(doc["start"]),
                int(doc["since"]),
            )
        except (ValueError, KeyError, TypeError):
            return None  # written by something else: no proof of anything

    @classmethod
    def this_process(cls) -> Claimant:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            boot=_read("/proc/sys/kernel/random/boot_id"),
            pidns=_pid_namespace(),
            pid=pid,
            start=process_start(pid) or 0,
            since=int(time.time() * 1000),
        )

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since / 1000))
        return f"pid {self.pid} on host {self.host}, since {since}"


def pid_place() -> str:
    """Where this process's pids mean something: its boot and pid namespace ("" if unknown).

    A hold records it beside its holder's pid and start time, so that only a
    daemon that sees the same pids says whether that holder is alive.
    """
    boot, pidns = _read("/proc/sys/kernel/random/boot_id"), _pid_namespace()
    return f"{boot}/{pidns}" if boot and pidns else ""


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if none runs.

    A zombie (killed, not yet reaped by its parent) runs no more.
    """
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after it.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        state, start = fields[0], int(fields[19])  # fields 3 and 22, counted from 1
    except (IndexError, ValueError):
        return None
    return None if state in ("Z", "X") else start


def provably_gone(holder: Claimant, me: Claimant) -> bool:
    """True when ``holder`` cannot be running: this boot, this pid namespace, pid gone.

    A pid reused by another process does not count as the holder (its start
    time differs). This very process (an earlier session of it) is gone as
    a holder too. Without a boot id or namespace to compare there is no proof.
    """
    if not (holder.boot and holder.pidns) or (holder.boot, holder.pidns) != (me.boot, me.pidns):
        return False
    if holder.pid == me.pid and holder.start == me.start:
        return True
    return process_start(holder.pid) != holder.start


async def claim_node(etcd: EtcdGateway, key: bytes, node: str, lease: int) -> None:
    """Put ``key`` (this process) on ``lease``, or raise :class:`NodeTaken`; see the module doc.

    Raises ``EtcdUnavailable`` / ``EtcdError`` when etcd does not answer or refuses.
    """
    me = Claimant.this_process()
    claim = PutOp(key, me.value(), lease=lease)
    watched: int | None = None  # the lease of the holder being watched
    lowest = 0  # the least time to live seen on it
    give_up = 0.0
    while True:
        result = await etcd.txn([Compare(key, "create_revision", "==", 0)], [claim], [RangeOp(key)])
        if result.succeeded:
            return
        read = result.responses[0]
        assert isinstance(read, RangeResult)
        if not read.kvs:
            continue  # gone in between: claim again
        record: KeyValue = read.kvs[0]
        if record.lease == lease:
            return  # ours already
        holder = Claimant.parse(record.value)
        if holder is not None and provably_gone(holder, me):
            log.info(kv(event="node_taken_over", node=node, previous=holder.describe()))
            with contextlib.suppress(LeaseNotFound):
                await etcd.lease_revoke(record.lease)
            continue
        left = await etcd.lease_time_to_live(record.lease)
        if left.ttl < 0:
            continue  # ran out just now
        if record.lease != watched:
            watched, lowest = record.lease, left.ttl
            give_up = trio.current_time() + left.granted_ttl + EXPIRY_MARGIN
            log.info(kv(event="node_claimed_elsewhere", node=node, waiting_s=left.ttl))
        elif left.ttl > lowest or trio.current_time() > give_up:
            who = holder.describe() if holder is not None else "an unknown process"
            raise NodeTaken(
                f"backend.node {node!r} is in use by another lockd on this etcd cluster and"
                f" prefix ({who}); give every daemon its own backend.node"
            )
        lowest = min(lowest, left.ttl)
        await trio.sleep(POLL_INTERVAL)
