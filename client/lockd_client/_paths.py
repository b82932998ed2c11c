"""Where the client looks for the daemon's socket."""

from __future__ import annotations

import os

__all__ = ["SOCKET_ENV", "default_socket_path", "resolve_socket_path"]

SOCKET_ENV = "LOCKD_SOCKET"
_RUN_USER = "/run/user"


def default_socket_path() -> str:
    """The user-mode socket path, as ``lockd serve`` (platformdirs) picks it on Linux.

    ``$XDG_RUNTIME_DIR/lockd/lockd.sock`` when ``XDG_RUNTIME_DIR`` is set to an
    absolute path; else ``/run/user/<euid>/lockd/lockd.sock`` when
    ``/run/user/<euid>`` exists; else
    ``<tempfile.gettempdir()>/runtime-<euid>/lockd/lockd.sock``.
    ``LOCKD_SOCKET`` is not consulted here (see :func:`resolve_socket_path`).
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        base = xdg
    else:
        euid = os.geteuid()
        run_user = os.path.join(_RUN_USER, str(euid))
        if os.path.isdir(run_user):
            base = run_user
        else:
            import tempfile  # rarely needed: its imports (shutil, random) cost start-up

            base = os.path.join(tempfile.gettempdir(), f"runtime-{euid}")
    return os.path.join(base, "lockd", "lockd.sock")


def resolve_socket_path(socket_path: str | os.PathLike[str] | None = None) -> str:
    """The socket to use: ``socket_path``, else ``$LOCKD_SOCKET`` if set, else the default."""
    if socket_path is not None:
        path = os.fspath(socket_path)
        if not path:
            raise ValueError("socket_path must not be empty")
        return path
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    return default_socket_path()
