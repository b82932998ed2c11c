"""HTTP/1.1 for the etcd gateway client, without I/O: request heads out, responses in.

Why not h11 (which the transport used before): the daemon makes one etcd
call per lock decision, so the client's CPU per call is on every reply's
path, and h11's general state machine (events, header validation objects,
both directions of both roles) was a fifth of the daemon's CPU per
uncontended acquire + release on etcd (py-spy, bench/etcd_baseline.py B1).
The conversation here is narrow: the daemon sends a POST with a JSON body
and reads the answer of one server, etcd's JSON gateway (Go's net/http).
This module speaks exactly that and refuses the rest:

- the status line must be ``HTTP/1.1 DDD reason`` (a 1.0 server, bare LF line
  ends, folded header lines, control characters: refused);
- the body is framed by one ``Content-Length``, or ``Transfer-Encoding:
  chunked`` (chunk sizes without extensions; trailers are read and dropped),
  or, with neither, runs to the end of the connection; both at once are
  refused (RFC 9112 §6.3: a sign of response splitting);
- 1xx answers but 101 are skipped; 204 and 304 have no body;
- ``Connection: close``, a body that runs to the end, or bytes after the
  response end the connection's reuse.

Everything it accepts h11 accepts with the same status, reason, body and
reuse (tests/unit/test_etcd_http1.py checks that with hypothesis against h11);
what it refuses is :class:`Malformed`, which the transport reports as a
request that may have reached etcd.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

#: a response head (status line and headers) larger than this is not etcd's gateway talking.
MAX_HEAD_BYTES: Final = 64 * 1024
#: the longest chunk-size line accepted (16 hex digits and CRLF).
MAX_CHUNK_LINE: Final = 18

_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([0-9]{3}) ([\t\x20-\x7e\x80-\xff]*)")
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_VALUE = rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?"
_FIELD = re.compile(rb"(" + _TOKEN + rb"):[ \t]*(" + _FIELD_VALUE + rb")[ \t]*")
# A whole head in one match (status line, then each field line after a CRLF),
# and the fields that frame the body, found in its field lines: two calls
# into the regex engine instead of one per line.
_HEAD = re.compile(
    rb"HTTP/1\.1 ([0-9]{3}) ([\t\x20-\x7e\x80-\xff]*)"
    rb"((?:\r\n" + _TOKEN + rb":[ \t]*" + _FIELD_VALUE + rb"[ \t]*)*)"
)
_FRAMING_FIELD = re.compile(
    rb"\r\n(content-length|transfer-encoding|connection):[ \t]*(" + _FIELD_VALUE + rb")[ \t]*"
    rb"(?=\r\n|\Z)",
    re.IGNORECASE,
)
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(rb"[0-9]{1,18}")
# What the parts of a request head may hold (no CR, LF, NUL or other controls).
_REQUEST_NAME = re.compile(_TOKEN.decode())
_REQUEST_VALUE = re.compile(r"[\t\x20-\x7e]*")
_REQUEST_WORD = re.compile(r"[\x21-\x7e]+")

Headers = Sequence[tuple[str, str]]


class Malformed(Exception):
    """The bytes received are not a response this module understands."""


class Closed(Malformed):
    """The connection ended before the response's first byte."""


class _End:
    """The body's end (a singleton: ``END``)."""

    def __repr__(self) -> str:
        return "END"


END: Final = _End()

# Body framings.
_LENGTH, _CHUNKED, _TO_EOF, _DONE = range(4)
# Where a chunked body is.
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


@dataclass(frozen=True, slots=True)
class Head:
    """A final response's status line, and whether the connection may serve another request."""

    status: int
    reason: str
    keep_alive: bool


def request_head(target: str, host: str, body_length: int, headers: Headers = ()) -> bytes:
    """The head of ``POST target`` with a JSON body of ``body_length`` bytes.

    ``headers`` are added as given; a name or value that could end the
    head early (CR, LF, a control character) raises ValueError, so no
    request another could be smuggled into is ever sent.
    """
    before, after = _head_around_length(target, host, tuple(headers))
    return b"%s%d%s" % (before, body_length, after)


@functools.lru_cache(maxsize=64)
def _head_around_length(
    target: str, host: str, headers: tuple[tuple[str, str], ...]
) -> tuple[bytes, bytes]:
    """A request head but its Content-Length, checked once: the same few serve every call."""
    if not (_REQUEST_WORD.fullmatch(target) and target.startswith("/")):
        raise ValueError(f"invalid request target {target!r}")
    if not _REQUEST_WORD.fullmatch(host):
        raise ValueError(f"invalid Host {host!r}")
    after = ["\r\n"]
    for name, value in headers:
        if not (_REQUEST_NAME.fullmatch(name) and _REQUEST_VALUE.fullmatch(value)):
            raise ValueError(f"invalid request header {name!r}")
        after.append(f"{name}: {value}\r\n")
    after.append("\r\n")
    before = f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return (before + "Content-Length: ").encode("ascii"), "".join(after).encode("ascii")


class ResponseReader:
    """Responses read from the bytes of one connection, one after another.

    Feed what the socket gives with :meth:`feed` (``b""`` at its end), then
    call :meth:`read_head` until it returns the head and :meth:`read_body`
    until it returns :data:`END`; both return None when they need more
    bytes. After the end, :attr:`reusable` says whether the connection may
    carry the next request (:meth:`next_response` starts it).
    """

    __slots__ = (
        "_buffer",
        "_chunk_state",
        "_eof",
        "_framing",
        "_keep_alive",
        "_remaining",
        "has_head",
    )

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._eof = False
        self._framing = _DONE
        self._remaining = 0
        self._chunk_state = _SIZE
        self._keep_alive = False
        #: the head of the response being read has arrived.
        self.has_head = False

    def feed(self, data: bytes) -> None:
        """Bytes from the connection; ``b""`` means it ended."""
        if data:
            self._buffer += data
        else:
            self._eof = True

    @property
    def reusable(self) -> bool:
        """The last response ended, the server keeps the connection, and nothing else came."""
        return (
            self.has_head
            and self._framing == _DONE
            and self._keep_alive
            and not self._eof
            and not self._buffer
        )

    def next_response(self) -> None:
        """Start reading the next response (for the next request on this connection)."""
        self.has_head = False
        self._framing = _DONE

    def read_head(self) -> Head | None:
        """The final response's head (1xx answers skipped), or None until more bytes come."""
        while True:
            buffer = self._buffer
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise Malformed(f"response head longer than {MAX_HEAD_BYTES} bytes")
                if self._eof:
                    if buffer:
                        raise Malformed("the connection ended inside the response head")
                    raise Closed("the server closed the connection before answering")
                return None
            if end > MAX_HEAD_BYTES:
                raise Malformed(f"response head longer than {MAX_HEAD_BYTES} bytes")
            raw = bytes(buffer[:end])
            del buffer[: end + 4]
            head = self._parse_head(raw)
            if head is not None:
                self.has_head = True
                return head

    def _parse_head(self, head: bytes) -> Head | None:
        match = _HEAD.fullmatch(head)
        if match is None:
            raise Malformed(_what_is_wrong(head))
        status = int(match[1])
        if status < 100:
            raise Malformed(f"status {status} does not exist")
        length: int | None = None
        chunked = False
        keep_alive = True
        # Every CRLF in the field lines starts a line (the match above let
        # no CR or LF into a value), so each hit is a whole field line.
        for raw_name, value in _FRAMING_FIELD.findall(match[3]):
            name = raw_name.lower()
            if name == b"content-length":
                if length is not None or not _DIGITS.fullmatch(value):
                    raise Malformed(f"Content-Length {value[:40]!r} not understood")
                length = int(value)
            elif name == b"transfer-encoding":
                if chunked or value.lower() != b"chunked":
                    raise Malformed(f"Transfer-Encoding {value[:40]!r} not understood")
                chunked = True
            elif b"close" in (token.strip().lower() for token in value.split(b",")):
                keep_alive = False
        if 100 <= status < 200:
            if status == 101:
                raise Malformed("101 Switching Protocols, which was not asked for")
            return None  # informational (100 Continue): the real answer follows
        if status in (204, 304):  # no body, whatever the headers say (RFC 9112 §6.3)
            self._framing, self._remaining = _LENGTH, 0
        elif chunked:
            if length is not None:
                raise Malformed("both Content-Length and Transfer-Encoding")
            self._framing, self._chunk_state = _CHUNKED, _SIZE
        elif length is not None:
            self._framing, self._remaining = _LENGTH, length
        else:
            self._framing, keep_alive = _TO_EOF, False
        self._keep_alive = keep_alive
        return Head(status, match[2].decode("latin-1"), keep_alive)

    def read_body(self) -> bytes | _End | None:
        """The body's next piece (never empty), :data:`END` after its last, None for more bytes."""
        framing = self._framing
        if framing == _LENGTH:
            return self._read_length()
        if framing == _CHUNKED:
            return self._read_chunked()
        if framing == _TO_EOF:
            if self._buffer:
                return self._take(len(self._buffer))
            if self._eof:
                self._framing = _DONE
                return END
            return None
        return END

    def _read_length(self) -> bytes | _End | None:
        remaining = self._remaining
        if remaining == 0:
            self._framing = _DONE
            return END
        if self._buffer:
            piece = self._take(remaining)
            self._remaining = remaining - len(piece)
            return piece
        if self._eof:
            raise Malformed(f"the connection ended {remaining} bytes before the body's end")
        return None

    def _read_chunked(self) -> bytes | _End | None:
        buffer = self._buffer
        while True:
            state = self._chunk_state
            if state == _DATA:
                if not buffer:
                    break
                piece = self._take(self._remaining)
                self._remaining -= len(piece)
                if self._remaining == 0:
                    self._chunk_state = _DATA_END
                return piece
            if state == _SIZE:
                end = buffer.find(b"\r\n", 0, MAX_CHUNK_LINE)
                if end < 0:
                    if len(buffer) >= MAX_CHUNK_LINE:
                        raise Malformed(f"invalid chunk size line {bytes(buffer[:20])!r}")
                    break
                size = bytes(buffer[:end])
                if not _CHUNK_SIZE.fullmatch(size):
                    raise Malformed(f"invalid chunk size line {size!r}")
                del buffer[: end + 2]
                self._remaining = int(size, 16)
                self._chunk_state = _DATA if self._remaining else _TRAILER
            elif state == _DATA_END:
                if len(buffer) < 2:
                    if buffer[:1] not in (b"", b"\r"):
                        raise Malformed("a chunk does not end with CRLF")
                    break
                if buffer[:2] != b"\r\n":
                    raise Malformed("a chunk does not end with CRLF")
                del buffer[:2]
                self._chunk_state = _SIZE
            else:  # the trailer section: header lines up to an empty one, dropped
                if buffer[:2] == b"\r\n":
                    del buffer[:2]
                    self._framing = _DONE
                    return END
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > MAX_HEAD_BYTES:
                        raise Malformed("trailer section too long")
                    break
                for line in bytes(buffer[:end]).split(b"\r\n"):
                    if _FIELD.fullmatch(line) is None:
                        raise Malformed(f"invalid trailer line {line[:100]!r}")
                del buffer[: end + 4]
                self._framing = _DONE
                return END
        if self._eof:
            raise Malformed("the connection ended inside a chunked body")
        return None

    def _take(self, at_most: int) -> bytes:
        buffer = self._buffer
        if len(buffer) <= at_most:
            piece = bytes(buffer)
            buffer.clear()
        else:
            piece = bytes(buffer[:at_most])
            del buffer[:at_most]
        return piece


def _what_is_wrong(head: bytes) -> str:
    """Why a response head did not match (the first line at fault), for the error."""
    status_line, *fields = head.split(b"\r\n")
    if not _STATUS_LINE.fullmatch(status_line):
        return f"invalid status line {status_line[:100]!r}"
    for line in fields:
        if not _FIELD.fullmatch(line):
            return f"invalid header line {line[:100]!r}"
    return "invalid response head"  # not reached: the lines match one by one
