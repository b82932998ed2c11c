"""The daemon's own socket file: take it safely, or refuse with a clear reason.

A stale socket left by a dead daemon is replaced; a live daemon on the same
path is never stolen from; ``<socket>.lock`` is held with flock for the
daemon's life so two daemons starting at once cannot race between the
liveness probe and the bind. (Under socket activation none of this runs: the
inherited socket is used as it is.)

Another local user must not be able to steer any of this. The socket's
folder (and every parent) must belong to us or root and be writable by
nobody else unless sticky, else we refuse to start: in a folder someone else
controls, they could swap the socket or plant symlinks. The lock file is
opened without following symlinks, and the socket gets its mode from the
umask at ``bind`` instead of a ``chmod`` by name afterwards, which would
follow a symlink swapped in between (and make its target world-writable).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket as stdsocket
import stat
from pathlib import Path

from lockd_client._trust import unsafe_directory


class SocketInUseError(Exception):
    """Another live daemon answers on the socket path (or it is not a socket)."""


class UnsafeSocketDirError(Exception):
    """The socket's folder could be controlled by another user; we do not start there."""


def _socket_dir(path: Path, mode: int) -> None:
    """Create the socket's folder if needed, then refuse it unless only we (or root) control it."""
    trusted = frozenset({0, os.geteuid()})
    reason = unsafe_directory(str(path.parent), trusted)  # before creating anything in it
    if reason is None:
        path.parent.mkdir(mode=0o700 if mode == 0o600 else 0o755, parents=True, exist_ok=True)
        reason = unsafe_directory(str(path.parent), trusted)
    if reason is not None:
        raise UnsafeSocketDirError(
            f"the socket folder is not safe: {reason}; another user could replace "
            f"{path.name} or plant symlinks there. Use a folder only you (or root) can "
            "write (--socket, LOCKD_SOCKET, or XDG_RUNTIME_DIR)"
        )


def acquire_path_lock(socket_path: Path, mode: int) -> int:
    """Hold ``<socket>.lock`` for the daemon's life so two daemons never race."""
    _socket_dir(socket_path, mode)
    lock_path = socket_path.with_name(socket_path.name + ".lock")
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(lock_path, flags, 0o600)
    except OSError:
        # ELOOP, or EACCES where the kernel protects symlinks in sticky folders
        if lock_path.is_symlink():
            raise UnsafeSocketDirError(f"{lock_path} is a symlink; not following it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafeSocketDirError(
                f"{lock_path} is not a regular file of ours; remove it and start again"
            )
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SocketInUseError(
            f"another lockd is already serving {socket_path} (it holds {lock_path})"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def running_daemon(path: Path) -> int | None:
    """The pid of a live process listening on ``path`` (SO_PEERCRED), else None.

    Checked before the database is opened, so that a second ``lockd serve``
    on the same paths says "a daemon is already running" instead of reporting
    the database as in use.
    """
    if not path.exists():
        return None
    probe = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        creds = probe.getsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_PEERCRED, 12)
    except OSError:
        return None  # stale, not a socket, or not ours to reach: bind_socket decides
    finally:
        probe.close()
    pid = int.from_bytes(creds[:4], "little", signed=True)
    return pid if pid > 0 else None


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
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketInUseError(f"{path} exists and is not a socket; not replacing it")
        path.unlink()
    sock = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    # bind() creates the socket file with 0777 & ~umask: the mode is right
    # from the first instant, and no chmod by name (which follows symlinks)
    # is needed afterwards.
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    sock.listen(512)
    return sock
