"""The synchronous client: :class:`LockClient`.

One client holds ONE connection to the daemon and shares it between threads:
requests are pipelined and replies matched by ``id`` (see ``_connection``), so
a lease taken with ``release_on_close=True`` stays bound to this client's
connection even while another thread (auto-renew) talks to the daemon.

The connection is opened on first use, and replaced when it breaks (the
daemon restarted: connection refused, reset, or EOF). Nothing is checked
before sending: on a Unix stream socket whose peer has closed, ``send`` fails
at once (EPIPE/ECONNRESET), so a dead connection shows itself when used.

Retry rules. A request is sent again, on a new connection, in exactly these
three cases, for up to ``retry_window`` seconds (5 s by default) with a short
backoff, then :class:`DaemonUnavailableError` is raised:

1. It was never sent, whatever the operation: connecting failed, the
   connection was already known to be dead, or the send failed (the daemon
   had closed the connection, e.g. it restarted while this client sat idle;
   or the send timed out). A failed send never delivered the line's final
   newline, and the daemon acts on complete lines only, so the daemon cannot
   have carried it out. The first such re-send goes at once, without backoff.
   Exception: a failed connect is retried only once this client has been
   connected before, so a daemon that is not running is reported at once.
2. It was sent, the connection broke before the reply came (EOF, reset), and
   doing it twice is harmless: ``hello``, ``status``, ``list``, ``stats``,
   ``rules``, ``renew``, ``release``; ``acquire`` and ``try_acquire`` only when
   an ``owner`` is given (the retry re-takes the hold and fences the first
   grant, if there was one; a retried blocking ``acquire`` waits only for what
   is left of its timeout). ``renew`` also stops retrying at the end of the
   lease when it renews for auto-renew.
3. A blocking ``acquire`` (with or without owner) that meets a daemon restart
   while parked: the reply ``SHUTTING_DOWN``, or the connection breaking
   after it was sent. A parked acquire was never granted, so it is parked
   again on a new connection with what is left of its timeout, for as long
   as that timeout (at least ``retry_window``) lasts. One residual risk,
   accepted: a daemon killed in the instant between committing a grant and
   writing its reply leaves that grant held until its TTL, as a crashed
   holder would.

Never sent twice: ``try_acquire`` without an owner and
``break_lock`` that were sent on a connection that then broke: the daemon may
have applied them, so they raise DaemonUnavailableError ("not retried"). No
request is retried after its reply timed out (``request_timeout``) on a live
connection; that raises DaemonUnavailableError ("no reply"). Daemon errors
such as ``SHUTTING_DOWN`` are raised, not retried (except by rule 3). A ``release`` retried after
a break may answer ``released: false`` although the first attempt released
the key.
"""

from __future__ import annotations

import builtins
import itertools
import os
import sys
import time
from _thread import allocate_lock  # threading.Lock itself, without threading's imports (issue 24)

from ._connection import Connection, ConnectionLost, ReplyTimeout
from ._errors import (
    DaemonUnavailableError,
    LockdError,
    LockLostError,
    LockTimeoutError,
    ShuttingDownError,
    SocketPermissionError,
)
from ._events import EVENTS_HELLO
from ._paths import resolve_socket_path
from ._requests import (
    DEFAULT_TTL,
    UNLIMITED_WAIT,
    Attempts,
    HandleRef,
    acquire_timeout_ms,
    break_args,
    dict_result,
    grant_args,
    list_args,
    list_result,
    release_args,
    renew_args,
    unwrap,
)
from ._results import BreakResult, Handle, LockStatus, ReleaseResult, RenewResult
from ._wire import check_key, seconds_to_ms

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager
    from types import TracebackType
    from typing import Any

    _Build = Callable[[], tuple[dict[str, Any], float | None]]

__all__ = ["HandleRef", "LockClient"]


class LockClient:
    """A synchronous, thread-safe client for the lockd daemon.

    ``socket_path`` defaults to ``$LOCKD_SOCKET``, else
    :func:`default_socket_path`. ``connect_timeout`` bounds connecting;
    ``request_timeout`` (seconds, ``None`` for no limit) bounds the wait for a
    reply, and is added to a blocking acquire's own timeout so the daemon
    always answers first; ``retry_window`` bounds reconnecting after the
    connection breaks. Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        connect_timeout: float | None = 5.0,
        request_timeout: float | None = 30.0,
        retry_window: float = 5.0,
    ) -> None:
        self.socket_path: str = resolve_socket_path(socket_path)
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.retry_window = retry_window
        self._lock = allocate_lock()
        self._conn: Connection | None = None
        self._connected_once = False
        self._closed = False
        self._ids = itertools.count(1)
        self._id_lock = allocate_lock()
        #: losses of ``lock()`` holds the daemon pushed, raised at the next call.
        self._unreported: list[LockLostError] = []
        #: every connection asks for lease-loss events (see ``listen_for_losses``).
        self._events_wanted = False

    def __repr__(self) -> str:
        return f"LockClient(socket_path={self.socket_path!r})"

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (leases taken with ``release_on_close`` are freed by the daemon).

        Threads still waiting for a reply get a LockdError with code
        ``CLIENT_CLOSED``. Closing twice is harmless.
        """
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> LockClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- operations -----------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        """Protocol and server version, and the caller as the daemon sees it.

        Keys: ``protocol``, ``version``, ``principal``, ``role``, ``uid``, ``pid``.
        """
        self._raise_unreported()
        return self._dict_result("hello", {})

    def acquire(
        self,
        key: str,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        owner: str | None = None,
        release_on_close: bool = False,
        *,
        shared: bool = False,
        limit: int = 1,
        pid: int | None = None,
    ) -> Handle:
        """Wait up to ``timeout`` seconds for ``key``; hold it for ``ttl`` seconds.

        The daemon queues waiters first-in-first-out. Raises
        :class:`LockTimeoutError` when the time runs out. A wait that meets a
        daemon restart (``SHUTTING_DOWN``, or the connection closing while
        parked) was never granted: the client reconnects and parks again with
        what is left of ``timeout`` (the place in the queue is lost).
        ``release_on_close=True`` binds the lease to this client's connection:
        closing the client (or the process dying) frees the key at once.
        ``shared=True`` takes a shared (reader) hold; ``limit=N`` (1-1000)
        makes the key a semaphore of N exclusive slots (docs/contract.md §10).
        ``ttl`` defaults to 60 s; without ``timeout`` the wait has no limit.
        ``pid`` names the process that will use the hold, shown by status
        instead of this one's; the daemon records it only when that process
        is this one's parent or descendant, as the same user (docs/contract.md §12.2).
        """
        self._raise_unreported()
        if timeout is None:
            # The wire needs timeoutMs: wait the longest it takes, again and again.
            while True:
                try:
                    return self.acquire(
                        key,
                        ttl,
                        UNLIMITED_WAIT,
                        owner,
                        release_on_close,
                        shared=shared,
                        limit=limit,
                        pid=pid,
                    )
                except LockTimeoutError:
                    continue
        base = grant_args(key, ttl, owner, release_on_close, shared, limit, pid)
        timeout_ms = acquire_timeout_ms(timeout)
        deadline = time.monotonic() + timeout_ms / 1000
        attempts = 0

        def build() -> tuple[dict[str, Any], float | None]:
            nonlocal attempts
            attempts += 1
            ms = timeout_ms
            if attempts > 1:  # a retry waits only for what is left
                ms = max(0, min(timeout_ms, int((deadline - time.monotonic()) * 1000)))
            read_timeout = (
                None if self.request_timeout is None else ms / 1000 + self.request_timeout
            )
            return {**base, "timeoutMs": ms}, read_timeout

        args, read_timeout = build()
        result = _call(
            self,
            "acquire",
            args,
            read_timeout,
            retry=owner is not None,
            again=build,
            repark=deadline,
        )
        return Handle.from_result(result)

    def try_acquire(
        self,
        key: str,
        ttl: float = DEFAULT_TTL,
        owner: str | None = None,
        release_on_close: bool = False,
        *,
        shared: bool = False,
        limit: int = 1,
        pid: int | None = None,
    ) -> Handle | None:
        """One attempt at ``key``: the Handle, or ``None`` when it is not free for us.

        ``release_on_close``, ``shared``, ``limit`` and ``pid`` as for :meth:`acquire`.
        """
        self._raise_unreported()
        args = grant_args(key, ttl, owner, release_on_close, shared, limit, pid)
        result = _call(self, "tryAcquire", args, self.request_timeout, retry=owner is not None)
        return None if result is None else Handle.from_result(result)

    def renew(self, handle: HandleRef, ttl: float) -> RenewResult:
        """Extend the lease to ``ttl`` seconds from now.

        ``renewed`` is False (``reason="lease_lost"``) when the handle no
        longer holds the key. On success a Handle's ``lease_expires_at`` and
        ``ttl_ms`` are updated in place.
        """
        self._raise_unreported()
        return self._renew(handle, seconds_to_ms(ttl, "ttl", allow_zero=False))

    def release(self, handle: HandleRef) -> ReleaseResult:
        """Free the key if ``handle`` still holds it (else ``released`` False, ``not_holder``)."""
        result = _call(self, "release", release_args(handle), self.request_timeout, retry=True)
        return ReleaseResult.from_result(result)

    def status(self, key: str) -> LockStatus:
        """Who holds ``key`` right now, without trying to take it."""
        self._raise_unreported()
        result = _call(self, "status", {"key": check_key(key)}, self.request_timeout, retry=True)
        return LockStatus.from_result(result)

    def list(
        self, prefix: str | None = None, limit: int | None = None
    ) -> builtins.list[LockStatus]:
        """Held locks in key order, optionally only under ``prefix`` (owner, admin, services).

        Without ``limit``, every one: the daemon's pages are followed to the
        end. With ``limit``, at most that many.
        """
        found: builtins.list[LockStatus] = []
        after: str | None = None
        while True:
            want = None if limit is None else limit - len(found)
            page, after = self.list_page(prefix, want, after)
            found.extend(page)
            if after is None or (limit is not None and len(found) >= limit):
                return found

    def list_page(
        self, prefix: str | None = None, limit: int | None = None, after: str | None = None
    ) -> tuple[builtins.list[LockStatus], str | None]:
        """One page of ``list``: the locks after key ``after``, and the key to pass next.

        The second item is ``None`` when nothing remains.
        """
        self._raise_unreported()
        args = list_args(prefix, limit, after)
        locks, more = list_result(_call(self, "list", args, self.request_timeout, retry=True))
        return [LockStatus.from_result(item) for item in locks], more

    def break_lock(self, key: str, reason: str) -> BreakResult:
        """Free ``key`` whoever holds it, fencing the holder (owner, admin). Never retried.

        When the holder listens for events, the daemon waits for it to stop
        (at most ``break_grace``, 5 s by default; a holder on another etcd
        host: at most ``break_grace`` + 1 s) before it answers.
        """
        self._raise_unreported()
        result = _call(self, "break", break_args(key, reason), self.request_timeout, retry=False)
        return BreakResult.from_result(result)

    def stats(self) -> dict[str, Any]:
        """Daemon counters, gauges and per-op latency percentiles (owner, admin, services)."""
        self._raise_unreported()
        return self._dict_result("stats", {})

    def rules(self) -> dict[str, Any]:
        """The loaded lock rule set and the last reload error: ``{"policy", "lastError"}``."""
        self._raise_unreported()
        return self._dict_result("rules", {})

    def lock(
        self,
        key: str,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        owner: str | None = None,
        auto_renew: bool = True,
        on_lost: Callable[[Handle], object] | None = None,
        release_on_close: bool = True,
        *,
        shared: bool = False,
        limit: int = 1,
    ) -> AbstractContextManager[Handle]:
        """Context manager: acquire ``key`` (blocking), yield the Handle, release on exit.

        Safe by default: the lease is renewed in the background
        (``auto_renew``, every third of the TTL the grant reports) and bound to this client's
        connection (``release_on_close``), so a process killed inside the
        block frees the key at once, as with flock.

        The release also happens when the block raises; a failing release
        then is logged, never raised over the block's own exception. When the
        block ends normally but the hold was lost meanwhile (the renewer saw
        ``lease_lost``, renewals failed until the lease was about to run out,
        or the release answers ``not_holder``), :class:`LockLostError` is
        raised. ``on_lost(handle)`` is called once, from the renewer's thread,
        the moment the loss is seen (or at the release, if that is where it is
        seen first); ``handle.lost`` is set then too. ``shared`` and ``limit``
        as for :meth:`acquire`.
        """
        from ._lock import hold

        return hold(
            self,
            key,
            ttl,
            timeout,
            owner=owner,
            auto_renew=auto_renew,
            on_lost=on_lost,
            release_on_close=release_on_close,
            shared=shared,
            limit=limit,
        )

    # -- internals ------------------------------------------------------------

    def stopped(self, handle: HandleRef) -> bool:
        """Tell the daemon the work of a broken hold has stopped (docs/contract.md §12).

        A break of a hold whose holder listens for events hands the key on
        only once the holder says so (or closes, or ``break_grace`` passes).
        True when a break was waiting for it. Never retried.
        """
        args = {"handle": release_args(handle)["handle"]}
        result = _call(self, "stopped", args, self.request_timeout, retry=False)
        return bool(dict_result("stopped", result).get("stopped"))

    def listen_for_losses(self) -> None:
        """Ask the daemon to push lease-loss events to this client (docs/contract.md §12).

        From now on every connection of this client starts with ``hello
        {"events": true}`` (sent ahead of the next request, not waited for:
        a daemon that predates events refuses it and nothing else changes).
        ``lock()`` calls it itself; an :class:`AutoRenewer` built on this
        client then hears of a break, a re-take or an expiry at once.
        """
        self._events_wanted = True
        conn = self._conn
        if conn is not None and not conn.dead:
            self._ask_events(conn)

    @staticmethod
    def _ask_events(conn: Connection) -> None:
        if not conn.events_asked:
            conn.events_asked = True
            conn.send_quietly("hello", EVENTS_HELLO)

    def events_connection(self) -> Connection | None:
        """The connection now open (its pushed losses are read by an AutoRenewer), if any."""
        conn = self._conn
        return conn if conn is not None and not conn.dead else None

    def _note_lost(self, error: LockLostError) -> None:
        """A ``lock()`` hold was lost: the next call of this client raises ``error``."""
        with self._lock:
            self._unreported.append(error)

    def _forget_lost(self, key: str, fence: int) -> None:
        """The ``lock()`` block raised the loss itself: the next call need not."""
        with self._lock:
            self._unreported = [e for e in self._unreported if (e.key, e.fence) != (key, fence)]

    def _raise_unreported(self) -> None:
        if self._unreported:
            with self._lock:
                if not self._unreported:
                    return
                error = self._unreported.pop(0)
            raise error

    def _renew(
        self, handle: HandleRef, ttl_ms: int, give_up_at: float | None = None
    ) -> RenewResult:
        """renew with ttl in ms; ``give_up_at`` (monotonic) bounds waiting and retrying."""
        args = renew_args(handle, ttl_ms)

        def build() -> tuple[dict[str, Any], float | None]:
            read_timeout = self.request_timeout
            if give_up_at is not None:
                left = max(0.001, give_up_at - time.monotonic())
                read_timeout = left if read_timeout is None else min(read_timeout, left)
            return args, read_timeout

        first_args, read_timeout = build()
        result = RenewResult.from_result(
            _call(
                self,
                "renew",
                first_args,
                read_timeout,
                retry=True,
                again=build,
                give_up_at=give_up_at,
            )
        )
        result.apply_to(handle, ttl_ms)
        return result

    def _dict_result(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        return dict_result(op, _call(self, op, args, self.request_timeout, retry=True))

    def _next_id(self) -> int:
        with self._id_lock:
            return next(self._ids)

    def _id_source(self) -> Callable[[], int]:
        """What a connection calls for each request id.

        Under the GIL, ``next()`` of an ``itertools.count`` is one C call
        that no other thread interleaves with, so ids stay unique without
        :meth:`_next_id`'s lock and frame (a request's cost, issue 25). A
        free-threaded build may run without the GIL (or drop it after an
        import): it keeps the lock.
        """
        return self._next_id if _FREE_THREADED else self._ids.__next__

    def _connection(self) -> Connection:
        """The live connection, (re)connecting if needed; OSError if connecting fails."""
        conn = self._conn  # fast path, no lock: a stale answer fails as "not sent"
        if conn is not None and not conn.dead:
            return conn
        with self._lock:
            if self._closed:
                raise _closed_error()
            conn = self._conn
            if conn is not None and not conn.dead:
                return conn
            self._conn = None
            conn = Connection.open(
                self.socket_path,
                connect_timeout=self.connect_timeout,
                send_timeout=self.request_timeout,
                next_id=self._id_source(),
            )
            self._conn = conn
            self._connected_once = True
            if self._events_wanted:
                self._ask_events(conn)
            return conn

    def _forget(self, conn: Connection) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None


def _call(
    client: LockClient,
    op: str,
    args: dict[str, Any],
    read_timeout: float | None,
    *,
    retry: bool,
    again: _Build | None = None,
    give_up_at: float | None = None,
    repark: float | None = None,
) -> Any:
    """Send ``op`` for ``client``; its ``result``, reconnecting and re-sending as documented.

    ``repark`` (a blocking acquire's deadline, monotonic): ``SHUTTING_DOWN``
    and a connection lost after sending are retried too, up to that
    deadline (or ``retry_window``, whichever ends later): a parked acquire
    was never granted, so it is always safe to park it again.

    ``retry`` says whether a request that was sent, but whose connection
    broke before the reply, may be sent again. ``again`` recomputes the
    arguments and read time-out for each re-send; ``give_up_at``
    (monotonic) ends re-sending early.
    """
    reparks = repark is not None  # a blocking acquire: see Attempts.reparks
    attempts: Attempts | None = None  # made at the first failure, not per request
    while True:
        at_once = False
        shutting_down: ShuttingDownError | None = None
        try:
            conn = client._connection()
        except PermissionError:
            raise SocketPermissionError(client.socket_path) from None
        except OSError as exc:
            failure = f"cannot connect ({exc.strerror or exc})"
            can_retry = client._connected_once  # nothing was sent: safe for every op
        else:
            try:
                reply = conn.request(op, args, read_timeout)
            except ConnectionLost as exc:
                client._forget(conn)
                if client._closed:
                    raise _closed_error() from None
                if not exc.sent:  # rule 1: safe for every op
                    failure = f"connection lost before {op!r} was sent ({exc.reason})"
                    can_retry = at_once = True
                elif exc.protocol:  # the daemon answered garbage: do not insist
                    raise LockdError(exc.reason, code="PROTOCOL_ERROR") from None
                else:  # rule 2 (harmless twice) and rule 3 (a parked acquire)
                    failure = f"connection lost during {op!r} ({exc.reason})"
                    can_retry = retry or reparks
                    if not can_retry:
                        failure += "; not retried, as the daemon may have carried it out"
            except ReplyTimeout:
                waited = "" if read_timeout is None else f" within {read_timeout:g} s"
                raise DaemonUnavailableError(
                    client.socket_path, f"no reply to {op!r}{waited}"
                ) from None
            else:
                try:
                    return unwrap(reply)
                except ShuttingDownError as exc:
                    if not reparks:
                        raise
                    # The daemon is stopping; it closes this connection itself.
                    shutting_down = exc
                    failure = f"the daemon shut down during {op!r}"
                    can_retry = True
        if attempts is None:
            attempts = Attempts(
                client.socket_path,
                retry_window=client.retry_window,
                give_up_at=give_up_at,
                repark=repark,
            )
        pause = attempts.after_failure(
            failure, can_retry=can_retry, at_once=at_once, shutting_down=shutting_down
        )
        if pause:
            time.sleep(pause)
        if again is not None:
            args, read_timeout = again()


#: A free-threaded build (3.13t and later name themselves so in ``sys.version``
#: on every platform); a default build always runs under the GIL.
_FREE_THREADED = "free-threading" in sys.version


def _closed_error() -> LockdError:
    return LockdError("the LockClient was closed", code="CLIENT_CLOSED")
