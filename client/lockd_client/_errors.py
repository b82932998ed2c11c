"""Exceptions raised by :mod:`lockd_client`.

Every error the daemon reports (docs/contract.md §3 error codes) becomes an instance of
:class:`LockdError` or one of its subclasses; :func:`error_from_reply` does the
mapping. :class:`DaemonUnavailableError` is raised by the client itself when it
cannot reach the daemon.
"""

from __future__ import annotations

import os
import pwd
import stat

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "CancelledError",
    "DaemonUnavailableError",
    "InternalError",
    "InvalidRequestError",
    "LockAccessDeniedError",
    "LockLostError",
    "LockTimeoutError",
    "LockdError",
    "RateLimitedError",
    "ShuttingDownError",
    "SocketPermissionError",
    "StorageUnavailableError",
    "UntrustedDaemonError",
    "error_from_reply",
]


class LockdError(Exception):
    """Base class of every lockd error.

    ``code`` is the daemon's error code (``"LOCK_TIMEOUT"``, ...) or a
    client-side code (``"DAEMON_UNAVAILABLE"``, ``"DAEMON_UNTRUSTED"``,
    ``"PROTOCOL_ERROR"``, ``"CLIENT_CLOSED"``); ``status`` mirrors HTTP (``None`` for client-side
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


class StorageUnavailableError(LockdError):
    """``STORAGE_UNAVAILABLE`` (503): the daemon cannot write its database; nothing took effect."""


class CancelledError(LockdError):
    """``CANCELLED`` (499): a parked acquire was withdrawn with ``cancel``.

    The async clients send ``cancel`` when the task waiting in ``acquire`` is
    cancelled; they raise the task's own cancellation, not this.
    """


class BackendUnavailableError(LockdError):
    """``BACKEND_UNAVAILABLE`` (503): the daemon cannot reach its etcd cluster in time.

    Nothing was decided; retrying is safe (a blocking ``acquire`` keeps
    waiting inside the daemon instead).
    """


class DeadlockError(LockdError):
    """``DEADLOCK`` (409): this blocking acquire would close a cycle of waits.

    ``.cycle`` lists the keys of the cycle in order (``details.cycle``). The
    other waiters of the cycle keep waiting: release something this program
    holds, or take its keys in one fixed order.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cycle = self.details.get("cycle")
        self.cycle: list[str] = (
            [k for k in cycle if isinstance(k, str)] if isinstance(cycle, list) else []
        )


class InternalError(LockdError):
    """``INTERNAL`` (500): a bug in the daemon; the daemon itself lives on."""


class LockLostError(LockdError):
    """The hold of a ``with client.lock(...)`` block was lost before the block ended.

    Raised when the block ends normally but the lease was gone meanwhile: the
    release answered ``not_holder``, or the renewer saw ``lease_lost`` (the
    key was broken, re-taken, or the lease ran out). The work done inside the
    block ran, at least in part, without the lock. ``key`` and ``fence``
    identify the hold; code ``LEASE_LOST``.
    """

    key: str
    fence: int
    #: why, in words (for a break: who broke it and the admin's reason).
    reason: str
    #: what the daemon said ended the hold: "break", "retake", "expired",
    #: "session"; None when it was seen otherwise (a renew or release).
    cause: str | None

    def __init__(self, key: str, fence: int, reason: str, cause: str | None = None) -> None:
        super().__init__(
            f"the lease on {key!r} (fence {fence}) was lost before the block ended: {reason}",
            code="LEASE_LOST",
            details={"key": key, "fence": fence, "reason": reason, "cause": cause},
        )
        self.key = key
        self.fence = fence
        self.reason = reason
        self.cause = cause


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


class SocketPermissionError(LockAccessDeniedError):
    """The daemon's socket exists, but this user may not connect to it (``EACCES``).

    Not "daemon unavailable": something listens there, only the socket's
    permissions keep this user out. The message names the socket, its owner,
    group and mode; ``details`` has ``socketPath``, ``owner``, ``group``,
    ``mode`` (octal text) when they could be read. Code ``LOCK_ACCESS_DENIED``.
    """

    socket_path: str

    def __init__(self, socket_path: str) -> None:
        details: dict[str, Any] = {"socketPath": socket_path}
        details.update(_socket_facts(socket_path))
        who = _user_name(os.geteuid())
        if "mode" in details:
            facts = f" (owner {details['owner']}, group {details['group']}, mode {details['mode']})"
        else:
            facts = f" ({details['denied']})" if "denied" in details else ""
        super().__init__(
            f"permission denied on the lockd socket {socket_path}{facts}: the daemon is "
            f"there, but user {who} may not use its socket. Ask its administrator for "
            "access (e.g. membership of the socket's group), or set LOCKD_SOCKET to a "
            "daemon of your own (`lockd serve` runs one as you).",
            code="LOCK_ACCESS_DENIED",
            status=403,
            details=details,
        )
        self.socket_path = socket_path


def _socket_facts(path: str) -> dict[str, Any]:
    """Owner, group and mode of the socket, or which folder refused us."""
    try:
        st = os.stat(path)
    except PermissionError:  # a folder on the way refuses us: name the first one
        folder = os.path.dirname(os.path.abspath(path))
        ancestors = [folder]
        while folder != os.path.dirname(folder):
            folder = os.path.dirname(folder)
            ancestors.append(folder)
        for folder in reversed(ancestors):
            if not os.access(folder, os.X_OK):
                return {"denied": f"cannot enter the folder {folder}"}
        return {}
    except OSError:
        return {}
    return {
        "owner": _user_name(st.st_uid),
        "group": _group_name(st.st_gid),
        "mode": f"{stat.S_IMODE(st.st_mode):04o}",
    }


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    import grp  # here: a C module of its own to load, for an error message (start-up, issue 24)

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


class UntrustedDaemonError(DaemonUnavailableError):
    """The socket is not one the client may trust; nothing was sent to it.

    Its folder (or a parent) belongs to another user or can be written by
    others, or the process listening runs as neither root, the caller, nor the
    ``lockd`` system user: it could be another user's fake daemon. ``reason``
    says which.
    """

    reason: str

    def __init__(self, socket_path: str, reason: str) -> None:
        super().__init__(socket_path, reason)
        self.message = (
            f"lockd socket {socket_path} is not trusted: {reason}. "
            "Use a socket in a folder only you (or root) can write, served by root, "
            "yourself or the lockd system user (set XDG_RUNTIME_DIR or LOCKD_SOCKET)."
        )
        self.args = (self.message,)
        self.code = "DAEMON_UNTRUSTED"
        self.reason = reason


_BY_CODE: dict[str, type[LockdError]] = {
    "INVALID_REQUEST": InvalidRequestError,
    "LOCK_ACCESS_DENIED": LockAccessDeniedError,
    "LOCK_TIMEOUT": LockTimeoutError,
    "RATE_LIMITED": RateLimitedError,
    "CANCELLED": CancelledError,
    "SHUTTING_DOWN": ShuttingDownError,
    "STORAGE_UNAVAILABLE": StorageUnavailableError,
    "BACKEND_UNAVAILABLE": BackendUnavailableError,
    "DEADLOCK": DeadlockError,
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
