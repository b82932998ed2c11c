"""The wire protocol (docs/contract.md §3) against a real daemon, on raw sockets.

The client library would hide what these tests look at: exact result
shapes and field names, id echo, out-of-order replies on one connection,
and what the daemon does with lines no client would send. One daemon serves
the whole module (each test uses its own keys); the hypothesis test throws
junk at it and checks that every line gets exactly one reply whose id is the
one the parser could read, and that the daemon and a lease taken before are
unharmed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from lockd_client import LockClient

from lockd.daemon.protocol import Acquire, Break, ProtocolError, parse_request
from lockd.testing.daemon import DaemonProcess
from lockd.testing.wire import RawConn, check_error, check_invalid, unique
from tests.conftest import Backend
from tests.depth import examples

RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
HANDLE_FIELDS = {"key", "handle", "fence", "owner", "ttlMs", "leaseExpiresAt"}
STATUS_FIELDS = {
    "key",
    "held",
    "heldBy",
    "owner",
    "fence",
    "leaseExpiresAt",
    "expiresInMs",
    "waiters",
    "pid",
    "process",
    "alive",
    "mode",
    "limit",
    "holderCount",
    "holders",
    "waiterList",  # docs/contract.md §12.2: the queue, in order (waiters stays the count)
}
HOLDER_FIELDS = {
    "heldBy",
    "owner",
    "fence",
    "leaseExpiresAt",
    "expiresInMs",
    "pid",
    "process",
    "alive",
}
MAX_LINE = 65536

pytestmark = pytest.mark.both_backends


# ------------------------------------------------------------ helpers


@pytest.fixture
def conn(lockd: DaemonProcess) -> Iterator[RawConn]:
    raw = RawConn(lockd.socket)
    try:
        yield raw
    finally:
        raw.close()


# ------------------------------------------------------- result shapes


def test_every_op_result_has_the_spec_fields(conn: RawConn, backend: Backend) -> None:
    key = unique()
    # docs/contract.md §11: with etcd, status, list entries and holders name the granting host.
    node = {"node"} if backend.differs("node_field") else set()
    status_fields, holder_fields = STATUS_FIELDS | node, HOLDER_FIELDS | node
    hello = conn.result({"id": 1, "op": "hello"})
    assert set(hello) == {"protocol", "version", "principal", "role", "uid", "pid"}
    assert hello["protocol"] == 1 and isinstance(hello["version"], str)
    assert (hello["principal"], hello["role"], hello["uid"]) == ("user:root", "owner", 0)
    assert hello["pid"] == os.getpid()

    handle = conn.result(
        {"id": 2, "op": "acquire", "key": key, "ttlMs": 60_000, "timeoutMs": 0, "owner": "run-1"}
    )
    assert set(handle) == HANDLE_FIELDS
    assert handle["key"] == key and handle["owner"] == "run-1" and handle["ttlMs"] == 60_000
    assert isinstance(handle["fence"], int) and handle["fence"] >= 1
    assert isinstance(handle["handle"], str) and len(handle["handle"]) >= 22
    assert RFC3339_MS.match(handle["leaseExpiresAt"])

    assert conn.result({"id": 3, "op": "tryAcquire", "key": key, "ttlMs": 1000}) is None

    status = conn.result({"id": 4, "op": "status", "key": key})
    assert set(status) == status_fields
    assert status["held"] is True and status["heldBy"] == "user:root"
    assert status["owner"] == "run-1" and status["fence"] == handle["fence"]
    assert RFC3339_MS.match(status["leaseExpiresAt"])
    assert 0 < status["expiresInMs"] <= 60_000 and status["waiters"] == 0
    assert status["pid"] == os.getpid()
    assert (status["mode"], status["limit"], status["holderCount"]) == ("exclusive", 1, 1)
    [holder] = status["holders"]
    assert set(holder) == holder_fields and holder == {f: status[f] for f in holder_fields}

    renew = conn.result(
        {"id": 5, "op": "renew", "key": key, "handle": handle["handle"], "ttlMs": 30_000}
    )
    assert set(renew) == {"renewed", "leaseExpiresAt"} and renew["renewed"] is True
    assert RFC3339_MS.match(renew["leaseExpiresAt"])
    lost = conn.result({"id": 6, "op": "renew", "key": key, "handle": "x" * 22, "ttlMs": 10})
    assert lost == {"renewed": False, "reason": "lease_lost"}

    listed = conn.result({"id": 7, "op": "list", "prefix": key})
    assert set(listed) == {"locks", "next"} and len(listed["locks"]) == 1
    assert listed["next"] is None
    moving = {"expiresInMs", "leaseExpiresAt", "holders"}  # renewed since the status above
    entry = listed["locks"][0]
    assert set(entry) == status_fields
    assert {k: v for k, v in entry.items() if k not in moving} == {
        k: v for k, v in status.items() if k not in moving
    }

    not_holder = conn.result({"id": 8, "op": "release", "key": key, "handle": "y" * 22})
    assert not_holder == {"released": False, "reason": "not_holder"}
    released = conn.result({"id": 9, "op": "release", "key": key, "handle": handle["handle"]})
    assert released == {"released": True}

    free = conn.result({"id": 10, "op": "status", "key": key})
    assert free == {
        "key": key,
        "held": False,
        "heldBy": None,
        "owner": None,
        "fence": None,
        "leaseExpiresAt": None,
        "expiresInMs": None,
        "waiters": 0,
        "pid": None,
        "process": None,
        "alive": None,
        "mode": None,
        "limit": None,
        "holderCount": 0,
        "holders": [],
        "waiterList": [],
        **dict.fromkeys(node),
    }
    assert conn.result({"id": 11, "op": "break", "key": key, "reason": "test"}) == {"broken": False}
    again = conn.result({"id": 12, "op": "tryAcquire", "key": key, "ttlMs": 60_000})
    assert set(again) == HANDLE_FIELDS and again["owner"] is None
    assert again["fence"] > handle["fence"]
    broken = conn.result({"id": 13, "op": "break", "key": key, "reason": "test"})
    assert broken == {
        "broken": True,
        "holders": 1,
        "heldBy": "user:root",
        "owner": None,
        "fence": again["fence"],
    }

    stats = conn.result({"id": 14, "op": "stats"})
    assert {"counters", "latency"} <= set(stats)
    assert stats["counters"]["grants"] >= 2 and stats["counters"]["breaks"] >= 1
    rules = conn.result({"id": 15, "op": "rules"})
    assert rules == {"policy": None, "lastError": None}


def test_lock_timeout_error_shape(conn: RawConn) -> None:
    key = unique()
    conn.result({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60_000})
    for timeout in (0, 50):
        request = {"id": "t", "op": "acquire", "key": key, "ttlMs": 10, "timeoutMs": timeout}
        reply = conn.error(request)
        assert reply["id"] == "t"
        error = check_error(reply, "LOCK_TIMEOUT", 408)
        assert error["details"] == {"key": key, "timeoutMs": timeout}


def test_pipelined_status_overtakes_a_parked_acquire(conn: RawConn, lockd: DaemonProcess) -> None:
    """A parked acquire does not block later requests on the same connection."""
    key = unique()
    with LockClient(str(lockd.socket)) as client:
        held = client.acquire(key, ttl=60, timeout=1)
        conn.sock.sendall(
            json.dumps(
                {"id": "parked", "op": "acquire", "key": key, "ttlMs": 5000, "timeoutMs": 20_000}
            ).encode()
            + b"\n"
            + json.dumps({"id": "st", "op": "status", "key": key}).encode()
            + b"\n"
            + json.dumps({"id": "hi", "op": "hello"}).encode()
            + b"\n"
        )
        # Both answered while the acquire waits, matched by id (the etcd backend
        # answers hello before a status that needs a round trip to etcd).
        replies = {reply["id"]: reply for reply in (conn.reply(), conn.reply())}
        assert set(replies) == {"st", "hi"}
        status = replies["st"]["result"]
        assert status["held"] is True and status["waiters"] == 1
        assert client.release(held).released
    granted = conn.reply()
    assert granted["id"] == "parked" and granted["ok"] is True
    assert granted["result"]["fence"] > held.fence


@pytest.mark.parametrize("rid", [0, 7, -3, 2**63 + 11, "", "abc", "\u20ac-\u2603", "9"])
def test_id_is_echoed_exactly(conn: RawConn, rid: int | str) -> None:
    reply = conn.call({"id": rid, "op": "hello"})
    assert reply["ok"] is True and reply["id"] == rid and type(reply["id"]) is type(rid)
    bad = conn.call({"id": rid, "op": "status"})
    assert bad["id"] == rid
    check_invalid(bad, "key")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"op": "hello"}',
        b'{"id": null, "op": "hello"}',
        b'{"id": true, "op": "hello"}',
        b'{"id": 1.5, "op": "hello"}',
        b'{"id": [1], "op": "hello"}',
        b'{"id": {}, "op": "hello"}',
        b'{"id": "\\ud800", "op": "hello"}',
        b"[]",
        b"{",
        b"hello",
        b'{"id": 1, "op": "hello"} {"id": 2}',
        b'{"id": NaN, "op": "hello"}',
        b'\xff\xfe{"id": 1}',
        b'{"id": 1, "op": "hello", "x": "\xc3\x28"}',
    ],
)
def test_unreadable_id_gives_null_id_and_the_connection_lives(conn: RawConn, raw: bytes) -> None:
    reply = conn.error(raw)
    assert reply["id"] is None
    check_error(reply, "INVALID_REQUEST", 400)
    assert conn.result({"id": 99, "op": "hello"})["protocol"] == 1


def test_blank_lines_are_no_requests(conn: RawConn) -> None:
    """A blank line costs its read and nothing more: no reply (issue 21, item 7)."""
    for blank in (b"", b"   ", b"\r", b"\t \r"):
        conn.send(blank)
    # The first reply is the hello's: a blank line would have had one before it.
    assert conn.result({"id": 99, "op": "hello"})["protocol"] == 1


def test_unknown_op_and_unknown_field_are_named(conn: RawConn) -> None:
    key = unique()
    reply = conn.error({"id": 1, "op": "lock", "key": key})
    assert reply["id"] == 1
    check_invalid(reply, "op")
    reply = conn.error({"id": 2, "op": "acquire", "key": key, "ttl": 1000, "timeoutMs": 0})
    check_invalid(reply, "ttl")
    reply = conn.error({"id": 3, "op": "tryAcquire", "key": key, "ttlMs": 1000, "timeoutMs": 5})
    check_invalid(reply, "timeoutMs")
    # Nothing was taken by the refused requests.
    assert conn.result({"id": 4, "op": "status", "key": key})["held"] is False


def test_null_optional_fields_are_absent(conn: RawConn) -> None:
    key = unique()
    handle = conn.result(
        {
            "id": 1,
            "op": "acquire",
            "key": key,
            "ttlMs": 60_000,
            "timeoutMs": 0,
            "owner": None,
            "releaseOnClose": None,
        }
    )
    assert handle["owner"] is None
    listed = conn.result({"id": 2, "op": "list", "prefix": key, "limit": None})
    assert [lock["key"] for lock in listed["locks"]] == [key]


EURO_1023 = "\u20ac" * 341

INVALID_CASES: list[tuple[dict[str, Any], str]] = [
    ({"op": "acquire", "key": "k", "ttlMs": 0, "timeoutMs": 0}, "ttlMs"),
    ({"op": "acquire", "key": "k", "ttlMs": 86_400_001, "timeoutMs": 0}, "ttlMs"),
    ({"op": "acquire", "key": "k", "ttlMs": 100.0, "timeoutMs": 0}, "ttlMs"),
    ({"op": "acquire", "key": "k", "ttlMs": 1.5, "timeoutMs": 0}, "ttlMs"),
    ({"op": "acquire", "key": "k", "ttlMs": True, "timeoutMs": 0}, "ttlMs"),
    ({"op": "acquire", "key": "k", "ttlMs": "1000", "timeoutMs": 0}, "ttlMs"),
    ({"op": "tryAcquire", "key": "k", "ttlMs": 0}, "ttlMs"),
    ({"op": "renew", "key": "k", "handle": "h" * 22, "ttlMs": 86_400_001}, "ttlMs"),
    ({"op": "acquire", "key": "k", "ttlMs": 10}, "timeoutMs"),
    ({"op": "acquire", "key": "k", "ttlMs": 10, "timeoutMs": -1}, "timeoutMs"),
    ({"op": "acquire", "key": "k", "ttlMs": 10, "timeoutMs": 86_400_001}, "timeoutMs"),
    ({"op": "acquire", "key": "k", "ttlMs": 10, "timeoutMs": 0.5}, "timeoutMs"),
    ({"op": "acquire", "key": "", "ttlMs": 10, "timeoutMs": 0}, "key"),
    ({"op": "acquire", "key": EURO_1023 + "\u00e9", "ttlMs": 10, "timeoutMs": 0}, "key"),
    ({"op": "tryAcquire", "key": "a\u0000b", "ttlMs": 10}, "key"),
    ({"op": "tryAcquire", "key": "a\u001fb", "ttlMs": 10}, "key"),
    ({"op": "tryAcquire", "key": "a\u007fb", "ttlMs": 10}, "key"),
    ({"op": "tryAcquire", "key": "a\u0085b", "ttlMs": 10}, "key"),
    ({"op": "status", "key": 12}, "key"),
    ({"op": "tryAcquire", "key": "k", "ttlMs": 10, "owner": "o" * 257}, "owner"),
    ({"op": "tryAcquire", "key": "k", "ttlMs": 10, "owner": ""}, "owner"),
    ({"op": "tryAcquire", "key": "k", "ttlMs": 10, "owner": "a\nb"}, "owner"),
    ({"op": "tryAcquire", "key": "k", "ttlMs": 10, "releaseOnClose": "yes"}, "releaseOnClose"),
    ({"op": "break", "key": "k", "reason": ""}, "reason"),
    ({"op": "break", "key": "k", "reason": "r" * 1025}, "reason"),
    ({"op": "break", "key": "k"}, "reason"),
    ({"op": "release", "key": "k"}, "handle"),
    ({"op": "list", "limit": 0}, "limit"),
]


@pytest.mark.parametrize(("request_", "field"), INVALID_CASES)
def test_invalid_fields_are_named(conn: RawConn, request_: dict[str, Any], field: str) -> None:
    reply = conn.error({"id": "bad", **request_})
    assert reply["id"] == "bad"
    check_invalid(reply, field)


def test_keys_and_owner_at_their_limits_are_accepted(conn: RawConn) -> None:
    for i, key in enumerate([EURO_1023 + "a", "a" * 1024, "x\u00a0y"]):
        assert len(key.encode()) <= 1024
        handle = conn.result(
            {"id": i, "op": "tryAcquire", "key": key, "ttlMs": 1000, "owner": "o" * 256}
        )
        assert handle["key"] == key and handle["owner"] == "o" * 256
        assert conn.result({"id": i, "op": "release", "key": key, "handle": handle["handle"]})[
            "released"
        ]


def test_a_line_of_exactly_the_limit_is_served(conn: RawConn) -> None:
    body = b'{"id": "edge", "op": "hello"}'
    reply = conn.call(body + b" " * (MAX_LINE - len(body)))
    assert reply["id"] == "edge" and reply["ok"] is True


def test_over_long_line_closes_only_that_connection(lockd: DaemonProcess) -> None:
    key = unique()
    with LockClient(str(lockd.socket)) as client:
        held = client.acquire(key, ttl=60, timeout=1)
        bystander = RawConn(lockd.socket)
        victim = RawConn(lockd.socket)
        try:
            body = b'{"id": "long", "op": "hello", "pad": "'
            long_line = body + b"x" * (MAX_LINE + 1 - len(body))
            assert len(long_line) == MAX_LINE + 1
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                victim.sock.sendall(b'{"id": "before", "op": "hello"}\n' + long_line + b"\n")
            before = victim.reply()
            assert before["id"] == "before" and before["ok"] is True
            reply = victim.reply()
            assert reply["id"] is None
            check_error(reply, "INVALID_REQUEST", 400)
            assert reply["error"]["details"]["limit"] == MAX_LINE
            assert victim.closed()
            # Others are untouched: the bystander's connection and the lease.
            assert bystander.result({"id": 1, "op": "status", "key": key})["fence"] == held.fence
            status = client.status(key)
            assert status.held and status.fence == held.fence
            assert client.release(held).released
        finally:
            bystander.close()
            victim.close()


def test_line_without_newline_is_bounded_too(lockd: DaemonProcess) -> None:
    """A peer that never sends a newline cannot make the daemon buffer forever."""
    victim = RawConn(lockd.socket)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            victim.sock.sendall(b"x" * (MAX_LINE + 10))
        reply = victim.reply()
        assert reply["error"]["details"]["limit"] == MAX_LINE
        assert victim.closed()
    finally:
        victim.close()


def test_malformed_lines_keep_the_connection_usable(conn: RawConn) -> None:
    for junk in (b"{", b"\x00\x01\x02", b"\xc3\x28", b"}}}", b'{"id": 1, "op": "hello",}'):
        reply = conn.error(junk)
        check_error(reply, "INVALID_REQUEST", 400)
    assert conn.result({"id": 1, "op": "hello"})["protocol"] == 1


# ----------------------------------------------------- hypothesis: junk

FIELDS = ["id", "op", "key", "ttlMs", "timeoutMs", "owner", "releaseOnClose", "handle"]
FIELDS += ["prefix", "limit", "reason", "ttl"]
OPS = ["hello", "acquire", "tryAcquire", "renew", "release", "status", "list", "break"]
OPS += ["stats", "rules", "Acquire"]

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**66), max_value=2**66)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
field_values = (
    values
    | st.sampled_from(OPS)
    | st.integers(min_value=-1, max_value=86_400_001)
    | st.text(min_size=1, max_size=6)
)
objects = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), field_values, max_size=6)
request_like = st.fixed_dictionaries(
    {"id": st.integers(0, 1000) | st.text(max_size=5), "op": st.sampled_from(OPS)},
    optional={name: field_values for name in FIELDS[2:]},
)


def encode_junk(item: object) -> bytes:
    if isinstance(item, bytes):
        return item.replace(b"\n", b" ")
    return json.dumps(item).encode()


def tame(line: bytes, guard_key: str) -> bytes:
    """Keep junk from parking (it would hold back its reply) or touching the guard."""
    try:
        request = parse_request(line)
    except ProtocolError:
        return line
    obj = json.loads(line)
    if isinstance(request, Acquire) and request.op == "acquire":
        obj["timeoutMs"] = 0
    if isinstance(request, Break | Acquire) and request.key == guard_key:
        obj["key"] = "not-the-guard"
    return json.dumps(obj).encode()


def expected_reply_id(line: bytes) -> int | str | None:
    try:
        return parse_request(line).id
    except ProtocolError as exc:
        return exc.request_id


@pytest.fixture(scope="module")
def guard(lockd: DaemonProcess) -> Iterator[tuple[LockClient, Any]]:
    """A lease taken before the junk arrives; it must come through unharmed."""
    with LockClient(str(lockd.socket)) as client:
        handle = client.acquire("guard:\u2603:" + uuid.uuid4().hex, ttl=3600, timeout=1)
        yield client, handle
        assert client.renew(handle, ttl=60).renewed
        assert client.release(handle).released


@pytest.mark.sqlite_only(
    "junk lines test the parser and server, which are the same for both backends"
)
@settings(
    max_examples=examples(100),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    junk=st.lists(
        st.binary(max_size=120) | values | objects | request_like, min_size=1, max_size=10
    ),
    end_with_long_line=st.integers(0, 9),
)
def test_junk_lines_each_get_one_reply(
    lockd: DaemonProcess,
    guard: tuple[LockClient, Any],
    junk: list[object],
    end_with_long_line: int,
) -> None:
    client, handle = guard
    lines = [tame(encode_junk(item), handle.key) for item in junk]
    raw = RawConn(lockd.socket)
    try:
        payload = b"".join(line + b"\n" for line in lines)
        long_line = end_with_long_line == 0
        if long_line:
            payload += b"[" + b"1," * (MAX_LINE // 2) + b"1]\n"
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            raw.sock.sendall(payload)
        for line in lines:
            if not line or line.isspace():
                continue  # a blank line is no request: it gets no reply
            reply = raw.reply()
            assert reply["id"] == expected_reply_id(line), (line, reply)
            assert isinstance(reply["ok"], bool)
            event("ok" if reply["ok"] else reply["error"]["code"])
            if reply["ok"] is False:
                assert reply["error"]["code"] != "INTERNAL", reply
                try:
                    parse_request(line)
                except ProtocolError as exc:
                    assert reply["error"]["code"] == exc.code
                    assert reply["error"]["details"].get("field") == exc.details.get("field")
        if long_line:
            reply = raw.reply()
            assert reply["error"]["details"]["limit"] == MAX_LINE
            assert raw.closed()
        else:
            assert raw.result({"id": "after", "op": "hello"})["protocol"] == 1
    finally:
        raw.close()
    status = client.status(handle.key)
    assert status.held and status.fence == handle.fence and status.owner is None


@pytest.mark.sqlite_only(
    "junk lines test the parser and server, which are the same for both backends"
)
def test_after_the_junk_the_daemon_never_had_an_internal_error(lockd: DaemonProcess) -> None:
    with LockClient(str(lockd.socket)) as client:
        assert client.stats()["counters"]["internalErrors"] == 0
    assert "Traceback" not in lockd.read_log()


@pytest.mark.sqlite_only(
    "junk lines test the parser and server, which are the same for both backends"
)
def test_daemon_answers_quickly_after_all_of_it(lockd: DaemonProcess) -> None:
    started = time.monotonic()
    with LockClient(str(lockd.socket)) as client:
        for _ in range(50):
            client.hello()
    assert time.monotonic() - started < 10
