"""Connecting a non-blocking Unix socket honestly, for the asyncio and trio clients.

``asyncio.open_unix_connection`` and ``trio.open_unix_socket`` treat a
non-blocking ``connect()`` that fails with ``EAGAIN`` as one in progress:
they wait until the socket is writable, read ``SO_ERROR`` (0) and hand back
a socket that is not connected at all. On Linux a Unix socket answers
``EAGAIN`` when the daemon's listen backlog is full (other clients
connecting at the same moment), and the peer check then read the
credentials of nobody ("untrusted uid -1"): 200 connects in 200 failed while
other clients churned connections. Here ``EAGAIN`` means "try again": the
connect is retried, with a short growing pause, until it goes through or the
caller's time runs out; a connect in progress (``EINPROGRESS``) is waited
for and its ``SO_ERROR`` read; and the socket is only handed back -- and
only then checked against the trusted uids -- once ``getpeername`` shows it
connected.
"""

from __future__ import annotations

import errno
import math
import socket
import time
from collections.abc import Awaitable, Callable

__all__ = ["connect_unix"]

#: first and longest pause between two tries while the backlog is full.
_FIRST_PAUSE = 0.001
_LONGEST_PAUSE = 0.05


async def connect_unix(
    path: str,
    timeout: float | None,
    *,
    sleep: Callable[[float], Awaitable[object]],
    wait_writable: Callable[[socket.socket], Awaitable[object]],
) -> socket.socket:
    """A connected non-blocking ``AF_UNIX`` socket to ``path``; OSError when it cannot be.

    ``timeout`` (seconds, None: no limit) bounds the whole connect, retries
    included: past it, ``TimeoutError`` (an OSError, ``ETIMEDOUT``).
    """
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    pause = _FIRST_PAUSE
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            if await _try_connect(sock, path, wait_writable):
                sock.getpeername()  # ENOTCONN unless it really is connected
                return sock
        except BaseException:
            sock.close()
            raise
        sock.close()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                errno.ETIMEDOUT, f"connect to {path}: the daemon's backlog stayed full"
            )
        await sleep(min(pause, left))
        pause = min(pause * 2, _LONGEST_PAUSE)


async def _try_connect(
    sock: socket.socket, path: str, wait_writable: Callable[[socket.socket], Awaitable[object]]
) -> bool:
    """True once connected; False when the backlog was full (EAGAIN: try again)."""
    try:
        sock.connect(path)
        return True
    except BlockingIOError as exc:
        if exc.errno != errno.EINPROGRESS:
            return False  # EAGAIN: the listen backlog is full, nothing is in progress
    await wait_writable(sock)
    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error == errno.EAGAIN:
        return False
    if error:
        raise OSError(error, f"connect to {path}: {errno.errorcode.get(error, error)}")
    return True
