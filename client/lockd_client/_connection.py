"""One Unix-socket connection to the daemon, shared by any number of threads.

Requests are pipelined: a thread sends its line under a send lock, then waits
for the reply carrying its ``id``. Reading is "one reader at a time": a
waiting thread that finds no reader becomes the reader, reads from the socket
(buffered, line by line) and files every reply it sees under its id, waking
the threads parked on a :class:`threading.Condition` when there are any. A
thread whose reply has been filed takes it and returns; a thread that gives
up (time-out, interrupt) leaves its id behind as abandoned: an abandoned
blocking acquire is withdrawn from the daemon's queue with ``cancel``, and if
a grant later arrives for it (it crossed the cancel), the grant is released
at once so the key is not held for nothing.

The single-thread case is the hot path and is kept to three system calls per
request (``send``, ``poll``, ``recv``) and three uncontended lock round trips:
the socket is in blocking mode with the send time-out set in the kernel
(``SO_SNDTIMEO``) so ``sendall`` does not poll first, one ``poll`` object made
at connect time bounds the wait for a reply, and the condition variable is
only notified when some thread is parked on it.

Whether a request reached the daemon is reported with :class:`ConnectionLost`
``sent``: False when the connection was already dead before sending or the
send itself failed. A failed send never delivered the request's final
newline (``sendall`` only fails on a ``send`` call that moved no bytes), and
the daemon only acts on complete lines, so such a request was not carried out
and may be sent again on a new connection. ``send`` on an ``AF_UNIX`` stream
whose peer has closed fails at once with ``EPIPE`` (``ECONNRESET`` when the
peer left our data unread); ``MSG_NOSIGNAL`` keeps that from raising SIGPIPE
in programs that restored its default action.
"""

from __future__ import annotations

# The C layers of socket and threading: ``socket`` builds its enums and
# ``threading`` pulls in functools and collections at import, together a
# good part of a ``lockd`` command's start-up (issue 24). A connection needs
# neither (an AF_UNIX stream socket, locks; a Condition only once a second
# thread waits on it).
import _socket
import os
import select
import time
from _socket import AF_UNIX, SHUT_RDWR, SO_SNDTIMEO, SOCK_STREAM, SOL_SOCKET
from _socket import socket as _unix_socket
from _thread import allocate_lock

from ._events import Loss, LossBook, loss_from
from ._requests import late_grant
from ._trust import check_folder, check_peer
from ._wire import C_LONG, BadLine, ReplyLines, ceil, encode_request, pack_native

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    import threading
    from collections.abc import Callable
    from typing import Any

    from ._renewer import Flag

__all__ = ["Connection", "ConnectionLost", "ReplyTimeout"]

_READ_CHUNK = 65536
_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0)
_POLLIN = select.POLLIN
_MAX_POLL_MS = 2**31 - 1  # poll() takes a C int; a longer wait just loops
_NO_LIMIT = pack_native((0, 0), C_LONG)  # SO_SNDTIMEO of zero: wait as long as it takes


class ConnectionLost(Exception):
    """The connection is gone (internal).

    ``protocol`` is True if the daemon sent garbage; ``sent`` is False when the
    request in hand certainly did not reach the daemon (see the module doc).
    """

    def __init__(self, reason: str, *, protocol: bool = False, sent: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.protocol = protocol
        self.sent = sent


class ReplyTimeout(Exception):
    """No reply arrived within the time allowed (internal); the connection stays usable."""


class Connection:
    """A connected socket plus the bookkeeping that lets threads share it."""

    def __init__(self, sock: _unix_socket, next_id: Callable[[], int]) -> None:
        self._sock = sock
        self._next_id = next_id
        self._poller = select.poll()
        self._poller.register(sock.fileno(), _POLLIN)
        self._send_lock = allocate_lock()
        self._lock = allocate_lock()
        #: on ``_lock``, made when a thread first parks (:meth:`_park_locked`)
        self._cond: threading.Condition | None = None
        self._parked = 0  # threads in self._cond.wait(): notify only when > 0
        self._lines = ReplyLines()
        self._replies: dict[int, dict[str, Any]] = {}
        self._abandoned: dict[int, str] = {}
        #: requests nobody waits for, to send once the lock is free: releases of
        #: late grants, cancels of abandoned acquires (op, arguments).
        self._late_sends: list[tuple[str, dict[str, Any]]] = []
        self._reading = False
        self._dead: ConnectionLost | None = None
        self._fd_closed = False
        #: the message of the last error the daemon sent without a request id.
        self._refusal: str | None = None
        #: losses the daemon pushed (docs/contract.md §12), by handle (see ``wait_for_loss``).
        self.losses = LossBook()
        #: ``hello {"events": true}`` was sent on it.
        self.events_asked = False
        #: a pipe that ends a ``wait_for_loss`` blocked in poll() (made on first use).
        self._wake_fds: tuple[int, int] | None = None
        self._wakeups = 0

    @classmethod
    def open(
        cls,
        path: str,
        *,
        connect_timeout: float | None,
        send_timeout: float | None,
        next_id: Callable[[], int],
    ) -> Connection:
        """Connect to ``path``; raises OSError when that fails.

        Raises :class:`UntrustedDaemonError` (before sending anything) when
        the socket's folder or the process serving it is not trusted (see
        :mod:`lockd_client._trust`).
        """
        trusted = check_folder(path)
        sock = _unix_socket(AF_UNIX, SOCK_STREAM)
        try:
            # A blocking connect waits in a full listen backlog ("clients wait
            # in the backlog"); settimeout() would make it non-blocking and
            # fail at once with EAGAIN. For AF_UNIX the kernel bounds that
            # wait by SO_SNDTIMEO, so the connect timeout goes there.
            if connect_timeout is not None:
                sock.setsockopt(SOL_SOCKET, SO_SNDTIMEO, _timeval(connect_timeout))
            sock.connect(path)
            check_peer(path, sock, trusted)
            # Blocking from here on: reads wait in poll(), and the kernel's
            # SO_SNDTIMEO bounds a stuck send (EAGAIN), so sendall() needs no
            # poll() of its own before each send.
            send_limit = _timeval(send_timeout) if send_timeout is not None else _NO_LIMIT
            sock.setsockopt(SOL_SOCKET, SO_SNDTIMEO, send_limit)
        except BaseException:
            sock.close()
            raise
        return cls(sock, next_id)

    # -- public -------------------------------------------------------------

    @property
    def dead(self) -> bool:
        """True once the connection is unusable."""
        return self._dead is not None

    def request(self, op: str, args: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """Send request ``op`` with ``args`` under a fresh id; return the reply with that id.

        Raises ConnectionLost when the connection breaks before the reply is
        in (``sent=False`` if the request never left), ReplyTimeout when
        ``timeout`` seconds pass without it.
        """
        rid = self._next_id()
        line = encode_request(rid, op, args)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._dead is not None:
            raise self._lost(sent=False)
        try:
            with self._send_lock:
                self._sock.sendall(line, _NOSIGNAL)
        except OSError as exc:
            with self._lock:
                self._kill_locked(f"sending failed ({_describe(exc)})")
            raise self._lost(sent=False) from exc
        except BaseException:
            # Interrupted part-way: the stream may end in half a line, which
            # would swallow the next request. Nothing can be trusted after it.
            with self._lock:
                self._kill_locked("interrupted while sending")
            raise
        return self._wait_reply(rid, op, deadline)

    def send_quietly(self, op: str, args: dict[str, Any]) -> None:
        """Send a request whose reply nobody waits for (it is dropped when read)."""
        with self._lock:
            self._late_sends.append((op, args))
        self._flush_late_sends()

    def wait_for_loss(
        self, handle: str, timeout: float, stop: threading.Event | Flag
    ) -> Loss | None:
        """Wait up to ``timeout`` s for the daemon to say ``handle`` is lost.

        Reads the connection meanwhile if no other thread does (a pushed
        line is read the moment it comes). Returns early, with None, when
        ``stop`` is set and :meth:`wake` called, or the connection dies.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            wakeups = self._wakeups
            while True:
                loss = self.losses.get(handle)
                if loss is not None or self._dead is not None:
                    return loss
                remaining = deadline - time.monotonic()
                if remaining <= 0 or stop.is_set() or self._wakeups != wakeups:
                    return None
                if self._reading:
                    self._park_locked(remaining)
                else:
                    if self._wake_fds is None:
                        self._wake_fds = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                        self._poller.register(self._wake_fds[0], _POLLIN)
                    self._read_once_locked(remaining)
                    if self._late_sends:  # as _wait_reply: give them back now
                        self._lock.release()
                        try:
                            self._flush_late_sends()
                        finally:
                            self._lock.acquire()

    def wake(self) -> None:
        """End every :meth:`wait_for_loss` now (its ``stop`` was just set)."""
        with self._lock:
            self._wakeups += 1
            if self._reading and self._wake_fds is not None:
                try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                    os.write(self._wake_fds[1], b"x")
                except OSError:
                    pass
            self._notify_locked()

    def close(self) -> None:
        """Close the connection; threads waiting on it get ConnectionLost."""
        with self._lock:
            self._kill_locked("the client closed the connection")

    # -- internals ----------------------------------------------------------

    def _park_locked(self, timeout: float | None) -> None:
        """Wait (the lock released) until the reader files replies or leaves its place."""
        if self._cond is None:
            import threading  # here: only a second thread waiting on the connection needs it

            self._cond = threading.Condition(self._lock)
        self._parked += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._parked -= 1

    def _notify_locked(self) -> None:
        """Wake the parked threads, if any (a thread parks only through :meth:`_park_locked`)."""
        if self._parked and self._cond is not None:
            self._cond.notify_all()

    def _lost(self, *, sent: bool) -> ConnectionLost:
        dead = self._dead
        assert dead is not None
        return ConnectionLost(dead.reason, protocol=dead.protocol, sent=sent)

    def _wait_reply(self, rid: int, op: str, deadline: float | None) -> dict[str, Any]:
        """Wait for reply ``rid``: read the socket ourselves, or park while another thread does."""
        self._lock.acquire()
        try:
            while True:
                reply = self._replies.pop(rid, None)
                if reply is not None:
                    return reply
                if self._dead is not None:
                    raise self._lost(sent=True)
                remaining = None
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ReplyTimeout()
                if self._reading:
                    self._park_locked(remaining)
                else:
                    self._read_once_locked(remaining)
                    if self._late_sends:  # give them back now, not when our reply comes
                        self._lock.release()
                        try:
                            self._flush_late_sends()
                        finally:
                            self._lock.acquire()
        except BaseException:
            # Giving up (time-out, broken connection, interrupt): a reply that
            # comes later is late; a late grant is given back.
            leftover = self._replies.pop(rid, None)
            if leftover is not None:
                self._note_late_locked(op, leftover)
            elif self._dead is None:
                self._abandoned[rid] = op
                if op == "acquire":  # leave the daemon's queue now, not at the timeout
                    self._late_sends.append(("cancel", {"target": rid}))
            raise
        finally:
            late = bool(self._late_sends)
            self._lock.release()
            if late:
                self._flush_late_sends()

    def _read_once_locked(self, timeout: float | None) -> None:
        """Become the reader, wait up to ``timeout`` for data, file what arrives.

        Called and returns with the lock held; it is released while waiting.
        """
        # ceil(timeout * 1000) written out: this runs once per request.
        wait_ms = -1 if timeout is None else min(-int(timeout * -1000 // 1), _MAX_POLL_MS)
        data: bytes | None = None
        self._reading = True
        try:
            try:
                self._lock.release()  # inside the try: an interrupt comes after it returns
                ready = self._poller.poll(wait_ms)
                if ready and (self._wake_fds is None or self._sock_ready(ready)):
                    data = self._sock.recv(_READ_CHUNK)
            finally:
                self._lock.acquire()
            if data is not None:
                self._absorb_locked(data)
        except OSError as exc:
            self._kill_locked(f"reading failed ({_describe(exc)})")
        finally:
            self._reading = False
            if self._parked:  # replies filed, or the reader's place is free: _notify_locked
                self._notify_locked()
            if self._dead is not None:
                self._close_fd_locked()

    def _sock_ready(self, ready: list[tuple[int, int]]) -> bool:
        """Is the socket among ``ready`` (the wake pipe may be there too: emptied here)?"""
        assert self._wake_fds is not None
        wake_fd = self._wake_fds[0]
        ours = False
        for fd, _ in ready:
            if fd == wake_fd:
                try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                    os.read(wake_fd, 4096)
                except OSError:
                    pass
            else:
                ours = True
        return ours

    def _absorb_locked(self, data: bytes) -> None:
        if not data:
            why = f": {self._refusal}" if self._refusal else ""
            self._kill_locked(f"the daemon closed the connection{why}")
            return
        try:
            replies = self._lines.feed(data)
        except BadLine as exc:
            self._kill_locked(str(exc), protocol=True)
            return
        replies_by_id, abandoned = self._replies, self._abandoned
        for reply in replies:
            rid = reply.get("id")
            if type(rid) is int and rid not in abandoned:
                replies_by_id[rid] = reply  # the usual case of _file_locked, inline
            else:
                self._file_locked(reply)

    def _file_locked(self, reply: dict[str, Any]) -> None:
        rid = reply.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool):
            loss = loss_from(reply) if rid is None else None
            if loss is not None:  # pushed (docs/contract.md §12): kept for whoever holds the handle
                self.losses.add(loss)
                return
            # id null: the daemon could not read one of our requests, or it
            # refuses the connection (too many); keep why for the close.
            error = reply.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                self._refusal = error["message"]
            return
        op = self._abandoned.pop(rid, None)
        if op is not None:
            self._note_late_locked(op, reply)
        else:
            # Its thread is waiting, or about to: it sent the request before
            # anyone could read the reply, and takes it (or abandons it) under
            # this lock.
            self._replies[rid] = reply

    def _note_late_locked(self, op: str, reply: dict[str, Any]) -> None:
        """A reply nobody waits for any more: if it granted a lease, give it back."""
        grant = late_grant(op, reply)
        if grant is not None:
            key, handle = grant
            self._late_sends.append(("release", {"key": key, "handle": handle}))

    def _flush_late_sends(self) -> None:
        with self._lock:
            sends, self._late_sends = self._late_sends, []
            if self._dead is not None or not sends:
                return
        for op, args in sends:
            rid = self._next_id()
            with self._lock:
                self._abandoned[rid] = op
            line = encode_request(rid, op, args)
            try:
                with self._send_lock:
                    self._sock.sendall(line, _NOSIGNAL)
            except OSError as exc:
                with self._lock:
                    self._kill_locked(f"sending failed ({_describe(exc)})")
                return

    def _kill_locked(self, reason: str, *, protocol: bool = False) -> None:
        if self._dead is None:
            self._dead = ConnectionLost(reason, protocol=protocol)
            try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                self._sock.shutdown(SHUT_RDWR)  # wakes a reader blocked in poll()
            except OSError:
                pass
            self._notify_locked()
        if not self._reading:
            self._close_fd_locked()

    def _close_fd_locked(self) -> None:
        if not self._fd_closed:
            self._fd_closed = True
            with self._send_lock:
                self._sock.close()
            if self._wake_fds is not None:
                for fd in self._wake_fds:
                    try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                        os.close(fd)
                    except OSError:
                        pass


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` for SO_SNDTIMEO; at least 1 µs (zero would mean "no limit")."""
    usec = max(1, ceil(seconds * 1_000_000))
    return pack_native((usec // 1_000_000, usec % 1_000_000), C_LONG)


def _describe(exc: OSError) -> str:
    if isinstance(exc, BlockingIOError):
        return "timed out"  # SO_SNDTIMEO ran out: the daemon stopped reading
    return exc.strerror or str(exc) or type(exc).__name__
