"""The daemon's wire protocol with nothing hidden, for tests and benchmarks.

:class:`RawConn` speaks JSON lines over the Unix socket without the client
library in between: bytes in, dicts out, so a test can send what the client
never would and see every field of every reply (docs/contract.md §2). The
``check_*`` helpers assert the shape of an error reply.
"""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path
from typing import Any


class RawConn:
    """A JSON-lines connection with nothing hidden: bytes in, dicts out."""

    def __init__(self, path: Path | str, timeout: float = 15.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.buf = b""
        self.timeout = timeout

    def send(self, message: dict[str, Any] | bytes) -> None:
        """Send a dict as one JSON line, or bytes as they are (newline added)."""
        data = message if isinstance(message, bytes) else json.dumps(message).encode()
        self.sock.sendall(data + b"\n")

    def read(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next reply, or None when the daemon closed the connection."""
        self.sock.settimeout(timeout if timeout is not None else self.timeout)
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                assert not self.buf, f"connection closed mid-line: {self.buf[:200]!r}"
                return None
            self.buf += chunk
        data, self.buf = self.buf.split(b"\n", 1)
        reply = json.loads(data)
        assert isinstance(reply, dict), reply
        return reply

    def reply(self, timeout: float | None = None) -> dict[str, Any]:
        reply = self.read(timeout)
        assert reply is not None, "the daemon closed the connection"
        return reply

    def call(self, message: dict[str, Any] | bytes) -> dict[str, Any]:
        self.send(message)
        return self.reply()

    def result(self, message: dict[str, Any]) -> Any:
        reply = self.call(message)
        assert reply.get("ok") is True, reply
        assert set(reply) == {"id", "ok", "result"}
        assert reply["id"] == message["id"]
        return reply["result"]

    def error(self, message: dict[str, Any] | bytes) -> dict[str, Any]:
        reply = self.call(message)
        assert reply.get("ok") is False, reply
        assert set(reply) == {"id", "ok", "error"}
        return reply

    def closed(self, timeout: float = 10.0) -> bool:
        """True if the daemon closed this connection (EOF or reset) in time."""
        try:
            return self.read(timeout) is None
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def unique(prefix: str = "k") -> str:
    return f"{prefix}:{uuid.uuid4().hex[:12]}"


def check_error(reply: dict[str, Any], code: str, status: int) -> dict[str, Any]:
    error = reply["error"]
    assert set(error) == {"code", "status", "message", "details"}
    assert (error["code"], error["status"]) == (code, status), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["details"], dict)
    return error


def check_invalid(reply: dict[str, Any], field: str | None) -> None:
    error = check_error(reply, "INVALID_REQUEST", 400)
    assert error["details"].get("field") == field, error
