"""What every client sends and how it reads the answers, without any I/O.

The synchronous :class:`~lockd_client.LockClient` and the async clients
(:mod:`lockd_client.aio`, :mod:`lockd_client.trio`) build their requests and
interpret their replies here, so the three speak the protocol identically;
they differ only in how they wait. Also here: which requests are harmless to
send twice (:func:`retry_safe`), and the retry schedule (:class:`Attempts`)
that decides, after a broken connection, whether and when to send again.
"""

from __future__ import annotations

import time

from ._errors import DaemonUnavailableError, LockdError, ShuttingDownError, error_from_reply
from ._results import Handle
from ._wire import (
    check_bool,
    check_key,
    check_optional_str,
    check_owner,
    check_reason,
    check_text,
    seconds_to_ms,
)

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "MAX_LIMIT",
    "Attempts",
    "HandleRef",
    "acquire_timeout_ms",
    "break_args",
    "grant_args",
    "handle_parts",
    "late_grant",
    "list_args",
    "release_args",
    "renew_args",
    "unwrap",
]

#: What ``renew`` and ``release`` accept: a Handle, or a ``(key, handle_id)`` pair.
HandleRef = Handle | tuple[str, str]

#: The TTL of every acquire that names none, in seconds (docs/contract.md §12: 60 s everywhere).
DEFAULT_TTL = 60.0
#: The longest ``timeoutMs`` one wait may send, in seconds (24 h, docs/contract.md §3). A
#: blocking acquire without a timeout sends it and parks again each time it
#: runs out, so it waits without limit.
UNLIMITED_WAIT = 86_400.0

#: The largest semaphore (docs/contract.md §10).
MAX_LIMIT = 1000
#: The first pause between attempts, and the longest.
_FIRST_PAUSE = 0.05
_MAX_PAUSE = 0.5


def grant_args(
    key: str,
    ttl: float,
    owner: str | None,
    release_on_close: bool,
    shared: bool = False,
    limit: int = 1,
    pid: int | None = None,
) -> dict[str, Any]:
    """Arguments of ``acquire``/``tryAcquire`` (without ``timeoutMs``).

    ``mode`` and ``limit`` are only sent when they differ from the defaults
    (exclusive, 1), so a plain mutex request stays as small as before;
    ``pid`` only when given (the process that will use the hold).
    """
    args: dict[str, Any] = {
        "key": check_key(key),
        "ttlMs": seconds_to_ms(ttl, "ttl", allow_zero=False),
    }
    # The defaults (no owner, False, False, 1) skip their checks: same
    # outcome, in the same order, with fewer calls on every plain request.
    if owner is not None:
        args["owner"] = check_owner(owner)
    if release_on_close is not False and check_bool(release_on_close, "release_on_close"):
        args["releaseOnClose"] = True
    if shared is not False and check_bool(shared, "shared"):
        args["mode"] = "shared"
    if pid is not None:
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise TypeError(f"pid must be an int, got {type(pid).__name__}")
        if pid < 1:
            raise ValueError(f"pid must be positive, got {pid}")
        args["pid"] = pid
    if type(limit) is int and limit == 1:
        return args
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, got {type(limit).__name__}")
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be 1-{MAX_LIMIT}, got {limit}")
    if limit != 1:
        if shared:
            raise ValueError("shared holds take no limit (a semaphore's slots are exclusive)")
        args["limit"] = limit
    return args


def acquire_timeout_ms(timeout: float) -> int:
    """A blocking acquire's ``timeoutMs`` (0 makes one attempt)."""
    return seconds_to_ms(timeout, "timeout", allow_zero=True)


def renew_args(handle: HandleRef, ttl_ms: int) -> dict[str, Any]:
    key, handle_id = handle_parts(handle)
    return {"key": key, "handle": handle_id, "ttlMs": ttl_ms}


def release_args(handle: HandleRef) -> dict[str, Any]:
    key, handle_id = handle_parts(handle)
    return {"key": key, "handle": handle_id}


def list_args(prefix: str | None, limit: int | None, after: str | None) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if check_optional_str(prefix, "prefix") is not None:
        args["prefix"] = prefix
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int or None, got {type(limit).__name__}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        args["limit"] = limit
    if after is not None:
        args["after"] = check_key(after, "after")
    return args


def break_args(key: str, reason: str) -> dict[str, Any]:
    return {"key": check_key(key), "reason": check_reason(reason)}


def handle_parts(handle: object) -> tuple[str, str]:
    """``(key, handle_id)`` of a Handle or a pair."""
    if isinstance(handle, Handle):
        return handle.key, handle.handle
    if isinstance(handle, tuple) and len(handle) == 2:
        key, handle_id = handle
        return check_key(key), check_text(handle_id, "handle id", 4096)
    raise TypeError(f"expected a Handle or a (key, handle_id) pair, got {type(handle).__name__}")


def unwrap(reply: dict[str, Any]) -> Any:
    """A reply's ``result``, or its error raised as the matching exception."""
    ok = reply.get("ok")
    if ok is True:
        return reply.get("result")
    if ok is False:
        raise error_from_reply(reply.get("error"))
    raise LockdError(f"malformed reply from lockd: {reply!r}", code="PROTOCOL_ERROR")


def dict_result(op: str, result: object) -> dict[str, Any]:
    if not isinstance(result, dict):
        raise LockdError(f"malformed {op} reply: {result!r}", code="PROTOCOL_ERROR")
    return result


def list_result(result: object) -> tuple[list[Any], str | None]:
    """The ``locks`` and ``next`` of a ``list`` reply."""
    locks = result.get("locks") if isinstance(result, dict) else None
    if not isinstance(locks, list):
        raise LockdError(f"malformed list reply: {result!r}", code="PROTOCOL_ERROR")
    after = result.get("next") if isinstance(result, dict) else None
    return locks, after if isinstance(after, str) else None


_GRANT_OPS = frozenset({"acquire", "tryAcquire"})


def late_grant(op: str, reply: dict[str, Any]) -> tuple[str, str] | None:
    """``(key, handle_id)`` when a reply nobody waits for granted a lease (to give back)."""
    if op not in _GRANT_OPS or reply.get("ok") is not True:
        return None
    result = reply.get("result")
    if isinstance(result, dict):
        key, handle = result.get("key"), result.get("handle")
        if isinstance(key, str) and isinstance(handle, str):
            return key, handle
    return None


class Attempts:
    """When to send a request again after it failed, and when to give up.

    One instance per call. After each failed attempt the caller says what
    happened (:meth:`after_failure`); the answer is the pause before the next
    attempt, or the exception to raise. The rules (see ``_client``'s module
    doc): a request that never left may always go again, the first time at
    once; one that left goes again only if ``retry`` (harmless twice) or
    ``repark`` (a blocking acquire, which was never granted while parked);
    retrying lasts ``retry_window`` seconds from the first failure, cut at
    ``give_up_at`` and stretched to ``repark`` (both monotonic).
    """

    def __init__(
        self,
        socket_path: str,
        *,
        retry_window: float,
        give_up_at: float | None = None,
        repark: float | None = None,
    ) -> None:
        self._socket_path = socket_path
        self._retry_window = retry_window
        self._give_up_at = give_up_at
        self._repark = repark
        self._until: float | None = None
        self._pause = _FIRST_PAUSE
        self._resent_at_once = False

    @property
    def reparks(self) -> bool:
        """True for a blocking acquire, which a restart never granted."""
        return self._repark is not None

    def after_failure(
        self,
        failure: str,
        *,
        can_retry: bool,
        at_once: bool = False,
        shutting_down: ShuttingDownError | None = None,
    ) -> float:
        """The pause before the next attempt; raises when there is none.

        ``at_once``: the request never left on a connection that was up (its
        send failed); the first such re-send goes without a pause.
        """
        now = time.monotonic()
        if self._until is None:
            self._until = now + self._retry_window
            if self._give_up_at is not None:
                self._until = min(self._until, self._give_up_at)
            if self._repark is not None:
                self._until = max(self._until, self._repark)
        pause = self._pause
        if at_once and not self._resent_at_once:
            pause = 0.0  # never left: the first re-send goes at once
            self._resent_at_once = True
        if not can_retry or now + pause > self._until:
            if shutting_down is not None:  # the daemon kept saying so: it stays down
                raise shutting_down
            raise DaemonUnavailableError(self._socket_path, failure)
        if pause:
            self._pause = min(self._pause * 2, _MAX_PAUSE)
        return pause
