"""``cancel`` (docs/contract.md §2, §3): withdraw one of this connection's parked acquires.

Every request gets exactly one reply: the withdrawn acquire is answered
``CANCELLED`` (499) and the cancel itself ``{"cancelled": true}``; a cancel
that comes too late (granted, timed out, unknown, another connection's)
answers ``{"cancelled": false}`` and leaves the answer that was sent alone.
"""

from __future__ import annotations

from typing import Any

import pytest
from lockd_client import LockClient

from lockd.daemon.protocol import Cancel, ProtocolError, parse_request
from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for
from lockd.testing.wire import RawConn

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """The module's one daemon (on its backend): each test queues on a key of its own."""
    return lockd


def replies_by_id(raw: RawConn, count: int) -> dict[Any, dict[str, Any]]:
    got = {}
    for _ in range(count):
        reply = raw.reply()
        got[reply["id"]] = reply
    return got


def waiters(client: LockClient, key: str) -> int:
    return client.status(key).waiters


def wait_for_waiters(client: LockClient, key: str, n: int) -> None:
    wait_for(lambda: waiters(client, key) == n, 10, f"{n} waiters on {key}", interval=0.005)


def test_parse_cancel() -> None:
    assert parse_request(b'{"id": 2, "op": "cancel", "target": 7}') == Cancel(2, "cancel", 7)
    assert parse_request(b'{"id": 2, "op": "cancel", "target": "a"}') == Cancel(2, "cancel", "a")
    for bad in (
        b'{"id": 2, "op": "cancel"}',
        b'{"id": 2, "op": "cancel", "target": true}',
        b'{"id": 2, "op": "cancel", "target": 1.5}',
        b'{"id": 2, "op": "cancel", "target": 1, "key": "k"}',
    ):
        with pytest.raises(ProtocolError) as caught:
            parse_request(bad)
        assert caught.value.code == "INVALID_REQUEST" and caught.value.request_id == 2
        assert caught.value.details["field"] in ("target", "key")


def test_cancel_withdraws_a_parked_acquire(daemon: DaemonProcess) -> None:
    with LockClient(daemon.socket) as client:
        held = client.acquire("c:k", ttl=30, timeout=1)
        raw = RawConn(daemon.socket)
        raw.send({"id": "w", "op": "acquire", "key": "c:k", "ttlMs": 30000, "timeoutMs": 60000})
        raw.send({"id": 9, "op": "acquire", "key": "c:k", "ttlMs": 30000, "timeoutMs": 60000})
        wait_for_waiters(client, "c:k", 2)
        raw.send({"id": "c", "op": "cancel", "target": "w"})
        got = replies_by_id(raw, 2)
        assert got["c"] == {"id": "c", "ok": True, "result": {"cancelled": True}}
        error = got["w"]["error"]
        assert (got["w"]["ok"], error["code"], error["status"]) == (False, "CANCELLED", 499)
        assert error["details"] == {"key": "c:k"}
        assert waiters(client, "c:k") == 1  # out of the queue at once; 9 still waits
        # Cancelling again, or an id nobody waits with: false, and no other reply.
        assert raw.call({"id": "c2", "op": "cancel", "target": "w"})["result"] == {
            "cancelled": False
        }
        assert raw.call({"id": "c3", "op": "cancel", "target": 12345})["result"] == {
            "cancelled": False
        }
        # Another connection cannot withdraw 9.
        other = RawConn(daemon.socket)
        assert other.call({"id": 1, "op": "cancel", "target": 9})["result"] == {"cancelled": False}
        other.sock.close()
        assert client.release(held).released
        granted = raw.reply()
        assert granted["id"] == 9 and granted["ok"] is True
        # Granted already: too late to cancel; the grant stands.
        assert raw.call({"id": "c4", "op": "cancel", "target": 9})["result"] == {"cancelled": False}
        assert client.status("c:k").fence == granted["result"]["fence"]
        raw.sock.close()


def test_cancel_of_the_head_hands_the_key_to_the_next(daemon: DaemonProcess) -> None:
    """Withdrawing a waiter never strands the queue behind it."""
    with LockClient(daemon.socket) as client:
        held = client.acquire("c:q", ttl=30, timeout=1)
        first, second = RawConn(daemon.socket), RawConn(daemon.socket)
        first.send({"id": 1, "op": "acquire", "key": "c:q", "ttlMs": 30000, "timeoutMs": 60000})
        wait_for_waiters(client, "c:q", 1)
        second.send({"id": 1, "op": "acquire", "key": "c:q", "ttlMs": 30000, "timeoutMs": 60000})
        wait_for_waiters(client, "c:q", 2)
        first.send({"id": 2, "op": "cancel", "target": 1})
        assert replies_by_id(first, 2)[1]["error"]["code"] == "CANCELLED"
        assert client.release(held).released
        reply = second.reply()
        assert reply["ok"] is True and reply["result"]["key"] == "c:q"
        first.sock.close()
        second.sock.close()
