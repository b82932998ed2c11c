"""Unit tests of lockd_client against a scripted fake JSON-lines server.

Each test starts a tiny server in a thread on a temporary Unix socket and
scripts, per connection, what it reads and answers. No daemon is involved.
"""

from __future__ import annotations

import _socket
import contextlib
import errno
import fcntl
import json
import os
import random
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import ROUND_CEILING, Decimal
from typing import Any

import lockd_client
import lockd_client._connection
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lockd_client import (
    AutoRenewer,
    BreakResult,
    DaemonUnavailableError,
    Handle,
    InternalError,
    InvalidRequestError,
    LockAccessDeniedError,
    LockClient,
    LockdError,
    LockLostError,
    LockStatus,
    LockTimeoutError,
    RateLimitedError,
    ShuttingDownError,
    SocketPermissionError,
    _paths,
    default_socket_path,
)

from lockd.testing.polling import wait_for

EXPIRES = "2099-11-30T03:31:00.123Z"  # far ahead: a lease that ended would be renewed at once
EXPIRES_DT = datetime(2099, 11, 30, 3, 31, 0, 123000, tzinfo=UTC)
HANDLE_ID = "h" * 22

# -- the fake server -----------------------------------------------------------


class Peer:
    """One accepted connection, as seen by the fake server."""

    def __init__(self, sock: socket.socket, server: FakeServer) -> None:
        self.sock = sock
        self.server = server
        self.buf = b""

    def recv(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """Next request (recorded in server.requests), or None at EOF."""
        while b"\n" not in self.buf:
            try:
                self.sock.settimeout(timeout)
                data = self.sock.recv(65536)
            except OSError:
                return None
            if not data:
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        message = json.loads(line)
        self.server.record(message)
        return message

    def send(self, obj: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def reply(self, request: dict[str, Any], body: dict[str, Any]) -> None:
        self.send({"id": request["id"], **body})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


Script = Callable[[Peer, int], None]


class FakeServer:
    """Accepts connections on ``path``; runs ``script(peer, index)`` for each."""

    def __init__(self, path: str, script: Script) -> None:
        self.path = path
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.errors: list[BaseException] = []
        self.stopped = False
        self._lock = threading.Lock()
        self._peers: list[Peer] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def record(self, message: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(message)

    def ops(self) -> list[str]:
        with self._lock:
            return [r["op"] for r in self.requests]

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
                peer = Peer(sock, self)
                self._peers.append(peer)
            threading.Thread(target=self._run, args=(peer, index), daemon=True).start()

    def _run(self, peer: Peer, index: int) -> None:
        try:
            self.script(peer, index)
        except BaseException as exc:  # reported at teardown
            if not self.stopped:
                self.errors.append(exc)

    def stop(self) -> None:
        self.stopped = True
        for s in [self.listener, *(p.sock for p in self._peers)]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def ok(result: Any) -> dict[str, Any]:
    return {"ok": True, "result": result}


def err(code: str, status: int, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "ok": False,
        "error": {"code": code, "status": status, "message": f"{code} msg", "details": details},
    }


def grant(request: dict[str, Any], fence: int = 7) -> dict[str, Any]:
    return {
        "key": request["key"],
        "handle": HANDLE_ID,
        "fence": fence,
        "owner": request.get("owner"),
        "ttlMs": request["ttlMs"],
        "leaseExpiresAt": EXPIRES,
    }


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """A plausible successful reply to any request."""
    op = request["op"]
    if op in ("acquire", "tryAcquire"):
        return ok(grant(request))
    if op == "renew":
        return ok({"renewed": True, "leaseExpiresAt": EXPIRES})
    if op == "release":
        return ok({"released": True})
    if op == "status":
        return ok(free_status(request["key"]))
    if op == "list":
        return ok({"locks": []})
    if op == "break":
        return ok({"broken": False})
    return ok({"op": op})


def free_status(key: str) -> dict[str, Any]:
    return {
        "key": key,
        "held": False,
        "heldBy": None,
        "owner": None,
        "fence": None,
        "leaseExpiresAt": None,
        "expiresInMs": None,
        "waiters": 0,
    }


def responder(handler: Callable[[dict[str, Any]], dict[str, Any] | None]) -> Script:
    """A script answering each request with handler(request); None closes the connection."""

    def script(peer: Peer, index: int) -> None:
        while (request := peer.recv()) is not None:
            body = handler(request)
            if body is None:
                peer.close()
                return
            peer.reply(request, body)

    return script


@pytest.fixture
def sock_path() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="lkc", dir="/tmp")  # AF_UNIX paths are short
    try:
        yield os.path.join(directory, "s.sock")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def serve(sock_path: str) -> Iterator[Callable[[Script], FakeServer]]:
    servers: list[FakeServer] = []

    def start(script: Script) -> FakeServer:
        server = FakeServer(sock_path, script)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
        assert not server.errors, server.errors


def unread_by_peer(sock: socket.socket) -> int:
    """What the peer of this Unix socket has yet to read of what we sent (0: all of it)."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0])


class SkippedMonotonic:
    """``time`` for the client's own modules, whose ``monotonic()`` the test moves ahead."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def skip(self, seconds: float) -> None:
        self.skipped += seconds

    def monotonic(self) -> float:
        return time.monotonic() + self.skipped

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def client_clock(monkeypatch: pytest.MonkeyPatch) -> SkippedMonotonic:
    """The clock the client computes its deadlines with (what is left of a timeout)."""
    clock = SkippedMonotonic()
    for module in ("lockd_client._client", "lockd_client._requests"):
        monkeypatch.setattr(f"{module}.time", clock)
    return clock


@pytest.fixture
def renewers(monkeypatch: pytest.MonkeyPatch) -> list[AutoRenewer]:
    """Every AutoRenewer ``client.lock()`` makes (its thread is a ``_thread`` one:
    ``threading.enumerate()`` does not list it; ``alive`` says whether it runs)."""
    made: list[AutoRenewer] = []

    class Recorded(AutoRenewer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("lockd_client._lock.AutoRenewer", Recorded)
    return made


def renewing(made: list[AutoRenewer]) -> bool:
    return any(renewer.alive for renewer in made)


def make_client(path: str, **kwargs: Any) -> LockClient:
    kwargs.setdefault("request_timeout", 5.0)
    kwargs.setdefault("retry_window", 1.0)
    return LockClient(path, **kwargs)


# -- encoding and decoding -------------------------------------------------------


def test_request_encoding_and_ms_rounding(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(responder(answer))
    with make_client(server.path) as client:
        h1 = client.try_acquire("k", ttl=0.0001)
        client.acquire("k2", ttl=0.007, timeout=2.5, owner="run-1", release_on_close=True)
        client.acquire("k3", ttl=60, timeout=0)
        client.renew(h1, ttl=1.5)
        client.renew(("k", HANDLE_ID), ttl=1)
        client.release(("k", HANDLE_ID))
        client.list(prefix="user:", limit=5)
        client.list()
        client.stats()
        client.break_lock("k", "stuck job")
    reqs = server.requests
    assert [r["op"] for r in reqs] == [
        "tryAcquire",
        "acquire",
        "acquire",
        "renew",
        "renew",
        "release",
        "list",
        "list",
        "stats",
        "break",
    ]
    ids = [r["id"] for r in reqs]
    assert all(type(i) is int for i in ids) and ids == sorted(set(ids))
    assert {k: v for k, v in reqs[0].items() if k != "id"} == {
        "op": "tryAcquire",
        "key": "k",
        "ttlMs": 1,
    }
    assert {k: v for k, v in reqs[1].items() if k != "id"} == {
        "op": "acquire",
        "key": "k2",
        "ttlMs": 7,
        "timeoutMs": 2500,
        "owner": "run-1",
        "releaseOnClose": True,
    }
    assert reqs[2]["ttlMs"] == 60000 and reqs[2]["timeoutMs"] == 0
    assert "owner" not in reqs[2] and "releaseOnClose" not in reqs[2]
    assert reqs[3] == {
        "id": reqs[3]["id"],
        "op": "renew",
        "key": "k",
        "handle": HANDLE_ID,
        "ttlMs": 1500,
    }
    assert reqs[4]["ttlMs"] == 1000 and reqs[4]["handle"] == HANDLE_ID
    assert reqs[5] == {"id": reqs[5]["id"], "op": "release", "key": "k", "handle": HANDLE_ID}
    assert reqs[6]["prefix"] == "user:" and reqs[6]["limit"] == 5
    assert set(reqs[7]) == {"id", "op"} and set(reqs[8]) == {"id", "op"}
    assert reqs[9]["reason"] == "stuck job"


def test_result_decoding(serve: Callable[[Script], FakeServer]) -> None:
    held = {
        "key": "k",
        "held": True,
        "heldBy": "user:alice",
        "owner": "run-1",
        "fence": 12,
        "leaseExpiresAt": EXPIRES,
        "expiresInMs": 4000,
        "waiters": 2,
    }
    replies = {
        "hello": ok({"protocol": 1, "version": "0.1.0", "principal": "user:root", "role": "owner"}),
        "tryAcquire": ok(None),
        "status": ok(held),
        "list": ok({"locks": [held, free_status("z")]}),
        "break": ok({"broken": True, "heldBy": "user:alice", "owner": "run-1", "fence": 12}),
        "renew": ok({"renewed": False, "reason": "lease_lost"}),
        "release": ok({"released": False, "reason": "not_holder"}),
        "rules": ok({"policy": None, "lastError": None}),
    }

    def handler(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "acquire":
            return ok(grant(request, fence=99))
        return replies[request["op"]]

    server = serve(responder(handler))
    with make_client(server.path) as client:
        assert client.hello()["principal"] == "user:root"
        assert client.try_acquire("k", ttl=1) is None
        handle = client.acquire("k", ttl=30, timeout=1, owner="o")
        assert isinstance(handle, Handle)
        assert (handle.key, handle.handle, handle.fence, handle.owner) == ("k", HANDLE_ID, 99, "o")
        assert handle.ttl_ms == 30000 and handle.lease_expires_at == EXPIRES_DT
        assert handle.lease_expires_at.tzinfo is not None
        assert handle.raw["leaseExpiresAt"] == EXPIRES and handle.lost is False
        assert HANDLE_ID not in repr(handle)

        status = client.status("k")
        assert isinstance(status, LockStatus)
        assert status.held and status.held_by == "user:alice" and status.owner == "run-1"
        assert status.fence == 12 and status.expires_in_ms == 4000 and status.waiters == 2
        assert status.lease_expires_at == EXPIRES_DT and status.raw == held

        locks = client.list()
        assert [s.key for s in locks] == ["k", "z"] and locks[1].held is False
        assert locks[1].lease_expires_at is None and locks[1].fence is None

        broken = client.break_lock("k", "why")
        assert isinstance(broken, BreakResult)
        assert broken.broken and broken.held_by == "user:alice" and broken.fence == 12

        renewed = client.renew(handle, ttl=5)
        assert not renewed.renewed and renewed.reason == "lease_lost"
        assert handle.ttl_ms == 30000  # not updated when not renewed
        released = client.release(handle)
        assert not released.released and released.reason == "not_holder"
        assert client.rules() == {"policy": None, "lastError": None}


def test_successful_renew_updates_handle(serve: Callable[[Script], FakeServer]) -> None:
    later = "2026-12-01T00:00:00.000Z"

    def handler(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "renew":
            return ok({"renewed": True, "leaseExpiresAt": later})
        return answer(request)

    server = serve(responder(handler))
    with make_client(server.path) as client:
        handle = client.acquire("k", ttl=10, timeout=1)
        result = client.renew(handle, ttl=20)
        assert result.renewed and result.reason is None
        assert result.lease_expires_at == datetime(2026, 12, 1, tzinfo=UTC)
        assert handle.lease_expires_at == result.lease_expires_at and handle.ttl_ms == 20000


def test_encoder_matches_json_dumps() -> None:
    from lockd_client import _wire

    samples: list[dict[str, Any]] = [
        {"id": 1, "op": "tryAcquire", "key": "k", "ttlMs": 30000},
        {
            "id": 2**40,
            "op": "acquire",
            "key": 'é\u2028"\\\t/<>',
            "owner": "o",
            "releaseOnClose": True,
        },
        {"id": 3, "op": "break", "key": "\U0001f512", "reason": "line\nbreak", "x": None},
    ]
    for message in samples:
        expected = json.dumps(message, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        assert _wire.encode(message) == expected.encode() + b"\n"
        assert json.loads(_wire.encode(message)) == message
    with pytest.raises((TypeError, ValueError)):
        _wire.encode({"id": 1, "op": "x", "bad": object()})
    with pytest.raises(ValueError):
        _wire.encode({"id": 1, "op": "x", "bad": float("nan")})


def test_reply_decoding_matches_json_loads() -> None:
    from lockd_client import _wire

    for text in ['{"id":1,"ok":true}', ' {"id": 1} ', "[1,2]", '"s"', "null"]:
        assert _wire.decode(text) == json.loads(text)
    for bad in ['{"id":1}{"id":2}', "", "{", '{"id":1} x']:
        with pytest.raises(ValueError):
            _wire.decode(bad)


def test_whole_seconds_short_cut_agrees_with_the_general_rule() -> None:
    from lockd_client._wire import seconds_to_ms

    assert seconds_to_ms(1, "ttl", allow_zero=False) == 1000
    assert seconds_to_ms(86_400, "ttl", allow_zero=False) == 86_400_000
    assert seconds_to_ms(0, "timeout", allow_zero=True) == 0
    assert seconds_to_ms(2.0, "ttl", allow_zero=False) == 2000
    for value, exc in [(0, ValueError), (-1, ValueError), (86_401, ValueError), (True, TypeError)]:
        with pytest.raises(exc):
            seconds_to_ms(value, "ttl", allow_zero=False)


def _ms_by_the_decimal_rule(seconds: float) -> int:
    return int((Decimal(str(seconds)) * 1000).to_integral_value(rounding=ROUND_CEILING))


@given(
    st.one_of(
        st.floats(min_value=0, max_value=86_400, exclude_min=True),
        st.integers(min_value=1, max_value=86_400_000).map(lambda ms: ms / 1000),
        st.integers(min_value=1, max_value=86_400_000).map(lambda ms: ms / 1000 + 1e-9),
    )
)
def test_float_seconds_short_cut_agrees_with_the_decimal_rule(seconds: float) -> None:
    from lockd_client._wire import seconds_to_ms

    expected = _ms_by_the_decimal_rule(seconds)
    if expected > 86_400_000:
        with pytest.raises(ValueError):
            seconds_to_ms(seconds, "ttl", allow_zero=False)
    else:
        assert seconds_to_ms(seconds, "ttl", allow_zero=False) == expected


def test_replies_split_across_reads_and_joined_in_one(
    serve: Callable[[Script], FakeServer],
) -> None:
    both_in = threading.Event()

    def script(peer: Peer, index: int) -> None:
        first = peer.recv()
        assert first is not None
        line = json.dumps({"id": first["id"], **answer(first)}).encode() + b"\n"
        for part in (line[:5], line[5:40], line[40:]):  # one reply in three pieces
            peer.sock.sendall(part)
            # The client has read this piece before the next is sent: a read of its own.
            wait_for(lambda: unread_by_peer(peer.sock) == 0, 5, "the piece read", interval=0.001)
        a, b = peer.recv(), peer.recv()
        assert a is not None and b is not None
        both_in.set()
        lines = [json.dumps({"id": r["id"], **answer(r)}).encode() + b"\n" for r in (b, a)]
        peer.sock.sendall(b"".join(lines))  # two replies in one write
        responder(answer)(peer, index)

    server = serve(script)
    with make_client(server.path) as client:
        assert client.status("split").key == "split"
        out: dict[str, Any] = {}
        threads = [
            threading.Thread(target=lambda k=k: out.__setitem__(k, client.status(k)))
            for k in ("x", "y")
        ]
        for t in threads:
            t.start()
        assert both_in.wait(2)
        for t in threads:
            t.join(2)
        assert out["x"].key == "x" and out["y"].key == "y"
        assert client.hello()["op"] == "hello"  # the stream is still in step


# -- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status", "cls"),
    [
        ("INVALID_REQUEST", 400, InvalidRequestError),
        ("LOCK_ACCESS_DENIED", 403, LockAccessDeniedError),
        ("LOCK_TIMEOUT", 408, LockTimeoutError),
        ("RATE_LIMITED", 429, RateLimitedError),
        ("SHUTTING_DOWN", 503, ShuttingDownError),
        ("INTERNAL", 500, InternalError),
        ("SOMETHING_NEW", 418, LockdError),
    ],
)
def test_error_mapping(
    serve: Callable[[Script], FakeServer], code: str, status: int, cls: type[LockdError]
) -> None:
    table: dict[str, dict[str, Any]] = {
        "INVALID_REQUEST": {"field": "ttlMs"},
        "LOCK_TIMEOUT": {"key": "k", "timeoutMs": 1500},
        "RATE_LIMITED": {"retryAfterMs": 2500, "limit": 600},
    }
    details = table.get(code, {})
    server = serve(responder(lambda request: err(code, status, details)))
    with make_client(server.path) as client, pytest.raises(LockdError) as info:
        client.acquire("k", ttl=1, timeout=1.5)
    exc = info.value
    assert type(exc) is cls
    assert exc.code == code and exc.status == status and exc.details == details
    assert str(exc) == f"{code} msg"
    if isinstance(exc, InvalidRequestError):
        assert exc.field == "ttlMs"
    if isinstance(exc, LockTimeoutError):
        assert exc.key == "k" and exc.timeout_ms == 1500
    if isinstance(exc, RateLimitedError):
        assert exc.retry_after == 2.5 and exc.limit == 600
    if code == "SHUTTING_DOWN":  # a blocking acquire parks again until its timeout
        assert len(server.requests) > 1
    else:
        assert server.connections == 1 and len(server.requests) == 1  # errors are not retried


def test_malformed_line_is_a_protocol_error(serve: Callable[[Script], FakeServer]) -> None:
    def script(peer: Peer, index: int) -> None:
        if peer.recv() is not None:
            peer.sock.sendall(b"this is not json\n")
            peer.recv()

    server = serve(script)
    with make_client(server.path) as client, pytest.raises(LockdError) as info:
        client.status("k")
    assert info.value.code == "PROTOCOL_ERROR"


def test_invalid_arguments_fail_before_sending(sock_path: str) -> None:
    client = LockClient(sock_path)  # nothing listens: a send would give DaemonUnavailableError
    bad_calls: list[tuple[type[Exception], Callable[[], object]]] = [
        (TypeError, lambda: client.try_acquire("k", ttl="10")),  # type: ignore[arg-type]
        (TypeError, lambda: client.try_acquire("k", ttl=True)),
        (TypeError, lambda: client.try_acquire(b"k", ttl=1)),  # type: ignore[arg-type]
        (ValueError, lambda: client.try_acquire("k", ttl=0)),
        (ValueError, lambda: client.try_acquire("k", ttl=-1)),
        (ValueError, lambda: client.try_acquire("k", ttl=float("nan"))),
        (ValueError, lambda: client.try_acquire("k", ttl=86_400.001)),
        (ValueError, lambda: client.try_acquire("", ttl=1)),
        (ValueError, lambda: client.try_acquire("a\nb", ttl=1)),
        (ValueError, lambda: client.try_acquire("x" * 1025, ttl=1)),
        (ValueError, lambda: client.try_acquire("k", ttl=1, owner="")),
        (ValueError, lambda: client.try_acquire("k", ttl=1, owner="o" * 257)),
        (TypeError, lambda: client.try_acquire("k", ttl=1, release_on_close=1)),  # type: ignore[arg-type]
        (ValueError, lambda: client.acquire("k", ttl=1, timeout=-0.5)),
        (ValueError, lambda: client.acquire("k", ttl=1, timeout=float("inf"))),
        (ValueError, lambda: client.list(limit=0)),
        (TypeError, lambda: client.list(prefix=3)),  # type: ignore[arg-type]
        (ValueError, lambda: client.break_lock("k", "")),
        (TypeError, lambda: client.release("k")),  # type: ignore[arg-type]
    ]
    for exc_type, call in bad_calls:
        with pytest.raises(exc_type):
            call()
    assert client.try_acquire.__doc__  # public names are documented


# -- pipelining ------------------------------------------------------------------------


def test_out_of_order_replies_with_threads(serve: Callable[[Script], FakeServer]) -> None:
    count = 6

    def script(peer: Peer, index: int) -> None:
        pending = [peer.recv() for _ in range(count)]
        for request in reversed(pending):  # answer the last first
            assert request is not None
            peer.reply(request, answer(request))
        peer.recv()

    server = serve(script)
    results: dict[int, Any] = {}
    with make_client(server.path) as client:

        def work(i: int) -> None:
            if i % 2:
                results[i] = client.status(f"key-{i}")
            else:
                results[i] = client.acquire(f"key-{i}", ttl=5, timeout=5)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
    assert len(results) == count
    for i, result in results.items():
        assert result.key == f"key-{i}"
        assert isinstance(result, LockStatus if i % 2 else Handle)
    assert server.connections == 1


def test_renew_answered_while_blocking_acquire_waits(
    serve: Callable[[Script], FakeServer],
) -> None:
    acquire_seen = threading.Event()

    def script(peer: Peer, index: int) -> None:
        parked = None
        while (request := peer.recv()) is not None:
            if request["op"] == "acquire" and request["key"] == "slow":
                parked = request
                acquire_seen.set()
            elif request["op"] == "release":
                peer.reply(request, answer(request))
                assert parked is not None
                peer.reply(parked, ok(grant(parked, fence=8)))
            else:
                peer.reply(request, answer(request))

    server = serve(script)
    with make_client(server.path) as client:
        first = client.try_acquire("k", ttl=5)
        assert first is not None
        box: list[Handle] = []
        waiter = threading.Thread(target=lambda: box.append(client.acquire("slow", 5, 5)))
        waiter.start()
        assert acquire_seen.wait(2)
        assert client.renew(first, ttl=5).renewed  # not blocked by the parked acquire
        assert client.release(first).released
        waiter.join(2)
        assert box and box[0].fence == 8


def test_reader_hands_over_when_it_gives_up(serve: Callable[[Script], FakeServer]) -> None:
    """The thread reading the socket times out while another waits: that one reads on."""
    status_seen = threading.Event()
    acquire_seen = threading.Event()
    answer_acquire = threading.Event()

    def script(peer: Peer, index: int) -> None:
        while (request := peer.recv()) is not None:
            if request["op"] == "status":
                status_seen.set()  # never answered
            elif request["op"] == "acquire":
                acquire_seen.set()
                assert answer_acquire.wait(5)
                peer.reply(request, answer(request))
            else:
                peer.reply(request, answer(request))

    server = serve(script)
    with make_client(server.path, request_timeout=0.1) as client:
        errors: list[BaseException] = []

        def short_wait() -> None:
            try:
                client.status("a")
            except BaseException as exc:
                errors.append(exc)

        first = threading.Thread(target=short_wait)
        first.start()
        assert status_seen.wait(2)
        box: list[Handle] = []
        second = threading.Thread(target=lambda: box.append(client.acquire("b", 1, 5)))
        second.start()
        assert acquire_seen.wait(2)
        first.join(2)
        assert isinstance(errors[0], DaemonUnavailableError)  # "no reply" within 0.1 s
        answer_acquire.set()
        second.join(5)
        assert box and box[0].key == "b"
        assert client.hello()["op"] == "hello"
    assert server.connections == 1


def test_many_threads_share_one_connection(serve: Callable[[Script], FakeServer]) -> None:
    """Replies come back in batches, shuffled: every thread gets its own."""
    rng = random.Random(7)

    def script(peer: Peer, index: int) -> None:
        buf = b""
        pending: list[dict[str, Any]] = []
        while True:
            ready, _, _ = select.select([peer.sock], [], [], 0.005 if pending else 5.0)
            if ready:
                data = peer.sock.recv(65536)
                if not data:
                    return
                *lines, buf = (buf + data).split(b"\n")
                for line in lines:
                    request = json.loads(line)
                    peer.server.record(request)
                    pending.append(request)
                if len(pending) < 4:
                    continue
            if not pending:
                return  # idle for 5 s: the client is gone
            rng.shuffle(pending)
            replies = [json.dumps({"id": r["id"], **answer(r)}).encode() + b"\n" for r in pending]
            peer.sock.sendall(b"".join(replies))
            pending.clear()

    server = serve(script)
    per_thread, threads_n = 60, 8
    failures: list[BaseException] = []
    with make_client(server.path) as client:

        def work(i: int) -> None:
            try:
                for j in range(per_thread):
                    key = f"t{i}-{j}"
                    if j % 3 == 0:
                        handle = client.try_acquire(key, ttl=5)
                        assert handle is not None and handle.key == key
                        assert client.release(handle).released
                    else:
                        assert client.status(key).key == key
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not failures, failures[:3]
    assert server.connections == 1


# -- time-outs --------------------------------------------------------------------------


def test_blocking_acquire_outlives_request_timeout(serve: Callable[[Script], FakeServer]) -> None:
    def script(peer: Peer, index: int) -> None:
        request = peer.recv()
        assert request is not None
        # The behaviour under test: a reply later than request_timeout (0.1 s), within
        # timeoutMs + margin. The client gives no sign of how long it has waited.
        time.sleep(0.25)
        peer.reply(request, answer(request))
        peer.recv()

    server = serve(script)
    with make_client(server.path, request_timeout=0.1) as client:
        assert client.acquire("k", ttl=1, timeout=0.3).key == "k"


def test_no_reply_times_out_and_late_grant_is_released(
    serve: Callable[[Script], FakeServer],
) -> None:
    gave_up = threading.Event()
    grant_sent = threading.Event()
    released = threading.Event()

    def script(peer: Peer, index: int) -> None:
        request = peer.recv()
        assert request is not None and request["op"] == "acquire"
        assert gave_up.wait(10)  # the grant comes only after the client has given up
        peer.reply(request, ok(grant(request)))
        grant_sent.set()
        while (request := peer.recv()) is not None:
            peer.reply(request, answer(request))
            if request["op"] == "release":
                assert request["handle"] == HANDLE_ID
                # Only once answered: the test then closes the connection, and a reply
                # written after that fails with EPIPE.
                released.set()

    server = serve(script)
    with make_client(server.path, request_timeout=0.05) as client:
        with pytest.raises(DaemonUnavailableError, match="no reply"):
            client.acquire("k", ttl=1, timeout=0.05)
        assert not grant_sent.is_set()  # the timeout, not the grant (held back until now)
        gave_up.set()
        assert grant_sent.wait(3)
        assert client.status("k").key == "k"  # same connection still works
        assert released.wait(2)
    assert server.connections == 1


def test_late_grant_is_released_while_another_thread_reads(
    serve: Callable[[Script], FakeServer],
) -> None:
    """The reader gives a late grant back at once, not when its own (long) wait ends."""
    gave_up = threading.Event()
    released_early = threading.Event()

    def script(peer: Peer, index: int) -> None:
        parked = late = None
        while (request := peer.recv()) is not None:
            if request["op"] == "acquire" and request["key"] == "slow":
                parked = request
            elif request["op"] == "acquire":
                late = request
                assert gave_up.wait(5)
                peer.reply(late, ok(grant(late)))  # nobody waits for it any more
            elif request["op"] == "release" and late is not None and request["key"] == late["key"]:
                released_early.set()
                assert parked is not None
                peer.reply(parked, ok(grant(parked)))
            else:
                peer.reply(request, answer(request))

    server = serve(script)
    with make_client(server.path, request_timeout=0.1) as client:
        box: list[Handle] = []
        waiter = threading.Thread(target=lambda: box.append(client.acquire("slow", 1, 10)))
        waiter.start()
        wait_for(lambda: "acquire" in server.ops(), 2, "the parked acquire", interval=0.005)
        with pytest.raises(DaemonUnavailableError, match="no reply"):
            client.acquire("k", ttl=1, timeout=0)
        gave_up.set()
        assert released_early.wait(5)  # while "slow" still waits: its reply needs it
        waiter.join(5)
        assert box and box[0].key == "slow"


def test_close_wakes_waiting_thread(serve: Callable[[Script], FakeServer]) -> None:
    seen = threading.Event()

    def script(peer: Peer, index: int) -> None:
        if peer.recv() is not None:
            seen.set()
            peer.recv()

    server = serve(script)
    client = make_client(server.path)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.acquire("k", ttl=1, timeout=30, owner="o")
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    assert seen.wait(2)
    client.close()
    t.join(2)
    assert not t.is_alive()
    assert isinstance(errors[0], LockdError) and errors[0].code == "CLIENT_CLOSED"
    client.close()  # twice is fine
    with pytest.raises(LockdError):
        client.hello()


# -- reconnecting ----------------------------------------------------------------------


def drop_first_connection(peer: Peer, index: int) -> None:
    """Connection 0 reads one request and closes; later ones answer normally."""
    if index == 0:
        peer.recv()
        peer.close()
        return
    responder(answer)(peer, index)


def test_release_is_retried_after_connection_drop(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(drop_first_connection)
    with make_client(server.path) as client:
        result = client.release(("k", HANDLE_ID))
    assert result.released
    assert server.connections == 2
    assert server.ops() == ["release", "release"]
    assert server.requests[0]["id"] != server.requests[1]["id"]


def test_try_acquire_without_owner_is_not_retried(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(drop_first_connection)
    with make_client(server.path) as client, pytest.raises(DaemonUnavailableError) as info:
        client.try_acquire("k", ttl=1)
    assert "not retried" in str(info.value) and server.path in str(info.value)
    assert server.ops() == ["tryAcquire"]
    assert server.connections == 1


def test_try_acquire_with_owner_is_retried(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(drop_first_connection)
    with make_client(server.path) as client:
        handle = client.try_acquire("k", ttl=1, owner="run-9")
    assert handle is not None and handle.owner == "run-9"
    assert server.ops() == ["tryAcquire", "tryAcquire"]


def test_retried_acquire_waits_only_for_the_rest(
    serve: Callable[[Script], FakeServer], client_clock: SkippedMonotonic
) -> None:
    def script(peer: Peer, index: int) -> None:
        if index == 0:
            peer.recv()
            client_clock.skip(0.1)  # time passes before the drop: the retry must not wait it again
            peer.close()
            return
        responder(answer)(peer, index)

    server = serve(script)
    with make_client(server.path) as client:
        client.acquire("k", ttl=1, timeout=2, owner="o")
    first, second = server.requests
    assert first["timeoutMs"] == 2000 and 1000 < second["timeoutMs"] < 1950


def test_idle_connection_closed_by_daemon_is_replaced(
    serve: Callable[[Script], FakeServer],
) -> None:
    closed = threading.Event()

    def script(peer: Peer, index: int) -> None:
        if index == 0:
            request = peer.recv()
            assert request is not None
            peer.reply(request, answer(request))
            peer.close()
            closed.set()
            return
        responder(answer)(peer, index)

    server = serve(script)
    with make_client(server.path) as client:
        client.hello()
        assert closed.wait(2)
        # Nothing was sent on the dead connection, so even this op goes through.
        assert client.try_acquire("k", ttl=1) is not None
    assert server.connections == 2 and server.ops() == ["hello", "tryAcquire"]


@pytest.mark.parametrize("unread", [False, True])
def test_send_after_the_peer_closed_fails_at_once(sock_path: str, unread: bool) -> None:
    """What the client relies on instead of checking a connection before each request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener, client:
        listener.bind(sock_path)
        listener.listen(1)
        client.connect(sock_path)
        daemon_side, _ = listener.accept()
        if unread:
            client.sendall(b'{"id":1,"op":"hello"}\n')  # the daemon leaves it unread
        daemon_side.close()
        with pytest.raises(OSError) as info:
            client.send(b'{"id":2,"op":"hello"}\n', socket.MSG_NOSIGNAL)
        assert info.value.errno in (errno.EPIPE, errno.ECONNRESET)


def close_after_first_reply(peer: Peer, index: int) -> None:
    """Connection 0 answers one request, then the daemon closes it; later ones answer."""
    if index == 0:
        request = peer.recv()
        assert request is not None
        peer.reply(request, answer(request))
        peer.close()
        return
    responder(answer)(peer, index)


@pytest.mark.parametrize("op", ["tryAcquire", "acquire", "break"])
def test_unsent_request_is_sent_once_at_once_on_a_new_connection(
    serve: Callable[[Script], FakeServer], monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """A send that fails on a connection the daemon closed is safe to repeat, even for
    requests that are never retried once sent; the first re-send does not back off."""
    server = serve(close_after_first_reply)
    real_sleep = time.sleep
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():
            slept.append(seconds)
        real_sleep(seconds)  # not a wait of the test's: the client's own, passed on

    with make_client(server.path) as client:
        client.hello()
        wait_for(
            lambda: server.connections >= 1 and server._peers[0].sock.fileno() == -1,
            2,
            "the daemon side closed",
            interval=0.005,
        )
        monkeypatch.setattr(time, "sleep", sleep)
        if op == "tryAcquire":
            assert client.try_acquire("k", ttl=1) is not None
        elif op == "acquire":
            assert client.acquire("k", ttl=1, timeout=1).key == "k"
        else:
            assert client.break_lock("k", "why").broken is False
    assert server.ops() == ["hello", op]
    assert server.connections == 2 and slept == []


def test_stuck_send_is_not_sent_and_goes_again_on_a_new_connection(
    serve: Callable[[Script], FakeServer],
) -> None:
    """A send that times out (the daemon stopped reading) never delivered the newline."""
    done = threading.Event()
    first_bytes: list[bytes] = []

    def script(peer: Peer, index: int) -> None:
        if index == 0:
            assert done.wait(10)  # read nothing until the client has moved on
            peer.sock.settimeout(5)
            data = b""
            while chunk := peer.sock.recv(1 << 20):
                data += chunk
            first_bytes.append(data)
            return
        responder(answer)(peer, index)

    server = serve(script)
    prefix = "p" * (1 << 20)  # far more than the socket buffers hold (~200 KiB)
    # The retry must get its whole MiB read and answered within one request
    # timeout: 0.5 s was too tight at load 12 (a third connection followed).
    with make_client(server.path, request_timeout=2, retry_window=6) as client:
        assert client.list(prefix=prefix) == []
        done.set()
    wait_for(lambda: first_bytes, 5, "the first connection's bytes")
    assert first_bytes and first_bytes[0] and b"\n" not in first_bytes[0]
    assert server.ops() == ["list"] and server.connections == 2


def test_default_sigpipe_does_not_kill_on_a_closed_connection(
    serve: Callable[[Script], FakeServer],
) -> None:
    """Programs that restore SIGPIPE's default action still get a reconnect, not death."""
    server = serve(close_after_first_reply)
    code = (
        "import select, signal, sys\n"
        "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
        "from lockd_client import LockClient\n"
        "with LockClient(sys.argv[1], request_timeout=5, retry_window=1) as client:\n"
        "    client.hello()\n"
        "    poller = select.poll()\n"
        "    poller.register(client._conn._sock.fileno(), select.POLLIN)\n"
        "    assert poller.poll(5000)  # EOF: the daemon closed this connection\n"
        "    assert client.try_acquire('k', ttl=1) is not None\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, server.path], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert server.ops() == ["hello", "tryAcquire"] and server.connections == 2


def test_gives_up_when_daemon_stays_away(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(responder(answer))
    with make_client(server.path, retry_window=0.3) as client:
        client.hello()
        server.stop()  # the daemon is gone for good
        os.unlink(server.path)
        started = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="cannot connect"):
            client.status("k")
        assert 0.1 < time.monotonic() - started < 1.5


def test_unavailable_message_names_path_and_how_to_start(sock_path: str) -> None:
    client = LockClient(sock_path)
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError) as info:
        client.status("k")
    assert time.monotonic() - started < 0.5  # a first connect failure is not retried
    message = str(info.value)
    assert sock_path in message and "lockd serve" in message
    assert "systemctl --user start lockd.socket" in message
    assert info.value.socket_path == sock_path and info.value.code == "DAEMON_UNAVAILABLE"


# -- socket path ---------------------------------------------------------------------------


def test_socket_path_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    monkeypatch.setenv("LOCKD_SOCKET", "/tmp/from-env.sock")
    assert LockClient().socket_path == "/tmp/from-env.sock"
    assert LockClient("/tmp/arg.sock").socket_path == "/tmp/arg.sock"
    monkeypatch.setenv("LOCKD_SOCKET", "")
    assert LockClient().socket_path == "/run/user/4242/lockd/lockd.sock"
    monkeypatch.delenv("LOCKD_SOCKET")
    assert LockClient().socket_path == default_socket_path()


def test_default_socket_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    euid = os.geteuid()
    xdg = tempfile.mkdtemp(dir=str(tmp_path))  # mode 0700, ours: platformdirs accepts it
    monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    assert default_socket_path() == f"{xdg}/lockd/lockd.sock"
    import platformdirs  # only the test uses it, to check we agree

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = os.path.join(platformdirs.user_runtime_dir("lockd"), "lockd.sock")
    assert default_socket_path() == expected

    monkeypatch.delenv("XDG_RUNTIME_DIR")
    run_user = tmp_path / "run-user"
    (run_user / str(euid)).mkdir(parents=True)
    monkeypatch.setattr(_paths, "_RUN_USER", str(run_user))
    assert default_socket_path() == f"{run_user}/{euid}/lockd/lockd.sock"

    monkeypatch.setattr(_paths, "_RUN_USER", str(tmp_path / "missing"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert default_socket_path() == f"{tmp_path}/tmp/runtime-{euid}/lockd/lockd.sock"


# -- lock() and auto-renew ------------------------------------------------------------------


def test_lock_releases_on_normal_exit(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(responder(answer))
    with make_client(server.path) as client:
        with client.lock("k", ttl=10, timeout=1, owner="o", auto_renew=False) as handle:
            assert handle.key == "k" and handle.owner == "o"
        assert server.ops() == ["acquire", "release"]
    # Safe by default: bound to the connection; plain acquire is not.
    assert server.requests[0]["releaseOnClose"] is True


def test_plain_acquire_keeps_ttl_lease_unless_asked(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(responder(answer))
    with make_client(server.path) as client:
        client.acquire("k", ttl=1, timeout=1)
        client.try_acquire("k", ttl=1)
        client.try_acquire("k", ttl=1, release_on_close=True)
        with client.lock("k", ttl=1, timeout=1, release_on_close=False, auto_renew=False):
            pass
    sent = [r.get("releaseOnClose", False) for r in server.requests if r["op"] != "release"]
    assert sent == [False, False, True, False]


def test_lock_raises_lock_lost_when_release_answers_not_holder(
    serve: Callable[[Script], FakeServer],
) -> None:
    def handler(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "release":
            return ok({"released": False, "reason": "not_holder"})
        return answer(request)

    server = serve(responder(handler))
    lost: list[Handle] = []
    with make_client(server.path) as client:
        lock = client.lock("k", ttl=100, timeout=1, on_lost=lost.append)
        with pytest.raises(LockLostError, match="not_holder") as caught, lock as handle:
            pass
        assert caught.value.fence == 7 and caught.value.details["key"] == "k"
        assert lost == [handle] and handle.lost
        # The block's own exception wins: no LockLostError over it.
        with pytest.raises(KeyError), client.lock("k", ttl=10, timeout=1):
            raise KeyError("mine")


def test_blocking_acquire_reparks_after_shutting_down(
    serve: Callable[[Script], FakeServer], client_clock: SkippedMonotonic
) -> None:
    """SHUTTING_DOWN to a parked acquire: a new connection, parked again with the rest."""

    def script(peer: Peer, index: int) -> None:
        request = peer.recv()
        assert request is not None
        if index == 0:
            # Parked for a while, then the daemon stops: the time that passes is what the
            # re-parked request's shorter timeout must account for.
            client_clock.skip(0.2)
            peer.reply(request, err("SHUTTING_DOWN", 503))
            peer.close()
        else:
            peer.reply(request, answer(request))
            while peer.recv() is not None:
                pass

    server = serve(script)
    with make_client(server.path) as client:
        handle = client.acquire("k", ttl=5, timeout=3)  # no owner: re-parked all the same
    assert handle.key == "k" and server.connections == 2
    first, second = (r["timeoutMs"] for r in server.requests if r["op"] == "acquire")
    assert first == 3000 and 0 < second <= 2800


def test_blocking_acquire_reparks_after_the_connection_drops(
    serve: Callable[[Script], FakeServer],
) -> None:
    def script(peer: Peer, index: int) -> None:
        request = peer.recv()
        assert request is not None
        if index == 0:
            peer.close()  # killed while we were parked
            return
        peer.reply(request, answer(request))
        while peer.recv() is not None:
            pass

    server = serve(script)
    with make_client(server.path) as client:
        assert client.acquire("k", ttl=5, timeout=3).key == "k"
        assert server.connections == 2


def test_abandoned_acquire_is_cancelled_and_a_crossing_grant_released(
    serve: Callable[[Script], FakeServer],
) -> None:
    """No reply in time: the client gives up, sends cancel; the grant that crossed it
    is released as soon as it is read."""
    seen = threading.Event()

    def script(peer: Peer, index: int) -> None:
        acquire = peer.recv()
        assert acquire is not None and acquire["op"] == "acquire"
        cancel = peer.recv()
        assert cancel == {"id": cancel["id"], "op": "cancel", "target": acquire["id"]}
        peer.reply(acquire, answer(acquire))  # the grant crossed the cancel
        peer.reply(cancel, ok({"cancelled": False}))
        while (request := peer.recv()) is not None:
            peer.reply(request, answer(request))
            if request["op"] == "release":
                seen.set()

    server = serve(script)
    with make_client(server.path, request_timeout=0.1) as client:
        with pytest.raises(DaemonUnavailableError, match="no reply"):
            client.acquire("k", ttl=5, timeout=0.01)
        client.hello()  # reading the late replies gives the grant back
        assert seen.wait(5)
    release = next(r for r in server.requests if r["op"] == "release")
    assert release == {"id": release["id"], "op": "release", "key": "k", "handle": HANDLE_ID}


def test_try_acquire_is_not_reparked(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(responder(lambda request: err("SHUTTING_DOWN", 503)))
    with make_client(server.path) as client, pytest.raises(ShuttingDownError):
        client.try_acquire("k", ttl=5)
    assert server.connections == 1


def test_socket_permission_denied_names_owner_and_mode(
    serve: Callable[[Script], FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve(responder(answer))

    class Refusing(_socket.socket):
        """A socket whose connect is refused as for a non-member (the tests run as root)."""

        def connect(self, address: object) -> None:
            raise PermissionError(errno.EACCES, "Permission denied")

    # The client connects with the C socket type (lockd_client._connection, issue 24).
    monkeypatch.setattr(lockd_client._connection, "_unix_socket", Refusing)
    os.chmod(server.path, 0o660)
    with make_client(server.path) as client, pytest.raises(SocketPermissionError) as caught:
        client.hello()
    exc = caught.value
    assert isinstance(exc, LockAccessDeniedError) and exc.code == "LOCK_ACCESS_DENIED"
    assert exc.details["mode"] == "0660" and "owner" in exc.details
    assert "may not use its socket" in exc.message and server.path in exc.message


def test_lock_releases_on_exception(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(responder(answer))
    with make_client(server.path) as client:
        with pytest.raises(KeyError), client.lock("k", ttl=10, timeout=1, auto_renew=False):
            raise KeyError("boom")
        assert server.ops() == ["acquire", "release"]


def test_failed_release_does_not_mask_the_exception(
    serve: Callable[[Script], FakeServer],
) -> None:
    def handler(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "release":
            return err("INTERNAL", 500)
        return answer(request)

    server = serve(responder(handler))
    with make_client(server.path) as client:
        lock = client.lock("k", ttl=10, timeout=1, auto_renew=False)
        with pytest.raises(ZeroDivisionError), lock:
            1 / 0  # noqa: B018
        assert server.ops() == ["acquire", "release"]


def test_lock_timeout_propagates_without_release(serve: Callable[[Script], FakeServer]) -> None:
    details = {"key": "k", "timeoutMs": 0}
    server = serve(responder(lambda request: err("LOCK_TIMEOUT", 408, details)))
    with make_client(server.path) as client:
        with pytest.raises(LockTimeoutError), client.lock("k", ttl=10, timeout=0):
            pytest.fail("must not run")
        # lock() asks for lease-loss events first (not waited for), then acquires.
        assert server.ops() == ["hello", "acquire"]


def test_auto_renew_renews_and_stops(
    serve: Callable[[Script], FakeServer], renewers: list[AutoRenewer]
) -> None:
    server = serve(responder(answer))
    lost: list[Handle] = []
    with make_client(server.path) as client:
        # Renewed every 0.5 s; each renew has 0.85 s to come back before the
        # lease counts as lost. (A 60 ms TTL left a renew 34 ms: a test process
        # starved of CPU on a loaded box lost the lease, "no reply within 0.01 s".)
        with client.lock("k", ttl=1.5, timeout=1, auto_renew=True, on_lost=lost.append) as h:
            wait_for(lambda: server.ops().count("renew") >= 3, 10, "three renewals")
        ops_at_exit = server.ops()
        # The renew thread has ended (leaving the block joins it): nothing can renew now.
        assert len(renewers) == 1
        wait_for(lambda: not renewing(renewers), 5, "the renew thread's end")
        assert server.ops() == ops_at_exit
    assert ops_at_exit.count("renew") >= 3 and ops_at_exit[-1] == "release"
    assert not lost and not h.lost
    renew = next(r for r in server.requests if r["op"] == "renew")
    assert renew["ttlMs"] == 1500 and renew["handle"] == HANDLE_ID
    assert not renewing(renewers)


def test_auto_renew_calls_on_lost_when_not_renewed(
    serve: Callable[[Script], FakeServer], renewers: list[AutoRenewer]
) -> None:
    def handler(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "renew":
            return ok({"renewed": False, "reason": "lease_lost"})
        if request["op"] == "release":
            return ok({"released": False, "reason": "not_holder"})
        return answer(request)

    server = serve(responder(handler))
    called = threading.Event()
    lost: list[Handle] = []

    def on_lost(handle: Handle) -> None:
        lost.append(handle)
        called.set()

    with make_client(server.path) as client:
        with (
            pytest.raises(LockLostError, match="lease_lost") as caught,
            # The first renew (after 0.5 s) answers lease_lost. A 30 ms TTL
            # let a slow acquire reply put the give-up time behind it: the
            # loss came as "about to run out" instead, on a loaded box.
            client.lock("k", ttl=1.5, timeout=1, auto_renew=True, on_lost=on_lost) as handle,
        ):
            assert called.wait(10)
            # It must not renew again or report twice: its thread ends after the report.
            assert len(renewers) == 1
            wait_for(lambda: not renewing(renewers), 5, "the renew thread's end")
        assert lost == [handle] and handle.lost
        # This daemon sends no events: the renewal still sees the loss.
        assert server.ops() == ["hello", "acquire", "renew", "release"]
    assert (caught.value.key, caught.value.fence, caught.value.code) == ("k", 7, "LEASE_LOST")


def test_auto_renew_is_paced_by_the_ttl_the_grant_reports(
    serve: Callable[[Script], FakeServer],
) -> None:
    """A daemon on etcd grants whole seconds (0.3 s asked, 2 s granted) and its
    renews take etcd round trips: a renew slower than the TTL asked for is
    not a lost lease while the granted one lasts."""

    def stamp(seconds: float) -> str:
        at = datetime.now(UTC) + timedelta(seconds=seconds)
        return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"

    def handler(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "renew":
            time.sleep(0.5)  # the behaviour under test: a renew slower than the TTL asked
            return ok({"renewed": True, "leaseExpiresAt": stamp(2.0)})
        reply = answer(request)
        if request["op"] == "acquire":
            reply["result"].update(ttlMs=2000, leaseExpiresAt=stamp(2.0))
        return reply

    server = serve(responder(handler))
    with make_client(server.path) as client, client.lock("k", ttl=0.3, timeout=1) as handle:
        wait_for(lambda: server.ops().count("renew") >= 2, 5, "two renewals", interval=0.02)
        assert not handle.lost
    renews = [r for r in server.requests if r["op"] == "renew"]
    assert len(renews) >= 2 and renews[0]["ttlMs"] == 300  # it asks for what it asked


def test_auto_renew_declares_loss_before_lease_runs_out(
    serve: Callable[[Script], FakeServer],
) -> None:
    def handler(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "renew":
            return err("INTERNAL", 500)
        reply = answer(request)
        if request["op"] == "acquire":
            # A real daemon's deadline: the client counts the lease from it.
            expires = datetime.now(UTC) + timedelta(milliseconds=request["ttlMs"])
            stamp = expires.strftime("%Y-%m-%dT%H:%M:%S.") + f"{expires.microsecond // 1000:03d}Z"
            reply["result"]["leaseExpiresAt"] = stamp
        return reply

    server = serve(responder(handler))
    called = threading.Event()
    with make_client(server.path) as client:
        started = time.monotonic()
        with (
            pytest.raises(LockLostError, match="about to run out"),
            client.lock(
                "k", ttl=2.0, timeout=1, auto_renew=True, on_lost=lambda h: called.set()
            ) as handle,
        ):
            assert called.wait(5)
            # Reported before the lease runs out (given up at ~1.3 s: the next
            # retry would come after the margin; 2 s leaves room for a busy box).
            assert time.monotonic() - started < 2.0
            assert handle.lost
    assert server.ops().count("renew") >= 2


# -- packaging -------------------------------------------------------------------------------


def test_import_uses_standard_library_only() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import lockd_client\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "bad = sorted(m for m in new if m != 'lockd_client' and m not in sys.stdlib_module_names)\n"
        "assert 'trio' not in sys.modules and 'click' not in sys.modules, bad\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_public_names_are_documented() -> None:
    for name in lockd_client.__all__:
        obj = getattr(lockd_client, name)
        if callable(obj) and not isinstance(obj, type(Handle | None)):
            assert obj.__doc__, name
    for name in dir(LockClient):
        if not name.startswith("_"):
            assert getattr(LockClient, name).__doc__, name


def test_on_lost_without_auto_renew_is_refused(serve: Callable[[Script], FakeServer]) -> None:
    server = serve(responder(answer))
    with make_client(server.path) as client:
        lock = client.lock("k", ttl=1, timeout=1, on_lost=lambda h: None, auto_renew=False)
        with pytest.raises(ValueError, match="auto_renew"), lock:
            pass
