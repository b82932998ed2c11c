"""Many hosts on one etcd cluster (docs/contract.md §11), with real daemons and a real cluster.

Two ``lockd serve`` processes with different ``node`` names share one etcd
prefix: they stand for two hosts. Everything goes through the real client
(raw sockets where exact replies and timing matter). The cases the
contract names: one holder across hosts, FIFO and fences across hosts, a
re-take from the other host, a handle that works through either daemon,
``kill -9`` of one daemon, a daemon cut off longer than its session, the
etcd leader killed while both hosts contend (an overlap detector the
workers share), and quorum loss and recovery.

Tests that keep the cluster intact share the session's cluster (each with
a prefix of its own); tests that kill etcd members start their own.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from lockd_client import Handle, LockClient, LockdError, LockTimeoutError

from lockd.testing.daemon import DaemonProcess
from lockd.testing.etcd_cluster import EtcdBackend, EtcdCluster
from lockd.testing.wire import RawConn, check_error
from tests.live.test_integration import PROMPT, park, wait_for, waiters

#: docs/contract.md §11: a dead host's waiters and releaseOnClose holds are gone within 10 s.
DEAD_HOST_BOUND = 10.0


@dataclass
class Hosts:
    """Two daemons, ``host-a`` and ``host-b``, on one cluster and one prefix."""

    a: DaemonProcess
    b: DaemonProcess

    def clients(self) -> tuple[LockClient, LockClient]:
        return LockClient(str(self.a.socket)), LockClient(str(self.b.socket))


@contextlib.contextmanager
def two_hosts(cluster: EtcdCluster, **settings: Any) -> Iterator[Hosts]:
    """Start ``host-a`` and ``host-b`` (``settings``: more ``[backend]`` keys, for both)."""
    etcd = EtcdBackend.on(cluster, **settings)
    roots = [Path(tempfile.mkdtemp(prefix="lockd-", dir="/tmp")) for _ in range(2)]
    daemons = [
        DaemonProcess.in_folder(root, etcd.as_node(f"host-{name}"))
        for root, name in zip(roots, "ab", strict=True)
    ]
    try:
        for daemon in daemons:
            daemon.start()
        yield Hosts(*daemons)
    finally:
        for daemon in daemons:
            daemon.terminate()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def hosts(etcd_cluster: EtcdCluster) -> Iterator[Hosts]:
    """Two hosts on the session cluster, for the tests that leave both running."""
    with two_hosts(etcd_cluster) as pair:
        yield pair


@pytest.fixture
def clients(hosts: Hosts) -> Iterator[tuple[LockClient, LockClient]]:
    a, b = hosts.clients()
    with a, b:
        yield a, b


def unique(name: str) -> str:
    return f"{name}:{uuid.uuid4().hex[:10]}"


def blocking_acquire(rid: int | str, key: str) -> dict[str, Any]:
    """An acquire that waits up to 60 s for a 60 s lease."""
    return {"id": rid, "op": "acquire", "key": key, "ttlMs": 60_000, "timeoutMs": 60_000}


# ------------------------------------------------------------ the cluster intact


def test_one_holder_across_hosts_and_everyone_sees_the_granting_node(
    hosts: Hosts, clients: tuple[LockClient, LockClient]
) -> None:
    a, b = clients
    key = unique("one")
    held = a.acquire(key, ttl=60, timeout=1, owner="job-1")
    assert b.try_acquire(key, ttl=60) is None
    with pytest.raises(LockTimeoutError):
        b.acquire(key, ttl=60, timeout=0.2)

    status = b.status(key)
    assert status.held and status.fence == held.fence and status.owner == "job-1"
    assert status.held_by == "user:root" and status.raw["node"] == "host-a"
    [holder] = status.holders
    assert holder.node == "host-a" and holder.fence == held.fence
    [entry] = b.list(prefix=key)
    assert entry.raw["node"] == "host-a" and entry.fence == held.fence
    assert (a.stats()["node"], b.stats()["node"]) == ("host-a", "host-b")

    # A waiter on host b is counted by host a: waiters counts every host's.
    waiter = park(a, hosts.b.socket, key, release_after=False)
    assert waiters(b, key) == 1
    assert a.release(held).released
    waiter.finish()
    assert waiter.handle is not None and waiter.handle.fence > held.fence
    status = a.status(key)
    assert status.raw["node"] == "host-b" and status.fence == waiter.handle.fence
    assert status.waiters == 0


def test_fifo_and_fences_across_hosts(hosts: Hosts, clients: tuple[LockClient, LockClient]) -> None:
    a, b = clients
    key = unique("fifo")
    holder = a.acquire(key, ttl=60, timeout=1)
    log: list[tuple[str, int]] = []
    sockets = [hosts.b.socket, hosts.a.socket, hosts.b.socket, hosts.a.socket]
    # Each is parked only once the other host counts the one before it.
    threads = [
        park(b if i % 2 else a, sock, key, release_after=True, log=log, name=str(i))
        for i, sock in enumerate(sockets)
    ]
    assert waiters(a, key) == waiters(b, key) == 4
    assert a.release(holder).released
    for thread in threads:
        thread.finish()
        assert thread.error is None, thread.error
    assert [name for name, _ in log] == ["0", "1", "2", "3"]
    fences = [fence for _, fence in log]
    assert fences == sorted(set(fences)) and fences[0] > holder.fence
    assert not b.status(key).held


def test_retake_from_the_other_host_and_handles_work_through_either_daemon(
    hosts: Hosts, clients: tuple[LockClient, LockClient]
) -> None:
    a, b = clients
    key = unique("retake")
    first = a.acquire(key, ttl=60, timeout=1, owner="nightly")
    queued = park(b, hosts.a.socket, key)

    started = time.monotonic()
    second = b.acquire(key, ttl=60, timeout=10, owner="nightly")  # the job re-run on host b
    assert time.monotonic() - started < PROMPT, "a re-take must not queue"
    assert second.fence > first.fence and second.handle != first.handle
    status = a.status(key)
    assert status.fence == second.fence and status.raw["node"] == "host-b"
    assert status.waiters == 1
    assert (a.release(first).released, a.release(first).reason) == (False, "not_holder")
    assert b.renew(first, ttl=60).reason == "lease_lost"
    assert a.try_acquire(key, ttl=60, owner="other") is None

    # The handle granted through host b is renewed and released through host a.
    assert a.renew(second, ttl=30).renewed
    assert a.status(key).fence == second.fence, "a renew keeps the fence"
    assert a.release(second).released
    queued.finish()
    assert queued.handle is not None and queued.handle.fence > second.fence
    assert a.release(queued.handle).released


def test_ttls_are_whole_seconds_and_replies_say_so(hosts: Hosts) -> None:
    raw = RawConn(hosts.a.socket)
    try:
        for asked, effective in ((1, 2000), (1500, 2000), (2000, 2000), (2001, 3000)):
            key = unique("ttl")
            sent = time.time()
            handle = raw.result({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": asked})
            assert handle["ttlMs"] == effective, (asked, handle)
            status = raw.result({"id": 2, "op": "status", "key": key})
            assert 0 < status["expiresInMs"] <= effective
            expires = _epoch(handle["leaseExpiresAt"])
            assert sent + effective / 1000 - 1 <= expires <= time.time() + effective / 1000 + 0.01
            renewed = raw.result(
                {"id": 3, "op": "renew", "key": key, "handle": handle["handle"], "ttlMs": 10}
            )
            assert renewed["renewed"] is True
            assert _epoch(renewed["leaseExpiresAt"]) >= time.time() + 1.0, renewed
            raw.result({"id": 4, "op": "release", "key": key, "handle": handle["handle"]})
    finally:
        raw.close()


def _epoch(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


# ------------------------------------------------------------ a host goes away


def test_kill9_of_a_host_frees_its_waiters_and_bound_holds_not_its_ttl_holds(
    etcd_cluster: EtcdCluster,
) -> None:
    """Default session TTL (5 s): what the dead host held for connections goes within 10 s."""
    with two_hosts(etcd_cluster) as hosts:
        a, b = hosts.clients()
        with a, b:
            kept, bound, queue = unique("kept"), unique("bound"), unique("queue")
            ttl_hold = a.acquire(kept, ttl=60, timeout=1)
            a.acquire(bound, ttl=60, timeout=1, release_on_close=True)
            in_queue = b.acquire(queue, ttl=60, timeout=1)
            dying = RawConn(hosts.a.socket)  # a waiter of host a, first in the queue
            dying.send(
                {"id": 1, "op": "acquire", "key": queue, "ttlMs": 60_000, "timeoutMs": 60_000}
            )
            wait_for(lambda: waiters(b, queue) == 1, what="host a's waiter to park")
            behind = park(b, hosts.b.socket, queue)

            hosts.a.kill9()
            killed_at = time.monotonic()
            dying.close()
            assert b.release(in_queue).released
            # Host b's release handed the key to the head, host a's waiter,
            # whose key lives on with a's session: that grant is tied to the
            # session (nobody on host a will ever answer it) and ends with it.
            status = b.status(queue)
            assert status.held and status.raw["node"] == "host-a"
            # Host a's waiter is ahead, but dead: host b's waiter gets the key
            # once host a's session lease ends.
            behind.finish(timeout=DEAD_HOST_BOUND + PROMPT)
            assert behind.handle is not None and behind.error is None
            assert behind.granted_at is not None
            assert behind.granted_at - killed_at <= DEAD_HOST_BOUND
            wait_for(lambda: not b.status(bound).held, timeout=DEAD_HOST_BOUND, what="bound hold")
            assert time.monotonic() - killed_at <= DEAD_HOST_BOUND + PROMPT

            status = b.status(kept)
            assert status.held and status.fence == ttl_hold.fence
            assert status.raw["node"] == "host-a" and b.try_acquire(kept, ttl=60) is None


# ------------------------------------------------------------ one daemon per node name


@contextlib.contextmanager
def daemons_of(etcd: EtcdBackend, count: int) -> Iterator[list[DaemonProcess]]:
    """``count`` daemons (not started) with ``etcd``'s table: one node name for all."""
    roots = [Path(tempfile.mkdtemp(prefix="lockd-", dir="/tmp")) for _ in range(count)]
    daemons = [DaemonProcess.in_folder(root, etcd) for root in roots]
    for daemon in daemons:
        daemon.write_config("")
    try:
        yield daemons
    finally:
        for daemon in daemons:
            daemon.terminate()
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def test_a_second_daemon_with_the_same_node_name_refuses_to_start(
    etcd_cluster: EtcdCluster,
) -> None:
    """Both would own the same waiter keys and bindings: the second one stops, naming why."""
    etcd = EtcdBackend.on(etcd_cluster, node="twin")
    with daemons_of(etcd, 2) as (first, second):
        first.start()
        assert first.proc is not None
        refused = second.serve_once()
        assert refused.returncode == 1, refused.stderr
        assert "backend.node 'twin' is in use by another lockd" in refused.stderr
        assert f"pid {first.proc.pid} on host" in refused.stderr
        with LockClient(str(first.socket)) as client:  # the first one serves on
            assert client.acquire(unique("twin"), ttl=60, timeout=1).fence > 0


def test_a_daemon_restarted_after_kill9_takes_its_node_name_back_at_once(
    etcd_cluster: EtcdCluster,
) -> None:
    """Same host, its old pid gone: the old session is revoked before serving.

    So the dead daemon's waiters are gone at the restart, not a session TTL
    (10 s here) after the kill; its TTL holds stay. (A restart slower than
    the TTL, on a loaded box, finds the old session ended already.)
    """
    etcd = EtcdBackend.on(etcd_cluster, node="phoenix", session_ttl=10)
    key = unique("phoenix")
    with daemons_of(etcd, 1) as (daemon,):
        daemon.start()
        with LockClient(str(daemon.socket)) as client:
            held = client.acquire(key, ttl=60, timeout=1)
            dying = RawConn(daemon.socket)
            dying.send(blocking_acquire(1, key))
            wait_for(lambda: waiters(client, key) == 1, what="the waiter to park")
        daemon.kill9()
        killed_at = time.monotonic()
        dying.close()
        daemon.start()
        with LockClient(str(daemon.socket)) as client:
            status = client.status(key)
            restarted_in = time.monotonic() - killed_at
            assert status.waiters == 0 and status.held and status.fence == held.fence
        # Its last keepalive came up to a third of the TTL before the kill.
        if restarted_in < 5:
            assert "event=node_taken_over node=phoenix" in daemon.read_log()


def test_a_host_cut_off_past_its_session_loses_bound_holds_keeps_ttl_holds(
    etcd_cluster: EtcdCluster,
) -> None:
    """SIGSTOP stands for a partition: the daemon sends no keepalive for 3 session TTLs."""
    with two_hosts(etcd_cluster, session_ttl=2) as hosts:
        a, b = hosts.clients()
        with a, b:
            kept, bound = unique("kept"), unique("bound")
            ttl_hold = a.acquire(kept, ttl=60, timeout=1)
            bound_hold = a.acquire(bound, ttl=60, timeout=1, release_on_close=True)
            assert hosts.a.proc is not None
            hosts.a.proc.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: not b.status(bound).held, timeout=DEAD_HOST_BOUND, what="bound")
                assert b.try_acquire(bound, ttl=60) is not None
            finally:
                hosts.a.proc.send_signal(signal.SIGCONT)
            renewed = a.renew(bound_hold, ttl=60)
            assert (renewed.renewed, renewed.reason) == (False, "lease_lost")
            assert a.renew(ttl_hold, ttl=60).renewed
            assert a.status(kept).fence == ttl_hold.fence
            # The daemon serves on after a new session.
            again = a.acquire(unique("after"), ttl=60, timeout=5, release_on_close=True)
            assert a.release(again).released


# ------------------------------------------------------------ etcd members go away


@dataclass
class OverlapDetector:
    """One file the workers of both hosts append to (O_APPEND: one total order).

    A worker writes ``enter`` once its acquire returned and ``exit`` before
    it releases; a line is one ``write``, so lines never interleave. Read
    back in order, every ``enter`` must follow the previous holder's ``exit``.
    """

    path: Path

    def __post_init__(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def record(self, event: str, who: str, fence: int = 0) -> None:
        os.write(self.fd, f"{event} {who} {fence}\n".encode())

    def close(self) -> None:
        os.close(self.fd)

    def check(self) -> tuple[int, int]:
        """Assert no overlap and rising fences; (grants before, grants after) the ``mark`` line."""
        holder: str | None = None
        last_fence = 0
        counts = [0, 0]
        after_mark = 0
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            event, who, fence_text = line.split()
            fence = int(fence_text)
            if event == "mark":
                after_mark = 1
            elif event == "enter":
                assert holder is None, f"line {number}: {who} entered while {holder} held"
                assert fence > last_fence, f"line {number}: fence {fence} after {last_fence}"
                holder, last_fence = who, fence
                counts[after_mark] += 1
            else:
                assert event == "exit" and holder == who, f"line {number}: {line}"
                holder = None
        return counts[0], counts[1]


class ContendingWorker(threading.Thread):
    """Takes one key over and over through one daemon until told to stop."""

    def __init__(self, name: str, socket_path: Path, key: str, detector: OverlapDetector) -> None:
        super().__init__(daemon=True, name=name)
        self.socket_path, self.key, self.detector = socket_path, key, detector
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with LockClient(str(self.socket_path)) as client:
                while not self.stop.is_set():
                    self._one_round(client)
        except BaseException as exc:  # reported by the test
            self.failure = exc

    def _one_round(self, client: LockClient) -> None:
        try:
            handle = client.acquire(self.key, ttl=30, timeout=30)
        except LockdError as exc:
            self.errors.append(exc.code)
            assert exc.code == "BACKEND_UNAVAILABLE", exc
            time.sleep(0.05)  # etcd is out: the worker's own pause before it tries again
            return
        self.detector.record("enter", self.name, handle.fence)
        time.sleep(0.002)  # the work done holding: a window an overlap would show in
        self.detector.record("exit", self.name, handle.fence)
        self._release(client, handle)

    def _release(self, client: LockClient, handle: Handle) -> None:
        unanswered = False
        while True:  # an unanswered release would stall everyone for the TTL
            try:
                result = client.release(handle)
            except LockdError as exc:
                self.errors.append(exc.code)
                assert exc.code == "BACKEND_UNAVAILABLE", exc
                unanswered = True  # it may have been committed all the same
                time.sleep(0.05)  # the worker's own pause before it tries again
                continue
            # After an attempt whose outcome was unknown, not_holder means it was.
            assert result.released or unanswered, (
                f"{self.name} lost fence {handle.fence}: {result.reason}"
            )
            return


@pytest.mark.parametrize("leader", ["kept", "killed"])
def test_both_hosts_contending_never_hold_at_once(
    request: pytest.FixtureRequest, short_tmp: Path, leader: str
) -> None:
    """Two workers on each host take one key over and over; midway the etcd leader
    is killed (or not). Every grant goes to one holder at a time, fences rise, and
    the key keeps moving (no waiter sleeps through its 30 s timeout)."""
    if leader == "killed":
        cluster = request.getfixturevalue("new_etcd_cluster")()
    else:
        cluster = request.getfixturevalue("etcd_cluster")
    detector = OverlapDetector(short_tmp / "holds.log")
    key = unique("contended")
    with two_hosts(cluster) as hosts:
        workers = [
            ContendingWorker(f"{host}{i}", daemon.socket, key, detector)
            for host, daemon in (("a", hosts.a), ("b", hosts.b))
            for i in range(2)
        ]
        for worker in workers:
            worker.start()
        try:
            progress = Progress(detector, workers, hosts)
            progress.wait(20, "at first")
            if leader == "killed":
                killed = cluster.leader()
                detector.record("mark", killed.name)
                cluster.kill(killed)
            else:
                detector.record("mark", "-")
            progress.wait(_grants(detector) + 30, f"after the mark (leader {leader})")
        finally:
            for worker in workers:
                worker.stop.set()
            for worker in workers:
                worker.join(60)
            detector.close()
        for worker in workers:
            assert not worker.is_alive(), f"{worker.name} is stuck"
            assert worker.failure is None, f"{worker.name}: {worker.failure!r}"
        before, after = detector.check()
        assert before >= 20 and after >= 30
        hosts_seen = {line.split()[1][0] for line in detector.path.read_text().splitlines()}
        assert {"a", "b"} <= hosts_seen, "both hosts must have held the key"


@dataclass
class Progress:
    """Waits for grants in the detector's file; if none come, says what workers and daemons saw."""

    detector: OverlapDetector
    workers: list[ContendingWorker]
    hosts: Hosts

    def wait(self, grants: int, when: str, timeout: float = 60) -> None:
        try:
            wait_for(lambda: _grants(self.detector) >= grants, timeout=timeout)
        except AssertionError:
            logs = "\n".join(
                f"{name}:\n" + "\n".join(daemon.read_log().splitlines()[-15:])
                for name, daemon in (("host-a", self.hosts.a), ("host-b", self.hosts.b))
            )
            seen = [(w.name, w.errors[-3:], repr(w.failure)) for w in self.workers]
            raise AssertionError(
                f"{_grants(self.detector)} of {grants} grants {when} within {timeout} s;"
                f" workers: {seen}\n{logs}"
            ) from None


def _grants(detector: OverlapDetector) -> int:
    return sum(line.startswith("enter ") for line in detector.path.read_text().splitlines())


def test_quorum_loss_refuses_in_time_grants_nothing_and_waiters_wait_it_out(
    new_etcd_cluster: Callable[..., EtcdCluster],
) -> None:
    cluster = new_etcd_cluster()
    etcd_timeout = 2
    # A session longer than the outage: the parked waiter keeps its key through it.
    with two_hosts(cluster, etcd_timeout=etcd_timeout, session_ttl=10) as hosts:
        conn, parked = RawConn(hosts.a.socket, timeout=60), RawConn(hosts.b.socket, timeout=60)
        try:
            kept, during, queued = unique("kept"), unique("during"), unique("queued")
            held = conn.result({"id": 1, "op": "tryAcquire", "key": kept, "ttlMs": 60_000})
            blocker = conn.result({"id": 2, "op": "tryAcquire", "key": queued, "ttlMs": 60_000})
            # Host b's waiter parks before the outage, so its key is in etcd.
            parked.send(
                {"id": "w", "op": "acquire", "key": queued, "ttlMs": 60_000, "timeoutMs": 60_000}
            )
            wait_for(
                lambda: conn.result({"id": 3, "op": "status", "key": queued})["waiters"] == 1,
                what="the waiter to park",
            )

            for member in cluster.members[:2]:
                cluster.kill(member)
            # hello never needs etcd.
            started = time.monotonic()
            assert conn.result({"id": 4, "op": "hello"})["protocol"] == 1
            assert time.monotonic() - started < PROMPT
            for request in (
                {"id": 5, "op": "tryAcquire", "key": during, "ttlMs": 60_000},
                {"id": 6, "op": "status", "key": kept},
                {"id": 7, "op": "release", "key": queued, "handle": blocker["handle"]},
            ):
                started = time.monotonic()
                check_error(conn.error(request), "BACKEND_UNAVAILABLE", 503)
                assert time.monotonic() - started <= etcd_timeout + PROMPT, request
            # A blocking acquire waits through the outage; its own timeout ends it.
            started = time.monotonic()
            timed_out = conn.error(
                {"id": 8, "op": "acquire", "key": during, "ttlMs": 60_000, "timeoutMs": 2500}
            )
            check_error(timed_out, "LOCK_TIMEOUT", 408)
            assert time.monotonic() - started >= 2.4
            with pytest.raises(TimeoutError):
                parked.read(timeout=0.5)  # still waiting, nothing granted

            for member in cluster.members[:2]:
                cluster.restart(member)
            wait_for(
                lambda: _answers(conn, {"id": 9, "op": "status", "key": kept}),
                timeout=30,
                what="the daemon to reach etcd again",
            )
            status = conn.result({"id": 10, "op": "status", "key": kept})
            assert status["held"] and status["fence"] == held["fence"], "etcd kept this lease"
            # The refused tryAcquire and the timed-out acquire left no hold behind.
            wait_for(
                lambda: not conn.result({"id": 11, "op": "status", "key": during})["held"],
                timeout=PROMPT,
                what="no hold from the outage",
            )
            assert conn.result(
                {"id": 12, "op": "release", "key": queued, "handle": blocker["handle"]}
            ) == {"released": True}
            granted = parked.reply(timeout=30)
            assert granted["id"] == "w" and granted["ok"] is True, granted
            assert granted["result"]["fence"] > blocker["fence"]
        finally:
            conn.close()
            parked.close()


def _answers(conn: RawConn, request: dict[str, Any]) -> bool:
    return conn.call(request).get("ok") is True


# ------------------------------------------------------------ TLS and etcd auth


def test_a_daemon_over_tls_as_an_etcd_user_limited_to_its_prefix(
    new_etcd_cluster: Callable[..., EtcdCluster], short_tmp: Path
) -> None:
    """What docs/operations.md tells an operator to set up: TLS with a client
    certificate without CommonName, and an etcd user whose role reaches only
    lockd's prefix."""
    cluster = new_etcd_cluster(1, tls=True)
    tls = cluster.tls
    assert tls is not None
    etcd = EtcdBackend.on(
        cluster,
        node="tls-host",
        extra=(
            ("ca_file", str(tls.ca)),
            ("cert_file", str(tls.client_cert)),
            ("key_file", str(tls.client_key)),
            ("username", "lockd"),
            ("password_file", "etcd-password"),  # relative: in the config folder
        ),
    )
    prefix = etcd.prefix.encode()
    member = cluster.members[0]
    for path, body in (
        ("/v3/auth/role/add", {"name": "lockd"}),
        (
            "/v3/auth/role/grant",
            {
                "name": "lockd",
                "perm": {
                    "permType": "READWRITE",
                    "key": _b64(prefix),
                    "range_end": _b64(prefix[:-1] + bytes([prefix[-1] + 1])),
                },
            },
        ),
        ("/v3/auth/user/add", {"name": "lockd", "password": "s3cret"}),
        ("/v3/auth/user/grant", {"user": "lockd", "role": "lockd"}),
    ):
        assert member.post(path, body, timeout=5.0) is not None, path
    cluster.enable_auth("root-secret")
    daemon = DaemonProcess.in_folder(short_tmp, etcd)
    daemon.config.mkdir(parents=True)
    (daemon.config / "etcd-password").write_text("s3cret\n")
    try:
        daemon.start()
        with LockClient(str(daemon.socket)) as client:
            handle = client.acquire("over-tls", ttl=10, timeout=1, release_on_close=True)
            waiter = park(client, daemon.socket, "over-tls")  # a watch, as the lockd user
            assert client.status("over-tls").raw["node"] == "tls-host"
            assert client.release(handle).released
            waiter.finish()
            assert waiter.handle is not None and client.release(waiter.handle).released
    finally:
        daemon.terminate()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
