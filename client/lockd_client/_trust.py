"""Whom the client may talk to: a socket in a safe folder, served by a trusted uid.

A lock client hands the daemon its keys and owners and believes its answers,
so talking to an impostor is worse than failing: another user who pre-creates
``/tmp/runtime-<uid>/`` (the fallback when ``XDG_RUNTIME_DIR`` is unset) and
runs a fake daemon there would make every lock "held" while nothing is held.
Two checks, both before anything is sent:

1. :func:`unsafe_directory`: every folder from the socket's up to ``/`` is
   owned by a trusted uid, and none is writable by group or others unless it
   is sticky (``/tmp``): otherwise someone else could swap the socket.
2. :func:`check_peer`: the process listening (``SO_PEERCRED`` of the
   connected socket, from the kernel) runs as root, as us, or as the
   ``lockd`` system user.

The daemon applies check 1 to its own socket folder too (with root and its
own uid as the trusted owners).
"""

from __future__ import annotations

import _socket  # not socket: its enums cost start-up (issue 24)
import os
import pwd
import stat

from ._errors import UntrustedDaemonError, _user_name
from ._wire import C_INT, unpack_native

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Container
    from typing import Protocol

    class _Socket(Protocol):
        """What the peer check needs of a socket (stdlib, asyncio's or trio's)."""

        def getsockopt(self, level: int, option: int, buflen: int) -> bytes: ...


__all__ = [
    "SYSTEM_USER",
    "TrustedUids",
    "check_folder",
    "check_peer",
    "trusted_uids",
    "unsafe_directory",
]

#: The system user the packaged system daemon runs as (systemd/lockd.sysusers).
SYSTEM_USER = "lockd"
#: ``struct ucred``: pid, uid, gid, three C ints
_PEERCRED_SIZE = 3 * C_INT
#: symlinks followed from the socket path at most (as the kernel's MAXSYMLINKS).
_MAX_HOPS = 40


class TrustedUids:
    """Root, the caller's effective uid, and the ``lockd`` system user if it exists.

    A set for ``in``: the system user is looked up (once) only when an
    owner or a peer is neither root nor us. The lookup goes through NSS
    (nsswitch.conf read, its modules loaded, systemd's user database asked):
    about 0.6 ms of every ``lockd`` command, whose daemon mostly runs as
    root or as the caller (issue 24, bench/startup.py).
    """

    __slots__ = ("_always", "_looked_up", "_system_uid")

    def __init__(self) -> None:
        self._always = frozenset({0, os.geteuid()})
        self._system_uid: int | None = None
        self._looked_up = False

    def __contains__(self, uid: object) -> bool:
        if uid in self._always:
            return True
        if not self._looked_up:
            # Looked up before it is marked done: a second thread asking
            # meanwhile looks it up too, rather than see no system user.
            try:  # noqa: SIM105 (contextlib is a start-up cost, issue 24)
                self._system_uid = pwd.getpwnam(SYSTEM_USER).pw_uid
            except KeyError:
                pass
            self._looked_up = True
        return self._system_uid is not None and uid == self._system_uid


def trusted_uids() -> TrustedUids:
    """Root, the caller's effective uid, and the ``lockd`` system user if it exists."""
    return TrustedUids()


def _owner(uid: int) -> str:
    name = _user_name(uid)
    return f"uid {uid}" if name == str(uid) else f"uid {uid} ({name})"


def _unsafe_entry(path: str, st: os.stat_result, trusted: Container[int]) -> str | None:
    if st.st_uid not in trusted:
        kind = "the symlink " if stat.S_ISLNK(st.st_mode) else ""
        return f"{kind}{path} belongs to {_owner(st.st_uid)}"
    if stat.S_ISLNK(st.st_mode):
        return None  # a symlink's own mode means nothing; its folder is checked next
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(st.st_mode)
        return f"{path} is writable by other users (mode {mode:04o}, not sticky)"
    return None


def unsafe_directory(folder: str, trusted: Container[int]) -> str | None:
    """Why ``folder`` (and its parents) cannot be trusted to hold a socket; None if it can.

    A folder that does not exist is not reported (connecting or binding
    will say so). Checked as ssh checks the path of its files, component by
    component, twice: on the path as given, where each folder and each
    symlink (``lstat``) must be trusted -- whoever owns a folder on the way,
    or a symlink, can point the rest anywhere, for instance at another
    trusted daemon's folder -- and on the path the symlinks lead to, whose
    real folders decide who can replace the socket.
    """
    path = os.path.abspath(folder)
    while True:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            reason = _unsafe_entry(path, st, trusted)
            if reason is not None:
                return reason
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    path = os.path.realpath(folder)
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_uid not in trusted:
                return f"{path} belongs to {_owner(st.st_uid)}"
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                mode = stat.S_IMODE(st.st_mode)
                return f"{path} is writable by other users (mode {mode:04o}, not sticky)"
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def check_folder(path: str) -> TrustedUids:
    """Check 1 for the socket ``path`` (UntrustedDaemonError); the trusted uids for check 2."""
    trusted = trusted_uids()
    # The socket may be a symlink (to a symlink ...): each hop is an entry of
    # its folder, which must be safe, and must be owned by a trusted uid.
    current = os.path.abspath(path)
    for _ in range(_MAX_HOPS):
        reason = unsafe_directory(os.path.dirname(current), trusted)
        if reason is not None:
            break
        try:
            st = os.lstat(current)
        except OSError:
            break  # missing: connecting will say so
        if not stat.S_ISLNK(st.st_mode):
            break
        reason = _unsafe_entry(current, st, trusted)
        if reason is not None:
            break
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
    if reason is not None:
        raise UntrustedDaemonError(path, reason)
    return trusted


def check_peer(path: str, sock: _Socket, trusted: Container[int]) -> None:
    """Check 2 on a connected socket (UntrustedDaemonError); every client runs both."""
    raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _PEERCRED_SIZE)
    pid, uid, _gid = unpack_native(raw, C_INT)
    if uid not in trusted:
        reason = f"the process listening on it (pid {pid}) runs as {_owner(uid)}"
        raise UntrustedDaemonError(path, reason)
