"""The etcd client's HTTP/1.1 response parser (http1.py) against h11's reading of the same bytes.

The parser is strict on purpose: it accepts the responses etcd's gateway
sends and refuses the rest. The property that makes it safe: whatever it
accepts, h11 (a general, well-tested HTTP/1.1 implementation) accepts too,
with the same status, reason, body and connection reuse, whichever way the
bytes are split into reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockd.daemon.backends.etcd.http1 import (
    END,
    MAX_HEAD_BYTES,
    Closed,
    Malformed,
    ResponseReader,
    request_head,
)
from tests.depth import examples


@dataclass(frozen=True)
class Read:
    """What a parser made of a response: None fields when it refused it."""

    status: int
    reason: str
    body: bytes
    reusable: bool


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[last:point])
        last = point
    return [p for p in pieces if p]


def ours(pieces: list[bytes]) -> Read | None:
    reader = ResponseReader()
    head, body, done = None, b"", False
    reusable = False
    try:
        for piece in [*pieces, b""]:
            if piece == b"" and done:
                break
            reader.feed(piece)
            if head is None:
                head = reader.read_head()
            while head is not None and not done:
                got = reader.read_body()
                if got is None:
                    break
                if got is END:
                    done = True
                    reusable = reader.reusable
                else:
                    assert isinstance(got, bytes) and got
                    body += got
    except Malformed:
        return None
    if not done or head is None:
        return None
    return Read(head.status, head.reason, body, reusable)


def theirs(pieces: list[bytes]) -> Read | None:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/v3/kv/txn", headers=[("Host", "etcd")]))
    conn.send(h11.EndOfMessage())
    status, reason, body, done, reusable = 0, "", b"", False, False
    try:
        for piece in [*pieces, b""]:
            if piece == b"" and done:
                break
            conn.receive_data(piece)
            while not done:
                event = conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                if isinstance(event, h11.Response):
                    status, reason = event.status_code, event.reason.decode("latin-1")
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    done = True
                    reusable = conn.their_state is h11.DONE and not conn.trailing_data[0]
                    reusable = reusable and not conn.trailing_data[1]
                elif isinstance(event, h11.ConnectionClosed):
                    return None
    except (h11.RemoteProtocolError, h11.LocalProtocolError):
        return None
    return Read(status, reason, body, reusable) if done else None


# --- responses etcd's gateway could send ---------------------------------------------

tokens = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_0123456789", min_size=1
)
values = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30)
reasons = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)
other_headers = st.lists(
    st.tuples(tokens, values).filter(
        lambda h: h[0].lower() not in ("content-length", "transfer-encoding", "connection")
    ),
    max_size=5,
)


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    head = b""
    if draw(st.booleans()):
        head += b"HTTP/1.1 100 Continue\r\n\r\n"
    status = draw(st.sampled_from([200, 200, 204, 304, 400, 404, 500, 503]))
    reason = draw(reasons)
    headers = [(n.encode(), v.encode()) for n, v in draw(other_headers)]
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "eof"]))
    if status in (204, 304):
        body = b""
    if draw(st.booleans()):
        headers.append((b"Connection", draw(st.sampled_from([b"close", b"keep-alive"]))))
    if framing == "length":
        headers.append(
            (draw(st.sampled_from([b"Content-Length", b"content-length"])), b"%d" % len(body))
        )
        wire_body = body
    elif framing == "chunked":
        headers.append((b"Transfer-Encoding", draw(st.sampled_from([b"chunked", b"Chunked"]))))
        cuts = draw(st.lists(st.integers(0, 300), max_size=4))
        wire_body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in split(body, cuts))
        trailers = draw(st.lists(st.tuples(tokens, values), max_size=2))
        wire_body += b"0\r\n" + b"".join(
            b"%s: %s\r\n" % (n.encode(), v.encode()) for n, v in trailers
        )
        wire_body += b"\r\n"
    else:
        wire_body = body
    draw(st.randoms()).shuffle(headers)
    lines = [b"HTTP/1.1 %d %s" % (status, reason.encode()), *(n + b": " + v for n, v in headers)]
    extra = draw(st.sampled_from([b"", b"", b"HTTP/1.1 200 OK\r\n"]))  # bytes after it
    return (
        head + b"\r\n".join(lines) + b"\r\n\r\n" + wire_body + (b"" if framing == "eof" else extra)
    )


@settings(max_examples=examples(250), suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.lists(st.integers(0, 1000), max_size=8))
def test_a_gateway_response_reads_as_h11_reads_it(response: bytes, cuts: list[int]) -> None:
    pieces = split(response, cuts)
    mine = ours(pieces)
    assert mine is not None
    assert mine == theirs(pieces)


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(responses()))
    alphabet = b" \t\r\n:;,0123456789abcdefHTP/.\x00\x7f\x80chunked-lengthclose"
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        what = draw(st.sampled_from(["insert", "delete", "replace"]))
        byte = draw(st.sampled_from(alphabet))
        if what == "insert":
            data[at:at] = bytes([byte])
        elif at < len(data):
            if what == "delete":
                del data[at]
            else:
                data[at] = byte
    return bytes(data)


@settings(max_examples=examples(500), suppress_health_check=[HealthCheck.too_slow])
@given(mangled(), st.lists(st.integers(0, 1000), max_size=4))
def test_whatever_it_accepts_h11_accepts_alike(response: bytes, cuts: list[int]) -> None:
    pieces = split(response, cuts)
    mine = ours(pieces)
    if mine is not None:
        assert mine == theirs(pieces)


# --- what it refuses --------------------------------------------------------------


def read_all(data: bytes) -> Read | None:
    return ours([data])


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",  # not what etcd speaks
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",  # bare LF line ends
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=1\r\n{}\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: \x01\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{}",  # ends 3 bytes short
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",  # no last chunk
        b"HTTP/1.1 200 OK\r\nContent-Le",  # ends inside the head
    ],
)
def test_what_it_does_not_understand_is_malformed(response: bytes) -> None:
    assert read_all(response) is None


def test_an_answer_that_never_started_is_closed_not_malformed() -> None:
    reader = ResponseReader()
    reader.feed(b"")
    with pytest.raises(Closed):
        reader.read_head()


def test_a_head_too_long_is_refused_before_it_ends() -> None:
    reader = ResponseReader()
    reader.feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD_BYTES)
    with pytest.raises(Malformed, match="longer than"):
        reader.read_head()


def test_responses_follow_each_other_on_one_connection() -> None:
    reader = ResponseReader()
    one = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    for _ in range(3):
        reader.next_response()
        reader.feed(one)
        head = reader.read_head()
        assert head is not None and head.status == 200 and head.keep_alive
        assert reader.read_body() == b"{}"
        assert reader.read_body() is END and reader.reusable


def test_the_request_head() -> None:
    head = request_head("/v3/kv/txn", "127.0.0.1:2379", 14, [("Grpc-Metadata-hasleader", "true")])
    assert head == (
        b"POST /v3/kv/txn HTTP/1.1\r\nHost: 127.0.0.1:2379\r\n"
        b"Content-Type: application/json\r\nContent-Length: 14\r\n"
        b"Grpc-Metadata-hasleader: true\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("target", "headers"),
    [
        ("/v3/kv/txn", [("Authorization", "tok\r\nX-Evil: 1")]),
        ("/v3/kv/txn", [("Bad Name", "1")]),
        ("/v3/kv/txn", [("A", "\x00")]),
        ("/v3/kv/txn HTTP/1.1\r\nX: 1", []),
        ("v3/kv/txn", []),
    ],
)
def test_a_request_head_that_could_smuggle_is_refused(
    target: str, headers: list[tuple[str, str]]
) -> None:
    with pytest.raises(ValueError):
        request_head(target, "127.0.0.1:2379", 0, headers)
