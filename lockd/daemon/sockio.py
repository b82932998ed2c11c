"""Non-blocking stdlib sockets driven by trio's readiness waits.

Why not ``trio.SocketStream``: every trio socket call ends in a scheduler
pass, even when the kernel could answer at once, and lockd's round trip is
short enough that those passes dominated it (profiled: ~3 passes per
request). Here a reply that fits the socket buffer -- nearly all of them -- is
written without yielding, and a read waits for readiness once and then
reads. Order of replies on a connection is kept by a per-connection lock
that only the slow path (a partially written reply) takes.
"""

from __future__ import annotations

import socket

import trio

RECV_BYTES = 65536


async def accept(listen: socket.socket) -> socket.socket:
    """Accept one connection; the returned socket is non-blocking."""
    while True:
        await trio.lowlevel.wait_readable(listen)
        try:
            sock, _ = listen.accept()
        except BlockingIOError:
            continue
        sock.setblocking(False)
        return sock


async def recv_some(sock: socket.socket) -> bytes:
    """Wait until ``sock`` is readable, then read what is there (b"" at EOF)."""
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            return sock.recv(RECV_BYTES)
        except BlockingIOError:
            continue


async def send_all(sock: socket.socket, lock: trio.Lock, data: bytes) -> None:
    """Write all of ``data``; raises OSError when the peer is gone.

    The fast path does not yield, so it cannot interleave with another
    task's reply; a reply that does not fit goes on under ``lock``, which
    also holds back the fast path of later replies until it is out.
    """
    view = memoryview(data)
    if not lock.locked():
        try:
            sent = sock.send(view)
        except BlockingIOError:
            sent = 0
        if sent == len(view):
            return
        view = view[sent:]
        lock.acquire_nowait()  # no yield since locked() was checked
        try:
            await _send_rest(sock, view)
        finally:
            lock.release()
        return
    async with lock:
        await _send_rest(sock, view)


async def _send_rest(sock: socket.socket, view: memoryview) -> None:
    while view:
        await trio.lowlevel.wait_writable(sock)
        try:
            sent = sock.send(view)
        except BlockingIOError:
            continue
        view = view[sent:]


def close(sock: socket.socket) -> None:
    """Close a socket other tasks may be waiting on (they get ClosedResourceError)."""
    trio.lowlevel.notify_closing(sock)
    sock.close()
