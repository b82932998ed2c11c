"""etcd gateway messages (no etcd needed) and the client's failover rules on scripted replies.

The scripted replies (httpx.MockTransport) are the gateway's real answers as
seen from a live etcd 3.4; they pin down which failures the client retries
elsewhere and which it must report as "maybe committed".
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
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
    RangeOp,
    TxnResult,
    WatchResponse,
    b64,
    prefix_end,
    txn_body,
    unb64,
)


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
    body = txn_body(
        [Compare("k", "create_revision", "==", 0), Compare("k", "value", "!=", b"\x00")],
        success=[RangeOp("/p/", prefix=True, sort_target="create_revision", limit=5)],
        failure=[],
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
    assert Compare("/p/", "mod_revision", "<", 8, prefix=True).body()["range_end"] == b64("/p0")
    with pytest.raises(TypeError):
        Compare("k", "mod_revision", "==", "7").body()
    with pytest.raises(ValueError):
        RangeOp("k", range_end="z", prefix=True).body()


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


Handler = Callable[[httpx.Request], httpx.Response]


def _gateway(handler: Handler, endpoints: int = 2, timeout: float = 1.0) -> EtcdGateway:
    urls = [f"http://10.0.0.{i}:2379" for i in range(1, endpoints + 1)]
    return EtcdGateway(
        GatewaySettings(urls, timeout=timeout), transport=httpx.MockTransport(handler)
    )


def _error(code: int, message: str, status: int = 503) -> httpx.Response:
    return httpx.Response(status, json={"error": message, "message": message, "code": code})


OK = {"header": {"revision": "5", "member_id": "1"}}


async def test_a_read_moves_on_after_no_leader_and_sends_hasleader() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "10.0.0.1":
            return _error(14, "etcdserver: no leader")
        return httpx.Response(200, json=OK)

    async with _gateway(handler) as etcd:
        result = await etcd.get("k")
    assert result.header.revision == 5
    assert [r.url.host for r in seen] == ["10.0.0.1", "10.0.0.2"]
    assert all(r.headers["Grpc-Metadata-hasleader"] == "true" for r in seen)
    assert json.loads(seen[0].content) == {"key": b64("k")}


async def test_a_write_whose_outcome_is_unknown_is_not_sent_again() -> None:
    hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return _error(14, "etcdserver: request timed out, possibly due to previous leader failure")

    async with _gateway(handler) as etcd:
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.put("k", "v")
    assert caught.value.maybe_committed
    assert hosts == ["10.0.0.1"]


async def test_a_write_refused_before_raft_moves_on_and_a_read_retries_a_broken_connection() -> (
    None
):
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.url.host}{request.url.path}")
        if request.url.host == "10.0.0.1" and request.url.path == "/v3/kv/put":
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/v3/kv/range" and len(calls) == 3:
            raise httpx.ReadError("reset", request=request)
        return httpx.Response(200, json=OK)

    async with _gateway(handler) as etcd:
        await etcd.put("k", "v")
        await etcd.get("k")
    assert calls == [
        "10.0.0.1/v3/kv/put",
        "10.0.0.2/v3/kv/put",
        "10.0.0.2/v3/kv/range",
        "10.0.0.1/v3/kv/range",
    ]


async def test_nothing_answering_raises_unavailable_after_the_timeout() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with _gateway(handler, endpoints=3, timeout=0.3) as etcd:
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.txn([Compare("k", "version", "==", 0)])
    assert not caught.value.maybe_committed
    assert "within 0.3 s" in str(caught.value)


async def test_refusals_are_errors_not_unavailability() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v3/lease/revoke":
            return _error(5, "etcdserver: requested lease not found", status=404)
        if request.url.path == "/v3/lease/keepalive":
            return httpx.Response(200, json={"result": {"header": {}, "ID": "7"}})
        return _error(3, "etcdserver: key is not provided", status=400)

    async with _gateway(handler) as etcd:
        with pytest.raises(LeaseNotFound):
            await etcd.lease_revoke(7)
        with pytest.raises(LeaseNotFound):
            await etcd.lease_keepalive(7)
        with pytest.raises(EtcdError) as caught:
            await etcd.get("")
    assert caught.value.code == 3


async def test_after_a_member_refuses_writes_wait_for_a_member_that_follows_a_live_leader() -> None:
    leaders = iter([1, 0, 2])  # host 2 follows the dead member 1, then no one, then itself
    down = False
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        calls.append(f"{host}{path}")
        if host == "10.0.0.1":
            if down:
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(200, json={"header": {"member_id": "1", "revision": "5"}})
        if path == "/v3/maintenance/status":
            return httpx.Response(
                200, json={"header": {"member_id": "2"}, "leader": str(next(leaders))}
            )
        return httpx.Response(200, json={"header": {"member_id": "2", "revision": "6"}})

    async with _gateway(handler, timeout=5) as etcd:
        await etcd.put("k", "1")  # learns that 10.0.0.1 is member 1
        down = True
        result = await etcd.put("k", "2")
    assert result.header.revision == 6
    assert calls[1:] == [
        "10.0.0.1/v3/kv/put",  # refused: member 1 is down
        "10.0.0.2/v3/maintenance/status",  # follows 1: not through here
        "10.0.0.1/v3/maintenance/status",  # still refused; a round failed: back off
        "10.0.0.2/v3/maintenance/status",  # no leader yet
        "10.0.0.1/v3/maintenance/status",
        "10.0.0.2/v3/maintenance/status",  # a new leader
        "10.0.0.2/v3/kv/put",
    ]
