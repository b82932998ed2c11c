"""The daemon's orjson path decodes and encodes exactly as its stdlib path does.

``lockd.daemon.protocol`` reads request lines and writes flat results with
orjson when it is installed (issue 25) and falls back to the stdlib for
everything orjson would treat differently. These tests run every input
both ways (``protocol.orjson`` set to None is the stdlib-only daemon) and
require the same request or the same error, and the same reply bytes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockd.daemon import protocol
from lockd.daemon.protocol import ProtocolError, Request, encode_result, parse_request

orjson = pytest.importorskip("orjson")


def _outcome(line: bytes | str) -> Request | tuple[str, str, Any, dict[str, Any]]:
    try:
        return parse_request(line)
    except ProtocolError as exc:
        return (exc.code, exc.message, exc.request_id, exc.details)


def _both(line: bytes | str) -> tuple[Any, Any]:
    fast = _outcome(line)
    saved = protocol.orjson
    protocol.orjson = None  # type: ignore[assignment]
    try:
        slow = _outcome(line)
    finally:
        protocol.orjson = saved
    return fast, slow


def test_orjson_is_used_for_a_plain_request() -> None:
    line = b'{"id":1,"op":"tryAcquire","key":"k","ttlMs":30000}'
    assert protocol._fast_decode(line) == {"id": 1, "op": "tryAcquire", "key": "k", "ttlMs": 30000}


@pytest.mark.parametrize(
    "line",
    [
        b'{"id":1,"op":"tryAcquire","key":"k","ttlMs":30000}',
        b'{"id":1180591620717411303424,"op":"hello"}',  # 2**70: an integer id, not a float
        b'{"id":18446744073709551616,"op":"hello"}',  # 2**64
        b'{"id":9223372036854775808,"op":"hello"}',  # 2**63
        b'{"id":-9223372036854775809,"op":"hello"}',
        b'{"id":1,"op":"tryAcquire","key":"k","ttlMs":1180591620717411303424}',
        b'{"id":1,"op":"tryAcquire","key":"k","ttlMs":30000.0}',
        b'{"id":1,"op":"tryAcquire","key":"k","ttlMs":1e999}',
        b'{"id":1,"op":"tryAcquire","key":"k","ttlMs":NaN}',
        b'{"id":"\\ud800","op":"hello"}',  # a lone surrogate: orjson refuses, the stdlib decodes
        b'{"id":1,"op":"tryAcquire","key":"\\udfff","ttlMs":5}',
        b'{"id":1,"op":"hello","id":2}',
        b'{"id":1,"op":"tryAcquire","key":"a","key":"b","ttlMs":5}',
        b'{"id":1,"op":"release","key":"a","handle":"x\\":"}',  # an escaped '":' in a value
        b'{"id" :1,"op":"hello"}',
        b' {"id":1,"op":"hello"} ',
        b'{"id":1,"op":"hello"} x',
        b'{"id":1,"op":"hello"',
        b"[1,2]",
        b"1180591620717411303424",
        b'"text"',
        b"\xff\xfe",
        b'{"id":1,"op":"tryAcquire","key":"\xc3\xa9","ttlMs":5}',
        b'{"id":1,"op":"tryAcquire","key":"\xed\xa0\x80","ttlMs":5}',  # surrogate as UTF-8
        b'{"id":1,"op":"tryAcquire","key":["k"],"ttlMs":5}',
        b'{"id":[1180591620717411303424],"op":"hello"}',
        b'{"id":true,"op":"hello"}',
        b'{"id":1,"op":"tryAcquire","key":"k","ttlMs":true}',
        b'{"id":1,"op":"hello","events":null}',
        b'{"id":1,"op":"acquire","key":"k","ttlMs":5,"timeoutMs":-0}',
        b"[" * 5000 + b"]" * 5000,
        b'{"id":1,"op":"tryAcquire","key":"k","ttlMs":' + b"9" * 5000 + b"}",
        '{"id":1,"op":"tryAcquire","key":"k","ttlMs":30000}',  # str lines too
        '{"id":1,"op":"hello","op":"hello"}',
    ],
)
def test_edge_lines_parse_alike(line: bytes | str) -> None:
    fast, slow = _both(line)
    assert fast == slow


_json_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
_field_names = st.sampled_from(
    ["id", "op", "key", "ttlMs", "timeoutMs", "owner", "handle", "releaseOnClose", "mode", "x"]
)
_field_values = st.one_of(
    _json_value,
    st.sampled_from(["tryAcquire", "acquire", "release", "hello", "renew", "k", 1, 30000]),
)


@settings(max_examples=400, deadline=None)
@given(
    pairs=st.lists(st.tuples(_field_names, _field_values), max_size=7),
    ascii_only=st.booleans(),
)
def test_any_request_object_parses_alike(pairs: list[tuple[str, Any]], ascii_only: bool) -> None:
    # Built by hand so that a name can repeat (a dict could not hold a duplicate).
    body = ",".join(
        json.dumps(name) + ":" + json.dumps(value, ensure_ascii=ascii_only) for name, value in pairs
    )
    text = "{" + body + "}"
    try:
        line = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written raw: not a line a socket can carry
        return
    fast, slow = _both(line)
    assert fast == slow


_flat_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=12),
    st.sampled_from(["\x7f", "\ud800", "é", "\n\t\x00", "</script>", "\\"]),
)


@settings(max_examples=400, deadline=None)
@given(
    request_id=st.integers(min_value=-(2**70), max_value=2**70) | st.text(max_size=6),
    result=st.none() | st.dictionaries(st.text(max_size=6), _flat_values, max_size=6),
)
def test_flat_results_encode_to_the_same_bytes(request_id: int | str, result: Any) -> None:
    fast = encode_result(request_id, result)
    saved = protocol.orjson
    protocol.orjson = None  # type: ignore[assignment]
    try:
        slow = encode_result(request_id, result)
    finally:
        protocol.orjson = saved
    assert fast == slow


def test_a_grant_reply_is_written_by_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[object] = []
    real = orjson.dumps

    class Spy:
        JSONDecodeError = orjson.JSONDecodeError
        loads = staticmethod(orjson.loads)

        @staticmethod
        def dumps(obj: object) -> bytes:
            called.append(obj)
            return real(obj)

    monkeypatch.setattr(protocol, "orjson", Spy)
    grant = {
        "key": "k",
        "handle": "h",
        "fence": 3,
        "owner": None,
        "ttlMs": 5,
        "leaseExpiresAt": "t",
    }
    line = encode_result(7, grant)
    assert called and json.loads(line) == {"id": 7, "ok": True, "result": grant}


def test_nested_and_float_results_take_the_stdlib() -> None:
    result = {"latency": {"p50Ms": 1e16}, "n": 0.1}
    expected = b'{"id":1,"ok":true,"result":{"latency":{"p50Ms":1e+16},"n":0.1}}\n'
    assert encode_result(1, result) == expected  # orjson would write 1e16
