"""The daemon's own socket file: take it safely, or refuse with a clear reason.

A stale socket left by a dead daemon is replaced; a live daemon on the same
path is never stolen from; ``<socket>.lock`` is held with flock for the
daemon's life so two daemons starting at once cannot race between the
liveness probe and the bind. (Under socket activation none of this runs: the
inherited socket is used as it is.)
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket as stdsocket
from pathlib import Path


class SocketInUseError(Exception):
    """Another live daemon answers on the socket path (or it is not a socket)."""


def _socket_dir(path: Path, mode: int) -> None:
    path.parent.mkdir(mode=0o700 if mode == 0o600 else 0o755, parents=True, exist_ok=True)


def acquire_path_lock(socket_path: Path, mode: int) -> int:
    """Hold ``<socket>.lock`` for the daemon's life so two daemons never race."""
    _socket_dir(socket_path, mode)
    lock_path = socket_path.with_name(socket_path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SocketInUseError(
            f"another lockd is already serving {socket_path} (it holds {lock_path})"
        ) from None
    return fd


def bind_socket(path: Path, mode: int) -> stdsocket.socket:
    """Bind the Unix socket, replacing a stale one but never a live daemon's."""
    _socket_dir(path, mode)
    if path.exists() or path.is_symlink():
        probe = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # stale: nobody listens
        except OSError as exc:
            if exc.errno == errno.ENOTSOCK:
                raise SocketInUseError(
                    f"{path} exists and is not a socket; not replacing it"
                ) from None
            raise
        else:
            raise SocketInUseError(f"another lockd is already serving {path}")
        finally:
            probe.close()
        if not path.is_socket():
            raise SocketInUseError(f"{path} exists and is not a socket; not replacing it")
        path.unlink()
    sock = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # never a window where the socket is wider than asked
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(512)
    return sock
