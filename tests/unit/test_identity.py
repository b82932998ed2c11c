"""Peer credentials -> caller (docs/contract.md §1 "Principal"), with injected lookups.

No users, groups or cgroups are created: ``resolve_caller`` takes the
passwd/group/cgroup lookups as arguments, and ``unit_from_cgroup`` parses
text shaped like real ``/proc/PID/cgroup`` files (v1 and v2).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from lockd import identity
from lockd.identity import (
    Caller,
    IdentityConfig,
    IdentityUnavailable,
    PeerCred,
    ensure_lookup_room,
    login_groups,
    peer_credentials,
    peer_unit,
    resolve_caller,
    systemd_unit_of,
    unit_from_cgroup,
)

DAEMON_UID = 990
NAMES = {0: "root", 990: "lockd", 1000: "alice", 1001: "bob", 1002: "deploy"}
GROUPS = {
    "root": {"root"},
    "lockd": {"lockd"},
    "alice": {"alice", "lockd-admin"},
    "bob": {"bob", "users"},
    "deploy": {"deploy"},
}
UNITS: dict[int, str | None] = {}


def name_of(uid: int) -> str | None:
    return NAMES.get(uid)


def groups_of(name: str | None, uid: int, gid: int) -> frozenset[str]:
    return frozenset(GROUPS.get(name or "", set()) | {f"gid{gid}"})


def unit_of(pid: int) -> str | None:
    return UNITS.get(pid)


def resolve(uid: int, config: IdentityConfig | None = None, pid: int = 4242) -> Caller:
    return resolve_caller(
        PeerCred(pid=pid, uid=uid, gid=uid),
        config or IdentityConfig(daemon_uid=DAEMON_UID),
        name_of=name_of,
        groups_of=groups_of,
        unit_of=unit_of,
    )


@pytest.fixture(autouse=True)
def _no_units() -> None:
    UNITS.clear()


def test_root_is_an_owner_named_root() -> None:
    caller = resolve(0)
    assert (caller.principal, caller.role, caller.kind, caller.name) == (
        "user:root",
        "owner",
        "user",
        "root",
    )
    assert caller.privileged


def test_daemon_uid_is_an_owner() -> None:
    caller = resolve(DAEMON_UID)
    assert (caller.principal, caller.role) == ("user:lockd", "owner")


def test_admin_through_an_admin_group() -> None:
    caller = resolve(1000)
    assert (caller.principal, caller.role) == ("user:alice", "admin")
    assert "lockd-admin" in caller.groups and caller.privileged


def test_admin_groups_are_configurable() -> None:
    config = IdentityConfig(daemon_uid=DAEMON_UID, admin_groups=frozenset({"users"}))
    assert resolve(1001, config).role == "admin"
    assert resolve(1000, config).role == "member", "lockd-admin is no longer special"


def test_peer_gid_counts_as_a_group() -> None:
    config = IdentityConfig(daemon_uid=DAEMON_UID, admin_groups=frozenset({"gid1001"}))
    caller = resolve(1001, config)
    assert caller.role == "admin" and "gid1001" in caller.groups


def test_plain_user_is_a_member() -> None:
    caller = resolve(1001)
    assert (caller.principal, caller.role, caller.uid, caller.gid, caller.pid) == (
        "user:bob",
        "member",
        1001,
        1001,
        4242,
    )
    assert not caller.privileged


def test_unknown_uid_is_named_by_number() -> None:
    caller = resolve(54321)
    assert (caller.principal, caller.role) == ("user:54321", "member")


def test_service_users_make_a_service() -> None:
    config = IdentityConfig(daemon_uid=DAEMON_UID, service_users=frozenset({"deploy"}))
    caller = resolve(1002, config)
    assert (caller.principal, caller.role, caller.kind) == (
        "service:deploy",
        "service",
        "service",
    )
    assert caller.privileged
    # An unknown uid can never match a service user by number.
    numbered = IdentityConfig(daemon_uid=DAEMON_UID, service_users=frozenset({"54321"}))
    assert resolve(54321, numbered).principal == "user:54321"


def test_service_units_make_a_service_whoever_runs_them() -> None:
    config = IdentityConfig(daemon_uid=DAEMON_UID, service_units=frozenset({"backup.service"}))
    UNITS[77] = "backup.service"
    UNITS[78] = "other.service"
    assert resolve(1001, config, pid=77).principal == "service:backup.service"
    assert resolve(0, config, pid=77).role == "service"
    assert resolve(1001, config, pid=78).principal == "user:bob"
    assert resolve(1001, config, pid=79).role == "member"


def test_units_are_not_looked_up_when_none_are_configured() -> None:
    def exploding(pid: int) -> str | None:
        raise AssertionError("cgroup read without service_units")

    caller = resolve_caller(
        PeerCred(pid=1, uid=1001, gid=1001),
        IdentityConfig(daemon_uid=DAEMON_UID),
        name_of=name_of,
        groups_of=groups_of,
        unit_of=exploding,
    )
    assert caller.role == "member"


# ----------------------------------------------------------- cgroups

V2_SYSTEM = ["0::/system.slice/backup.service"]
V2_DELEGATED = ["0::/system.slice/backup.service/worker/tasks"]
V2_SESSION = ["0::/user.slice/user-1000.slice/session-3.scope"]
V2_USER_UNIT = ["0::/user.slice/user-1000.slice/user@1000.service/app.slice/backup.service"]
V2_TEMPLATE = ["0::/system.slice/system-getty.slice/getty@tty1.service"]
V1_SYSTEM = [
    "12:pids:/system.slice/cron.service",
    "11:memory:/system.slice/cron.service",
    "5:cpu,cpuacct:/system.slice/cron.service",
    "1:name=systemd:/system.slice/cron.service",
    "0::/system.slice/cron.service",
]
V1_ONLY = [
    "11:memory:/",
    "4:devices:/system.slice/nginx.service",
    "1:name=systemd:/system.slice/nginx.service",
]
HYBRID = [
    "1:name=systemd:/system.slice/old.service",
    "0::/system.slice/new.service",
]


@pytest.mark.parametrize(
    ("lines", "unit"),
    [
        (V2_SYSTEM, "backup.service"),
        (V2_DELEGATED, "backup.service"),
        (V2_SESSION, None),
        (V2_TEMPLATE, "getty@tty1.service"),
        (V1_SYSTEM, "cron.service"),
        (V1_ONLY, "nginx.service"),
        (HYBRID, "new.service"),
        ([], None),
        (["garbage"], None),
        (["0::/"], None),
        (["4:devices:/system.slice/nginx.service"], None),
    ],
)
def test_unit_from_cgroup(lines: list[str], unit: str | None) -> None:
    assert unit_from_cgroup(lines) == unit


def test_user_manager_units_are_not_system_units() -> None:
    assert unit_from_cgroup(V2_USER_UNIT) is None
    assert unit_from_cgroup(["0::/user.slice/user-1000.slice/user@1000.service/init.scope"]) is None


def test_delegated_sub_cgroups_cannot_pick_a_unit_name() -> None:
    """Below a unit with Delegate=yes its processes name cgroups at will."""
    lines = ["0::/system.slice/containerd.service/backup.service"]
    assert unit_from_cgroup(lines) == "containerd.service"


def test_systemd_unit_of_reads_proc() -> None:
    """The real /proc of this process parses; a pid that does not exist is None."""
    with open(f"/proc/{os.getpid()}/cgroup", encoding="utf-8") as f:
        expected = unit_from_cgroup(f.read().splitlines())
    assert systemd_unit_of(os.getpid()) == expected
    assert systemd_unit_of(2**22 + 12345) is None


# ------------------------------------------------------ real lookups


def test_peer_credentials_of_a_socketpair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        cred = peer_credentials(a)
    assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.getuid(), os.getgid())


def test_login_groups_include_the_primary_group_and_the_peer_gid() -> None:
    groups = login_groups("root", 0, 0)
    assert "root" in groups
    assert login_groups(None, 54321, 54321) == frozenset({"54321"})


# --------------------------------------------------------------------------
# peer_unit as the system daemon runs it: an unprivileged uid, peers of others

_PEER_UNIT_CHILD = textwrap.dedent(
    """
    import errno, json, os, socket, sys
    from lockd import identity
    # The cgroup read is not under test: pretend every peer runs in a unit.
    identity.systemd_unit_of = lambda pid: "probe.service"
    listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listen.bind(sys.argv[1])
    listen.listen(1)
    os.setgid(65534)
    os.setuid(65534)  # like the user lockd: no CAP_KILL over the peers
    print("ready", flush=True)
    sys.stdin.readline()  # the peer has connected (and maybe exited)
    conn, _ = listen.accept()
    try:
        conn.getsockopt(socket.SOL_SOCKET, identity._SO_PEERPIDFD, 4)
    except OSError as exc:
        if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
            print(json.dumps("no SO_PEERPIDFD"), flush=True)
            sys.exit()
    print(json.dumps(identity.peer_unit(conn, identity.peer_credentials(conn))), flush=True)
    """
)


def _peer_unit_seen_by_nobody(path: Path, connect: Callable[[], object]) -> object:
    """What an unprivileged daemon's peer_unit says about a peer that ``connect`` makes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER_UNIT_CHILD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        keep = connect()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = json.loads(proc.stdout.readline())
        del keep
        if result == "no SO_PEERPIDFD":
            pytest.skip("kernel without SO_PEERPIDFD (before 6.5): the uid check is used")
        return result
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the daemon side as nobody")
def test_peer_unit_of_a_living_peer_the_daemon_may_not_signal(short_tmp: Path) -> None:
    """pidfd_send_signal(0) answers EPERM for another user's live process: still the unit."""
    path = short_tmp / "peer.sock"

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))  # as root: nobody may not signal us
        return sock

    assert _peer_unit_seen_by_nobody(path, connect) == "probe.service"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the daemon side as nobody")
def test_peer_unit_of_a_peer_that_exited_is_none(short_tmp: Path) -> None:
    """A peer gone before the check (its pid free for reuse) is never given a unit."""
    path = short_tmp / "peer.sock"

    def connect() -> None:
        script = f"import socket; socket.socket(socket.AF_UNIX).connect({str(path)!r})"
        subprocess.run([sys.executable, "-c", script], check=True, timeout=30)

    assert _peer_unit_seen_by_nobody(path, connect) is None


# ------------------------------------------------------ the peer's own process


def _pretend_every_process_is_a_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "unit_from_cgroup", lambda lines: "billing.service")


def test_peer_unit_of_a_live_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_every_process_is_a_service(monkeypatch)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_unit(a, peer_credentials(a)) == "billing.service"


def test_peer_unit_of_a_peer_that_is_gone_is_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The connecting process exited: its pid may be anyone's now (pid reuse)."""
    _pretend_every_process_is_a_service(monkeypatch)
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(1)
        child = os.fork()
        if child == 0:  # connects, then exits at once
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            os._exit(0)
        os.waitpid(child, 0)
        conn, _ = listener.accept()
        with conn:
            cred = peer_credentials(conn)
            assert cred.pid == child
            assert peer_unit(conn, cred) is None


def test_peer_unit_without_pidfd_needs_the_peers_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels before 6.5: the process behind /proc/PID must run as the peer's uid."""
    _pretend_every_process_is_a_service(monkeypatch)
    monkeypatch.setattr(identity, "_SO_PEERPIDFD", 0x7FFF)  # unknown option: ENOPROTOOPT
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        cred = peer_credentials(a)
        assert peer_unit(a, cred) == "billing.service"
        assert peer_unit(a, PeerCred(cred.pid, cred.uid + 1, cred.gid)) is None


def test_lookups_need_spare_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors, glibc reports 'no such user': refuse instead of guessing."""

    def no_descriptor(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(identity.os, "open", no_descriptor)
    with pytest.raises(IdentityUnavailable, match="Too many open files") as caught:
        ensure_lookup_room()
    assert caught.value.errno == errno.EMFILE


# ------------------------------------- issue 21, item 10: an unreadable group database


def test_an_unreadable_group_file_is_logged_loudly_once_per_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    group_file = tmp_path / "group"
    group_file.write_text("lockd-admin:x:990:alice\n")
    watch = identity.GroupDatabaseWatch(str(tmp_path))  # a folder: open() fails as EACCES would
    with caplog.at_level("WARNING", logger="lockd.identity"):
        for _ in range(3):
            assert watch.check({"lockd-admin"}) is not None
        watch.path = str(group_file)
        for _ in range(3):
            assert watch.check({"lockd-admin"}) is None
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert caplog.records[0].levelname == "ERROR"
    assert "event=admin_groups_unreadable" in lines[0] and "admin_groups=lockd-admin" in lines[0]
    assert "admins are treated as members" in lines[0]
    assert "event=admin_groups_readable" in lines[1]


def test_identify_checks_the_group_file_for_members(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller found to be a member, admin groups configured: the watch is asked."""
    monkeypatch.setattr(identity, "GROUP_DATABASE", identity.GroupDatabaseWatch(str(tmp_path)))
    monkeypatch.setattr(
        identity, "peer_credentials", lambda sock: identity.PeerCred(os.getpid(), 65534, 65534)
    )
    left, right = socket.socketpair()
    with left, right, caplog.at_level("ERROR", logger="lockd.identity"):
        config = identity.IdentityConfig(daemon_uid=0, admin_groups=frozenset({"lockd-admin"}))
        assert identity.identify(left, config).role == "member"
        assert identity.identify(left, config).role == "member"
    assert [r.getMessage().split()[0] for r in caplog.records] == ["event=admin_groups_unreadable"]
