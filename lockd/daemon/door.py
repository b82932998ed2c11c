"""Letting connections in: the accept loop, the connection limits, who is calling.

Every connection costs a file descriptor and memory, so the door counts
them before their task runs: ``max_connections`` in all, of which the last
``owner_reserve`` slots are for owners (root always gets in), and
``max_connections_per_uid`` per member uid. A refused client gets one line
saying why before the connection closes (:meth:`Door.admit`); running out
of descriptors refuses, never hangs (:mod:`lockd.daemon.fdlimit`). Then
the caller is identified from its peer credentials (:meth:`Door.identify`);
one whose identity cannot be read now is answered, not dropped
(:mod:`lockd.daemon.unidentified`).

This is the server's front door (:mod:`lockd.daemon.server`), separate
because none of it is about requests: once a caller is in and known, the
server serves its connection.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket as stdsocket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from lockd.daemon import fdlimit, sockio, unidentified
from lockd.daemon.protocol import encode_error
from lockd.daemon.stats import StatsRecorder
from lockd.identity import Caller, IdentityConfig, IdentityUnavailable, peer_credentials
from lockd.logfmt import kv

if TYPE_CHECKING:
    from lockd.daemon.server import Limits

log = logging.getLogger("lockd.daemon.server")

#: Refused connections kept open for a moment at once (more are closed at once).
MAX_LINGERING = 64
#: What :meth:`Door.admit` returns for a connection no uid count holds
#: (an owner's, or one whose peer credentials could not be read).
NOT_COUNTED = -1


class Door:
    """Accepts connections within the limits and counts the open ones."""

    def __init__(
        self,
        limits: Limits,
        identity: IdentityConfig,
        stats: StatsRecorder,
        resolve: Callable[[stdsocket.socket], Caller],
        stopping: trio.Event,
    ) -> None:
        self._limits = limits
        self._identity = identity
        self._stats = stats
        self._resolve = resolve
        #: set when the daemon begins to stop (the server's).
        self._stopping = stopping
        #: connections counted against the limits (admitted, not yet closed).
        self.open_connections = 0
        #: open connections per uid (owners are not counted).
        self._per_uid: dict[int, int] = {}
        #: refused connections waiting a moment before they are closed.
        self._lingering = 0
        self.warnings = fdlimit.ThrottledWarnings(log)

    async def accept_loop(
        self,
        listen_sock: stdsocket.socket,
        nursery: trio.Nursery,
        scope: trio.CancelScope,
        serve: Callable[[stdsocket.socket, int], Awaitable[None]],
    ) -> None:
        """Accept until ``scope`` is cancelled; an admitted connection runs ``serve(sock, uid)``."""
        spare_fd = fdlimit.SpareFd()
        try:
            with scope:
                await self._accept_forever(listen_sock, nursery, spare_fd, serve)
        finally:
            spare_fd.close()

    async def _accept_forever(
        self,
        listen_sock: stdsocket.socket,
        nursery: trio.Nursery,
        spare_fd: fdlimit.SpareFd,
        serve: Callable[[stdsocket.socket, int], Awaitable[None]],
    ) -> None:
        listen_sock.setblocking(False)
        while True:
            try:
                sock = await sockio.accept(listen_sock)
            except OSError as exc:
                # Out of descriptors: refuse the waiting client at once rather
                # than leave it in the backlog (see fdlimit.SpareFd).
                if exc.errno in fdlimit.OUT_OF_FDS and spare_fd.refuse_one(listen_sock):
                    self._stats.count("connectionsRefused")
                    self.warnings.warn("connection_refused", "no_file_descriptors")
                    continue
                if exc.errno in (*fdlimit.OUT_OF_FDS, errno.ENOBUFS, errno.ENOMEM):
                    self.warnings.warn("accept_failed", errno.errorcode[exc.errno])
                    await trio.sleep(0.1)
                    continue
                if self._stopping.is_set() or exc.errno == errno.EBADF:
                    return
                raise
            # Counted here, not when the connection's task first runs, so a
            # burst of connects cannot overshoot the limit.
            uid = self.admit(sock)
            if uid is None:
                if self._lingering < MAX_LINGERING:
                    self._lingering += 1
                    nursery.start_soon(self._linger_and_close, sock)
                else:
                    sock.close()
                continue
            self.open_connections += 1
            nursery.start_soon(serve, sock, uid)

    async def _linger_and_close(self, sock: stdsocket.socket) -> None:
        """Close a refused connection once the client has sent (or after a second).

        Closed at once, the client's first request would fail with EPIPE
        before it could read the line that says why it was refused.
        """
        try:
            with trio.move_on_after(1.0):
                with contextlib.suppress(OSError):
                    await sockio.recv_some(sock)
        finally:
            self._lingering -= 1
            sock.close()

    def admit(self, sock: stdsocket.socket) -> int | None:
        """Count a new connection against the limits; its uid, or None when refused.

        One uid may hold ``max_connections_per_uid`` connections, and the last
        ``owner_reserve`` slots are for owners (root and the daemon's user),
        so one member holding idle connections never shuts out everyone
        else, root included. A refused client gets one line saying why
        (``RATE_LIMITED``, ``id`` null) before the connection closes.
        """
        limits = self._limits
        try:
            uid: int | None = peer_credentials(sock).uid
        except OSError:
            uid = None  # the identity step will refuse it
        owner = uid is not None and uid in (0, self._identity.daemon_uid)
        ceiling = limits.max_connections if owner else limits.max_connections - limits.owner_reserve
        if self.open_connections >= ceiling:
            why, limit = "max_connections", limits.max_connections
        elif uid is not None and not owner:
            if self._per_uid.get(uid, 0) < limits.max_connections_per_uid:
                self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
                return uid
            why, limit = "max_connections_per_uid", limits.max_connections_per_uid
        else:
            return NOT_COUNTED
        self._stats.count("connectionsRefused")
        self.warnings.warn("connection_refused", why, uid=uid, limit=limit)
        who = "the daemon" if why == "max_connections" else f"uid {uid}"
        refusal = encode_error(
            None,
            "RATE_LIMITED",
            f"too many connections to {who} ({why} = {limit}); close some and retry",
            {"limit": limit, "reason": why},
        )
        with contextlib.suppress(OSError):
            sock.send(refusal)
            sock.shutdown(stdsocket.SHUT_WR)
        return None

    def release_uid(self, uid: int) -> None:
        """A connection ``admit`` counted for ``uid`` has ended."""
        if uid == NOT_COUNTED:
            return
        count = self._per_uid.get(uid, 0) - 1
        if count > 0:
            self._per_uid[uid] = count
        else:
            self._per_uid.pop(uid, None)

    async def identify(self, sock: stdsocket.socket) -> tuple[Caller, bytes] | None:
        """Who is calling, and what it sent before that was known; None: the connection ended.

        A caller whose identity cannot be read now is never guessed (an
        admin would become a member): its requests are answered
        BACKEND_UNAVAILABLE until a lookup works. None means the connection
        is over (closed here, and counted out).
        """
        try:
            return self._resolve(sock), b""
        except IdentityUnavailable as exc:
            self._stats.count("connectionsRefused")
            reason = "no_file_descriptors" if exc.errno in fdlimit.OUT_OF_FDS else "no_identity"
            self.warnings.warn("connection_refused", reason, error=exc.strerror or exc)
            identified = await unidentified.serve_until_identified(
                sock,
                self._resolve,
                exc,
                max_line_bytes=self._limits.max_line_bytes,
                partial_line_timeout=self._limits.partial_line_timeout,
            )
            if identified is None:
                self.open_connections -= 1
                sockio.close(sock)
            return identified
        except OSError as exc:
            self.open_connections -= 1
            log.warning(kv(event="peer_unknown", error=exc))
            sock.close()
            return None
