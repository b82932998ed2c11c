"""Exceptions raised by :mod:`lockd_client`.

Every error the daemon reports (SPEC §3 error codes) becomes an instance of
:class:`LockdError` or one of its subclasses; :func:`error_from_reply` does the
mapping. :class:`DaemonUnavailableError` is raised by the client itself when it
cannot reach the daemon.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DaemonUnavailableError",
    "InternalError",
    "InvalidRequestError",
    "LockAccessDeniedError",
    "LockTimeoutError",
    "LockdError",
    "RateLimitedError",
    "ShuttingDownError",
    "error_from_reply",
]


class LockdError(Exception):
    """Base class of every lockd error.

    ``code`` is the daemon's error code (``"LOCK_TIMEOUT"``, ...) or a
    client-side code (``"DAEMON_UNAVAILABLE"``, ``"PROTOCOL_ERROR"``,
    ``"CLIENT_CLOSED"``); ``status`` mirrors HTTP (``None`` for client-side
    errors); ``details`` is the error's ``details`` object (never ``None``).
    """

    code: str
    status: int | None
    details: dict[str, Any]
    message: str

    def __init__(
        self,
        message: str,
        *,
        code: str = "ERROR",
        status: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.details = dict(details) if details else {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class InvalidRequestError(LockdError):
    """``INVALID_REQUEST`` (400): the daemon refused the request's shape or values.

    ``field`` names the offending field when the daemon said which
    (``details.field``), else ``None``.
    """

    field: str | None

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        field = self.details.get("field")
        self.field = field if isinstance(field, str) else None


class LockAccessDeniedError(LockdError):
    """``LOCK_ACCESS_DENIED`` (403): a rule refused, or the operation needs more rights."""


class LockTimeoutError(LockdError):
    """``LOCK_TIMEOUT`` (408): a blocking acquire did not win the key in time.

    ``key`` and ``timeout_ms`` come from the error's details (``None`` if absent).
    """

    key: str | None
    timeout_ms: int | None

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        key = self.details.get("key")
        timeout_ms = self.details.get("timeoutMs")
        self.key = key if isinstance(key, str) else None
        self.timeout_ms = _as_int(timeout_ms)


class RateLimitedError(LockdError):
    """``RATE_LIMITED`` (429): too many acquire attempts in the rolling hour.

    ``retry_after`` is how long to wait, in seconds (from
    ``details.retryAfterMs``; ``None`` if absent); ``limit`` is the configured
    number of attempts per hour (``None`` if absent).
    """

    retry_after: float | None
    limit: int | None

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        retry_ms = self.details.get("retryAfterMs")
        self.retry_after = None
        if isinstance(retry_ms, int | float) and not isinstance(retry_ms, bool):
            self.retry_after = retry_ms / 1000.0
        self.limit = _as_int(self.details.get("limit"))


class ShuttingDownError(LockdError):
    """``SHUTTING_DOWN`` (503): the daemon is stopping. Try again once it is back."""


class InternalError(LockdError):
    """``INTERNAL`` (500): a bug in the daemon; the daemon itself lives on."""


class DaemonUnavailableError(LockdError):
    """The daemon could not be reached, or the connection dropped and a retry was unsafe.

    ``socket_path`` is the socket that was tried; the message names it and
    says how to start the daemon.
    """

    socket_path: str

    def __init__(self, socket_path: str, reason: str) -> None:
        message = (
            f"lockd daemon unavailable at {socket_path}: {reason}. "
            "Start it with `lockd serve` (or `systemctl --user start lockd.socket`), "
            "or set LOCKD_SOCKET to the socket of a running daemon."
        )
        super().__init__(message, code="DAEMON_UNAVAILABLE", details={"socketPath": socket_path})
        self.socket_path = socket_path


_BY_CODE: dict[str, type[LockdError]] = {
    "INVALID_REQUEST": InvalidRequestError,
    "LOCK_ACCESS_DENIED": LockAccessDeniedError,
    "LOCK_TIMEOUT": LockTimeoutError,
    "RATE_LIMITED": RateLimitedError,
    "SHUTTING_DOWN": ShuttingDownError,
    "INTERNAL": InternalError,
}


def error_from_reply(error: object) -> LockdError:
    """Turn a reply's ``error`` object into the matching exception (unknown codes: LockdError)."""
    if not isinstance(error, dict):
        return LockdError(f"malformed error reply: {error!r}", code="PROTOCOL_ERROR")
    code = error.get("code")
    code = code if isinstance(code, str) else "ERROR"
    status = _as_int(error.get("status"))
    message = error.get("message")
    message = message if isinstance(message, str) and message else code
    details = error.get("details")
    details = details if isinstance(details, dict) else None
    cls = _BY_CODE.get(code, LockdError)
    return cls(message, code=code, status=status, details=details)


def _as_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
