"""lockd_client: the synchronous Python client of the lockd lock daemon.

Standard library only (never imports trio or click)::

    from lockd_client import LockClient, LockTimeoutError

    with LockClient() as client:  # socket: argument, else $LOCKD_SOCKET, else the user default
        try:
            handle = client.acquire("portfolio-import:42", ttl=60, timeout=10)
        except LockTimeoutError:
            ...  # already running
        try:
            ...  # the exclusive work
        finally:
            client.release(handle)

        # Renewed in the background and bound to this connection; raises
        # LockLostError at the end if the hold was lost meanwhile.
        with client.lock("refresh:42", ttl=30, timeout=5) as handle:
            ...

Times are seconds (floats) on the Python side, whole milliseconds (rounded
up) on the wire. One client is safe to share between threads; it uses one
pipelined connection. After a daemon restart it reconnects by itself and
re-sends the requests that are safe to repeat: ``hello``, ``status``, ``list``,
``stats``, ``rules``, ``renew``, ``release``, and ``acquire``/``try_acquire``
when an ``owner`` is given. A blocking ``acquire`` that meets a daemon
restart while waiting parks again with what is left of its timeout.
``ttl`` defaults to 60 s everywhere (:data:`DEFAULT_TTL`); a blocking
``acquire``/``lock`` without ``timeout`` waits without limit (the wire needs
a ``timeoutMs``: the client sends the largest, 24 h, and parks again
whenever it runs out).
``try_acquire`` without an owner and
``break_lock`` are not re-sent once sent; they raise
:class:`DaemonUnavailableError` instead (see :mod:`lockd_client._client`).
"""

from ._client import HandleRef, LockClient
from ._errors import (
    BackendUnavailableError,
    CancelledError,
    DaemonUnavailableError,
    DeadlockError,
    InternalError,
    InvalidRequestError,
    LockAccessDeniedError,
    LockdError,
    LockLostError,
    LockTimeoutError,
    RateLimitedError,
    ShuttingDownError,
    SocketPermissionError,
    StorageUnavailableError,
    UntrustedDaemonError,
)
from ._paths import SOCKET_ENV, default_socket_path, resolve_socket_path
from ._requests import DEFAULT_TTL, MAX_LIMIT, UNLIMITED_WAIT
from ._results import (
    BreakResult,
    Handle,
    Holder,
    LockStatus,
    ReleaseResult,
    RenewResult,
    Waiter,
)

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from ._renewer import AutoRenewer


def __getattr__(name: str) -> object:
    # AutoRenewer (threads, logging) is imported when asked for: a program, or
    # a ``lockd`` command, that never renews in the background does not pay
    # for it at start-up.
    if name == "AutoRenewer":
        from ._renewer import AutoRenewer

        return AutoRenewer
    raise AttributeError(f"module 'lockd_client' has no attribute {name!r}")


__all__ = [
    "DEFAULT_TTL",
    "MAX_LIMIT",
    "SOCKET_ENV",
    "UNLIMITED_WAIT",
    "AutoRenewer",
    "BackendUnavailableError",
    "BreakResult",
    "CancelledError",
    "DaemonUnavailableError",
    "DeadlockError",
    "Handle",
    "HandleRef",
    "Holder",
    "InternalError",
    "InvalidRequestError",
    "LockAccessDeniedError",
    "LockClient",
    "LockLostError",
    "LockStatus",
    "LockTimeoutError",
    "LockdError",
    "RateLimitedError",
    "ReleaseResult",
    "RenewResult",
    "ShuttingDownError",
    "SocketPermissionError",
    "StorageUnavailableError",
    "UntrustedDaemonError",
    "Waiter",
    "default_socket_path",
    "resolve_socket_path",
]
