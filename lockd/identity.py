"""Who is calling: peer credentials -> principal, role, groups, service unit.

Identity comes only from the kernel (SO_PEERCRED on the accepted socket),
never from anything the client writes. The mapping from (pid, uid, gid) to a
:class:`Caller` is pure given the lookups, which are injected so tests can
describe users and cgroups without creating them.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

Role = Literal["owner", "admin", "member", "service"]
Kind = Literal["user", "service"]

_PEERCRED = struct.Struct("3i")
# A systemd unit name as it appears as a path component of /proc/PID/cgroup.
_UNIT_RE = re.compile(r"^[^/]+\.(service|scope)$")


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

    @property
    def principal(self) -> str:
        return f"{self.kind}:{self.name}"

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
    """Groups of a login (passwd gid + supplementary) plus the peer's gid."""
    gids = {peer_gid}
    if name is not None:
        try:
            entry = pwd.getpwnam(name)
            gids.update(os.getgrouplist(name, entry.pw_gid))
        except (KeyError, OSError):
            pass
    return frozenset(group_name(g) for g in gids)


def systemd_unit_of(pid: int) -> str | None:
    """The system service unit that ``pid`` runs in, if any."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    return unit_from_cgroup(lines)


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
