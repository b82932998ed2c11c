"""``alive`` wherever the daemon can know it (docs/contract.md §12.2).

- A hold restored after a daemon restart: the holder's start time is in
  the database (schema 4), so ``alive`` is known again, true while that
  very process runs and false once it is gone.
- The etcd backend: a hold records its holder's start time and where its
  pid means something (boot and pid namespace); the daemon of the hold's
  node says ``alive``, before and after its own restart; another node's
  daemon says null (it cannot see that process).
- Records without a start time (written by older versions) read as null.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from lockd_client import Handle, LockClient

from lockd.daemon.backends.etcd.records import Hold
from lockd.daemon.backends.etcd.wire import KeyValue
from lockd.testing.daemon import DaemonProcess
from lockd.testing.etcd_cluster import EtcdCluster
from tests.live.test_cli_run import wait_until

from .test_etcd_hosts import two_hosts


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A descendant of this process: one the daemon believes as a holder."""
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        yield sleeper
    finally:
        sleeper.kill()
        sleeper.wait(5)


def _holder(daemon: DaemonProcess, key: str) -> dict[str, Any]:
    with LockClient(daemon.socket) as client:
        raw = client.status(key).raw
    entry = raw["holders"][0]
    assert {f: raw[f] for f in ("pid", "process", "alive")} == {
        f: entry[f] for f in ("pid", "process", "alive")
    }
    return entry


def _take(daemon: DaemonProcess, key: str, pid: int) -> None:
    with LockClient(daemon.socket) as client:
        assert client.try_acquire(key, 120, pid=pid) is not None


def test_a_restored_hold_knows_whether_its_holder_lives(
    daemon: DaemonProcess, child: subprocess.Popen[bytes]
) -> None:
    _take(daemon, "restored", child.pid)
    daemon.stop()
    daemon.start()
    entry = _holder(daemon, "restored")
    assert (entry["pid"], entry["process"], entry["alive"]) == (child.pid, "sleep", True)
    child.kill()
    child.wait(5)
    assert _holder(daemon, "restored")["alive"] is False


def test_etcd_alive_on_the_holds_node_and_null_elsewhere(
    etcd_cluster: EtcdCluster, child: subprocess.Popen[bytes]
) -> None:
    with two_hosts(etcd_cluster) as hosts:
        _take(hosts.a, "mine", child.pid)
        entry = _holder(hosts.a, "mine")
        assert (entry["pid"], entry["process"], entry["alive"]) == (child.pid, "sleep", True)
        assert entry["node"] == "host-a"
        # Another host cannot see that process: it does not guess.
        assert _holder(hosts.b, "mine")["alive"] is None
        hosts.a.stop()
        hosts.a.start()
        assert _holder(hosts.a, "mine")["alive"] is True  # computed at view time, after a restart
        child.kill()
        child.wait(5)
        assert _holder(hosts.a, "mine")["alive"] is False
        assert _holder(hosts.b, "mine")["alive"] is None


def test_an_etcd_record_without_start_time_reads_as_unknown() -> None:
    old = {
        "principal": "user:a",
        "owner": None,
        "mode": "exclusive",
        "limit": 1,
        "node": "n",
        "pid": 42,
        "process": "sh",
        "ttlMs": 2000,
        "expiresAt": 1,
        "bound": False,
    }
    hold = Hold.parse("k", "h", KeyValue(b"/p/k/6b/h/h", json.dumps(old).encode(), 3, 3, 1, 9))
    assert hold.pid == 42 and hold.pid_start is None and hold.pid_place is None
    odd = {**old, "pidStart": "12", "pidPlace": 5}
    hold = Hold.parse("k", "h", KeyValue(b"/p/k/6b/h/h", json.dumps(odd).encode(), 3, 3, 1, 9))
    assert hold.pid_start is None and hold.pid_place is None
    written = Hold.parse(
        "k",
        "h",
        KeyValue(b"", json.dumps({**old, "pidStart": 77, "pidPlace": "b/ns"}).encode(), 3, 3, 1, 9),
    )
    assert Hold.parse("k", "h", KeyValue(b"", written.value(), 3, 3, 1, 9)) == written


def test_etcd_alive_for_a_hold_granted_from_the_queue_by_the_other_host(
    etcd_cluster: EtcdCluster, child: subprocess.Popen[bytes]
) -> None:
    """The waiter record carries the start time into the hold another daemon grants.

    host-b's holder got the key through host-b's queue, so host-b has a view
    of the queue and its release grants host-a's waiter in the same
    transaction, from the waiter's record (docs/etcd-design.md §5a).
    """
    with two_hosts(etcd_cluster) as hosts, contextlib.ExitStack() as stack:
        first, second, waiting = (
            stack.enter_context(LockClient(daemon.socket)) for daemon in (hosts.b, hosts.b, hosts.a)
        )
        held = first.try_acquire("queued", 120)
        assert held is not None
        second_grant = _in_thread(lambda: second.acquire("queued", 120, 30))
        wait_until(lambda: first.status("queued").waiters == 1, 10, "host-b's waiter queued")
        first.release(held)
        handed = second_grant()
        third_grant = _in_thread(lambda: waiting.acquire("queued", 120, 30, pid=child.pid))
        wait_until(lambda: first.status("queued").waiters == 1, 10, "host-a's waiter queued")
        second.release(handed)  # host-b's hand-off grants host-a's waiter
        third_grant()
        entry = _holder(hosts.a, "queued")
        assert (entry["pid"], entry["alive"], entry["node"]) == (child.pid, True, "host-a")


def _in_thread(call: Callable[[], Handle]) -> Callable[[], Handle]:
    """Run ``call`` in a thread; the returned function waits for its result."""
    result: list[Handle] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()

    def join() -> Handle:
        thread.join(30)
        assert result, "not granted"
        return result[0]

    return join
