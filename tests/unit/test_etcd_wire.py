"""etcd gateway messages (no etcd needed) and the client's failover rules on scripted replies.

The scripted replies come from tiny HTTP servers in the test
(tests/http_stub.py), one per "member"; they are the gateway's real answers
as seen from a live etcd 3.4, and pin down which failures the client retries
elsewhere and which it must report as "maybe committed".
"""

from __future__ import annotations

import base64
import json

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from lockd.daemon.backends.etcd.gateway import (
    EtcdError,
    EtcdGateway,
    EtcdUnavailable,
    GatewaySettings,
    LeaseNotFound,
)
from lockd.daemon.backends.etcd.wire import (
    Compare,
    DeleteOp,
    PutOp,
    RangeOp,
    TxnResult,
    WatchRequest,
    WatchResponse,
    b64,
    prefix_end,
    txn_body,
    unb64,
)
from lockd.testing.etcd_cluster import free_ports
from tests.http_stub import CLOSE, SILENT, Handler, Raw, Reply, Request, Stream, StubServer


@given(st.binary(min_size=1, max_size=6), st.binary(max_size=6))
def test_prefix_end_bounds_exactly_the_keys_under_the_prefix(prefix: bytes, key: bytes) -> None:
    end = prefix_end(prefix)
    under = key.startswith(prefix)
    in_range = prefix <= key and (end == b"\0" or key < end)
    assert under == in_range


def test_prefix_end_of_0xff_bytes_is_the_end_of_the_key_space() -> None:
    assert prefix_end(b"a\xff\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"
    assert prefix_end("/lockd/") == b"/lockd0"


def test_requests_use_the_gateways_names_and_string_int64() -> None:
    body = json.loads(
        txn_body(
            [Compare("k", "create_revision", "==", 0), Compare("k", "value", "!=", b"\x00")],
            success=[RangeOp("/p/", prefix=True, sort_target="create_revision", limit=5)],
            failure=[],
        )
    )
    assert body["compare"] == [
        {"key": b64("k"), "target": "CREATE", "result": "EQUAL", "create_revision": "0"},
        {"key": b64("k"), "target": "VALUE", "result": "NOT_EQUAL", "value": "AA=="},
    ]
    [op] = body["success"]
    assert op == {
        "request_range": {
            "key": b64("/p/"),
            "range_end": b64("/p0"),
            "limit": "5",
            "sort_target": "CREATE",
            "sort_order": "ASCEND",
        }
    }
    guard = json.loads(Compare("/p/", "mod_revision", "<", 8, prefix=True).body())
    assert guard["range_end"] == b64("/p0") and guard["mod_revision"] == "8"
    with pytest.raises(TypeError):
        Compare("k", "mod_revision", "==", "7").body()
    with pytest.raises(ValueError):
        RangeOp("k", range_end="z", prefix=True).body()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


keys = st.binary(min_size=1, max_size=40)
int64s = st.integers(min_value=1, max_value=2**63 - 1)


@given(keys, st.binary(max_size=200), st.one_of(st.just(0), int64s), st.booleans(), keys)
def test_request_bodies_are_the_json_the_gateway_expects(
    key: bytes, value: bytes, lease: int, flag: bool, end: bytes
) -> None:
    """Bodies are written as JSON text directly: they must read back as the documents
    the gateway's protobuf JSON mapping expects, whatever bytes the keys hold."""
    put = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    if flag:
        put["prev_kv"] = True
    assert json.loads(PutOp(key, value, lease=lease, prev_kv=flag).body()) == put
    ranged = {"key": _b64(key), "range_end": _b64(end)}
    deleted = DeleteOp(key, range_end=end, prev_kv=flag).body()
    assert json.loads(deleted) == {**ranged, **({"prev_kv": True} if flag else {})}
    read = RangeOp(key, prefix=True, revision=lease, limit=3, keys_only=flag, count_only=True)
    expected = {"key": _b64(key), "range_end": _b64(prefix_end(key)), "limit": "3"}
    expected |= {"count_only": True} | ({"revision": str(lease)} if lease else {})
    assert json.loads(read.body()) == expected | ({"keys_only": True} if flag else {})
    guard = Compare(key, "value", "==", value, range_end=end)
    assert json.loads(guard.body()) == {
        **ranged,
        "target": "VALUE",
        "result": "EQUAL",
        "value": _b64(value),
    }
    watch = WatchRequest(key, prefix=flag, prev_kv=True).body(start_revision=lease)
    created = {"key": _b64(key), "prev_kv": True}
    if flag:
        created["range_end"] = _b64(prefix_end(key))
    if lease:
        created["start_revision"] = str(lease)
    assert json.loads(watch) == {"create_request": created}
    txn = json.loads(txn_body([guard], [PutOp(key, value, lease=lease, prev_kv=flag)], []))
    compares = [json.loads(guard.body())]
    assert txn == {"compare": compares, "success": [{"request_put": put}], "failure": []}


def test_replies_fill_in_the_fields_the_gateway_leaves_out() -> None:
    txn = TxnResult.parse({"header": {"revision": "9"}, "responses": [{"response_put": {}}]})
    assert (txn.header.revision, txn.succeeded) == (9, False)
    watch = WatchResponse.parse(
        {"header": {}, "events": [{"kv": {"key": b64("k"), "mod_revision": "4"}}]}
    )
    [event] = watch.events
    assert (event.type, event.kv.key, event.kv.value, event.kv.mod_revision) == (
        "PUT",
        b"k",
        b"",
        4,
    )
    assert unb64(None) == b""


def _gateway(*urls: str, timeout: float = 1.0) -> EtcdGateway:
    return EtcdGateway(GatewaySettings(urls, timeout=timeout))


async def _servers(nursery: trio.Nursery, handler: Handler, count: int = 2) -> list[StubServer]:
    return [await StubServer(handler).start(nursery) for _ in range(count)]


def _error(code: int, message: str, status: int = 503) -> Reply:
    return Reply(status, json={"error": message, "message": message, "code": code})


def _sent(server: StubServer) -> list[Request]:
    """The requests ``server`` got, less the status reads that ask who leads before a write
    (gateway ``_write_endpoint``)."""
    return [r for r in server.requests if r.path != "/v3/maintenance/status"]


def _dead_url() -> str:
    [port] = free_ports(1)
    return f"http://127.0.0.1:{port}"


# Also what a status read gets: a member that follows leader 1 (a real member always
# names one outside an election; leader 0 means one is under way, and writes wait).
OK = {"header": {"revision": "5", "member_id": "1"}, "leader": "1"}


async def test_a_read_moves_on_after_no_leader_and_sends_hasleader(nursery: trio.Nursery) -> None:
    first: list[StubServer] = []

    def handler(request: Request) -> Reply:
        if request in first[0].requests:
            return _error(14, "etcdserver: no leader")
        return Reply(json=OK)

    servers = await _servers(nursery, handler)
    first.append(servers[0])
    async with _gateway(*(s.url for s in servers)) as etcd:
        result = await etcd.get("k")
    assert result.header.revision == 5
    seen = [r for s in servers for r in s.requests]
    assert [len(s.requests) for s in servers] == [1, 1]
    assert all(r.headers["grpc-metadata-hasleader"] == "true" for r in seen)
    assert seen[0].json() == {"key": b64("k")}


async def test_a_compare_only_txn_is_decided_on_a_quorum_read(nursery: trio.Nursery) -> None:
    # etcd answers a txn with no ops from the member's own copy (it counts as
    # serializable): a follower then judged the compare on a store from
    # before an acknowledged put. One linearizable read in ``failure`` makes
    # it a quorum read; its reply is not the caller's.
    failed = {
        "header": {"revision": "5"},
        "succeeded": False,
        "responses": [{"response_range": {"count": "1"}}],
    }
    [server] = await _servers(nursery, lambda request: Reply(json=failed), count=1)
    async with _gateway(server.url) as etcd:
        result = await etcd.txn([Compare("k", "mod_revision", "<", 3, prefix=True)])
    assert not result.succeeded and result.responses == []
    [sent] = _sent(server)
    body = sent.json()
    assert body["success"] == []
    [read] = body["failure"]
    assert read == {"request_range": {"key": b64("k"), "count_only": True}}
    assert "serializable" not in read["request_range"]


async def test_a_write_whose_outcome_is_unknown_is_not_sent_again(nursery: trio.Nursery) -> None:
    timed_out = "etcdserver: request timed out, possibly due to previous leader failure"
    servers = await _servers(nursery, lambda request: _error(14, timed_out))
    async with _gateway(*(s.url for s in servers)) as etcd:
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.put("k", "v")
    assert caught.value.maybe_committed
    assert [len(_sent(s)) for s in servers] == [1, 0]


@pytest.mark.parametrize("cut", [CLOSE, Raw(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{}")])
async def test_a_write_cut_off_or_answered_with_garbage_is_not_sent_again(
    nursery: trio.Nursery, cut: object
) -> None:
    servers = await _servers(nursery, lambda request: cut)
    async with _gateway(*(s.url for s in servers)) as etcd:
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.put("k", "v")
    assert caught.value.maybe_committed
    assert [len(_sent(s)) for s in servers] == [1, 0]


async def test_a_write_refused_before_raft_moves_on_and_a_read_retries_a_broken_connection(
    nursery: trio.Nursery,
) -> None:
    ranges: list[Request] = []

    def handler(request: Request) -> object:
        if request.path == "/v3/kv/range":
            ranges.append(request)
            if len(ranges) == 1:
                return CLOSE  # the connection breaks after the read was sent
        return Reply(json=OK)

    dead = _dead_url()
    live = await _servers(nursery, handler, count=2)
    async with _gateway(dead, *(s.url for s in live)) as etcd:
        await etcd.put("k", "v")  # refused at the dead endpoint: sent to the next
        await etcd.get("k")  # cut off there: sent again, to the one after
    assert [r.path for r in _sent(live[0])] == ["/v3/kv/put", "/v3/kv/range"]
    assert [r.path for r in _sent(live[1])] == ["/v3/kv/range"]
    assert etcd.endpoint == live[1].url


async def test_nothing_answering_raises_unavailable_after_the_timeout() -> None:
    async with _gateway(*(_dead_url() for _ in range(3)), timeout=0.3) as etcd:
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.txn([Compare("k", "version", "==", 0)])
    assert not caught.value.maybe_committed
    assert "within 0.3 s" in str(caught.value)


async def test_a_silent_member_bounds_a_read_by_half_the_timeout_then_moves_on(
    nursery: trio.Nursery,
) -> None:
    silent = await StubServer(lambda request: SILENT).start(nursery)
    [live] = await _servers(nursery, lambda request: Reply(json=OK), count=1)
    async with _gateway(silent.url, live.url, timeout=1.0) as etcd:
        started = trio.current_time()
        await etcd.get("k")
        assert 0.5 <= trio.current_time() - started < 1.0
        await etcd.put("k", "v")  # a write now goes to the member that answered
    assert len(silent.requests) == 1 and len(_sent(live)) == 2


async def test_refusals_are_errors_not_unavailability(nursery: trio.Nursery) -> None:
    def handler(request: Request) -> Reply:
        if request.path == "/v3/lease/revoke":
            return _error(5, "etcdserver: requested lease not found", status=404)
        if request.path == "/v3/lease/keepalive":
            return Reply(json={"result": {"header": {}, "ID": "7"}})
        return _error(3, "etcdserver: key is not provided", status=400)

    servers = await _servers(nursery, handler)
    async with _gateway(*(s.url for s in servers)) as etcd:
        with pytest.raises(LeaseNotFound):
            await etcd.lease_revoke(7)
        with pytest.raises(LeaseNotFound):
            await etcd.lease_keepalive(7)
        with pytest.raises(EtcdError) as caught:
            await etcd.get("")
    assert caught.value.code == 3
    assert [len(s.requests) for s in servers] == [3, 0]


async def test_after_a_member_refuses_writes_wait_for_a_member_that_follows_a_live_leader(
    nursery: trio.Nursery,
) -> None:
    leaders = iter([1, 0, 2])  # member 2 follows the dead member 1, then no one, then itself

    def member(n: int) -> Handler:
        def handler(request: Request) -> Reply:
            if request.path == "/v3/maintenance/status":
                return Reply(json={"header": {"member_id": str(n)}, "leader": str(next(leaders))})
            return Reply(json={"header": {"member_id": str(n), "revision": str(4 + n)}})

        return handler

    one = await StubServer(member(1)).start(nursery)
    two = await StubServer(member(2)).start(nursery)
    async with _gateway(one.url, two.url, timeout=5) as etcd:
        await etcd.put("k", "1")  # learns that the first endpoint is member 1
        one.stop()  # member 1 dies: its kept connection closes, new ones are refused
        await trio.testing.wait_all_tasks_blocked()  # the close has happened
        result = await etcd.put("k", "2")
    assert result.header.revision == 6
    # The first write asks who leads (member 1) and goes there.
    assert [r.path for r in one.requests] == ["/v3/maintenance/status", "/v3/kv/put"]
    assert [r.path for r in two.requests] == [
        "/v3/maintenance/status",  # member 1 refused: no leader yet
        "/v3/maintenance/status",  # a new leader: this member
        "/v3/kv/put",
    ]


async def test_a_watch_resumes_on_the_next_member_from_the_revision_it_reached(
    nursery: trio.Nursery,
) -> None:
    created = b'{"result":{"header":{"revision":"9"},"created":true}}'
    event = b'{"result":{"header":{"revision":"10"},"events":[{"kv":{"key":"aw==",'
    event += b'"mod_revision":"10"}}]}}'
    later = event.replace(b'"10"', b'"11"')

    watches: list[Request] = []

    def handler(request: Request) -> object:
        watches.append(request)
        if len(watches) == 1:  # the first member sends one event, then dies
            return Raw(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + _chunk(created + b"\n")
                + _chunk(event + b"\n")
            )
        return Stream([created + b"\n", later + b"\n"], pieces=2)

    servers = await _servers(nursery, handler)
    request = WatchRequest("k", start_revision=10)
    async with _gateway(*(s.url for s in servers)) as etcd, etcd.watch(request) as watch:
        with trio.fail_after(5):
            assert (await watch.__anext__()).created
            assert [e.kv.mod_revision for e in (await watch.__anext__()).events] == [10]
            # Resumed elsewhere: the second "created" is not shown, the next event is.
            assert [e.kv.mod_revision for e in (await watch.__anext__()).events] == [11]
    assert servers[0].requests[0].json()["create_request"]["start_revision"] == "10"
    assert servers[1].requests[0].json()["create_request"]["start_revision"] == "11"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
