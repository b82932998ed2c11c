"""The floor lockd is measured against: ``python bench/floor_server.py --socket S --db D``.

A minimal lock server for B3's workload only: it speaks ``hello``,
``tryAcquire`` and ``release`` on a Unix socket (enough for the real
``lockd_client``'s ``try_acquire`` + ``release`` loop) and stores every
grant and release exactly as the daemon does: through lockd's own
:class:`~lockd.daemon.store.Store` (same schema, statements, checksums,
fence mark and run record), with the daemon's group commit (the requests
read in one loop pass share one commit; a connection commits at once when
no other connection has a request waiting, see ``LockServer._batch_point``).
Replies carry the same fields as lockd's.

What it leaves out is everything that makes lockd a lock service beyond
that: no timers or expiry, no waiters, no authorisation or rules, no stats,
no field validation beyond what the JSON decoder does, no busy-poll or
inline reads. Its server CPU per pair is what trio + JSON + SQLite cost
for this traffic; lockd's CPU per pair over it (``bench/run.py``'s
``lockd/floor`` ratio) is what lockd's own Python adds. ``--json orjson``
decodes and encodes with orjson instead of the stdlib, to price the codec.

Not a lock service: a request it does not expect is answered with an
error and otherwise ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from lockd.daemon import fencemark
from lockd.daemon.leases import Changes, Lease
from lockd.daemon.runrecord import RunRecord, record_path
from lockd.daemon.store import Store, read_boot_id
from lockd.identity import process_start
from lockd.timefmt import format_epoch_ms

RECV_BYTES = 65536


def _codec(name: str) -> tuple[Callable[[bytes], Any], Callable[[dict[str, Any]], bytes]]:
    """(decode one line, encode one reply line with its newline)."""
    if name == "orjson":
        import orjson

        dumps = orjson.dumps
        return orjson.loads, lambda obj: dumps(obj) + b"\n"
    encode = json.JSONEncoder(separators=(",", ":")).encode
    return json.loads, lambda obj: encode(obj).encode("ascii") + b"\n"


class FloorServer:
    """One process, one trio loop, one task per connection."""

    def __init__(self, store: Store, fence: int, codec: str) -> None:
        self.store = store
        self.fence = fence
        self.decode, self.encode = _codec(codec)
        #: key -> the lease holding it.
        self.held: dict[str, Lease] = {}
        self.changes = Changes()
        #: (socket, reply) of the open batch, sent after its commit.
        self.outbox: list[tuple[socket.socket, bytes]] = []
        self.connections = 0
        #: every connection's socket: "does another one have a request waiting?"
        self.readable = select.epoll()
        self.flush_wanted = trio.Event()

    async def serve(self, path: str) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(128)
        listener.setblocking(False)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._flusher)
            nursery.start_soon(self._stop_on_sigterm, nursery.cancel_scope)
            while True:
                await trio.lowlevel.wait_readable(listener)
                try:
                    sock, _ = listener.accept()
                except BlockingIOError:
                    continue
                sock.setblocking(False)
                nursery.start_soon(self._connection, sock)

    async def _stop_on_sigterm(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                scope.cancel()
                return

    async def _flusher(self) -> None:
        while True:
            await self.flush_wanted.wait()
            self.flush_wanted = trio.Event()
            self._flush()

    async def _connection(self, sock: socket.socket) -> None:
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        pid, uid, _ = struct.unpack("3i", cred)
        try:
            principal = f"user:{pwd.getpwuid(uid).pw_name}"
        except KeyError:
            principal = f"uid:{uid}"
        try:
            process: str | None = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            process = None
        # What lockd records of the holder's process (lockd.daemon.holder).
        caller = (principal, uid, pid, process, process_start(pid))
        fd = sock.fileno()
        self.readable.register(fd, select.EPOLLIN)
        self.connections += 1
        pending = b""
        try:
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    data = sock.recv(RECV_BYTES)
                except BlockingIOError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line:
                        self.outbox.append((sock, self._answer(line, caller)))
                self._batch_point(fd)
        finally:
            self._flush()
            self.readable.unregister(fd)
            self.connections -= 1
            trio.lowlevel.notify_closing(sock)
            sock.close()

    def _answer(self, line: bytes, caller: tuple[str, int, int, str | None, int | None]) -> bytes:
        req = self.decode(line)
        rid = req.get("id")
        op = req.get("op")
        result: Any
        if op == "tryAcquire":
            key = req["key"]
            if key in self.held:
                result = None
            else:
                ttl_ms = req["ttlMs"]
                self.fence += 1
                principal, _, pid, process, pid_start = caller
                expires_at = time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000 + ttl_ms
                lease = Lease(
                    key,
                    secrets.token_urlsafe(16),
                    self.fence,
                    None,
                    principal,
                    ttl_ms,
                    expires_at,
                    pid=pid,
                    process=process,
                    pid_start=pid_start,
                )
                self.held[key] = lease
                self.changes.rows[(key, 0)] = lease
                self.changes.fence = self.fence
                result = {
                    "key": key,
                    "handle": lease.handle,
                    "fence": lease.fence,
                    "owner": None,
                    "ttlMs": ttl_ms,
                    "leaseExpiresAt": format_epoch_ms(time.time_ns() // 1_000_000 + ttl_ms),
                }
        elif op == "release":
            key = req["key"]
            holder = self.held.get(key)
            if holder is not None and holder.handle == req["handle"]:
                del self.held[key]
                self.changes.rows[(key, 0)] = None
                result = {"released": True}
            else:
                result = {"released": False, "reason": "not_holder"}
        elif op == "hello":
            principal, uid, pid, _, _ = caller
            result = {
                "protocol": 1,
                "version": "floor",
                "principal": principal,
                "role": "owner",
                "uid": uid,
                "pid": pid,
            }
        else:
            error = {"code": "INVALID_REQUEST", "status": 400, "message": f"floor: no op {op!r}"}
            return self.encode({"id": rid, "ok": False, "error": {**error, "details": {}}})
        return self.encode({"id": rid, "ok": True, "result": result})

    def _batch_point(self, fd: int) -> None:
        """lockd's rule: commit now unless another connection has a request waiting."""
        if not self.outbox:
            return
        if self.connections > 1:
            for ready_fd, _ in self.readable.poll(0, 2):
                if ready_fd != fd:
                    self.flush_wanted.set()
                    return
        self._flush()

    def _flush(self) -> None:
        changes, self.changes = self.changes, Changes()
        if changes.rows or changes.fence is not None:
            self.store.apply(changes)
        outbox, self.outbox = self.outbox, []
        for sock, data in outbox:
            try:
                sent = sock.send(data)
            except OSError:
                continue
            if sent < len(data):  # a reply is ~200 bytes: the buffer takes it
                sock.setblocking(True)
                sock.sendall(data[sent:])
                sock.setblocking(False)


def open_store(db: Path, runtime_dir: Path) -> tuple[Store, int]:
    """The database as ``lockd serve`` opens it (lockd.daemon.serve); the fence to go on from."""
    store = Store(db, read_boot_id(), record=RunRecord(record_path(runtime_dir, db)))
    fence = store.stored_fence()
    if store.mark is not None:
        fence = fencemark.check_at_start(store.mark, fence)
    fence = max(fence, store.recorded_fence)
    store.begin_run(max(fence, store.mark.reserved if store.mark is not None else 0))
    return store, fence


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--db", required=True, type=Path)
    parser.add_argument("--json", choices=("stdlib", "orjson"), default="stdlib")
    args = parser.parse_args(argv)
    store, fence = open_store(args.db, args.socket.parent)
    server = FloorServer(store, fence, args.json)
    try:
        trio.run(server.serve, str(args.socket))
    finally:
        store.close()
        if args.socket.exists():
            os.unlink(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
