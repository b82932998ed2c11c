"""The client's safe defaults against a real daemon (docs/contract.md §8 "Safe by default").

``lock()`` renews and binds the hold to its connection; a hold lost inside
the block raises :class:`LockLostError` at its end; a blocking acquire parks
again after a daemon restart (clean stop or kill -9), with and without owner,
and so do ``lockd locks acquire --wait`` and ``lockd run --wait``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from lockd_client import Handle, LockClient, LockdError, LockLostError

from lockd.testing.daemon import LOCKD, DaemonProcess
from lockd.testing.polling import wait_for

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """The module's one daemon for the tests that leave it running, each on keys of its own.

    The tests that stop, kill or freeze a daemon start their own (``daemon_paths``).
    """
    return lockd


def waiters(client: LockClient, key: str) -> int:
    return client.status(key).waiters


# -- lock() ---------------------------------------------------------------------------------


def test_lock_raises_lock_lost_when_the_ttl_ran_out_inside(daemon: DaemonProcess) -> None:
    with LockClient(daemon.socket) as client:
        lock = client.lock("safe:ttl", ttl=0.2, timeout=1, auto_renew=False)
        with pytest.raises(LockLostError) as caught, lock as handle:
            # Not renewed: the lease runs out (on etcd a moment after leaseExpiresAt).
            wait_for(lambda: not client.status("safe:ttl").held, 20, "the lease to run out")
        assert caught.value.key == "safe:ttl" and caught.value.fence == handle.fence
        assert "not_holder" in str(caught.value) and handle.lost


def test_lock_raises_lock_lost_after_a_break_and_calls_on_lost_at_once(
    daemon: DaemonProcess,
) -> None:
    lost = threading.Event()
    broken_at: list[float] = []
    with LockClient(daemon.socket) as client, LockClient(daemon.socket) as admin:

        def break_it() -> None:
            assert admin.break_lock("safe:break", "test").broken
            broken_at.append(time.monotonic())

        breaker = threading.Thread(target=break_it)
        # A TTL of a minute: no renewal comes in the test's time, the daemon tells.
        lock = client.lock("safe:break", ttl=60, timeout=1, on_lost=lambda h: lost.set())
        with pytest.raises(LockLostError, match=r"broken by user:.*: test") as caught, lock:
            breaker.start()
            assert lost.wait(5)  # pushed by the daemon, inside the block
            with pytest.raises(LockLostError) as at_next_call:
                client.status("safe:other")
            assert at_next_call.value.cause == "break"
            assert not broken_at  # the key stays ours until the block is over
            left_block = time.monotonic()
        breaker.join(10)
        assert caught.value.cause == "break" and caught.value.reason.endswith(": test")
        # The break was answered (the key handed on) only after the block let go.
        assert broken_at and broken_at[0] >= left_block
        assert not client.status("safe:break").held


def test_lock_renews_by_default(daemon: DaemonProcess) -> None:
    with (
        LockClient(daemon.socket) as client,
        LockClient(daemon.socket) as observer,
        client.lock("safe:renew", ttl=0.3, timeout=1) as h,
    ):
        first_end = h.lease_expires_at
        assert first_end is not None

        def renewed_past_the_ttl() -> bool:
            # The daemon's end of the lease lies the TTL past the grant's: kept past it.
            end = observer.status("safe:renew").lease_expires_at
            return end is not None and (end - first_end).total_seconds() >= 0.3

        wait_for(renewed_past_the_ttl, 20, "renewals past the TTL", interval=0.05)
        assert client.status("safe:renew").fence == h.fence and not h.lost


def test_killed_process_inside_lock_frees_the_key_at_once(daemon: DaemonProcess) -> None:
    code = (
        "import signal, sys\n"
        "from lockd_client import LockClient\n"
        "with LockClient(sys.argv[1]) as c, c.lock('safe:kill', ttl=600, timeout=5):\n"
        "    print('held', flush=True)\n"
        "    signal.pause()  # until killed\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(daemon.socket)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        with LockClient(daemon.socket) as other:
            assert other.status("safe:kill").held
            child.kill()
            child.wait(10)
            # The TTL is 10 minutes; only releaseOnClose can free it this soon.
            handle = other.acquire("safe:kill", ttl=5, timeout=5)
            assert other.release(handle).released
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


# -- re-park across daemon restarts ---------------------------------------------------------


class Waiter(threading.Thread):
    def __init__(self, socket: Path, key: str, owner: str | None) -> None:
        super().__init__(daemon=True)
        self.client = LockClient(socket, retry_window=10)
        self.key, self.owner = key, owner
        self.handle: Handle | None = None
        self.error: LockdError | None = None
        self.released = False

    def run(self) -> None:
        try:
            self.handle = self.client.acquire(self.key, ttl=30, timeout=60, owner=self.owner)
            self.released = self.client.release(self.handle).released
        except LockdError as exc:
            self.error = exc
        finally:
            self.client.close()


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_parked_acquires_survive_restarts_under_load(daemon_paths: DaemonProcess, how: str) -> None:
    """Twelve waiters (half with an owner) parked on a held key, while other clients
    hammer the daemon; the daemon is restarted twice; every waiter gets the key once."""
    daemon = daemon_paths.start()
    key = f"repark:{how}"
    holder = LockClient(daemon.socket)
    held = holder.acquire(key, ttl=60, timeout=1, owner="holder")
    waiters_ = [Waiter(daemon.socket, key, f"w{i}" if i % 2 else None) for i in range(12)]
    for w in waiters_:
        w.start()
    with LockClient(daemon.socket) as probe:
        wait_for(lambda: waiters(probe, key) == 12, 20, "12 parked waiters")
    stop_load = threading.Event()
    load_errors: list[BaseException] = []

    def load(n: int) -> None:  # unrelated traffic through the restarts
        with LockClient(daemon.socket, retry_window=10) as c:
            while not stop_load.is_set():
                try:
                    h = c.try_acquire(f"load:{how}:{n}", ttl=5, owner="load")
                    if h is not None:
                        c.release(h)
                except LockdError:
                    pass  # mid-restart (the client's retry window paces it); waiters are tested
                except BaseException as exc:
                    load_errors.append(exc)
                    return

    loaders = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(3)]
    for t in loaders:
        t.start()
    try:
        for _ in range(2):
            if how == "sigterm":
                assert daemon.stop(signal.SIGTERM) == 0
            else:
                daemon.kill9()
            daemon.start()
            with LockClient(daemon.socket) as probe:
                wait_for(lambda: waiters(probe, key) == 12, 20, "the waiters to park again")
        with LockClient(daemon.socket) as probe:
            assert probe.status(key).fence == held.fence  # the lease survived both
        assert holder.release(held).released
        for w in waiters_:
            w.join(60)
        assert not [w for w in waiters_ if w.is_alive()]
        assert [w.error for w in waiters_ if w.error] == []
        assert all(w.released for w in waiters_)
        fences = sorted(w.handle.fence for w in waiters_ if w.handle)
        assert len(set(fences)) == 12 and fences[0] > held.fence
    finally:
        stop_load.set()
        for t in loaders:
            t.join(20)
        holder.close()
    assert not load_errors


def _cli(daemon: DaemonProcess, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*LOCKD, *args],
        env=daemon.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cli_waits_survive_a_restart(daemon_paths: DaemonProcess) -> None:
    """``lockd locks acquire --wait`` and ``lockd run --wait`` park again after a restart."""
    daemon = daemon_paths.start()
    with LockClient(daemon.socket) as client:
        held = client.acquire("repark:cli", ttl=60, timeout=1)
        acquire = _cli(daemon, "locks", "acquire", "repark:cli", "--ttl", "30s", "--wait", "60s")
        run = _cli(daemon, "run", "--wait", "60s", "repark:cli", "--", "sh", "-c", "echo ran")
        wait_for(lambda: waiters(client, "repark:cli") == 2, 20, "both CLI waiters")
    assert daemon.stop(signal.SIGTERM) == 0
    daemon.start()
    with LockClient(daemon.socket) as client:
        wait_for(lambda: waiters(client, "repark:cli") == 2, 20, "both CLI waiters again")
        assert client.release(held).released
        # Whichever got it first: the CLI acquire prints a handle and exits 0,
        # holding the key until released; run finishes once it gets its turn.
        out, err = acquire.communicate(timeout=60)
        assert acquire.returncode == 0, err
        assert client.release(("repark:cli", out.strip())).released
        run_out, run_err = run.communicate(timeout=60)
        assert run.returncode == 0, run_err
        assert run_out == "ran\n"


def test_auto_renew_reports_loss_before_the_lease_runs_out(daemon_paths: DaemonProcess) -> None:
    """``lock(auto_renew=True)``: with a frozen daemon, ``on_lost`` comes while
    the lease still holds, so the block can stop before another holder may get
    the key (a margin of a tenth of the TTL)."""
    daemon = daemon_paths.start()
    assert daemon.proc is not None
    lost_at: list[float] = []
    done = threading.Event()

    def on_lost(handle: Handle) -> None:
        lost_at.append(time.time())
        done.set()

    client = LockClient(daemon.socket)
    lock = client.lock("freeze", ttl=3, timeout=1, auto_renew=True, on_lost=on_lost)
    with client, pytest.raises(LockLostError), lock as h:  # the block ends after the loss
        expires = h.lease_expires_at
        assert expires is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            done.wait(10)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
    assert lost_at, "on_lost never called"
    # The margin is a tenth of the TTL (300 ms): reported before the lease's end.
    assert datetime.fromtimestamp(lost_at[0], expires.tzinfo) < expires
