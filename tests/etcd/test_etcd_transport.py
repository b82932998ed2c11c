"""The etcd client's HTTP/1.1 transport (http1.py on trio sockets): connections, failures.

Edge cases run against a tiny trio HTTP server in the test (tests/http_stub.py);
the last tests run against the real etcd cluster. What matters most here is
the line between ``NotSent`` (the request certainly did not go out: the
gateway may send it elsewhere) and ``MaybeSent`` (it may have: a write must
not be sent again).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from lockd.daemon.backends.etcd.transport import (
    Connection,
    MaybeSent,
    NotSent,
    Origin,
    Pool,
    Wire,
)
from lockd.daemon.backends.etcd.wire import b64
from lockd.testing.etcd_cluster import EtcdCluster, free_ports
from tests.http_stub import CLOSE, SILENT, Raw, Reply, Request, Stream, StubServer

CONNECT = 2.0  # connect timeout: loopback answers at once or refuses at once


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    pool = Pool()
    try:
        yield pool
    finally:
        await pool.aclose()


async def serve(nursery: trio.Nursery, handler: object) -> StubServer:
    return await StubServer(handler).start(nursery)  # type: ignore[arg-type]


async def test_requests_share_one_kept_connection_with_either_framing(
    pool: Pool, nursery: trio.Nursery
) -> None:
    answers = itertools.cycle([Reply(json={"n": 1}), Reply(json={"n": 2}, chunked=True)])
    server = await serve(nursery, lambda request: next(answers))
    replies = []
    for n in range(4):
        body = json.dumps({"key": n}).encode()
        reply = await pool.request(
            server.url, "/v3/kv/range", body, [("X-Test", "yes")], connect_timeout=CONNECT
        )
        replies.append((reply.status, json.loads(reply.body)))
    assert replies == [(200, {"n": 1}), (200, {"n": 2})] * 2
    assert server.connections == 1 and pool.connects == 1
    first = server.requests[0]
    assert (first.method, first.path, first.json()) == ("POST", "/v3/kv/range", {"key": 0})
    assert first.headers["host"] == f"127.0.0.1:{server.port}"
    assert first.headers["content-type"] == "application/json"
    assert first.headers["x-test"] == "yes"


async def test_a_request_goes_out_in_one_write() -> None:
    sends: list[bytes] = []

    class Recording(Wire):
        async def send_all(self, data: bytes) -> None:
            sends.append(bytes(data))

        async def receive_some(self) -> bytes:
            return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"

        def idle(self) -> bool:
            return True

        async def aclose(self) -> None:
            pass

    connection = Connection(Recording(), Origin.parse("http://127.0.0.1:2379"))
    await connection.send_request("/v3/kv/txn", b'{"compare":[]}', [("A", "b")])
    assert len(sends) == 1
    head, body = sends[0].split(b"\r\n\r\n")
    assert body == b'{"compare":[]}' and b"content-length: 14" in head.lower()
    assert (await connection.receive_head()).status == 200
    assert await connection.receive_data() == b"{}"
    assert await connection.receive_data() is None


async def test_a_connection_the_server_closed_while_idle_is_replaced_before_sending(
    pool: Pool, nursery: trio.Nursery
) -> None:
    # The server answers, then closes without saying so (as an idle timeout would).
    server = await serve(nursery, lambda request: Reply(json={"ok": True}, drop=True))
    await pool.request(server.url, "/a", b"{}", connect_timeout=CONNECT)
    await trio.testing.wait_all_tasks_blocked()  # the server's close is done
    reply = await pool.request(server.url, "/b", b"{}", connect_timeout=CONNECT)
    assert json.loads(reply.body) == {"ok": True}
    # Sent once, on a new connection: nothing went out on the dead one.
    assert [r.path for r in server.requests] == ["/a", "/b"]
    assert [r.connection for r in server.requests] == [0, 1]


async def test_connection_close_in_the_reply_is_honoured(pool: Pool, nursery: trio.Nursery) -> None:
    server = await serve(nursery, lambda request: Reply(json={}, close=True))
    for _ in range(2):
        await pool.request(server.url, "/a", b"{}", connect_timeout=CONNECT)
    assert [r.connection for r in server.requests] == [0, 1]


async def test_a_request_cut_off_after_sending_is_maybe_sent_and_not_sent_again(
    pool: Pool, nursery: trio.Nursery
) -> None:
    server = await serve(nursery, lambda request: CLOSE)
    with pytest.raises(MaybeSent, match="closed the connection"):
        await pool.request(server.url, "/v3/kv/put", b"{}", connect_timeout=CONNECT)
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    "garbage",
    [
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",  # body cut short
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # bad chunk size
    ],
    ids=["not-http", "short-body", "bad-chunk"],
)
async def test_a_malformed_response_is_maybe_sent(
    pool: Pool, nursery: trio.Nursery, garbage: bytes
) -> None:
    server = await serve(nursery, lambda request: Raw(garbage))
    with pytest.raises(MaybeSent):
        await pool.request(server.url, "/v3/kv/put", b"{}", connect_timeout=CONNECT)
    assert len(server.requests) == 1


async def test_no_connection_is_not_sent(pool: Pool) -> None:
    [port] = free_ports(1)
    with pytest.raises(NotSent, match="cannot connect"):
        await pool.request(f"http://127.0.0.1:{port}", "/a", b"{}", connect_timeout=CONNECT)
    with pytest.raises(ValueError, match="expected http"):
        await pool.request("ftp://127.0.0.1:1", "/a", b"{}", connect_timeout=CONNECT)


async def test_no_answer_within_the_read_timeout_is_maybe_sent_and_the_connection_dropped(
    pool: Pool, nursery: trio.Nursery
) -> None:
    answers = iter([SILENT, Reply(json={"late": False})])
    server = await serve(nursery, lambda request: next(answers))
    with pytest.raises(MaybeSent, match=r"no answer within 0\.2 s"):
        await pool.request(server.url, "/a", b"{}", connect_timeout=CONNECT, read_timeout=0.2)
    # A request cancelled from outside leaves nothing half-read in the pool either.
    reply = await pool.request(server.url, "/b", b"{}", connect_timeout=CONNECT)
    assert json.loads(reply.body) == {"late": False}
    assert [r.connection for r in server.requests] == [0, 1]


async def test_a_cancelled_request_closes_its_connection(pool: Pool, nursery: trio.Nursery) -> None:
    answers = iter([SILENT, Reply(json={})])
    server = await serve(nursery, lambda request: next(answers))
    with trio.move_on_after(0.1):
        await pool.request(server.url, "/a", b"{}", connect_timeout=CONNECT)
    await pool.request(server.url, "/b", b"{}", connect_timeout=CONNECT)
    assert [r.connection for r in server.requests] == [0, 1]


async def test_a_request_already_cancelled_is_not_sent(pool: Pool, nursery: trio.Nursery) -> None:
    server = await serve(nursery, lambda request: Reply(json={}))
    await pool.request(server.url, "/a", b"{}", connect_timeout=CONNECT)
    with trio.CancelScope() as scope:
        scope.cancel()  # as a deadline that passed before the call
        await pool.request(server.url, "/b", b"{}", connect_timeout=CONNECT)
    assert scope.cancelled_caught
    await pool.request(server.url, "/c", b"{}", connect_timeout=CONNECT)
    # Nothing went out, and the kept connection was not given up for it.
    assert [r.path for r in server.requests] == ["/a", "/c"]
    assert pool.connects == 1


async def test_a_streamed_response_comes_line_by_line_across_chunks(
    pool: Pool, nursery: trio.Nursery
) -> None:
    lines = [b'{"result":{"created":true}}\n', b'{"a":1}\n{"b":2}\n', b'{"c":"' + b"x" * 300]
    server = await serve(nursery, lambda request: Stream(lines, pieces=3))
    response = await pool.stream(server.url, "/v3/watch", b"{}", connect_timeout=CONNECT)
    try:
        assert response.status == 200
        got = [await response.next_line() for _ in range(3)]
        assert got == [b'{"result":{"created":true}}', b'{"a":1}', b'{"b":2}']
        with trio.move_on_after(0.2) as waiting:  # the last line is not finished: wait
            await response.next_line()
        assert waiting.cancelled_caught
    finally:
        await response.aclose()


async def test_a_stream_that_ends_or_breaks(pool: Pool, nursery: trio.Nursery) -> None:
    def handler(request: Request) -> object:
        if request.path == "/done":
            return Reply(body=b"one\ntwo", chunked=True)
        return Raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nhal")

    server = await serve(nursery, handler)
    done = await pool.stream(server.url, "/done", b"{}", connect_timeout=CONNECT)
    assert [await done.next_line() for _ in range(3)] == [b"one", b"two", None]
    # The body ended cleanly: its connection went back to the pool.
    await pool.request(server.url, "/done", b"{}", connect_timeout=CONNECT)
    assert server.connections == 1
    broken = await pool.stream(server.url, "/broken", b"{}", connect_timeout=CONNECT)
    with pytest.raises(MaybeSent):
        await broken.next_line()


async def test_closing_the_pool_closes_kept_connections(nursery: trio.Nursery) -> None:
    server = await serve(nursery, lambda request: Reply(json={}))
    pool = Pool()
    await pool.request(server.url, "/a", b"{}", connect_timeout=CONNECT)
    await pool.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await pool.request(server.url, "/a", b"{}", connect_timeout=CONNECT)


# --- against a real etcd -----------------------------------------------------------


async def test_etcd_requests_reuse_connections_and_large_bodies_arrive_whole(
    pool: Pool, etcd_cluster: EtcdCluster
) -> None:
    url = etcd_cluster.endpoints[0]
    prefix = f"/test-transport/{time.monotonic_ns()}/"
    value = "v" * 1000

    async def post(path: str, body: dict[str, object]) -> dict[str, object]:
        reply = await pool.request(url, path, json.dumps(body).encode(), connect_timeout=CONNECT)
        assert reply.status == 200, reply
        doc: dict[str, object] = json.loads(reply.body)
        return doc

    for n in range(60):
        await post("/v3/kv/put", {"key": b64(f"{prefix}{n:03}"), "value": b64(value)})
    assert pool.connects == 1
    # ~80 KB of JSON: far past what Go's server sends with a Content-Length.
    everything = await post(
        "/v3/kv/range", {"key": b64(prefix), "range_end": b64(prefix[:-1] + "0")}
    )
    assert everything["count"] == "60" and len(everything["kvs"]) == 60  # type: ignore[arg-type]

    # Concurrent requests each take a connection; they are kept afterwards.
    async with trio.open_nursery() as nursery:
        for n in range(5):
            nursery.start_soon(post, "/v3/kv/range", {"key": b64(f"{prefix}{n:03}")})
    connects = pool.connects
    assert connects >= 2
    for _ in range(5):
        await post("/v3/kv/range", {"key": b64(prefix)})
    assert pool.connects == connects


async def test_an_etcd_error_reply_is_a_response_not_a_failure(
    pool: Pool, etcd_cluster: EtcdCluster
) -> None:
    reply = await pool.request(
        etcd_cluster.endpoints[0], "/v3/kv/range", b'{"key":""}', connect_timeout=CONNECT
    )
    assert reply.status == 400
    assert json.loads(reply.body)["message"] == "etcdserver: key is not provided"
    # The connection survives an error reply.
    await pool.request(
        etcd_cluster.endpoints[0], "/v3/maintenance/status", b"{}", connect_timeout=CONNECT
    )
    assert pool.connects == 1
