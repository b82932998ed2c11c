"""Lease-loss events against a real daemon (docs/contract.md §12), on the wire.

Both backends (an etcd session's end: ``test_loss_events_etcd``).

A connection that said ``hello {"events": true}`` is told at once when a
hold it took ends other than by its own release; a break of such a hold
hands the key on only once the holder said ``stopped`` (or closed, or the
grace passed). A connection that did not ask never sees an unsolicited line.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from lockd.testing.daemon import DaemonProcess
from lockd.testing.wire import RawConn


def _events_conn(daemon: DaemonProcess) -> RawConn:
    conn = RawConn(daemon.socket)
    hello = conn.call({"id": 0, "op": "hello", "events": True})
    assert hello["ok"] and hello["result"]["events"] is True, hello
    return conn


def _take(conn: RawConn, key: str, rid: int = 1, **extra: Any) -> dict[str, Any]:
    reply = conn.call({"id": rid, "op": "tryAcquire", "key": key, "ttlMs": 60000, **extra})
    assert reply["ok"] and reply["result"] is not None, reply
    result: dict[str, Any] = reply["result"]
    return result


def _nothing_within(conn: RawConn, seconds: float) -> None:
    conn.sock.settimeout(seconds)
    try:
        data = conn.sock.recv(65536)
    except TimeoutError:
        return
    raise AssertionError(f"unexpected line: {data[:300]!r}")


@pytest.mark.both_backends
def test_hello_says_whether_events_are_on_when_asked(daemon: DaemonProcess) -> None:
    conn = RawConn(daemon.socket)
    # the docs/contract.md §3 fields
    assert "events" not in conn.call({"id": 1, "op": "hello"})["result"]
    assert conn.call({"id": 2, "op": "hello", "events": True})["result"]["events"] is True
    assert conn.call({"id": 3, "op": "hello", "events": False})["result"]["events"] is False
    bad = conn.call({"id": 4, "op": "hello", "events": "yes"})
    assert bad["error"]["code"] == "INVALID_REQUEST"
    assert bad["error"]["details"]["field"] == "events"


@pytest.mark.both_backends
def test_break_waits_for_stopped_then_hands_over(daemon: DaemonProcess) -> None:
    holder = _events_conn(daemon)
    grant = _take(holder, "k")
    waiter = RawConn(daemon.socket)
    waiter.send({"id": 7, "op": "acquire", "key": "k", "ttlMs": 60000, "timeoutMs": 20000})
    admin = RawConn(daemon.socket)
    admin.send({"id": 9, "op": "break", "key": "k", "reason": "disk replaced"})

    event = holder.reply()
    assert event == {
        "event": "lost",
        "key": "k",
        "handle": grant["handle"],
        "fence": grant["fence"],
        "cause": "break",
        "reason": "disk replaced",
        "by": event["by"],
        "at": event["at"],
    }
    assert event["by"].startswith(("user:", "service:")) and event["at"].endswith("Z")
    assert "id" not in event
    # Until the holder stops, nobody gets the key and the break is not answered.
    _nothing_within(waiter, 0.3)
    _nothing_within(admin, 0.01)
    renew = holder.call({"id": 2, "op": "renew", "key": "k", "handle": grant["handle"], "ttlMs": 1})
    assert renew["result"] == {"renewed": False, "reason": "lease_lost"}

    stopped = holder.call({"id": 3, "op": "stopped", "handle": grant["handle"]})
    assert stopped["result"] == {"stopped": True}
    broken = admin.reply()
    assert broken["id"] == 9 and broken["result"]["broken"] is True
    assert broken["result"]["fence"] == grant["fence"]
    granted = waiter.reply()
    assert granted["id"] == 7 and granted["result"]["fence"] > grant["fence"]
    # A second stopped for the same handle finds nothing waiting.
    again = holder.call({"id": 4, "op": "stopped", "handle": grant["handle"]})
    assert again["result"] == {"stopped": False}


@pytest.mark.both_backends
def test_break_ends_when_the_holder_closes(daemon: DaemonProcess) -> None:
    holder = _events_conn(daemon)
    _take(holder, "k")
    admin = RawConn(daemon.socket)
    admin.send({"id": 9, "op": "break", "key": "k", "reason": "r"})
    assert holder.reply()["cause"] == "break"
    _nothing_within(admin, 0.2)
    holder.sock.close()
    assert admin.reply()["result"]["broken"] is True
    status = admin.call({"id": 10, "op": "status", "key": "k"})
    assert status["result"]["held"] is False


@pytest.mark.both_backends
def test_break_ends_after_the_grace(daemon_paths: DaemonProcess) -> None:
    daemon_paths.write_config("break_grace = 0.5\n")
    daemon = daemon_paths.start()
    holder = _events_conn(daemon)
    _take(holder, "k")
    admin = RawConn(daemon.socket)
    started = time.monotonic()
    reply = admin.call({"id": 9, "op": "break", "key": "k", "reason": "hung job"})
    waited = time.monotonic() - started
    assert reply["result"]["broken"] is True
    assert 0.4 <= waited < 5, waited
    assert holder.reply()["reason"] == "hung job"


@pytest.mark.both_backends
def test_break_of_a_free_key_and_of_a_silent_holder_answer_at_once(
    daemon: DaemonProcess,
) -> None:
    admin = RawConn(daemon.socket)
    assert admin.call({"id": 1, "op": "break", "key": "free", "reason": "r"})["result"] == {
        "broken": False
    }
    old = RawConn(daemon.socket)  # never asked for events
    _take(old, "k")
    started = time.monotonic()
    assert admin.call({"id": 2, "op": "break", "key": "k", "reason": "r"})["result"]["broken"]
    assert time.monotonic() - started < 1.0
    _nothing_within(old, 0.3)  # an old client sees no unsolicited line


@pytest.mark.both_backends
def test_old_client_sees_no_event_for_retake_or_expiry(daemon: DaemonProcess) -> None:
    old = RawConn(daemon.socket)
    _take(old, "r", owner="job-1")
    old.call({"id": 2, "op": "tryAcquire", "key": "e", "ttlMs": 100})
    other = RawConn(daemon.socket)
    _take(other, "r", owner="job-1")
    # The expiry of "e" is noticed by the next request that touches it.
    deadline = time.monotonic() + 10
    while other.call({"id": 3, "op": "status", "key": "e"})["result"]["held"]:
        assert time.monotonic() < deadline
        other.sock.settimeout(0.05)
        with pytest.raises(TimeoutError):
            other.sock.recv(1)
    _nothing_within(old, 0.2)


@pytest.mark.both_backends
def test_retake_tells_the_first_holder(daemon: DaemonProcess) -> None:
    first = _events_conn(daemon)
    grant = _take(first, "job", owner="run-7")
    second = RawConn(daemon.socket)
    again = _take(second, "job", owner="run-7")
    event = first.reply()
    assert event["cause"] == "retake" and event["handle"] == grant["handle"]
    assert event["by"] == second.call({"id": 5, "op": "hello"})["result"]["principal"]
    assert event["reason"] is None
    assert again["fence"] > grant["fence"]


@pytest.mark.both_backends
def test_expiry_tells_the_holder(daemon: DaemonProcess) -> None:
    holder = _events_conn(daemon)
    reply = holder.call({"id": 1, "op": "tryAcquire", "key": "x", "ttlMs": 200})
    grant = reply["result"]
    event = holder.reply(timeout=10)  # pushed by the daemon's expiry timer
    assert event["cause"] == "expired" and event["handle"] == grant["handle"]
    assert event["by"] is None and event["reason"] is None


@pytest.mark.both_backends
def test_release_is_not_a_loss(daemon: DaemonProcess) -> None:
    holder = _events_conn(daemon)
    grant = _take(holder, "k")
    released = holder.call({"id": 2, "op": "release", "key": "k", "handle": grant["handle"]})
    assert released["result"] == {"released": True}
    admin = RawConn(daemon.socket)
    admin.call({"id": 3, "op": "break", "key": "k", "reason": "r"})
    _nothing_within(holder, 0.2)


@pytest.mark.both_backends
def test_release_after_a_break_counts_as_stopped(daemon: DaemonProcess) -> None:
    holder = _events_conn(daemon)
    grant = _take(holder, "k")
    admin = RawConn(daemon.socket)
    admin.send({"id": 9, "op": "break", "key": "k", "reason": "r"})
    assert holder.reply()["cause"] == "break"
    released = holder.call({"id": 2, "op": "release", "key": "k", "handle": grant["handle"]})
    assert released["result"] == {"released": False, "reason": "not_holder"}
    assert admin.reply()["result"]["broken"] is True


@pytest.mark.both_backends
def test_break_of_shared_holders_waits_only_for_the_listening_one(
    daemon: DaemonProcess,
) -> None:
    listening = _events_conn(daemon)
    _take(listening, "s", mode="shared")
    silent = RawConn(daemon.socket)
    _take(silent, "s", mode="shared")
    admin = RawConn(daemon.socket)
    admin.send({"id": 9, "op": "break", "key": "s", "reason": "r"})
    event = listening.reply()
    assert event["cause"] == "break"
    status = RawConn(daemon.socket).call({"id": 1, "op": "status", "key": "s"})
    assert status["result"]["holderCount"] == 1  # the silent holder is gone already
    listening.call({"id": 3, "op": "stopped", "handle": event["handle"]})
    assert admin.reply()["result"]["holders"] == 2
