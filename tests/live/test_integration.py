"""Lock semantics and daemon life against a real ``lockd serve``.

Everything goes through the real :mod:`lockd_client` (raw sockets where the
client would hide what matters: a waiter's connection closing, a grant whose
reply cannot be written). Waiting is observed, never slept for: the tests
poll ``status`` (waiter counts, holders) with generous deadlines, because
the machine is small and shared. The only waits for time itself are the
short TTLs (at most 300 ms) of the expiry tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lockd_client import (
    Handle,
    InvalidRequestError,
    LockClient,
    LockdError,
    LockTimeoutError,
)

from lockd.testing.daemon import LOCKD, DaemonProcess
from lockd.testing.polling import wait_for
from lockd.testing.wire import RawConn
from tests.conftest import Backend, running_daemon

#: Generous bounds for "at once" on a loaded 2-core box.
PROMPT = 3.0


def waiters(client: LockClient, key: str) -> int:
    return client.status(key).waiters


class Waiter(threading.Thread):
    """A blocking ``acquire`` on its own client and connection, in a thread."""

    def __init__(
        self,
        socket_path: Path,
        key: str,
        *,
        ttl: float = 30,
        timeout: float = 20,
        owner: str | None = None,
        release_after: bool = False,
        log: list[tuple[str, int]] | None = None,
        name: str = "",
    ) -> None:
        super().__init__(daemon=True)
        self.client = LockClient(str(socket_path))
        self.key, self.ttl, self.timeout, self.owner = key, ttl, timeout, owner
        self.release_after = release_after
        self.log = log
        self.label = name
        self.handle: Handle | None = None
        self.error: LockdError | None = None
        self.granted_at: float | None = None

    def run(self) -> None:
        try:
            self.handle = self.client.acquire(
                self.key, ttl=self.ttl, timeout=self.timeout, owner=self.owner
            )
            self.granted_at = time.monotonic()
            if self.log is not None:
                self.log.append((self.label, self.handle.fence))
            if self.release_after:
                assert self.client.release(self.handle).released
        except LockdError as exc:
            self.error = exc

    def finish(self, timeout: float = 20.0) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"waiter {self.label} still blocked"
        self.client.close()


def park(client: LockClient, socket_path: Path, key: str, **kwargs: Any) -> Waiter:
    """Start a waiter and return once the daemon counts it in the queue."""
    before = waiters(client, key)
    waiter = Waiter(socket_path, key, **kwargs)
    waiter.start()
    wait_for(lambda: waiters(client, key) == before + 1, what=f"{key} to have {before + 1}")
    return waiter


def park_raw(
    raw: RawConn, client: LockClient, key: str, rid: str = "p", timeout_ms: int = 20_000
) -> None:
    before = waiters(client, key)
    raw.send({"id": rid, "op": "acquire", "key": key, "ttlMs": 30_000, "timeoutMs": timeout_ms})
    wait_for(lambda: waiters(client, key) == before + 1, what="the raw waiter to park")


@pytest.fixture(scope="module")
def shared(backend: Backend) -> Iterator[DaemonProcess]:
    """One daemon for the semantics tests; each test uses its own keys."""
    with running_daemon(backend=backend) as proc:
        yield proc


@pytest.fixture
def client(shared: DaemonProcess) -> Iterator[LockClient]:
    with LockClient(str(shared.socket)) as c:
        yield c


# ------------------------------------------------------------ hand-off


@pytest.mark.both_backends
def test_fifo_handoff_to_four_threads_in_parking_order(
    shared: DaemonProcess, client: LockClient
) -> None:
    key = "fifo"
    holder = client.acquire(key, ttl=60, timeout=1)
    log: list[tuple[str, int]] = []
    threads = [
        park(client, shared.socket, key, release_after=True, log=log, name=str(i)) for i in range(4)
    ]
    assert client.status(key).waiters == 4
    assert client.release(holder).released
    for thread in threads:
        thread.finish()
        assert thread.error is None, thread.error
    assert [name for name, _ in log] == ["0", "1", "2", "3"]
    fences = [fence for _, fence in log]
    assert fences == sorted(fences) and fences[0] > holder.fence
    assert len(set(fences)) == 4
    assert not client.status(key).held


@pytest.mark.both_backends
def test_release_break_and_expiry_hand_to_the_head_at_once(
    shared: DaemonProcess, client: LockClient, backend: Backend
) -> None:
    key = "handoff"
    holder = client.acquire(key, ttl=60, timeout=1)

    # release
    first = park(client, shared.socket, key)
    released_at = time.monotonic()
    assert client.release(holder).released
    first.finish()
    assert first.handle is not None and first.granted_at is not None
    assert first.granted_at - released_at < PROMPT

    # break
    second = park(client, shared.socket, key)
    broken_at = time.monotonic()
    assert client.break_lock(key, "hand-off test").broken
    second.finish()
    assert second.handle is not None and second.granted_at is not None
    assert second.granted_at - broken_at < PROMPT
    assert client.release(first.handle).reason == "not_holder"

    # expiry: the holder's lease is renewed to 250 ms (etcd: 2 s) and runs out
    third = park(client, shared.socket, key)
    assert client.renew(second.handle, ttl=0.25).renewed
    renewed_at = time.monotonic()
    ttl = backend.effective_ttl_ms(250) / 1000
    third.finish()
    assert third.handle is not None and third.granted_at is not None
    assert third.granted_at - renewed_at >= ttl - 0.05
    assert third.granted_at - renewed_at < ttl + PROMPT
    assert third.handle.fence > second.handle.fence > first.handle.fence
    assert client.renew(second.handle, ttl=1).reason == "lease_lost"


@pytest.mark.both_backends
def test_waiter_whose_connection_closes_leaves_the_queue(
    shared: DaemonProcess, client: LockClient, backend: Backend
) -> None:
    key = "leaver"
    holder = client.acquire(key, ttl=60, timeout=1)
    raw = RawConn(shared.socket)
    park_raw(raw, client, key)
    behind = park(client, shared.socket, key)
    raw.close()
    wait_for(lambda: waiters(client, key) == 1, what="the closed waiter to leave")
    assert client.release(holder).released
    behind.finish()
    assert behind.handle is not None and backend.fence_follows(holder.fence, behind.handle.fence)
    status = client.status(key)
    assert status.held and status.fence == behind.handle.fence


@pytest.mark.both_backends
def test_closed_waiter_alone_leaves_the_key_free(shared: DaemonProcess, client: LockClient) -> None:
    key = "leaver-alone"
    holder = client.acquire(key, ttl=60, timeout=1)
    raw = RawConn(shared.socket)
    park_raw(raw, client, key)
    raw.close()
    wait_for(lambda: waiters(client, key) == 0, what="the closed waiter to leave")
    assert client.release(holder).released
    assert not client.status(key).held


def stall(raw: RawConn) -> int:
    """Pipeline requests without reading until the daemon cannot write.

    Returns how many were sent. Afterwards the daemon's writes to ``raw``
    block: a grant for it cannot be delivered. The requests are ``hello``s,
    answered at once by either backend, whose replies echo a long id: the
    replies fill the socket before the requests do, so the daemon stops
    reading because it cannot write. (A ``status`` costs an etcd daemon a
    round trip: it read slowly and had room left for the grant.)
    """
    raw.sock.settimeout(0.5)
    line = json.dumps({"id": "s" * 1000, "op": "hello"}).encode() + b"\n"
    sent = 0
    try:
        while sent < 100_000:
            raw.sock.sendall(line)
            sent += 1
    except TimeoutError:
        pass
    return sent


@pytest.mark.both_backends
def test_grant_whose_reply_cannot_be_written_is_released(
    shared: DaemonProcess, client: LockClient, backend: Backend
) -> None:
    """The head waiter's connection is stuck, then gone: the key goes on."""
    key = "undelivered"
    holder = client.acquire(key, ttl=60, timeout=1)
    raw = RawConn(shared.socket)
    try:
        park_raw(raw, client, key, rid="stuck")
        behind = park(client, shared.socket, key)
        assert stall(raw) > 10
        assert client.release(holder).released
        # The stuck waiter was the head: it got the key, but cannot be told.
        # (On etcd the hand-off follows the release: the waiter's daemon sees
        # it through its watch, so the grant may come a moment after.)
        if backend.differs("handoff_follows_release"):
            wait_for(lambda: client.status(key).held, timeout=PROMPT, what="the hand-off")
        status = client.status(key)
        assert status.held and backend.fence_follows(holder.fence, status.fence)
        assert status.waiters == 1
    finally:
        raw.close()
    behind.finish()
    assert behind.handle is not None and behind.error is None
    assert backend.fence_follows(holder.fence, behind.handle.fence, grants=2)
    assert behind.handle.fence > status.fence
    wait_for(
        lambda: "event=released_undelivered key=undelivered " in shared.read_log(),
        timeout=PROMPT,
        what="the undelivered grant to be logged as released",
    )


@pytest.mark.both_backends
def test_release_on_close_frees_at_once_on_disconnect(
    shared: DaemonProcess, client: LockClient
) -> None:
    bound, unbound = "roc:bound", "roc:unbound"
    other = LockClient(str(shared.socket))
    b = other.acquire(bound, ttl=60, timeout=1, release_on_close=True)
    other.acquire(unbound, ttl=60, timeout=1)
    behind = park(client, shared.socket, bound)
    closed_at = time.monotonic()
    other.close()
    behind.finish()
    assert behind.handle is not None and behind.handle.fence > b.fence
    assert behind.granted_at is not None and behind.granted_at - closed_at < PROMPT
    # Without releaseOnClose the lease outlives the connection.
    assert client.status(unbound).held
    # And a bound lease with nobody waiting is simply freed.
    third = LockClient(str(shared.socket))
    third.acquire("roc:alone", ttl=60, timeout=1, release_on_close=True)
    third.close()
    wait_for(lambda: not client.status("roc:alone").held, timeout=PROMPT, what="roc release")


@pytest.mark.both_backends
def test_owner_retake_fences_the_earlier_handle_and_jumps_the_queue(
    shared: DaemonProcess, client: LockClient
) -> None:
    key = "retake"
    first = client.acquire(key, ttl=60, timeout=1, owner="run-1")
    queued = park(client, shared.socket, key)
    with LockClient(str(shared.socket)) as again:
        started = time.monotonic()
        second = again.acquire(key, ttl=60, timeout=10, owner="run-1")
        assert time.monotonic() - started < PROMPT, "a re-take must not queue"
        assert second.fence > first.fence and second.handle != first.handle
        assert second.owner == "run-1"
        status = client.status(key)
        assert status.fence == second.fence and status.owner == "run-1" and status.waiters == 1
        # Every earlier handle is fenced.
        lost = client.release(first)
        assert (lost.released, lost.reason) == (False, "not_holder")
        renewed = client.renew(first, ttl=60)
        assert (renewed.renewed, renewed.reason) == (False, "lease_lost")
        # Other owners and no owner never re-enter.
        assert again.try_acquire(key, ttl=60, owner="run-2") is None
        assert again.try_acquire(key, ttl=60) is None
        assert again.renew(second, ttl=60).renewed
        assert again.release(second).released
    queued.finish()
    assert queued.handle is not None and queued.handle.fence > second.fence


@pytest.mark.both_backends
def test_hold_without_owner_is_never_reentered(client: LockClient) -> None:
    handle = client.acquire("no-owner", ttl=60, timeout=1)
    assert client.try_acquire("no-owner", ttl=60) is None
    started = time.monotonic()
    with pytest.raises(LockTimeoutError) as info:
        client.acquire("no-owner", ttl=60, timeout=0.05)
    assert time.monotonic() - started >= 0.045, "the wait must last its timeout"
    assert info.value.key == "no-owner" and info.value.timeout_ms == 50
    assert client.release(handle).released


@pytest.mark.both_backends
def test_short_ttl_expires_and_status_says_so_right_after(
    client: LockClient, backend: Backend
) -> None:
    ttl_ms = backend.effective_ttl_ms(200)  # etcd: 2 s, its shortest lease
    handle = client.acquire("short", ttl=0.2, timeout=1)
    granted = time.monotonic()
    ttl = ttl_ms / 1000
    status = client.status("short")
    assert status.held and status.expires_in_ms is not None and status.expires_in_ms <= ttl_ms
    # Wait out the lease itself, then one status must say free (on etcd, once
    # etcd has ended the lease: leaseExpiresAt is the earliest end, docs/contract.md §11).
    # This sleep stays: a live daemon's real clock running past the TTL is the subject.
    time.sleep(max(0.0, granted + ttl + 0.01 - time.monotonic()))
    if backend.differs("expiry_ends_in_etcd"):  # idle: ~0.5 s late; loaded: over 3 s
        wait_for(lambda: not client.status("short").held, timeout=15, what="etcd's expiry")
    status = client.status("short")
    assert not status.held
    assert (status.held_by, status.owner, status.fence, status.expires_in_ms) == (
        None,
        None,
        None,
        None,
    )
    assert client.release(handle).reason == "not_holder"
    assert client.renew(handle, ttl=10).reason == "lease_lost"
    if not backend.differs("expiry_ends_in_etcd"):  # no daemon sees etcd end a lease
        wait_for(lambda: client.stats()["counters"]["expiries"] >= 1, timeout=PROMPT)


@pytest.mark.both_backends
def test_list_with_prefix_and_limit(client: LockClient) -> None:
    for key in ("app:b", "app:a", "app:c", "other:a"):
        client.acquire(key, ttl=60, timeout=1, owner=f"o-{key}")
    locks = client.list(prefix="app:")
    assert [lock.key for lock in locks] == ["app:a", "app:b", "app:c"]
    assert all(lock.held and lock.owner == f"o-{lock.key}" for lock in locks)
    assert all(lock.held_by == "user:root" for lock in locks)
    assert [lock.key for lock in client.list(prefix="app:", limit=2)] == ["app:a", "app:b"]
    assert {lock.key for lock in client.list()} >= {"app:a", "app:b", "app:c", "other:a"}
    assert client.list(prefix="nothing-here") == []


# 1,001 grants and releases take ~20 s on etcd; etcd's paging is in
# test_list_with_prefix_and_limit and test_cli.py's test_list_follows_next_across_pages.
def test_list_pages_of_the_default_size_and_following_them(client: LockClient) -> None:
    # 1,001 locks: the default page is 1,000, so a second page of one follows.
    keys = [f"many:{i:04d}" for i in range(1001)]
    handles = [client.try_acquire(key, ttl=60) for key in keys]
    first, after = client.list_page(prefix="many:")
    assert [lock.key for lock in first] == keys[:1000] and after == keys[999]
    last, after = client.list_page(prefix="many:", after=after)
    assert [lock.key for lock in last] == keys[1000:] and after is None
    assert [lock.key for lock in client.list(prefix="many:")] == keys  # follows every page
    page, _ = client.list_page(prefix="many:", limit=2, after="many:0500")
    assert [lock.key for lock in page] == ["many:0501", "many:0502"]
    assert client.list_page(prefix="many:", limit=10_000)[1] is None
    with pytest.raises(InvalidRequestError) as too_many:
        client.list_page(limit=10_001)
    assert too_many.value.field == "limit"
    with pytest.raises(ValueError):
        client.list_page(after="")
    for handle in handles:  # the daemon is shared: leave no thousand leases behind
        assert handle is not None and client.release(handle).released


@pytest.mark.both_backends
def test_break_result_and_warning_log(shared: DaemonProcess, client: LockClient) -> None:
    handle = client.acquire("breakme", ttl=60, timeout=1, owner="job-9")
    result = client.break_lock("breakme", "operator: stuck job")
    assert result.broken and result.held_by == "user:root"
    assert result.owner == "job-9" and result.fence == handle.fence
    assert set(result.raw) == {"broken", "holders", "heldBy", "owner", "fence"}
    assert result.raw["holders"] == 1
    assert client.release(handle).reason == "not_holder"
    assert client.renew(handle, ttl=5).reason == "lease_lost"
    free = client.break_lock("breakme", "again")
    assert not free.broken and free.raw == {"broken": False}

    def logged() -> list[str]:
        return [
            line
            for line in shared.read_log().splitlines()
            if "level=WARNING" in line and "event=broken" in line and "key=breakme " in line
        ]

    wait_for(lambda: bool(logged()), timeout=PROMPT, what="the break log line")
    (line,) = logged()
    assert "key=breakme" in line and "by=user:root" in line
    assert 'reason="operator: stuck job"' in line


@pytest.mark.both_backends
def test_hello_through_the_client(client: LockClient) -> None:
    hello = client.hello()
    assert set(hello) == {"protocol", "version", "principal", "role", "uid", "pid"}
    assert hello["protocol"] == 1 and hello["principal"] == "user:root"
    assert hello["role"] == "owner" and hello["uid"] == 0 and hello["pid"] == os.getpid()


@pytest.mark.both_backends
def test_stats_counters_move(shared: DaemonProcess, client: LockClient, backend: Backend) -> None:
    before = client.stats()["counters"]
    h = client.acquire("stats", ttl=60, timeout=1)
    assert client.try_acquire("stats", ttl=60) is None
    with pytest.raises(LockTimeoutError):
        client.acquire("stats", ttl=60, timeout=0.02)
    client.renew(h, ttl=60)
    client.release(h)
    h2 = client.acquire("stats", ttl=60, timeout=1)
    client.break_lock("stats", "stats test")
    client.acquire("stats", ttl=60, timeout=1, owner="o")
    client.acquire("stats", ttl=60, timeout=1, owner="o")
    raw = RawConn(shared.socket)
    raw.error(b"not json")
    raw.close()
    after = client.stats()
    counters = after["counters"]
    assert counters["grants"] - before["grants"] == 4
    assert counters["retakes"] - before["retakes"] == 1
    assert counters["releases"] - before["releases"] == 1
    assert counters["renewals"] - before["renewals"] == 1
    assert counters["timeouts"] - before["timeouts"] == 1
    assert counters["breaks"] - before["breaks"] == 1
    assert counters["invalidRequests"] - before["invalidRequests"] == 1
    assert counters["connectionsAccepted"] - before["connectionsAccepted"] >= 1
    # With etcd, held is null (no host counts every host's keys).
    assert after["held"] is None if backend.differs("held_is_null") else after["held"] >= 1
    assert after["fence"] >= h2.fence + 1
    for op in ("acquire", "tryAcquire", "renew", "release", "break", "stats"):
        assert after["latency"][op]["count"] >= 1, op


# --------------------------------------------------------- handle secrecy

HANDLE_RE = re.compile(r"^[A-Za-z0-9_-]{22,}$")


@pytest.mark.both_backends
def test_handle_ids_never_leave_their_caller(daemon_paths: DaemonProcess) -> None:
    """Long, random, and absent from status, list, break and the log (debug level)."""
    daemon_paths.write_config('log_level = "debug"\n')
    daemon_paths.start()
    handles: list[str] = []
    shown: list[Any] = []
    with LockClient(str(daemon_paths.socket)) as client:
        keys = [f"secret:{i}" for i in range(6)]
        for i, key in enumerate(keys):
            h = client.acquire(key, ttl=60, timeout=1, owner="o" if i % 2 else None)
            handles.append(h.handle)
        retaken = client.acquire(keys[1], ttl=60, timeout=1, owner="o")
        handles.append(retaken.handle)
        queued = park(client, daemon_paths.socket, keys[0])
        shown.append(client.status(keys[0]).raw)
        shown.append([lock.raw for lock in client.list()])
        shown.append(client.break_lock(keys[0], "secrecy").raw)
        queued.finish()
        assert queued.handle is not None
        handles.append(queued.handle.handle)
        roc = LockClient(str(daemon_paths.socket))
        handles.append(roc.acquire("secret:roc", ttl=60, timeout=1, release_on_close=True).handle)
        roc.close()
        short = client.acquire("secret:short", ttl=0.05, timeout=1)
        handles.append(short.handle)
        # On etcd a 0.05 s TTL is 2 s, and the hold's lease lives up to a second longer.
        wait_for(lambda: not client.status("secret:short").held, timeout=PROMPT + 1.5)
        client.renew((keys[2], "not-a-handle-" * 3), ttl=5)
        client.release(queued.handle)
        shown.append([lock.raw for lock in client.list()])
        shown.append(client.stats())
    daemon_paths.stop()
    assert len(set(handles)) == len(handles)
    for handle in handles:
        assert HANDLE_RE.match(handle), handle
    visible = json.dumps(shown)
    log = daemon_paths.read_log()
    assert "event=granted" in log, "the debug log should have been written"
    for handle in handles:
        assert handle not in visible
        assert handle not in log


# ------------------------------------------------------------ daemon life


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_are_private_in_user_mode(shared: DaemonProcess, client: LockClient) -> None:
    client.acquire("files", ttl=60, timeout=1)
    assert stat.S_ISSOCK(shared.socket.stat().st_mode)
    assert mode_of(shared.socket) == 0o600
    assert mode_of(shared.db) == 0o600
    assert mode_of(shared.db.parent) == 0o700
    for suffix in ("-wal", "-shm"):
        extra = shared.db.with_name(shared.db.name + suffix)
        if extra.exists():
            assert mode_of(extra) & 0o077 == 0, (extra, oct(mode_of(extra)))


def test_no_flags_user_mode_paths_are_private(short_tmp: Path) -> None:
    """``lockd serve`` with no arguments: XDG paths, socket 0600, state 0700/0600."""
    env = {k: v for k, v in os.environ.items() if k != "LOCKD_SOCKET"}
    env |= {
        "XDG_RUNTIME_DIR": str(short_tmp / "run"),
        "XDG_STATE_HOME": str(short_tmp / "state"),
        "XDG_CONFIG_HOME": str(short_tmp / "config"),
    }
    (short_tmp / "run").mkdir(mode=0o700)
    sock = short_tmp / "run" / "lockd" / "lockd.sock"
    db = short_tmp / "state" / "lockd" / "lockd.db"
    with (short_tmp / "log").open("wb") as log:
        proc = subprocess.Popen([*LOCKD, "serve"], env=env, stdout=log, stderr=log)
    try:

        def answers() -> bool:
            assert proc.poll() is None, (short_tmp / "log").read_text()
            try:
                with LockClient(str(sock), connect_timeout=1) as c:
                    return c.hello()["protocol"] == 1
            except LockdError:
                return False

        wait_for(answers, timeout=15, what="the daemon on its default socket")
        with LockClient(str(sock)) as c:
            c.acquire("default-paths", ttl=60, timeout=1)
        assert mode_of(sock) == 0o600 and stat.S_ISSOCK(sock.stat().st_mode)
        assert mode_of(sock.parent) & 0o077 == 0
        assert mode_of(db) == 0o600 and mode_of(db.parent) == 0o700
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_system_mode_socket_is_open_to_all(daemon_paths: DaemonProcess) -> None:
    daemon_paths.extra_args = ["--system"]
    daemon_paths.start()
    assert mode_of(daemon_paths.socket) == 0o666
    assert mode_of(daemon_paths.db) == 0o600


def test_stale_socket_from_kill9_is_replaced(daemon_paths: DaemonProcess) -> None:
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        handle = client.acquire("stale", ttl=60, timeout=1)
    daemon_paths.kill9()
    assert daemon_paths.socket.is_socket(), "kill -9 leaves the socket file behind"
    with pytest.raises(ConnectionRefusedError), socket.socket(socket.AF_UNIX) as probe:
        probe.connect(str(daemon_paths.socket))
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        assert client.status("stale").fence == handle.fence
        assert client.release(handle).released
    assert daemon_paths.stop() == 0


def test_second_daemon_on_a_live_socket_refuses_and_the_first_serves(
    shared: DaemonProcess, client: LockClient
) -> None:
    daemon = shared
    handle = client.acquire("first", ttl=60, timeout=1)
    second = daemon.serve_once(db=daemon.root / "other.db")
    assert second.returncode != 0
    assert "a daemon is already running on" in second.stderr and str(daemon.socket) in second.stderr
    assert daemon.socket.is_socket()
    with LockClient(str(daemon.socket)) as fresh:
        assert fresh.hello()["protocol"] == 1
        assert fresh.status("first").fence == handle.fence
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_second_daemon_on_the_same_database_refuses_at_once(
    shared: DaemonProcess, client: LockClient
) -> None:
    handle = client.acquire("db-owner", ttl=60, timeout=1)
    second = shared.serve_once(socket=shared.root / "second.sock")
    assert second.returncode == 1
    assert "in use by another process" in second.stderr and str(shared.db) in second.stderr
    # "At once" (no SQLite busy wait) is timed in process, by test_store's
    # test_a_database_in_use_is_refused_without_a_busy_wait: around this whole
    # second daemon, Python's start-up on a starved CPU took longer than the bound.
    assert not (shared.root / "second.sock").exists()
    assert client.status("db-owner").fence == handle.fence


@pytest.mark.both_backends
def test_sigterm_answers_parked_acquires_and_keeps_leases(daemon_paths: DaemonProcess) -> None:
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        held = client.acquire("term", ttl=60, timeout=1, owner="run")
        other = client.acquire("term:other", ttl=60, timeout=1)
        raw = RawConn(daemon_paths.socket)
        park_raw(raw, client, "term", rid="w")
        waiter = park(client, daemon_paths.socket, "term")
        # A releaseOnClose lease whose connection is still open at the stop:
        # the stop closes the connection, but it stays as a TTL lease (docs/contract.md §3, §7).
        bound_client = LockClient(str(daemon_paths.socket))
        bound = bound_client.acquire("term:bound", ttl=60, timeout=1, release_on_close=True)
    assert daemon_paths.stop(signal.SIGTERM) == 0
    bound_client.close()
    reply = raw.reply()
    raw.close()
    assert reply["id"] == "w" and reply["ok"] is False
    assert (reply["error"]["code"], reply["error"]["status"]) == ("SHUTTING_DOWN", 503)
    assert not daemon_paths.socket.exists()
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        status = client.status("term")
        assert status.held and status.fence == held.fence and status.owner == "run"
        # The client's waiter was answered SHUTTING_DOWN and parked again (docs/contract.md §8).
        wait_for(lambda: waiters(client, "term") == 1, what="the waiter to park again")
        assert client.release(held).released
        waiter.finish()
        assert waiter.error is None and waiter.handle is not None
        assert waiter.handle.fence > held.fence
        assert client.renew(other, ttl=60).renewed
        assert client.status("term:bound").fence == bound.fence
        assert client.release(bound).released
        assert client.acquire("new", ttl=60, timeout=1).fence > bound.fence


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ('colour = "blue"\n', "colour"),
        ('acquire_per_hour = "many"\n', "acquire_per_hour"),
        ('admin_groups = "wheel"\n', "admin_groups"),
    ],
)
def test_bad_config_stops_startup_naming_the_key(
    daemon_paths: DaemonProcess, config: str, named: str
) -> None:
    daemon_paths.write_config(config)
    daemon_paths.start(wait=False)
    assert daemon_paths.proc is not None
    code = daemon_paths.proc.wait(30)
    assert code != 0
    log = daemon_paths.read_log()
    assert "cannot start" in log and named in log and "lockd.toml" in log
    assert not daemon_paths.socket.exists()


def test_max_connections_refuses_the_extra_connection(daemon_paths: DaemonProcess) -> None:
    daemon_paths.write_config("max_connections = 3\n")
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as observer:
        # The fixture's readiness probe may not be reaped yet: wait until the
        # observer is the only connection the daemon counts.
        wait_for(lambda: observer.stats()["connections"] == 1, timeout=PROMPT)
        first, second = RawConn(daemon_paths.socket), RawConn(daemon_paths.socket)
        try:
            assert first.result({"id": 1, "op": "hello"})["protocol"] == 1
            assert second.result({"id": 1, "op": "hello"})["protocol"] == 1
            third = RawConn(daemon_paths.socket)
            try:
                # Refused with one line that says why, then closed.
                refusal = third.call({"id": 1, "op": "hello"})
                assert refusal["id"] is None and refusal["error"]["code"] == "RATE_LIMITED"
                assert refusal["error"]["details"] == {"limit": 3, "reason": "max_connections"}
            finally:
                third.close()
            assert first.result({"id": 2, "op": "hello"})["protocol"] == 1
        finally:
            first.close()
            second.close()
        assert observer.stats()["counters"]["connectionsRefused"] == 1
        # Room again once the others are gone.
        wait_for(lambda: observer.stats()["connections"] == 1, timeout=PROMPT)
        fourth = RawConn(daemon_paths.socket)
        try:
            assert fourth.result({"id": 1, "op": "hello"})["protocol"] == 1
        finally:
            fourth.close()


# ----------------------------------------------- another uid, for real

NOBODY_UID = 54_321  # no passwd entry on purpose: principal user:<uid>
#: The venv's interpreter lives under /root here; another uid needs a system one.
#: The client is standard library only, so its source folder is all it needs.
SYSTEM_PYTHON = "/usr/bin/python3"
CLIENT_DIR = str(Path(__file__).resolve().parents[2] / "client")

MEMBER_SCRIPT = """
import json, sys
from lockd_client import LockClient, LockdError
out = {}
with LockClient(sys.argv[1]) as c:
    out["hello"] = c.hello()
    for name, call in [
        ("list", lambda: [s.key for s in c.list()]),
        ("stats", lambda: c.stats()),
        ("rules", lambda: c.rules()),
        ("break", lambda: c.break_lock("root-key", "member tries")),
    ]:
        try:
            call()
            out[name] = "allowed"
        except LockdError as exc:
            out[name] = exc.code
    out["status"] = c.status("root-key").raw
    out["retake"] = c.try_acquire("root-key", ttl=5, owner="shared") is not None
    h = c.try_acquire("member-key", ttl=5)
    out["own"] = h.raw if h else None
    out["release_own"] = c.release(h).released
print(json.dumps(out))
"""


@pytest.mark.skipif(
    os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs root and python3"
)
def test_member_without_passwd_entry(daemon_paths: DaemonProcess) -> None:
    """A uid with no passwd entry is ``user:<uid>``, a member, kept out of admin ops."""
    daemon_paths.extra_args = ["--system"]  # socket mode 0666 so another uid may connect
    os.chmod(daemon_paths.root, 0o755)
    daemon_paths.start()
    with LockClient(str(daemon_paths.socket)) as client:
        held = client.acquire("root-key", ttl=60, timeout=1, owner="shared")
        run = subprocess.run(
            [SYSTEM_PYTHON, "-c", MEMBER_SCRIPT, str(daemon_paths.socket)],
            user=NOBODY_UID,
            group=NOBODY_UID,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": CLIENT_DIR},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["hello"]["principal"] == f"user:{NOBODY_UID}"
        assert out["hello"]["role"] == "member" and out["hello"]["uid"] == NOBODY_UID
        for op in ("stats", "rules", "break"):
            assert out[op] == "LOCK_ACCESS_DENIED", (op, out[op])
        # docs/contract.md §12: a member lists its own holds (none yet)
        assert out["list"] == "allowed"
        assert out["status"]["held"] and out["status"]["heldBy"] == "user:root"
        assert "handle" not in out["status"]
        assert out["retake"] is False, "a member must not re-take another principal's hold"
        assert out["own"]["key"] == "member-key" and out["release_own"] is True
        status = client.status("root-key")
        assert status.fence == held.fence
        assert client.release(held).released


def test_serve_json_reports_a_startup_error_as_one_json_line(
    daemon_paths: DaemonProcess,
) -> None:
    daemon_paths.write_config("acquire_per_hour = 'many'\n")
    proc = daemon_paths.serve_once("--json")
    assert proc.returncode == 2  # a config mistake is a usage error (issue 24)
    error = json.loads(proc.stderr.strip().splitlines()[-1])["error"]
    assert (error["code"], error["status"]) == ("USAGE", 400)  # docs/contract.md §9's one shape
    assert error["details"] == {"reason": "bad_config"}
    assert "acquire_per_hour" in error["message"]
