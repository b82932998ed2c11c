"""Lease-loss events on the etcd backend (docs/contract.md §11, §12): the end of the session.

A ``releaseOnClose`` hold lives on the daemon's etcd session; when etcd
ends that session (an outage past its TTL, here a revoke of its lease),
the hold is gone and its listening holder is told ``cause: "session"``.
Breaks and re-takes through the holder's own daemon are tested with the
embedded backend's tests (``test_loss_events_live``, both backends); here,
with two daemons on one cluster, the losses made elsewhere: a break and a
re-take through the other host's daemon and an expiry in etcd, which the
holder's daemon sees on its watch of the holds and pushes at once; and a
break through the other host that hands the key on only once the holder
stopped, or at a bound when it never answers or its daemon is dead
(docs/etcd-design.md §6a).
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lockd_client import LockClient

from lockd.daemon.backends.etcd.records import Layout
from lockd.exitcodes import EXIT_LOST
from lockd.testing.daemon import DaemonProcess
from lockd.testing.etcd_cluster import EtcdBackend, EtcdCluster
from lockd.testing.wire import RawConn
from tests.etcd.test_etcd_hosts import Hosts, two_hosts
from tests.live.test_cli_run import RUN_EXIT
from tests.live.test_run_containment import Waiter, cleanup, start_escapers


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _session_lease(cluster: EtcdCluster, backend: EtcdBackend) -> str:
    """The daemon's session lease: the one its node-name claim is written on."""
    claim = Layout(backend.prefix).node(backend.node or socket.gethostname())
    reply = cluster.members[0].post("/v3/kv/range", {"key": _b64(claim)}, timeout=5)
    assert reply is not None and reply.get("kvs"), reply
    lease = reply["kvs"][0]["lease"]  # type: ignore[index]
    assert isinstance(lease, str)
    return lease


def test_a_lost_session_tells_the_bound_holder(etcd_cluster: EtcdCluster, short_tmp: Path) -> None:
    backend = EtcdBackend.on(etcd_cluster, session_ttl=2)
    daemon = DaemonProcess.in_folder(short_tmp, backend)
    daemon.start()
    try:
        holder = RawConn(daemon.socket)
        hello = holder.call({"id": 0, "op": "hello", "events": True})
        assert hello["result"]["events"] is True
        bound = holder.call(
            {"id": 1, "op": "tryAcquire", "key": "s", "ttlMs": 60000, "releaseOnClose": True}
        )["result"]
        ttl_only = holder.call({"id": 2, "op": "tryAcquire", "key": "t", "ttlMs": 60000})["result"]
        lease = _session_lease(etcd_cluster, backend)
        assert (
            etcd_cluster.members[0].post("/v3/lease/revoke", {"ID": lease}, timeout=5) is not None
        )
        # The watch of the holds sees the binding go with the lease at once
        # (the session keeper, which looks every third of its TTL, would too).
        event, took = _event(holder)
        assert took < PUSH_BOUND
        assert event["event"] == "lost" and event["cause"] == "session"
        assert event["handle"] == bound["handle"] and event["by"] is None
        # The TTL hold does not live on the session: it stays, and is not told.
        renewed = holder.call(
            {"id": 3, "op": "renew", "key": "t", "handle": ttl_only["handle"], "ttlMs": 60000}
        )
        assert renewed["result"]["renewed"] is True
    finally:
        daemon.terminate()


# ------------------------------------------------ losses made through another host

#: a loss made elsewhere reaches the holder within one watch event and, for an
#: expiry, one lease look-up; this bound leaves room for a loaded 2-core box.
PUSH_BOUND = 5.0


@pytest.fixture(scope="module")
def pair(etcd_cluster: EtcdCluster) -> Iterator[Hosts]:
    """``host-a`` (where the holders are) and ``host-b`` (where the breaks come from)."""
    with two_hosts(etcd_cluster) as hosts:
        yield hosts


def _listening(daemon: DaemonProcess) -> tuple[RawConn, str]:
    """A connection to ``daemon`` that asked for events, and the caller's principal."""
    conn = RawConn(daemon.socket)
    hello = conn.call({"id": 0, "op": "hello", "events": True})
    assert hello["result"]["events"] is True
    return conn, hello["result"]["principal"]


def _event(conn: RawConn, bound: float = PUSH_BOUND) -> tuple[dict[str, Any], float]:
    """The next line on ``conn``, which must be an event, and how long it took."""
    started = time.monotonic()
    line = conn.reply(timeout=bound)
    return line, time.monotonic() - started


def test_a_break_through_another_host_is_pushed_with_who_and_why(pair: Hosts) -> None:
    holder, _ = _listening(pair.a)
    key = f"brk-{uuid.uuid4().hex[:8]}"
    held = holder.call({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60000})["result"]
    admin = RawConn(pair.b.socket)
    breaker = admin.call({"id": 3, "op": "hello"})["result"]["principal"]
    admin.send({"id": 2, "op": "break", "key": key, "reason": "disk swap"})
    event, took = _event(holder)
    assert event["event"] == "lost" and event["cause"] == "break", event
    assert event["key"] == key and event["handle"] == held["handle"]
    assert event["fence"] == held["fence"]
    assert event["by"] == breaker and event["reason"] == "disk swap"
    assert took < PUSH_BOUND
    # Until it stopped, the hold is fenced: renew says lost (docs/contract.md §12.1).
    renewed = holder.call(
        {"id": 4, "op": "renew", "key": key, "handle": held["handle"], "ttlMs": 60000}
    )
    assert renewed["result"] == {"renewed": False, "reason": "lease_lost"}
    stopped = holder.call({"id": 5, "op": "stopped", "handle": held["handle"]})
    assert stopped["result"] == {"stopped": True}
    assert admin.reply()["result"]["broken"] is True


def test_a_retake_through_another_host_is_pushed_with_the_new_holder(pair: Hosts) -> None:
    holder, principal = _listening(pair.a)
    key = f"rtk-{uuid.uuid4().hex[:8]}"
    take = {"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60000, "owner": "job-7"}
    held = holder.call(take)["result"]
    again = RawConn(pair.b.socket).call({**take, "id": 2})["result"]
    assert again["handle"] != held["handle"] and again["fence"] > held["fence"]
    event, _took = _event(holder)
    assert event["cause"] == "retake" and event["handle"] == held["handle"], event
    assert event["by"] == principal and event["reason"] is None


def test_an_expiry_in_etcd_is_pushed(pair: Hosts) -> None:
    holder, _ = _listening(pair.a)
    key = f"exp-{uuid.uuid4().hex[:8]}"
    # etcd's shortest lease (2 s, granted a second longer): the event is waited
    # for, not slept for; the bound counts from the lease's end.
    held = holder.call({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 2000})["result"]
    event, took = _event(holder, bound=3.0 + 1.0 + PUSH_BOUND)
    assert event["cause"] == "expired" and event["handle"] == held["handle"], event
    assert event["by"] is None and event["reason"] is None
    assert took >= 1.5  # not before the lease could end


def test_a_hold_released_by_its_own_daemon_is_not_told(pair: Hosts) -> None:
    """The holder's own release is no loss; a loss right after still is (order kept)."""
    holder, _ = _listening(pair.a)
    first, second = (f"own-{uuid.uuid4().hex[:8]}" for _ in range(2))
    one = holder.call({"id": 1, "op": "tryAcquire", "key": first, "ttlMs": 60000})["result"]
    holder.call({"id": 2, "op": "tryAcquire", "key": second, "ttlMs": 60000})
    released = holder.call({"id": 3, "op": "release", "key": first, "handle": one["handle"]})
    assert released["result"] == {"released": True}
    admin = RawConn(pair.b.socket)
    admin.send({"id": 4, "op": "break", "key": second, "reason": "r"})
    event, _took = _event(holder)
    assert event["key"] == second and event["cause"] == "break", event
    holder.call({"id": 5, "op": "stopped", "handle": event["handle"]})
    assert admin.reply()["result"]["broken"] is True


# ------------------------------------------- a break across hosts waits for the holder

#: ``break_grace`` of the daemons below: short, so a hung holder's bound is
#: driven by the daemon's own clock in seconds, not slept for by the test.
GRACE_S = 3.0
#: the breaking daemon deletes a hold still there at the grace plus this
#: (lockd.daemon.backends.etcd.holdstop.TAKEOVER_MARGIN_MS).
MARGIN_S = 1.0


@contextlib.contextmanager
def _graced_pair(cluster: EtcdCluster) -> Iterator[Hosts]:
    """``host-a`` and ``host-b`` with ``break_grace = GRACE_S``."""
    etcd = EtcdBackend.on(cluster)
    roots = [Path(tempfile.mkdtemp(prefix="lockd-", dir="/tmp")) for _ in range(2)]
    daemons = [
        DaemonProcess.in_folder(root, etcd.as_node(f"host-{name}"))
        for root, name in zip(roots, "ab", strict=True)
    ]
    try:
        for daemon in daemons:
            daemon.write_config(f"break_grace = {GRACE_S}\n")
            daemon.start()
        yield Hosts(*daemons)
    finally:
        for daemon in daemons:
            daemon.terminate()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def graced(etcd_cluster: EtcdCluster) -> Iterator[Hosts]:
    with _graced_pair(etcd_cluster) as hosts:
        yield hosts


def _queued(daemon: DaemonProcess, key: str) -> RawConn:
    """A blocking acquire of ``key`` on ``daemon``, queued (status counts it) before returning."""
    waiter = RawConn(daemon.socket, timeout=60)
    waiter.send({"id": 1, "op": "acquire", "key": key, "ttlMs": 60000, "timeoutMs": 60000})
    probe = RawConn(daemon.socket)
    deadline = time.monotonic() + 10
    while probe.call({"id": 2, "op": "status", "key": key})["result"]["waiters"] < 1:
        assert time.monotonic() < deadline, "the waiter never queued"
    return waiter


def test_a_break_through_another_host_hands_the_key_on_once_the_holder_stopped(
    graced: Hosts,
) -> None:
    holder, _ = _listening(graced.a)
    key = f"stop-{uuid.uuid4().hex[:8]}"
    held = holder.call({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60000})["result"]
    waiter = _queued(graced.b, key)
    admin = RawConn(graced.b.socket, timeout=30)
    admin.send({"id": 3, "op": "break", "key": key, "reason": "rack move"})
    event, _took = _event(holder)
    assert event["cause"] == "break" and event["reason"] == "rack move", event
    # Told, not yet stopped: the hold is still there, on every host.
    for daemon in (graced.a, graced.b):
        status = RawConn(daemon.socket).call({"id": 4, "op": "status", "key": key})["result"]
        assert status["held"] is True and status["fence"] == held["fence"], status
    stopped = holder.call({"id": 5, "op": "stopped", "handle": held["handle"]})
    assert stopped["result"] == {"stopped": True}  # the break was still waiting for it
    granted = waiter.reply()
    assert granted["ok"] is True and granted["result"]["fence"] > held["fence"], granted
    broken = admin.reply()["result"]
    assert broken["broken"] is True and broken["holders"] == 1 and broken["fence"] == held["fence"]


def test_a_holder_that_never_stops_loses_the_key_after_break_grace(graced: Hosts) -> None:
    holder, _ = _listening(graced.a)
    key = f"hung-{uuid.uuid4().hex[:8]}"
    held = holder.call({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60000})["result"]
    waiter = _queued(graced.b, key)
    admin = RawConn(graced.b.socket, timeout=30)
    started = time.monotonic()
    admin.send({"id": 3, "op": "break", "key": key, "reason": "hung"})
    event, _took = _event(holder)
    assert event["cause"] == "break", event
    # The holder says nothing: its daemon ends the hold at the grace.
    granted = waiter.reply()
    took = time.monotonic() - started
    assert granted["ok"] is True and granted["result"]["fence"] > held["fence"], granted
    assert took >= GRACE_S - 0.1, took  # not before the grace (clocks of one box)
    assert admin.reply()["result"]["broken"] is True
    late = holder.call({"id": 4, "op": "stopped", "handle": held["handle"]})
    assert late["result"] == {"stopped": False}  # nothing waited for it any more


def test_a_dead_holders_daemon_frees_the_key_within_the_bound(etcd_cluster: EtcdCluster) -> None:
    with _graced_pair(etcd_cluster) as hosts:
        holder, _ = _listening(hosts.a)
        key = f"dead-{uuid.uuid4().hex[:8]}"
        held = holder.call({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60000})["result"]
        waiter = _queued(hosts.b, key)
        assert hosts.a.proc is not None
        hosts.a.proc.kill()  # host A dies: nobody tells its holder, nobody ends its hold
        hosts.a.proc.wait()
        admin = RawConn(hosts.b.socket, timeout=30)
        started = time.monotonic()
        broken = admin.call({"id": 3, "op": "break", "key": key, "reason": "host down"})
        took = time.monotonic() - started
        assert broken["result"]["broken"] is True and broken["result"]["holders"] == 1
        # docs/contract.md §11: at most break_grace + 1 s (+ the box's own delays).
        assert GRACE_S + MARGIN_S - 0.1 <= took < GRACE_S + MARGIN_S + PUSH_BOUND, took
        granted = waiter.reply()
        assert granted["ok"] is True and granted["result"]["fence"] > held["fence"], granted


def test_lockd_run_broken_from_another_host_hands_on_only_once_its_processes_are_gone(
    graced: Hosts, tmp_path: Path
) -> None:
    """``lockd run`` on host A, the break and the next holder on host B (issue 20).

    COMMAND's escapers ignore SIGTERM and last ``--grace``; the next holder
    must find every one of them gone when it is granted.
    """
    key = f"run-{uuid.uuid4().hex[:8]}"
    proc, nohup, setsid = start_escapers(
        graced.a, tmp_path, key, "--on-lost", "term", "--grace", "300ms"
    )
    try:
        with LockClient(str(graced.b.socket)) as other_host:
            waiter = Waiter(graced.b.socket, key, (nohup, setsid))
            waiter.start(other_host)
            assert other_host.break_lock(key, "test: across hosts").broken
            waiter.join()
        assert waiter.alive_at_grant == []
        assert proc.wait(RUN_EXIT) == EXIT_LOST
        assert "test: across hosts" in (proc.stderr.read() if proc.stderr else "")
    finally:
        cleanup(nohup, setsid)
