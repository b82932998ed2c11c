"""One Unix-socket connection to the daemon, shared by any number of threads.

Requests are pipelined: a thread sends its line under a send lock, then waits
for the reply carrying its ``id``. Reading is "one reader at a time": whichever
waiting thread finds no reader becomes the reader, reads from the socket
(buffered, line by line) and files every reply it sees under its id, then
wakes the others through a :class:`threading.Condition`. A thread whose reply
has been filed takes it and returns; a thread that gives up (time-out,
interrupt) leaves its id behind as abandoned, and if a grant later arrives for
it, the grant is released at once so the key is not held for nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ._wire import encode

__all__ = ["Connection", "ConnectionLost", "ReplyTimeout"]

_READ_CHUNK = 65536
_GRANT_OPS = frozenset({"acquire", "tryAcquire"})


class ConnectionLost(Exception):
    """The connection is gone (internal). ``protocol`` is True if the daemon sent garbage."""

    def __init__(self, reason: str, *, protocol: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.protocol = protocol


class ReplyTimeout(Exception):
    """No reply arrived within the time allowed (internal); the connection stays usable."""


class Connection:
    """A connected socket plus the bookkeeping that lets threads share it."""

    def __init__(self, sock: socket.socket, next_id: Callable[[], int]) -> None:
        self._sock = sock
        self._next_id = next_id
        self._send_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._buf = bytearray()
        self._replies: dict[int, dict[str, Any]] = {}
        self._waiting: set[int] = set()
        self._abandoned: dict[int, str] = {}
        self._late_grants: list[tuple[str, str]] = []
        self._reading = False
        self._dead: ConnectionLost | None = None
        self._fd_closed = False

    @classmethod
    def open(
        cls,
        path: str,
        *,
        connect_timeout: float | None,
        send_timeout: float | None,
        next_id: Callable[[], int],
    ) -> Connection:
        """Connect to ``path``; raises OSError when that fails."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(connect_timeout)
            sock.connect(path)
            # Reads wait in poll(); the socket timeout only bounds a stuck send.
            sock.settimeout(send_timeout)
        except BaseException:
            sock.close()
            raise
        return cls(sock, next_id)

    # -- public -------------------------------------------------------------

    @property
    def dead(self) -> bool:
        """True once the connection is unusable."""
        return self._dead is not None

    def request(self, message: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """Send ``message`` and return the reply with its id.

        Raises ConnectionLost when the connection breaks before the reply is
        in, ReplyTimeout when ``timeout`` seconds pass without it.
        """
        rid: int = message["id"]
        line = encode(message)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._dead is not None:
                raise self._lost()
            self._waiting.add(rid)
        answered = False
        try:
            self._send(line)
            reply = self._wait_reply(rid, deadline)
            answered = True
            return reply
        finally:
            with self._cond:
                self._waiting.discard(rid)
                if not answered:
                    leftover = self._replies.pop(rid, None)
                    if leftover is not None:
                        self._note_late_locked(message["op"], leftover)
                    elif self._dead is None:
                        self._abandoned[rid] = message["op"]
            self._flush_late_grants()

    def is_closed_by_peer(self) -> bool:
        """Check an idle connection for EOF without blocking (True if it is dead).

        Used before sending a request that must not be retried: a daemon that
        restarted while we were idle is noticed here, before anything is sent.
        """
        with self._cond:
            if self._dead is not None:
                return True
            if self._reading or self._waiting:
                return False
            self._read_once_locked(0.0)
            dead = self._dead is not None
        self._flush_late_grants()
        return dead

    def close(self) -> None:
        """Close the connection; threads waiting on it get ConnectionLost."""
        with self._cond:
            self._kill_locked("the client closed the connection")

    # -- internals ----------------------------------------------------------

    def _lost(self) -> ConnectionLost:
        dead = self._dead
        assert dead is not None
        return ConnectionLost(dead.reason, protocol=dead.protocol)

    def _send(self, line: bytes) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(line)
        except OSError as exc:
            with self._cond:
                self._kill_locked(f"sending failed ({_describe(exc)})")
                raise self._lost() from exc

    def _wait_reply(self, rid: int, deadline: float | None) -> dict[str, Any]:
        with self._cond:
            while True:
                reply = self._replies.pop(rid, None)
                if reply is not None:
                    return reply
                if self._dead is not None:
                    raise self._lost()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ReplyTimeout()
                if self._reading:
                    self._cond.wait(remaining)
                    continue
                self._read_once_locked(remaining)
                if self._late_grants:
                    self._cond.release()
                    try:
                        self._flush_late_grants()
                    finally:
                        self._cond.acquire()

    def _read_once_locked(self, timeout: float | None) -> None:
        """Become the reader, wait up to ``timeout`` for data, file what arrives."""
        self._reading = True
        try:
            self._cond.release()
            try:
                data = self._recv(timeout)
            finally:
                self._cond.acquire()
            if data is not None:
                self._absorb_locked(data)
        except OSError as exc:
            self._kill_locked(f"reading failed ({_describe(exc)})")
        finally:
            self._reading = False
            self._cond.notify_all()
            if self._dead is not None:
                self._close_fd_locked()

    def _recv(self, timeout: float | None) -> bytes | None:
        """Bytes from the socket (b"" at EOF), or None if nothing came in time."""
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        wait_ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        if not poller.poll(wait_ms):
            return None
        return self._sock.recv(_READ_CHUNK)

    def _absorb_locked(self, data: bytes) -> None:
        if not data:
            self._kill_locked("the daemon closed the connection")
            return
        self._buf += data
        start = 0
        while (end := self._buf.find(b"\n", start)) >= 0:
            line = bytes(self._buf[start:end])
            start = end + 1
            if not line.strip():
                continue
            try:
                reply = json.loads(line)
            except ValueError:
                reply = None
            if not isinstance(reply, dict):
                self._kill_locked(
                    f"the daemon sent a line that is not a JSON object: {line[:200]!r}",
                    protocol=True,
                )
                return
            self._file_locked(reply)
        del self._buf[:start]

    def _file_locked(self, reply: dict[str, Any]) -> None:
        rid = reply.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool):
            return  # id null: the daemon could not read one of our requests
        if rid in self._waiting:
            self._replies[rid] = reply
            return
        op = self._abandoned.pop(rid, None)
        if op is not None:
            self._note_late_locked(op, reply)

    def _note_late_locked(self, op: str, reply: dict[str, Any]) -> None:
        """A reply nobody waits for any more: if it granted a lease, give it back."""
        if op not in _GRANT_OPS or reply.get("ok") is not True:
            return
        result = reply.get("result")
        if isinstance(result, dict):
            key, handle = result.get("key"), result.get("handle")
            if isinstance(key, str) and isinstance(handle, str):
                self._late_grants.append((key, handle))

    def _flush_late_grants(self) -> None:
        with self._cond:
            grants, self._late_grants = self._late_grants, []
            if self._dead is not None or not grants:
                return
        for key, handle in grants:
            rid = self._next_id()
            with self._cond:
                self._abandoned[rid] = "release"
            line = encode({"id": rid, "op": "release", "key": key, "handle": handle})
            try:
                with self._send_lock:
                    self._sock.sendall(line)
            except OSError as exc:
                with self._cond:
                    self._kill_locked(f"sending failed ({_describe(exc)})")
                return

    def _kill_locked(self, reason: str, *, protocol: bool = False) -> None:
        if self._dead is None:
            self._dead = ConnectionLost(reason, protocol=protocol)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._cond.notify_all()
        if not self._reading:
            self._close_fd_locked()

    def _close_fd_locked(self) -> None:
        if not self._fd_closed:
            self._fd_closed = True
            with self._send_lock:
                self._sock.close()


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__
