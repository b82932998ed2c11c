"""``lockd serve --etcd`` / ``[backend] kind = "etcd"``: a real daemon on a real cluster.

What the etcd backend adds to the contract (docs/contract.md §11): ``node`` in status,
list, holders and stats, the effective ``ttlMs``, nothing written to the
local database, ``hello`` while etcd is down and BACKEND_UNAVAILABLE for the
rest within ``etcd_timeout``, ``cancel`` and ``releaseOnClose`` through the
server's remote path. The cross-host and failure tests are elsewhere.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from lockd_client import LockClient, LockdError

from lockd.testing.daemon import LOCKD, DaemonProcess
from lockd.testing.etcd_cluster import EtcdCluster
from lockd.testing.polling import wait_for


@pytest.fixture
def etcd_daemon(daemon_paths: DaemonProcess, etcd_cluster: EtcdCluster) -> DaemonProcess:
    prefix = f"/test-daemon/{time.monotonic_ns()}/"
    daemon_paths.write_config(f'[backend]\nprefix = "{prefix}"\nnode = "host-a"\n')
    daemon_paths.extra_args = ["--etcd", ",".join(etcd_cluster.endpoints)]
    return daemon_paths.start()


@pytest.fixture
def client(etcd_daemon: DaemonProcess) -> Iterator[LockClient]:
    with LockClient(etcd_daemon.socket) as c:
        yield c


def lockd(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LOCKD, *args],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_views_carry_the_node_and_the_effective_ttl(
    etcd_daemon: DaemonProcess, client: LockClient
) -> None:
    handle = client.try_acquire("job", ttl=1.5)
    assert handle is not None and handle.ttl_ms == 2000  # whole seconds, etcd's minimum
    status = client.status("job")
    assert status.held and status.node == "host-a" and status.fence == handle.fence
    assert [h.node for h in status.holders] == ["host-a"]
    locks, after = client.list_page()
    assert [(st.key, st.node) for st in locks] == [("job", "host-a")] and after is None
    assert client.stats()["node"] == "host-a"
    shown = lockd(etcd_daemon, "locks", "status", "job")
    assert "host-a" in shown.stdout, shown
    assert client.release(handle).released
    # Nothing of the lock state went to the local database.
    assert not etcd_daemon.db.exists()


def test_release_on_close_and_renew_through_the_daemon(
    etcd_daemon: DaemonProcess, client: LockClient
) -> None:
    with LockClient(etcd_daemon.socket) as other:
        bound = other.try_acquire("bound", ttl=60, release_on_close=True)
        assert bound is not None
        renewed = other.renew(bound, ttl=30)
        assert renewed.renewed
    wait_for(lambda: not client.status("bound").held, 10, "the bound hold's release")


def send(sock: socket.socket, **message: object) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def replies(sock: socket.socket, count: int) -> list[dict[str, object]]:
    data = b""
    while data.count(b"\n") < count:
        chunk = sock.recv(65536)
        assert chunk, "connection closed"
        data += chunk
    return [json.loads(line) for line in data.splitlines()]


def park(sock: socket.socket, daemon: DaemonProcess, client: LockClient, key: str) -> None:
    """Send a blocking acquire (id 1) of ``key`` on ``sock``; return once it waits."""
    sock.connect(str(daemon.socket))
    send(sock, id=1, op="acquire", key=key, ttlMs=5000, timeoutMs=60000)
    wait_for(lambda: client.status(key).waiters > 0, 10, f"a waiter on {key}", interval=0.02)


def test_cancel_withdraws_a_parked_acquire(etcd_daemon: DaemonProcess, client: LockClient) -> None:
    held = client.try_acquire("busy", ttl=60)
    assert held is not None
    with socket.socket(socket.AF_UNIX) as sock:
        park(sock, etcd_daemon, client, "busy")
        send(sock, id=2, op="cancel", target=1)
        answers = {r["id"]: r for r in replies(sock, 2)}
    assert answers[2]["result"] == {"cancelled": True}
    assert answers[1]["error"]["code"] == "CANCELLED"  # type: ignore[index]
    wait_for(lambda: client.status("busy").waiters == 0, 10, "no waiter", interval=0.02)
    assert client.release(held).released


def test_hello_answers_while_etcd_is_down(daemon_paths: DaemonProcess) -> None:
    daemon_paths.write_config("[backend]\netcd_timeout = 1\n")
    daemon_paths.extra_args = ["--etcd", "http://127.0.0.1:9"]
    daemon_paths.start()
    with LockClient(daemon_paths.socket) as client:
        assert client.hello()["protocol"] == 1
        started = time.monotonic()
        with pytest.raises(LockdError) as info:
            client.status("k")
        assert info.value.code == "BACKEND_UNAVAILABLE" and info.value.status == 503
        assert time.monotonic() - started < 10
        assert client.stats()["counters"]["backendUnavailable"] == 1


def test_a_bad_backend_setting_stops_the_start(daemon_paths: DaemonProcess) -> None:
    daemon_paths.write_config("[backend]\nsession_ttl = 30\n")
    result = daemon_paths.serve_once("--etcd", "http://127.0.0.1:9")
    assert result.returncode == 2 and "'backend.session_ttl'" in result.stderr
    daemon_paths.write_config("")
    result = daemon_paths.serve_once("--etcd", "127.0.0.1:2379")
    assert result.returncode == 2 and "--etcd" in result.stderr


def test_sigterm_with_parked_waiters_stops_cleanly(
    etcd_daemon: DaemonProcess, client: LockClient
) -> None:
    held = client.try_acquire("parked", ttl=60, release_on_close=True)
    assert held is not None
    with socket.socket(socket.AF_UNIX) as sock:
        park(sock, etcd_daemon, client, "parked")
        assert etcd_daemon.stop() == 0
        assert replies(sock, 1)[0]["error"]["code"] == "SHUTTING_DOWN"  # type: ignore[index]
    etcd_daemon.start()
    with LockClient(etcd_daemon.socket) as again:
        status = again.status("parked")
    # The stop kept the releaseOnClose hold as a TTL hold; its waiter left.
    assert status.held and status.fence == held.fence and status.waiters == 0
