"""What the asyncio and trio clients share: the pipelined connection's
bookkeeping and every operation, written once against a small backend.

:class:`~lockd_client._pipeline.Pipeline` (:mod:`lockd_client._pipeline`) is
one connection's state without any I/O: requests in flight by id, replies
filed as bytes come in, and what to do when a waiting task gives up.
:class:`AsyncClientBase` is the whole client API as coroutines (the block of
its ``lock()`` is :mod:`lockd_client._ahold`); :mod:`lockd_client.aio` and
:mod:`lockd_client.trio` supply how to connect, read, write, sleep and run a
background task.

**Cancellation never leaves a key held.** Every step that must happen when a
task is cancelled is synchronous (queueing bytes to send), so it also runs
inside a cancelled task. When the task waiting in ``acquire`` is cancelled
(``asyncio.wait_for``, ``task.cancel()``, a trio cancel scope):

- if the grant is already here but the task had not taken it yet, it is
  released at once;
- otherwise the request is marked abandoned and ``cancel {target: id}`` is
  sent. The daemon either withdraws the waiter (the acquire is answered
  ``CANCELLED``) or the grant crossed the cancel on the wire (``cancelled:
  false``); a grant that arrives for an abandoned request is released as
  soon as it is read.

Retry and re-park rules are the synchronous client's
(:class:`lockd_client._requests.Attempts`).
"""

from __future__ import annotations

import builtins
import itertools
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, Generic

from ._ahold import hold
from ._connection import ConnectionLost, ReplyTimeout
from ._errors import (
    DaemonUnavailableError,
    LockdError,
    LockTimeoutError,
    ShuttingDownError,
    SocketPermissionError,
)
from ._paths import resolve_socket_path
from ._pipeline import BlockGuard, Pipeline, Slot, SlotT
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

__all__ = ["AsyncClientBase", "BlockGuard", "ConnectionLost", "Pipeline", "ReplyTimeout", "Slot"]


class AsyncClientBase(ABC, Generic[SlotT]):
    """The client API as coroutines, over a backend (asyncio or trio).

    A backend implements :meth:`_open` (connect, start reading, return a
    Pipeline), :meth:`_wait` (a slot's reply within a time limit),
    :meth:`_sleep`, :meth:`_background` (run a coroutine function in the
    background until the returned stopper is awaited) and :meth:`_shutdown`.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        request_timeout: float | None = 30.0,
        retry_window: float = 5.0,
    ) -> None:
        """``socket_path``, ``request_timeout``, ``retry_window`` as for ``LockClient``."""
        self.socket_path: str = resolve_socket_path(socket_path)
        self.request_timeout = request_timeout
        self.retry_window = retry_window
        self._pipe: Pipeline[SlotT] | None = None
        self._connected_once = False
        self._closed = False
        self._ids = itertools.count(1)
        #: connections ask for lease-loss events (``lock()`` turns it on).
        self._events_wanted = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(socket_path={self.socket_path!r})"

    # -- backend ------------------------------------------------------------------

    @abstractmethod
    async def _open(self) -> Pipeline[SlotT]:
        """Connect and start reading; OSError when connecting fails."""

    @abstractmethod
    async def _wait(self, slot: SlotT, timeout: float | None) -> dict[str, Any]:
        """The slot's reply; ReplyTimeout after ``timeout``; ConnectionLost if it died."""

    @abstractmethod
    async def _sleep(self, seconds: float) -> None:
        """Sleep."""

    @abstractmethod
    def _background(self, run: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """Start ``run()`` in the background; the result stops it (and waits for it)."""

    @abstractmethod
    async def _shutdown(self) -> None:
        """Close the connection and stop reading."""

    @abstractmethod
    def _block_guard(self) -> BlockGuard:
        """A guard for the block of ``lock()``, made in the block's task."""

    def _cleanup_scope(self) -> AbstractContextManager[Any]:
        """Where cleanup runs after the block was cancelled (trio: shielded, bounded)."""
        return nullcontext()

    # -- lifecycle ----------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connection (``release_on_close`` leases are freed by the daemon)."""
        self._closed = True
        if self._pipe is not None:
            self._pipe.die("the client closed the connection")
        await self._shutdown()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- operations ---------------------------------------------------------------

    async def hello(self) -> dict[str, Any]:
        """Protocol and server version, and the caller as the daemon sees it."""
        return dict_result("hello", await self._call("hello", {}, retry=True))

    async def acquire(
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

        As :meth:`lockd_client.LockClient.acquire` (``pid`` too: the process
        that will use the hold). Cancelling the waiting task withdraws the
        waiter; a grant that crossed the cancel is released.
        """
        while timeout is None:  # no limit: the longest wait the wire takes, again and again
            try:
                return await self.acquire(
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

        def build() -> tuple[dict[str, Any], float | None]:
            ms = max(0, min(timeout_ms, int((deadline - time.monotonic()) * 1000)))
            wait = None if self.request_timeout is None else ms / 1000 + self.request_timeout
            return {**base, "timeoutMs": ms}, wait

        args, wait = build()
        args["timeoutMs"] = timeout_ms
        result = await self._call(
            "acquire", args, wait, retry=owner is not None, again=build, repark=deadline
        )
        return Handle.from_result(result)

    async def try_acquire(
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

        ``pid`` as for :meth:`acquire`.
        """
        args = grant_args(key, ttl, owner, release_on_close, shared, limit, pid)
        result = await self._call("tryAcquire", args, retry=owner is not None)
        return None if result is None else Handle.from_result(result)

    async def renew(self, handle: HandleRef, ttl: float) -> RenewResult:
        """Extend the lease to ``ttl`` seconds from now (``renewed`` False when lost)."""
        ttl_ms = seconds_to_ms(ttl, "ttl", allow_zero=False)
        result = RenewResult.from_result(
            await self._call("renew", renew_args(handle, ttl_ms), retry=True)
        )
        result.apply_to(handle, ttl_ms)
        return result

    async def release(self, handle: HandleRef) -> ReleaseResult:
        """Free the key if ``handle`` still holds it (else ``released`` False)."""
        result = await self._call("release", release_args(handle), retry=True)
        return ReleaseResult.from_result(result)

    async def status(self, key: str) -> LockStatus:
        """Who holds ``key`` right now, without trying to take it."""
        result = await self._call("status", {"key": check_key(key)}, retry=True)
        return LockStatus.from_result(result)

    async def list(
        self, prefix: str | None = None, limit: int | None = None
    ) -> builtins.list[LockStatus]:
        """Held locks in key order (every one without ``limit``: pages are followed)."""
        found: builtins.list[LockStatus] = []
        after: str | None = None
        while True:
            want = None if limit is None else limit - len(found)
            page, after = await self.list_page(prefix, want, after)
            found.extend(page)
            if after is None or (limit is not None and len(found) >= limit):
                return found

    async def list_page(
        self, prefix: str | None = None, limit: int | None = None, after: str | None = None
    ) -> tuple[builtins.list[LockStatus], str | None]:
        """One page of ``list`` and the key to pass as ``after`` next (None at the end)."""
        args = list_args(prefix, limit, after)
        locks, more = list_result(await self._call("list", args, retry=True))
        return [LockStatus.from_result(item) for item in locks], more

    async def break_lock(self, key: str, reason: str) -> BreakResult:
        """Free ``key`` whoever holds it (owner, admin). Never retried."""
        result = await self._call("break", break_args(key, reason), retry=False)
        return BreakResult.from_result(result)

    async def stats(self) -> dict[str, Any]:
        """Daemon counters, gauges and latency percentiles (owner, admin, services)."""
        return dict_result("stats", await self._call("stats", {}, retry=True))

    async def rules(self) -> dict[str, Any]:
        """The loaded lock rule set and the last reload error."""
        return dict_result("rules", await self._call("rules", {}, retry=True))

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
    ) -> AbstractAsyncContextManager[Handle]:
        """``async with client.lock(...) as handle:`` as :meth:`LockClient.lock`.

        Renewed by a background task, bound to the connection, released on
        exit (also when the block raises or is cancelled); raises
        :class:`LockLostError` at the end of a block that finished normally
        after the hold was lost. ``on_lost(handle)`` is called the moment the
        loss is seen (a plain callable, from the renewing task).
        """
        if on_lost is not None and not auto_renew:
            raise ValueError("on_lost needs auto_renew=True")
        return hold(
            self, key, ttl, timeout, owner, auto_renew, on_lost, release_on_close, shared, limit
        )

    # -- internals ----------------------------------------------------------------
    async def _pipeline(self) -> Pipeline[SlotT]:
        if self._closed:
            raise LockdError("the client was closed", code="CLIENT_CLOSED")
        if self._pipe is None or self._pipe.dead:
            self._pipe = None
            self._pipe = await self._open()
            self._connected_once = True
            if self._events_wanted:
                self._pipe.ask_events()
        return self._pipe

    async def _call(
        self,
        op: str,
        args: dict[str, Any],
        wait: float | bool | None = True,
        *,
        retry: bool,
        again: Callable[[], tuple[dict[str, Any], float | None]] | None = None,
        repark: float | None = None,
    ) -> Any:
        """Send ``op`` and return its result, retrying as the sync client does.

        ``wait``: the reply's time limit (``True``: ``request_timeout``).
        """
        timeout = self.request_timeout if wait is True else wait
        assert timeout is not True
        attempts = Attempts(self.socket_path, retry_window=self.retry_window, repark=repark)
        while True:
            at_once = False
            shutting_down: ShuttingDownError | None = None
            try:
                pipe = await self._pipeline()
            except PermissionError:
                raise SocketPermissionError(self.socket_path) from None
            except OSError as exc:
                failure = f"cannot connect ({exc.strerror or exc})"
                can_retry = self._connected_once
            else:
                rid = next(self._ids)
                try:
                    slot = pipe.start({"id": rid, "op": op, **args})
                    reply = await self._wait_reply(pipe, rid, op, slot, timeout)
                except ConnectionLost as exc:
                    if self._closed:
                        raise LockdError("the client was closed", code="CLIENT_CLOSED") from None
                    if not exc.sent:
                        failure = f"connection lost before {op!r} was sent ({exc.reason})"
                        can_retry = at_once = True
                    elif exc.protocol:
                        raise LockdError(exc.reason, code="PROTOCOL_ERROR") from None
                    else:
                        failure = f"connection lost during {op!r} ({exc.reason})"
                        can_retry = retry or attempts.reparks
                        if not can_retry:
                            failure += "; not retried, as the daemon may have carried it out"
                else:
                    try:
                        return unwrap(reply)
                    except ShuttingDownError as exc:
                        if not attempts.reparks:
                            raise
                        shutting_down = exc
                        failure = f"the daemon shut down during {op!r}"
                        can_retry = True
            pause = attempts.after_failure(
                failure, can_retry=can_retry, at_once=at_once, shutting_down=shutting_down
            )
            if pause:
                await self._sleep(pause)
            if again is not None:
                args, timeout = again()

    async def _wait_reply(
        self, pipe: Pipeline[SlotT], rid: int, op: str, slot: SlotT, timeout: float | None
    ) -> dict[str, Any]:
        try:
            return await self._wait(slot, timeout)
        except ConnectionLost:
            raise
        except ReplyTimeout:
            pipe.give_up(rid, op, slot)
            waited = "" if timeout is None else f" within {timeout:g} s"
            raise DaemonUnavailableError(self.socket_path, f"no reply to {op!r}{waited}") from None
        except BaseException:  # cancelled: withdraw, and give back what crossed
            pipe.give_up(rid, op, slot)
            raise
