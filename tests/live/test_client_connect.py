"""Clients connect or fail honestly (issue 21, items 9 and 11).

- A full listen backlog makes a non-blocking Unix ``connect()`` fail with
  EAGAIN; the asyncio and trio clients took that for a connect in progress
  and ran the peer check on an unconnected socket ("untrusted uid -1").
  Now they retry within the caller's time and check only a connected socket.
- The socket path is checked component by component as given, as ssh
  checks its files: a folder or symlink on the way owned by anyone but root,
  the daemon's user or the caller is refused, even when it leads to a
  trusted daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from lockd_client import DaemonUnavailableError, LockClient, UntrustedDaemonError
from lockd_client.aio import AsyncLockClient
from lockd_client.trio import TrioLockClient

from lockd.testing.daemon import DaemonProcess

#: a uid nobody on the test box has: an attacker's.
STRANGER = 54321


class FullBacklog:
    """A listening socket whose backlog is full until :meth:`start_serving`."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(0)
        self.fillers: list[socket.socket] = []
        while self._one_more_fits():
            pass
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _one_more_fits(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(self.path)
        except BlockingIOError as exc:
            assert exc.errno == errno.EAGAIN
            sock.close()
            return False
        self.fillers.append(sock)
        return True

    def start_serving(self, after: float) -> None:
        """Accept (and answer hello on) every connection from ``after`` seconds on."""

        def serve() -> None:
            time.sleep(after)  # the behaviour under test: a daemon that answers late
            self.listener.settimeout(0.1)
            while not self._stop.is_set():
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                worker = threading.Thread(target=self._answer, args=(conn,), daemon=True)
                worker.start()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            buf = b""
            while not self._stop.is_set():
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    request = json.loads(line)
                    result = {"protocol": 1, "version": "x", "principal": "user:root"}
                    reply = {"id": request["id"], "ok": True, "result": result}
                    conn.sendall(json.dumps(reply).encode() + b"\n")

    def close(self) -> None:
        self._stop.set()
        for sock in self.fillers:
            sock.close()
        self.listener.close()
        for thread in self._threads:
            thread.join(5)


@pytest.fixture
def backlog(short_tmp: Path) -> Iterator[FullBacklog]:
    full = FullBacklog(short_tmp / "full.sock")
    try:
        yield full
    finally:
        full.close()


def test_async_clients_wait_out_a_full_backlog(backlog: FullBacklog) -> None:
    backlog.start_serving(after=0.3)

    async def with_asyncio() -> dict[str, object]:
        async with AsyncLockClient(backlog.path, request_timeout=10) as client:
            return await client.hello()

    async def with_trio() -> dict[str, object]:
        async with TrioLockClient(backlog.path, request_timeout=10) as client:
            return await client.hello()

    assert asyncio.run(with_asyncio())["protocol"] == 1
    assert trio.run(with_trio)["protocol"] == 1


def test_async_clients_give_up_on_a_full_backlog_within_their_time(
    backlog: FullBacklog,
) -> None:
    async def with_asyncio() -> None:
        async with AsyncLockClient(backlog.path, request_timeout=0.5) as client:
            with pytest.raises(DaemonUnavailableError, match="backlog stayed full"):
                await client.hello()

    async def with_trio() -> None:
        async with TrioLockClient(backlog.path, request_timeout=0.5) as client:
            with pytest.raises(DaemonUnavailableError, match="backlog stayed full"):
                await client.hello()

    for run in (lambda: asyncio.run(with_asyncio()), lambda: trio.run(with_trio)):
        started = time.monotonic()
        run()
        assert time.monotonic() - started < 5


# ------------------------------------------------------------ item 11: the path


def _stranger_folder_linking_to(daemon: DaemonProcess, short_tmp: Path) -> Path:
    """A folder the stranger owns, holding a symlink to the trusted daemon's folder."""
    theirs = short_tmp / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o755)
    (theirs / "lockd").symlink_to(daemon.socket.parent)
    os.chown(theirs, STRANGER, STRANGER)
    return theirs / "lockd" / daemon.socket.name


def test_a_folder_of_someone_else_on_the_way_is_refused_even_to_a_trusted_daemon(
    daemon: DaemonProcess, short_tmp: Path
) -> None:
    path = _stranger_folder_linking_to(daemon, short_tmp)
    expected = f"{short_tmp / 'theirs'} belongs to uid {STRANGER}"
    with LockClient(path) as client, pytest.raises(UntrustedDaemonError, match=expected):
        client.hello()

    async def with_asyncio() -> None:
        async with AsyncLockClient(path) as client:
            with pytest.raises(UntrustedDaemonError, match=expected):
                await client.hello()

    async def with_trio() -> None:
        async with TrioLockClient(path) as client:
            with pytest.raises(UntrustedDaemonError, match=expected):
                await client.hello()

    asyncio.run(with_asyncio())
    trio.run(with_trio)
    with LockClient(daemon.socket) as client:  # the daemon itself is fine
        assert client.hello()["protocol"] == 1


def test_a_symlink_someone_else_owns_is_refused(daemon: DaemonProcess, short_tmp: Path) -> None:
    ours = short_tmp / "ours"
    ours.mkdir()
    link = ours / "lockd"
    link.symlink_to(daemon.socket.parent)
    os.lchown(link, STRANGER, STRANGER)
    refused = pytest.raises(UntrustedDaemonError, match=f"the symlink {link} belongs to uid")
    with LockClient(link / daemon.socket.name) as client, refused:
        client.hello()


def test_a_socket_that_is_a_symlink_into_an_unsafe_folder_is_refused(
    daemon: DaemonProcess, short_tmp: Path
) -> None:
    unsafe = short_tmp / "unsafe"
    unsafe.mkdir()
    os.chmod(unsafe, 0o777)
    (unsafe / "real.sock").symlink_to(daemon.socket)
    ours = short_tmp / "ours"
    ours.mkdir()
    (ours / "lockd.sock").symlink_to(unsafe / "real.sock")
    refused = pytest.raises(UntrustedDaemonError, match="writable by other users")
    with LockClient(ours / "lockd.sock") as client, refused:
        client.hello()
