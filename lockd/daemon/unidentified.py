"""A connection whose caller could not be identified yet: answered, not dropped.

When the daemon cannot tell who is calling (the user and group database
cannot be read: out of descriptors, an NSS source down, a login that
vanished mid-lookup), it must not guess -- an admin would become a member --
and it must not hang up without a word either (the client saw only a broken
pipe). So each request on such a connection is answered
``BACKEND_UNAVAILABLE`` (``details.reason: "identity_unavailable"``; retry
safe, nothing was done) and identification is tried again before the next
one. Once it succeeds, the request that was waiting and everything after it
go to the connection's ordinary loop.

The same bounds apply as on an identified connection: a line longer than
``max_line_bytes`` ends the connection, and so does a line not complete
within ``partial_line_timeout`` of its first byte.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable

import trio

from lockd.daemon import sockio
from lockd.daemon.protocol import ProtocolError, encode_error, encode_protocol_error, parse_request
from lockd.identity import Caller, IdentityUnavailable
from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.server")

REASON = "identity_unavailable"


def identity_error(request_id: object, exc: OSError) -> bytes:
    """The reply to a request whose caller could not be identified."""
    rid = request_id if isinstance(request_id, int | str) else None
    why = exc.strerror or str(exc) or "lookup failed"
    return encode_error(
        rid,
        "BACKEND_UNAVAILABLE",
        f"cannot establish who is calling ({why}); nothing was done, retry",
        {"reason": REASON},
    )


def _answer(line: bytes, exc: OSError) -> bytes:
    try:
        request = parse_request(line)
    except ProtocolError as bad:
        return encode_protocol_error(bad)
    return identity_error(request.id, exc)


async def serve_until_identified(
    sock: socket.socket,
    resolve: Callable[[socket.socket], Caller],
    first_error: OSError,
    *,
    max_line_bytes: int,
    partial_line_timeout: float,
) -> tuple[Caller, bytes] | None:
    """Answer requests until ``resolve`` succeeds: the caller and the bytes not yet served.

    None when the connection ended first (the peer left, a bound was crossed).
    """
    error = first_error
    buffer = bytearray()
    line_started = 0.0
    try:
        while True:
            newline = buffer.find(b"\n")
            if newline == -1:
                if len(buffer) > max_line_bytes:
                    return None
                data: bytes | None = None
                deadline = line_started + partial_line_timeout if buffer else math.inf
                with trio.move_on_at(deadline):
                    data = await sockio.recv_some(sock)
                if not data:  # None: the line took too long; b"": the peer left
                    return None
                if not buffer:
                    line_started = trio.current_time()
                buffer += data
                continue
            line = bytes(buffer[:newline])
            if not line or line.isspace():
                del buffer[: newline + 1]
                continue
            try:
                caller = resolve(sock)
            except IdentityUnavailable as exc:
                error = exc
            else:
                log.info(kv(event="identified", principal=caller.principal, after=REASON))
                return caller, bytes(buffer)
            del buffer[: newline + 1]
            if buffer:
                line_started = trio.current_time()
            await sockio.send_all(sock, _answer(line, error))
    except (trio.ClosedResourceError, OSError):
        return None
