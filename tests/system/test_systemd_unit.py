"""The systemd edge without a running systemd.

- ``lockd.daemon.systemd`` against sockets the test owns: sd_notify datagrams (path
  and abstract ``@`` addresses, sender credentials), socket activation
  (``LISTEN_PID``/``LISTEN_FDS``) in child processes, because adopting fds 3..n
  inside the pytest process would steal whatever pytest keeps there, and the
  watchdog interval.
- The shipped unit files: the contract values (paths, modes, Type=notify ...)
  and ``.ci/systemd-checks.sh`` (systemd-analyze verify + security exposure).
- ``MemoryDenyWriteExecute=yes`` in lockd.service: everything the daemon
  imports must work when W+X memory is refused, checked with the kernel's
  PR_SET_MDWE where the kernel has it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockd.daemon import systemd
from lockd.testing.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"
CHECKS = REPO / ".ci" / "systemd-checks.sh"


def _checks_env(**extra: str) -> dict[str, str]:
    """Point the script at the console script of the Python running the tests."""
    env = {**os.environ, **extra}
    beside = Path(sys.executable).parent / "lockd"
    if "LOCKD_BIN" not in env and beside.exists():
        env["LOCKD_BIN"] = str(beside)
    return env


# --------------------------------------------------------------------------
# notify


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test sees (or leaks) systemd variables, nor a cached notify socket."""
    for name in (
        "NOTIFY_SOCKET",
        "LISTEN_PID",
        "LISTEN_FDS",
        "LISTEN_FDNAMES",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
    ):
        monkeypatch.delenv(name, raising=False)
    systemd._drop_socket()
    yield
    systemd._drop_socket()


class Receiver:
    """A datagram socket standing in for systemd's notify socket."""

    def __init__(self, sock: socket.socket, env_value: str) -> None:
        self.sock = sock
        self.env_value = env_value

    def recv(self) -> str:
        return self.sock.recv(4096).decode()

    def recv_with_pid(self) -> tuple[str, int]:
        """Message and the sender pid the kernel attached (SO_PASSCRED)."""
        data, ancdata, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = int.from_bytes(payload[:4], sys.byteorder, signed=True)
                return data.decode(), pid
        raise AssertionError("no SCM_CREDENTIALS on the datagram")

    def nothing_pending(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(4096)
        except BlockingIOError:
            return True
        finally:
            self.sock.settimeout(2)
        return False


def _receiver(address: str | bytes, env_value: str) -> Receiver:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    # systemd sets SO_PASSCRED on its notify socket to learn the sender's pid.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.settimeout(2)
    return Receiver(sock, env_value)


@pytest.fixture
def path_receiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    path = str(tmp_path / "notify")
    receiver = _receiver(path, path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield receiver
    receiver.sock.close()


@pytest.fixture
def abstract_receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    name = f"lockd-test-notify-{uuid.uuid4().hex}"
    receiver = _receiver(b"\0" + name.encode(), "@" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield receiver
    receiver.sock.close()


def test_notify_without_notify_socket_returns_false() -> None:
    assert systemd.notify("READY=1") is False
    assert systemd.ready("x") is False
    assert systemd.watchdog_ping() is False


def test_notify_to_path_socket(path_receiver: Receiver) -> None:
    assert systemd.notify("READY=1") is True
    message, pid = path_receiver.recv_with_pid()
    assert message == "READY=1"
    # NotifyAccess=main: systemd accepts the message because it comes from us.
    assert pid == os.getpid()


def test_notify_to_abstract_socket(abstract_receiver: Receiver) -> None:
    assert systemd.notify("STATUS=abstract") is True
    assert abstract_receiver.recv() == "STATUS=abstract"


def test_notify_reuses_one_socket(path_receiver: Receiver) -> None:
    assert systemd.watchdog_ping()
    first = systemd._notify_sock
    assert systemd.watchdog_ping()
    assert systemd._notify_sock is first
    assert path_receiver.recv() == "WATCHDOG=1"
    assert path_receiver.recv() == "WATCHDOG=1"


def test_notify_missing_socket_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="lockd.daemon.systemd")
    missing = tmp_path / "gone"
    monkeypatch.setenv("NOTIFY_SOCKET", str(missing))
    assert systemd.notify("READY=1") is False
    assert "sd_notify" in caplog.text
    # Recovers once the socket appears (the cached socket was dropped).
    receiver = _receiver(str(missing), str(missing))
    try:
        assert systemd.notify("READY=1") is True
        assert receiver.recv() == "READY=1"
    finally:
        receiver.sock.close()


@pytest.mark.parametrize("value", ["relative/path", "@", "vsock:2:1234"])
def test_notify_unsupported_address_returns_false(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert systemd.notify("READY=1") is False


def test_notify_to_a_stream_socket_fails_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "stream"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert systemd.notify("READY=1") is False


def test_message_helpers(path_receiver: Receiver) -> None:
    assert systemd.ready()
    assert path_receiver.recv() == "READY=1"
    assert systemd.ready("3 locks held, 1 waiter")
    assert path_receiver.recv() == "READY=1\nSTATUS=3 locks held, 1 waiter"
    assert systemd.status("two\nlines")
    assert path_receiver.recv() == "STATUS=two lines"
    assert systemd.stopping()
    assert path_receiver.recv() == "STOPPING=1"
    assert systemd.watchdog_ping()
    assert path_receiver.recv() == "WATCHDOG=1"
    assert systemd.extend_timeout(1.5)
    assert path_receiver.recv() == "EXTEND_TIMEOUT_USEC=1500000"


def test_reloading_carries_monotonic_usec(path_receiver: Receiver) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert systemd.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    lines = path_receiver.recv().split("\n")
    assert lines[0] == "RELOADING=1"
    key, value = lines[1].split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_reload_cycle_ends_with_ready_even_on_error(path_receiver: Receiver) -> None:
    with pytest.raises(RuntimeError), systemd.reload_cycle("0 locks held, 0 waiters"):
        raise RuntimeError("bad rule set")
    assert path_receiver.recv().startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert path_receiver.recv() == "READY=1\nSTATUS=0 locks held, 0 waiters"
    assert path_receiver.nothing_pending()


@pytest.mark.parametrize(
    ("held", "waiters", "text"),
    [
        (0, 0, "0 locks held, 0 waiters"),
        (1, 1, "1 lock held, 1 waiter"),
        (3, 1, "3 locks held, 1 waiter"),
    ],
)
def test_describe_load(held: int, waiters: int, text: str) -> None:
    assert systemd.describe_load(held, waiters) == text


# --------------------------------------------------------------------------
# watchdog


def test_watchdog_interval_unset() -> None:
    assert systemd.watchdog_interval() is None


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0


@pytest.mark.parametrize(
    ("usec", "pid"),
    [("30000000", "1"), ("0", None), ("-5", None), ("soon", None), ("30000000", "me")],
)
def test_watchdog_interval_disabled(
    usec: str, pid: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is not None:
        monkeypatch.setenv("WATCHDOG_PID", pid)
    assert systemd.watchdog_interval() is None


# --------------------------------------------------------------------------
# socket activation, in child processes

_CHILD = textwrap.dedent(
    """
    import json, os, socket, sys
    from lockd.daemon import systemd

    spec = json.loads(sys.argv[1])
    # Put a listening stream socket on fd 3, and what the spec asks on fd 4.
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.bind(spec["path"])
    stream.listen()
    os.dup2(stream.fileno(), 3)
    if spec.get("fd4") == "dgram":
        dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # kept alive
        os.dup2(dgram.fileno(), 4)
    elif spec.get("fd4") == "pipe":
        os.dup2(os.pipe()[0], 4)
    os.environ.update(
        {k: str(os.getpid()) if v == "$PID" else v for k, v in spec["env"].items()}
    )
    names_before = systemd.listen_fd_names()
    socks = systemd.listen_fds_with_names(unset_env=spec.get("unset", True))
    out = {
        "names_before": names_before,
        "adopted": [
            {
                "fd": s.fileno(),
                "name": name,
                "family": int(s.family),
                "type": int(s.type),
                "inheritable": os.get_inheritable(s.fileno()),
            }
            for s, name in socks
        ],
        "env": {k: os.environ.get(k) for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")},
        # A second call must find nothing once the environment is unset. (With
        # unset=False it would wrap the same fds in second socket objects.)
        "again": len(systemd.listen_fds()) if spec.get("unset", True) else None,
    }
    if socks:
        socks[0][0].settimeout(5)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(spec["path"])
        conn, _ = socks[0][0].accept()  # the adopted socket really is fd 3's listener
        out["accepted"] = True
    print(json.dumps(out))
    """
)


def _activate(tmp_path: Path, env: dict[str, str], **spec: object) -> dict[str, object]:
    payload = json.dumps({"path": str(tmp_path / "listen.sock"), "env": env, **spec})
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, payload],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def test_listen_fds_adopts_fds_for_our_pid(tmp_path: Path) -> None:
    out = _activate(
        tmp_path,
        {"LISTEN_PID": "$PID", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "lockd.socket:extra"},
        fd4="dgram",
    )
    assert out["names_before"] == ["lockd.socket", "extra"]
    assert out["adopted"] == [
        {
            "fd": 3,
            "name": "lockd.socket",
            "family": int(socket.AF_UNIX),
            "type": int(socket.SOCK_STREAM),
            "inheritable": False,
        },
        {
            "fd": 4,
            "name": "extra",
            "family": int(socket.AF_UNIX),
            "type": int(socket.SOCK_DGRAM),
            "inheritable": False,
        },
    ]
    assert out["env"] == {"LISTEN_PID": None, "LISTEN_FDS": None, "LISTEN_FDNAMES": None}
    assert out["again"] == 0
    assert out["accepted"] is True


def test_listen_fds_missing_names_read_unknown(tmp_path: Path) -> None:
    out = _activate(tmp_path, {"LISTEN_PID": "$PID", "LISTEN_FDS": "2"}, fd4="dgram")
    adopted = out["adopted"]
    assert isinstance(adopted, list)
    assert [a["name"] for a in adopted] == ["unknown", "unknown"]


def test_listen_fds_skips_non_sockets(tmp_path: Path) -> None:
    out = _activate(tmp_path, {"LISTEN_PID": "$PID", "LISTEN_FDS": "2"}, fd4="pipe")
    adopted = out["adopted"]
    assert isinstance(adopted, list)
    assert [a["fd"] for a in adopted] == [3]


def test_listen_fds_ignored_for_another_pid(tmp_path: Path) -> None:
    out = _activate(tmp_path, {"LISTEN_PID": "1", "LISTEN_FDS": "1"})
    assert out["adopted"] == []
    # Unset all the same, as libsystemd does: they were never ours.
    assert out["env"] == {"LISTEN_PID": None, "LISTEN_FDS": None, "LISTEN_FDNAMES": None}
    assert out["names_before"] == []


@pytest.mark.parametrize(
    "env",
    [
        {"LISTEN_PID": "$PID", "LISTEN_FDS": "0"},
        {"LISTEN_PID": "$PID", "LISTEN_FDS": "many"},
        {"LISTEN_PID": "me", "LISTEN_FDS": "1"},
        {"LISTEN_FDS": "1"},
    ],
)
def test_listen_fds_invalid_environment(tmp_path: Path, env: dict[str, str]) -> None:
    out = _activate(tmp_path, env)
    assert out["adopted"] == []


def test_listen_fds_can_keep_environment(tmp_path: Path) -> None:
    out = _activate(tmp_path, {"LISTEN_PID": "$PID", "LISTEN_FDS": "1"}, unset=False)
    adopted = out["adopted"]
    assert isinstance(adopted, list) and len(adopted) == 1
    env = out["env"]
    assert isinstance(env, dict)
    assert env["LISTEN_FDS"] == "1"


def test_listen_fds_without_environment_is_empty() -> None:
    assert systemd.listen_fds() == []
    assert systemd.listen_fd_names() == []


_ACTIVATED_CHILD = textwrap.dedent(
    """
    import json, os
    from lockd.daemon import systemd

    names = systemd.listen_fd_names()
    socks = systemd.listen_fds()
    conn, _ = socks[0].accept()
    conn.sendall(json.dumps({"names": names, "fds": [s.fileno() for s in socks]}).encode())
    conn.close()
    """
)


@pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate absent"
)
def test_listen_fds_under_systemd_socket_activate(tmp_path: Path) -> None:
    """The real activator: it listens, starts us on the first connection, passes fd 3."""
    path = tmp_path / "activated.sock"
    proc = subprocess.Popen(
        [
            "systemd-socket-activate",
            "-l",
            str(path),
            "--fdname=lockd.socket",
            sys.executable,
            "-c",
            _ACTIVATED_CHILD,
        ],
        stderr=subprocess.PIPE,
    )
    try:

        def socket_made() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            return path.exists()

        wait_for(socket_made, 10, "the activator's socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(20)
            client.connect(str(path))
            data = b""
            while chunk := client.recv(4096):
                data += chunk
        assert json.loads(data) == {"names": ["lockd.socket"], "fds": [3]}
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------
# MemoryDenyWriteExecute=yes

_MDWE_PROBE = textwrap.dedent(
    """
    import ctypes, importlib, json, mmap, os, pkgutil, sqlite3, sys, tempfile
    import lockd

    libc = ctypes.CDLL(None, use_errno=True)
    if sys.argv[1] == "mdwe":
        # PR_SET_MDWE = 65, PR_MDWE_REFUSE_EXEC_GAIN = 1 (Linux >= 6.3).
        if libc.prctl(65, 1, 0, 0, 0) != 0:
            print(json.dumps({"unsupported": os.strerror(ctypes.get_errno())}))
            sys.exit(0)
    out = {}
    try:
        mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        out["wx_refused"] = False
    except OSError:
        out["wx_refused"] = True

    # Exercise what the daemon runs on, not just imports.
    import celpy, inotify_simple, trio
    env = celpy.Environment()
    prog = env.program(env.compile("record.key.startsWith('a')"))
    out["cel"] = bool(prog.evaluate({"record": celpy.json_to_cel({"key": "abc"})}))
    d = tempfile.mkdtemp()
    with inotify_simple.INotify(nonblocking=True) as ino:
        ino.add_watch(d, inotify_simple.flags.CREATE)
        open(os.path.join(d, "x"), "w").close()
        out["inotify"] = len(ino.read(timeout=1000)) > 0
    db = sqlite3.connect(os.path.join(d, "t.db"))
    out["sqlite"] = db.execute("pragma journal_mode=wal").fetchone()[0]
    async def main():
        await trio.to_thread.run_sync(lambda: None)
        return True
    out["trio"] = trio.run(main)
    out["ctypes_callback"] = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 7)() == 7

    # Every lockd module: report those that fail to import (compared with and
    # without MDWE by the test, so half-finished modules elsewhere don't count).
    failed = {}
    for mod in pkgutil.iter_modules(lockd.__path__, "lockd."):
        try:
            importlib.import_module(mod.name)
        except BaseException as exc:
            failed[mod.name] = type(exc).__name__
    out["import_failures"] = failed
    print(json.dumps(out))
    """
)


def _probe(mode: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _MDWE_PROBE, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_daemon_runtime_works_without_writable_executable_memory() -> None:
    """lockd.service sets MemoryDenyWriteExecute=yes; nothing we run may need W+X pages.

    The kernel's PR_SET_MDWE refuses the same mappings as systemd's seccomp
    form of the setting (W+X mmap); a dependency that JITs or writes code
    (a ctypes callback on an old libffi, say) would fail here first.
    """
    mdwe = _probe("mdwe")
    if "unsupported" in mdwe:
        pytest.skip(f"kernel without PR_SET_MDWE: {mdwe['unsupported']}")
    plain = _probe("plain")
    assert mdwe["wx_refused"] is True and plain["wx_refused"] is False
    for key in ("cel", "inotify", "trio", "ctypes_callback"):
        assert mdwe[key] is True, key
    assert mdwe["sqlite"] == "wal"
    assert mdwe["import_failures"] == plain["import_failures"]


# --------------------------------------------------------------------------
# unit files

Directive = tuple[str, str, str]


def _directives(path: Path) -> list[Directive]:
    """(section, key, value) in order; repeated keys stay (systemd appends them)."""
    out: list[Directive] = []
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def _get(path: Path, section: str, key: str) -> list[str]:
    return [v for s, k, v in _directives(path) if s == section and k == key]


def test_system_socket_contract() -> None:
    sock = UNITS / "lockd.socket"
    assert _get(sock, "Socket", "ListenStream") == ["/run/lockd/lockd.sock"]
    assert _get(sock, "Socket", "SocketMode") == ["0666"]


def test_user_socket_contract() -> None:
    sock = UNITS / "user" / "lockd.socket"
    assert _get(sock, "Socket", "ListenStream") == ["%t/lockd/lockd.sock"]
    assert _get(sock, "Socket", "SocketMode") == ["0600"]


@pytest.mark.parametrize(
    ("unit", "exec_start"),
    [
        (UNITS / "lockd.service", "/usr/local/bin/lockd serve --system"),
        (UNITS / "user" / "lockd.service", "%h/.local/bin/lockd serve"),
    ],
)
def test_service_contract(unit: Path, exec_start: str) -> None:
    def one(key: str) -> str:
        values = _get(unit, "Service", key)
        assert len(values) == 1, (key, values)
        return values[0]

    assert one("ExecStart") == exec_start
    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert one("ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one("WatchdogSec") == "30s"
    assert one("Restart") == "on-failure"
    assert one("KillSignal") == "SIGTERM"
    assert one("RuntimeDirectory") == "lockd"
    # The socket unit made its socket inside RuntimeDirectory: keep it on stop.
    assert one("RuntimeDirectoryPreserve") == "yes"
    assert one("MemoryDenyWriteExecute") == "yes"
    assert one("RestrictAddressFamilies") == "AF_UNIX"
    assert _get(unit, "Unit", "Requires") == ["lockd.socket"]


def test_system_service_paths_and_identity_constraints() -> None:
    unit = UNITS / "lockd.service"
    assert _get(unit, "Service", "StateDirectory") == ["lockd"]  # /var/lib/lockd
    assert _get(unit, "Service", "User") == ["lockd"]
    # RuntimeDirectoryPreserve= + DynamicUser= would move /run/lockd under the
    # 0700 /run/private and lock every non-root client out of the socket.
    assert _get(unit, "Service", "DynamicUser") == []
    # Peer identity needs other users' uids (SO_PEERCRED) and /proc/PID/cgroup.
    assert _get(unit, "Service", "PrivateUsers") == ["no"]
    assert _get(unit, "Service", "ProtectProc") == ["default"]
    assert _get(unit, "Service", "ProcSubset") == ["all"]
    sysusers = (UNITS / "lockd.sysusers").read_text()
    assert re.search(r"^u\s+lockd\s", sysusers, re.MULTILINE)


def test_system_service_only_reads_its_configuration() -> None:
    """No ConfigurationDirectory=: systemd chowns it to User= and mounts it read-write.

    /etc/lockd is made by root at install (docs/operations.md) and stays
    read-only in the daemon's namespace through ProtectSystem=strict.
    """
    unit = UNITS / "lockd.service"
    assert _get(unit, "Service", "ConfigurationDirectory") == []
    assert _get(unit, "Service", "ProtectSystem") == ["strict"]
    writable = " ".join(_get(unit, "Service", "ReadWritePaths"))
    assert "/etc" not in writable


@pytest.mark.parametrize("unit", [UNITS / "lockd.service", UNITS / "user" / "lockd.service"])
def test_service_raises_the_file_descriptor_limit(unit: Path) -> None:
    """systemd's default soft RLIMIT_NOFILE (1024) would cap connections near 1,000."""
    (value,) = _get(unit, "Service", "LimitNOFILE")
    soft = int(value.split(":")[0])
    assert soft >= 16384


def test_documented_install_creates_root_owned_config_folder() -> None:
    """The install block of docs/operations.md makes /etc/lockd, since the unit no longer does."""
    doc = (REPO / "docs" / "operations.md").read_text()
    block = doc.split("<!-- e2e: system-install -->", 1)[1].split("```", 2)[1]
    assert "install -d -m 0755 /etc/lockd/rule-sets" in block
    # lockd ships lockd_client itself: one install from the checkout, no index.
    assert "/opt/lockd/bin/pip install ." in block
    # Debian 12 has no /etc/sysusers.d until something creates it.
    assert "install -D -m 0644 systemd/lockd.sysusers /etc/sysusers.d/lockd.conf" in block
    # PEP 668 refuses the first on Debian 12; bookworm's pipx has no --global.
    commands = "".join(doc.split("```")[1::2]) + "".join(
        line for unit in UNITS.rglob("lockd.service") for line in unit.read_text().splitlines()
    )
    for refused in ("pip install --user", "pipx install --global"):
        assert refused not in commands


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze absent")
def test_ci_systemd_checks_pass() -> None:
    """verify + security exposure <= 2.0, as CI runs them."""
    proc = subprocess.run(
        ["bash", str(CHECKS)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=_checks_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "systemd checks: all passed" in proc.stdout
    match = re.search(r"security exposure ([0-9.]+)", proc.stdout)
    assert match and float(match.group(1)) <= 2.0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze absent")
def test_ci_systemd_checks_catch_broken_units(tmp_path: Path) -> None:
    """A misspelt key, a bad ExecStart flag, a weak sandbox, a writable config folder
    and a missing LimitNOFILE= each fail the script."""
    broken = tmp_path / "systemd"
    shutil.copytree(UNITS, broken)
    service = broken / "lockd.service"
    text = service.read_text()
    text = text.replace("serve --system", "serve --sistem")
    text = text.replace("ProtectSystem=strict", "ProtectSytem=strict")
    text = text.replace("UMask=0077", "UMask=0077\nConfigurationDirectory=lockd")
    service.write_text(text)
    user_service = broken / "user" / "lockd.service"
    user_service.write_text(user_service.read_text().replace("LimitNOFILE=", "#LimitNOFILE="))
    # Lower the limit so the (still small) exposure rise must fail the gate.
    env = _checks_env(LOCKD_UNITS_DIR=str(broken), LOCKD_MAX_EXPOSURE="0.5")
    proc = subprocess.run(
        ["bash", str(CHECKS)], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Unknown key 'ProtectSytem'" in proc.stdout
    assert "--sistem" in proc.stdout
    assert re.search(r"FAIL  lockd.service: security exposure [0-9.]+ is above 0.5", proc.stdout)
    assert "FAIL  lockd.service: ConfigurationDirectory= hands /etc/lockd" in proc.stdout
    assert "FAIL  user/lockd.service: no LimitNOFILE=" in proc.stdout
    assert "5 failed" in proc.stdout
