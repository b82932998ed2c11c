"""Who is calling: peer credentials -> principal, role, groups, service unit.

Identity comes only from the kernel (SO_PEERCRED on the accepted socket),
never from anything the client writes. The mapping from (pid, uid, gid) to a
:class:`Caller` is pure given the lookups, which are injected so tests can
describe users and cgroups without creating them.

Identity fails closed, never degrades:

- A lookup that fails is not "no such user": the daemon out of file
  descriptors made ``getpwuid`` miss and turned an admin into a member with a
  fresh rate-limit bucket. :func:`identify` first makes sure the lookups have
  descriptors to work with and raises :class:`IdentityUnavailable` when they
  do not, or when the answers contradict each other; the request is refused.
- The pid in SO_PEERCRED is the pid at ``connect()``; by the time the daemon
  reads ``/proc/PID/cgroup`` that process may be gone and its pid reused by a
  service's process. :func:`peer_unit` ties the read to the peer itself (a
  pidfd from ``SO_PEERPIDFD``; on older kernels the uid of the process behind
  ``/proc/PID``) and gives no unit when it cannot: never a service by accident.
"""

from __future__ import annotations

import errno
import functools
import grp
import logging
import os
import pwd
import re
import signal
import socket
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from lockd.logfmt import kv

log = logging.getLogger("lockd.identity")

Role = Literal["owner", "admin", "member", "service"]
Kind = Literal["user", "service"]

_PEERCRED = struct.Struct("3i")
#: getsockopt(SO_PEERPIDFD) (Linux 6.5+): a pidfd of the process that connected.
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_INT = struct.Struct("i")
#: Descriptors the passwd/group lookups may hold at once (NSS files, nscd).
_LOOKUP_FDS = 4
# A systemd unit name as it appears as a path component of /proc/PID/cgroup.
_UNIT_RE = re.compile(r"^[^/]+\.(service|scope)$")


class IdentityUnavailable(OSError):
    """Who is calling could not be established; the request is refused, never guessed."""


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Caller:
    """The caller of one connection, as the daemon sees it."""

    kind: Kind
    #: login name (``user:<name>``) or service name (``service:<name>``).
    name: str
    role: Role
    uid: int
    gid: int
    pid: int
    #: Unix group names: login groups plus the peer gid.
    groups: frozenset[str]
    #: the process name (/proc/PID/comm) when the connection was accepted;
    #: shown with the holder's pid in status, as lslocks does for flock.
    process: str | None = None
    #: when that process started (:func:`process_start`), read with the name:
    #: recorded with its holds so that status can say whether it still runs.
    start: int | None = None

    @functools.cached_property
    def principal(self) -> str:
        # Interned: the leases of one caller share one string, not one each.
        # Made once per caller (a connection's), not on every request.
        return sys.intern(f"{self.kind}:{self.name}")

    @property
    def privileged(self) -> bool:
        """Owners, admins and services act with the daemon's authority."""
        return self.role in ("owner", "admin", "service")


def peer_credentials(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return PeerCred(pid=pid, uid=uid, gid=gid)


def login_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def login_groups(name: str | None, uid: int, peer_gid: int) -> frozenset[str]:
    """Groups of a login (passwd gid + supplementary) plus the peer's gid.

    Raises :class:`IdentityUnavailable` when the login found by uid a moment
    ago cannot be looked up by name, or its group list cannot be read.
    """
    gids = {peer_gid}
    if name is not None:
        try:
            entry = pwd.getpwnam(name)
            gids.update(os.getgrouplist(name, entry.pw_gid))
        except KeyError:
            raise IdentityUnavailable(f"the login {name!r} vanished during lookup") from None
        except OSError as exc:
            raise IdentityUnavailable(f"groups of {name!r}: {exc.strerror or exc}") from None
    return frozenset(group_name(g) for g in gids)


def ensure_lookup_room() -> None:
    """Raise :class:`IdentityUnavailable` unless the passwd/group lookups can open files.

    glibc reports a lookup that could not open /etc/passwd exactly like a
    uid without an entry, so the only safe way is to make sure beforehand:
    descriptors opened and closed here stay free for the lookups that follow
    (the daemon's loop is single-threaded; nothing runs in between).
    """
    fds: list[int] = []
    try:
        for _ in range(_LOOKUP_FDS):
            fds.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        raise IdentityUnavailable(
            exc.errno, f"cannot look up users and groups: {exc.strerror or exc}"
        ) from None
    finally:
        for fd in fds:
            os.close(fd)


def systemd_unit_of(pid: int) -> str | None:
    """The system service unit that ``pid`` runs in, if any."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    return unit_from_cgroup(lines)


def peer_unit(sock: socket.socket, cred: PeerCred) -> str | None:
    """The system unit of the process that connected ``sock``, or None if not provable.

    With ``SO_PEERPIDFD`` the cgroup is read, then the peer's pidfd is
    signalled with 0: if the peer still lives, its pid was never reused, so
    ``/proc/PID`` was the peer's during the read. Without it (kernels before
    6.5) the process behind ``/proc/PID`` must at least run as the peer's
    uid. A peer that is gone, or a mismatch, gives None.
    """
    try:
        pidfd = _INT.unpack(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD, _INT.size))[0]
    except OSError as exc:
        if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
            return _unit_if_uid_matches(cred)
        return None  # ESRCH and the like: the peer is gone
    try:
        unit = systemd_unit_of(cred.pid)
        return unit if _alive(pidfd) else None
    finally:
        os.close(pidfd)


def _alive(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` still runs (so its pid was not reused)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except PermissionError:
        # EPERM, as from kill(2): it lives but is not ours to signal -- always
        # so for the system daemon, which runs as the user lockd without
        # CAP_KILL. A process that is gone answers ESRCH before any such check.
        return True
    except OSError:  # ProcessLookupError: it exited, its pid may be anyone's now
        return False
    return True


def _unit_if_uid_matches(cred: PeerCred) -> str | None:
    """Older kernels: read uid and cgroup through one handle on ``/proc/PID``."""
    try:
        proc = os.open(f"/proc/{cred.pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:

        def read(name: str) -> str:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)
            with open(fd, encoding="utf-8") as f:
                return f.read()

        uids = next(
            (line.split()[1:] for line in read("status").splitlines() if line.startswith("Uid:")),
            [],
        )
        if str(cred.uid) not in uids[:2]:  # real or effective uid
            return None
        return unit_from_cgroup(read("cgroup").splitlines())
    except OSError:
        return None
    finally:
        os.close(proc)


def unit_from_cgroup(lines: Iterable[str]) -> str | None:
    """The system unit of /proc/PID/cgroup lines (unified ``0::`` hierarchy first).

    Only units of the system manager count: the first ``*.service`` in the
    path, and none at all under a user manager (``user@UID.service``).
    """
    paths: list[str] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths.insert(0, path)
        elif "name=systemd" in controllers:
            paths.append(path)
    for path in paths:
        for component in path.split("/"):
            if component.endswith(".service") and _UNIT_RE.match(component):
                # The outermost service is the unit the system manager made;
                # anything below it is delegated to that unit's processes and
                # may be named at will. A user manager (user@UID.service) runs
                # units any member can name, e.g. `systemd-run --user
                # --unit=backup.service`: never a system service.
                return None if component.startswith("user@") else component
    return None


@dataclass(frozen=True)
class IdentityConfig:
    daemon_uid: int
    admin_groups: frozenset[str] = frozenset({"lockd-admin"})
    service_units: frozenset[str] = frozenset()
    service_users: frozenset[str] = frozenset()


def resolve_caller(
    cred: PeerCred,
    config: IdentityConfig,
    *,
    name_of: Callable[[int], str | None] = login_name,
    groups_of: Callable[[str | None, int, int], frozenset[str]] = login_groups,
    unit_of: Callable[[int], str | None] = systemd_unit_of,
) -> Caller:
    """Map peer credentials to a caller; the lookups are injectable for tests."""
    name = name_of(cred.uid)
    groups = groups_of(name, cred.uid, cred.gid)
    if config.service_units:
        unit = unit_of(cred.pid)
        if unit is not None and unit in config.service_units:
            return Caller("service", unit, "service", cred.uid, cred.gid, cred.pid, groups)
    if name is not None and name in config.service_users:
        return Caller("service", name, "service", cred.uid, cred.gid, cred.pid, groups)
    role: Role
    if cred.uid == 0 or cred.uid == config.daemon_uid:
        role = "owner"
    elif groups & config.admin_groups:
        role = "admin"
    else:
        role = "member"
    display = name if name is not None else str(cred.uid)
    return Caller("user", display, role, cred.uid, cred.gid, cred.pid, groups)


class GroupDatabaseWatch:
    """Says loudly, once per change, that admins cannot be recognised.

    glibc answers a group lookup whose file cannot be read exactly like a
    group that does not exist: with ``/etc/group`` unreadable (a bad chmod,
    a broken package upgrade) every admin silently became a member. Each
    caller found to be a member while admin groups are configured has the
    file opened here; an error is logged when it becomes unreadable (and
    which admin groups it hides), a warning when it can be read again --
    one line per change, not one per connection.
    """

    def __init__(self, path: str = "/etc/group") -> None:
        self.path = path
        #: why the file could not be read at the last check; None when it could.
        self.problem: str | None = None

    def check(self, admin_groups: Iterable[str]) -> str | None:
        """Open the group file; log a change of state; the problem, if any."""
        try:
            with open(self.path, "rb"):
                pass
        except FileNotFoundError:
            problem = None  # no files source: NSS answers from elsewhere
        except OSError as exc:
            problem = exc.strerror or str(exc)
        else:
            problem = None
        if problem != self.problem:
            groups = ",".join(sorted(admin_groups))
            if problem is not None:
                log.error(
                    kv(
                        event="admin_groups_unreadable",
                        file=self.path,
                        error=problem,
                        admin_groups=groups,
                        effect="admins are treated as members until it can be read",
                    )
                )
            else:
                log.warning(kv(event="admin_groups_readable", file=self.path, admin_groups=groups))
            self.problem = problem
        return problem


#: the daemon's watch on the group database (one per process).
GROUP_DATABASE = GroupDatabaseWatch()


def identify(sock: socket.socket, config: IdentityConfig) -> Caller:
    """The caller behind an accepted socket; raises :class:`IdentityUnavailable`."""
    cred = peer_credentials(sock)
    ensure_lookup_room()
    caller = resolve_caller(cred, config, unit_of=lambda _pid: peer_unit(sock, cred))
    if caller.role == "member" and config.admin_groups:
        GROUP_DATABASE.check(config.admin_groups)
    return caller


def process_name(pid: int) -> str | None:
    """The kernel's name for ``pid`` (/proc/PID/comm), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().rstrip("\n") or None
    except OSError:
        return None


# -- the holder's process (docs/contract.md §12.2) ------------------

#: How many parent links a claimed holder pid is followed up to find the peer.
_MAX_ANCESTRY = 64


def process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot); None if it does not run (or is a zombie).

    Together with the pid it names one process for good: a pid reused by a
    later process has a later start.
    """
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        state, start = fields[0], int(fields[19])  # fields 3 and 22 of proc(5), counted from 1
    except (IndexError, ValueError):
        return None
    return None if state in (b"Z", b"X") else start


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (/proc/PID/stat), None if it is gone."""
    fields = _stat_fields(pid)
    try:
        return int(fields[1]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def process_uid(pid: int) -> int | None:
    """The uid owning /proc/PID (the process's effective uid), None if it is gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces).

    Read with os.open/os.read (no text layer): status and list read it for
    every holder they show.
    """
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        stat = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return stat[stat.rfind(b")") + 1 :].split()


def verified_holder_pid(
    peer_pid: int,
    peer_uid: int,
    claimed: int | None,
    *,
    parent_of: Callable[[int], int | None] = parent_pid,
    uid_of: Callable[[int], int | None] = process_uid,
) -> int:
    """The pid to record as a hold's holder: ``claimed`` if the daemon can vouch for it.

    A client may name the process that will use the hold (``lockd run``:
    COMMAND; ``lockd locks acquire``: the shell that called it). The claim is
    believed only when the kernel backs it: the process runs as the peer's
    uid and is the peer itself, the peer's parent, or a descendant of the
    peer. Anything else (another user's process, an unrelated pid, one that
    is gone) falls back to the peer's own pid: never an error, never a
    holder the daemon cannot see.
    """
    if claimed is None or claimed == peer_pid:
        return peer_pid
    if uid_of(claimed) != peer_uid:
        return peer_pid
    if parent_of(peer_pid) == claimed:
        return claimed
    pid: int | None = claimed
    for _ in range(_MAX_ANCESTRY):
        pid = parent_of(pid) if pid is not None else None
        if pid is None or pid <= 1:
            break
        if pid == peer_pid:
            return claimed
    return peer_pid
