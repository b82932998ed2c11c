"""The real daemon under systemd's protocols, without a running systemd.

``tests/system/test_systemd_unit.py`` checks ``lockd.daemon.systemd`` in isolation; here a
real ``lockd serve`` subprocess is driven the way the units in ``systemd/``
drive it, and what it does is observed from outside:

- **Socket activation.** Under ``systemd-socket-activate`` (which binds the
  socket, waits for the first client and only then execs the daemon with the
  socket as fd 3) the daemon serves the inherited socket and never unlinks or
  re-binds it. Under a stand-in for ``lockd.socket`` (the test keeps the
  listening socket open across two daemon lives) a client that connects while
  the daemon is down waits in the backlog and is served by the next daemon,
  with its lease still held: the reason the units are socket activated.
- **sd_notify.** A datagram socket owned by the test stands in for PID 1's
  notify socket: ``READY=1`` comes only once the socket answers,
  ``RELOADING=1``/``READY=1`` frame a SIGHUP, ``STOPPING=1`` starts a SIGTERM
  stop (exit status 0), and with ``WATCHDOG_USEC`` the ``WATCHDOG=1`` pings
  come from the event loop with ``STATUS=`` lines that follow the load.
- **The operator docs** (``docs/operations.md``) keep naming every
  ``lockd.toml`` key with its real default, and the example metrics units in
  them pass ``systemd-analyze verify``.

Timing bounds are generous (the box has 2 shared cores): "at once" means
within :data:`PROMPT` seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest

from lockd.config import BackendSettings, Settings
from lockd.testing.daemon import LOCKD, DaemonProcess
from lockd.testing.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "operations.md"

#: Generous bound for "at once" on a loaded 2-core box.
PROMPT = 3.0
#: Bound for a daemon start (imports, CEL grammar, SQLite) on that box.
START = 20.0

#: Variables a test run might inherit from its own systemd unit; the daemon
#: under test must only see the ones the test sets.
SYSTEMD_ENV = (
    "NOTIFY_SOCKET",
    "LISTEN_PID",
    "LISTEN_FDS",
    "LISTEN_FDNAMES",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
)

needs_activate = pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate absent"
)


# --------------------------------------------------------------------------
# helpers


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without systemd's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_ENV}
    env.update(extra)
    return env


class Wire:
    """One JSON-lines connection: raw enough to see exactly what the daemon says."""

    def __init__(self, path: Path | str, timeout: float = PROMPT) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.buf = b""
        self.ids = 0

    def send(self, op: str, **args: Any) -> int:
        self.ids += 1
        self.sock.sendall(json.dumps({"id": self.ids, "op": op, **args}).encode() + b"\n")
        return self.ids

    def reply(self, request_id: int, timeout: float = PROMPT) -> dict[str, Any]:
        """The reply to ``request_id`` (replies to other ids are not expected here)."""
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, "daemon closed the connection"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        assert reply["id"] == request_id, reply
        return reply

    def call(self, op: str, timeout: float = PROMPT, **args: Any) -> dict[str, Any]:
        return self.reply(self.send(op, **args), timeout)

    def result(self, op: str, timeout: float = PROMPT, **args: Any) -> Any:
        reply = self.call(op, timeout, **args)
        assert reply["ok"] is True, reply
        return reply["result"]

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def wire(path: Path | str, timeout: float = PROMPT) -> Iterator[Wire]:
    conn = Wire(path, timeout)
    try:
        yield conn
    finally:
        conn.close()


def fields_of(message: str) -> dict[str, str]:
    """An sd_notify datagram as a dict: ``"READY=1\\nSTATUS=x"`` -> {READY: 1, STATUS: x}."""
    out: dict[str, str] = {}
    for line in message.split("\n"):
        name, sep, value = line.partition("=")
        assert sep, f"not an assignment in sd_notify message: {message!r}"
        out[name] = value
    return out


@dataclass
class Received:
    at: float  #: time.monotonic() when the test read it
    message: str

    @property
    def fields(self) -> dict[str, str]:
        return fields_of(self.message)


class NotifySocket:
    """A SOCK_DGRAM socket standing in for systemd's ``$NOTIFY_SOCKET``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.seen: list[Received] = []

    def receive(self, timeout: float) -> Received | None:
        """The next datagram, or None when none comes within ``timeout``."""
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        got = Received(time.monotonic(), data.decode())
        self.seen.append(got)
        return got

    def wait_for(self, predicate: Callable[[dict[str, str]], bool], timeout: float) -> Received:
        """Read datagrams until one matches; fail naming what came instead."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.receive(deadline - time.monotonic())
            if got is not None and predicate(got.fields):
                return got
            if got is None or time.monotonic() > deadline:
                raise AssertionError(
                    f"no matching sd_notify message within {timeout} s; "
                    f"seen: {[r.message for r in self.seen]}"
                )

    def collect(self, seconds: float) -> list[Received]:
        """Everything that arrives in the next ``seconds``."""
        deadline = time.monotonic() + seconds
        out = []
        while (left := deadline - time.monotonic()) > 0:
            got = self.receive(left)
            if got is not None:
                out.append(got)
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(short_tmp: Path) -> Iterator[NotifySocket]:
    receiver = NotifySocket(short_tmp / "notify")
    yield receiver
    receiver.close()


def is_ready(f: dict[str, str]) -> bool:
    return f.get("READY") == "1"


def start_notified(daemon: DaemonProcess, notify: NotifySocket, **env: str) -> Received:
    """Start the daemon with ``NOTIFY_SOCKET`` and return its READY=1 message."""
    daemon.start(wait=False, env=clean_env(NOTIFY_SOCKET=str(notify.path), **env))
    try:
        return notify.wait_for(is_ready, START)
    except AssertionError:
        raise AssertionError(f"no READY=1; daemon log:\n{daemon.read_log()}") from None


def stop_quietly(proc: subprocess.Popen[bytes]) -> None:
    """Teardown: SIGTERM, then SIGKILL if it does not go (only our own child)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def notified(daemon_paths: DaemonProcess) -> Iterator[DaemonProcess]:
    """Daemon paths whose process, if started, is stopped after the test."""
    yield daemon_paths
    if daemon_paths.proc is not None:
        stop_quietly(daemon_paths.proc)


def serve_args(daemon: DaemonProcess) -> list[str]:
    """``lockd serve`` as the units run it: no --socket (the socket is inherited)."""
    return [*LOCKD, "serve", "--db", str(daemon.db), "--config", str(daemon.config)]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    wait_for(predicate, timeout, what)


# --------------------------------------------------------------------------
# socket activation


@needs_activate
def test_socket_activate_first_connection_starts_daemon_on_inherited_socket(
    daemon_paths: DaemonProcess, notify: NotifySocket
) -> None:
    """systemd-socket-activate binds, waits for a client, then execs ``lockd serve``.

    The daemon must serve fd 3 (not bind ``$LOCKD_SOCKET``, which points
    elsewhere here), leave the socket file alone (systemd owns it) and stop
    with exit status 0 on SIGTERM. systemd-socket-activate passes only TERM,
    PATH, USER and HOME through, so the rest goes in with ``-E``.
    """
    elsewhere = daemon_paths.root / "elsewhere.sock"
    log = daemon_paths.log.open("ab")
    proc = subprocess.Popen(
        [
            "systemd-socket-activate",
            "-l",
            str(daemon_paths.socket),
            "--fdname=lockd.socket",
            "-E",
            f"NOTIFY_SOCKET={notify.path}",
            "-E",
            f"LOCKD_SOCKET={elsewhere}",
            *serve_args(daemon_paths),
        ],
        stdout=log,
        stderr=log,
        env=clean_env(),
    )
    log.close()
    try:
        wait_until(daemon_paths.socket.exists, START, "the activator's socket")
        inode = daemon_paths.socket.stat().st_ino
        # Nothing has connected yet: the activator is still waiting, and no
        # daemon has started (the activator execs it in place, same pid).
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert Path(cmdline[0].decode()).name == "systemd-socket-activate"
        assert "event=started" not in daemon_paths.read_log()
        assert notify.receive(0.2) is None

        with wire(daemon_paths.socket, timeout=START) as first:
            # The first connection is what starts the daemon; it is accepted
            # from the backlog once the daemon runs.
            hello = first.result("hello", timeout=START)
            assert hello["pid"] == os.getpid()
            assert hello["protocol"] == 1
            handle = first.result("tryAcquire", key="activated", ttlMs=60_000)
            assert handle["key"] == "activated"
        ready = notify.wait_for(is_ready, PROMPT)
        assert "STATUS" in ready.fields
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"serve" in cmdline, cmdline
        with wire(daemon_paths.socket) as second:
            status = second.result("status", key="activated")
            assert status["held"] is True and status["fence"] == handle["fence"]

        assert "socket=inherited" in daemon_paths.read_log()
        assert daemon_paths.socket.stat().st_ino == inode, "daemon re-bound the socket"
        assert not elsewhere.exists() and not elsewhere.with_name("elsewhere.sock.lock").exists()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, daemon_paths.read_log()
        notify.wait_for(lambda f: f.get("STOPPING") == "1", PROMPT)
        # The socket belongs to the socket unit: the daemon leaves it in place.
        assert daemon_paths.socket.is_socket()
        assert daemon_paths.socket.stat().st_ino == inode
    finally:
        stop_quietly(proc)


_EXEC_ON_FD3 = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)  # inheritable, as systemd passes it
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())  # exec keeps the pid
os.environ["LISTEN_FDS"] = "1"
os.execv(sys.argv[2], sys.argv[2:])
"""


def _activated_daemon(
    daemon: DaemonProcess, listener: socket.socket, notify: NotifySocket
) -> subprocess.Popen[bytes]:
    """Start ``lockd serve`` on ``listener`` as systemd does: fd 3, LISTEN_PID = its pid."""
    fd = listener.fileno()
    log = daemon.log.open("ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _EXEC_ON_FD3, str(fd), *serve_args(daemon)],
            pass_fds=(fd,),
            stdout=log,
            stderr=log,
            env=clean_env(NOTIFY_SOCKET=str(notify.path)),
        )
    finally:
        log.close()


def test_inherited_socket_queues_clients_across_a_restart(
    daemon_paths: DaemonProcess, notify: NotifySocket
) -> None:
    """lockd.socket keeps the listener across restarts; the daemon must not spoil it.

    The test holds the listening socket, as systemd does. A client that
    connects while no daemon runs waits in the backlog and gets its answer
    from the next daemon, whose database still has the lease of the first.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(daemon_paths.socket))
    listener.listen(64)
    inode = daemon_paths.socket.stat().st_ino
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_activated_daemon(daemon_paths, listener, notify))
        notify.wait_for(is_ready, START)
        with wire(daemon_paths.socket) as conn:
            granted = conn.result("tryAcquire", key="kept", ttlMs=600_000, owner="run-1")
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(10) == 0, daemon_paths.read_log()
        assert daemon_paths.socket.stat().st_ino == inode

        # No daemon now: the connection is queued by the kernel, not refused.
        with wire(daemon_paths.socket, timeout=START) as waiting:
            request = waiting.send("status", key="kept")
            procs.append(_activated_daemon(daemon_paths, listener, notify))
            status = waiting.reply(request, timeout=START)["result"]
            assert status["held"] is True
            assert status["fence"] == granted["fence"]
            assert status["owner"] == "run-1"
            renewed = waiting.result("renew", key="kept", handle=granted["handle"], ttlMs=600_000)
            assert renewed["renewed"] is True
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(10) == 0, daemon_paths.read_log()
        assert daemon_paths.socket.stat().st_ino == inode
        assert daemon_paths.read_log().count("socket=inherited") == 2
    finally:
        for proc in procs:
            stop_quietly(proc)
        listener.close()


# --------------------------------------------------------------------------
# sd_notify


def test_ready_only_once_the_socket_answers(notified: DaemonProcess, notify: NotifySocket) -> None:
    """Type=notify: when READY=1 arrives, a client is served at once, no retry."""
    ready = start_notified(notified, notify)
    with wire(notified.socket) as conn:  # one connect, no retry loop
        sent = time.monotonic()
        hello = conn.result("hello")
        assert time.monotonic() - sent < PROMPT
    assert hello["protocol"] == 1
    # No earlier message claimed readiness; READY=1 carries the load.
    assert [r for r in notify.seen if is_ready(r.fields)] == [ready]
    assert ready.fields["STATUS"].startswith("0 locks held, 0 waiters")


def test_sighup_reports_reloading_then_ready(notified: DaemonProcess, notify: NotifySocket) -> None:
    """ExecReload=kill -HUP: RELOADING=1 (with MONOTONIC_USEC, systemd >= 253) then READY=1."""
    start_notified(notified, notify)
    assert notified.proc is not None
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notified.proc.send_signal(signal.SIGHUP)
    reloading = notify.wait_for(lambda f: f.get("RELOADING") == "1", PROMPT)
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert before <= int(reloading.fields["MONOTONIC_USEC"]) <= after
    done = notify.wait_for(is_ready, PROMPT)
    assert done.at >= reloading.at
    assert "STATUS" in done.fields
    # Still serving, and a reload is not a stop.
    with wire(notified.socket) as conn:
        assert conn.result("hello")["protocol"] == 1
    assert not any(r.fields.get("STOPPING") for r in notify.seen)
    assert notified.stop() == 0


def test_sigterm_reports_stopping_and_exits_zero(
    notified: DaemonProcess, notify: NotifySocket
) -> None:
    """SIGTERM: STOPPING=1, parked acquires answered SHUTTING_DOWN, exit status 0."""
    start_notified(notified, notify)
    assert notified.proc is not None
    with wire(notified.socket) as holder, wire(notified.socket) as waiter:
        holder.result("tryAcquire", key="busy", ttlMs=600_000)
        parked = waiter.send("acquire", key="busy", ttlMs=60_000, timeoutMs=60_000)
        wait_until(
            lambda: holder.result("status", key="busy")["waiters"] == 1,
            PROMPT,
            "the acquire to park",
        )
        notified.proc.send_signal(signal.SIGTERM)
        notify.wait_for(lambda f: f.get("STOPPING") == "1", PROMPT)
        answer = waiter.reply(parked)
        assert answer["ok"] is False
        assert answer["error"]["code"] == "SHUTTING_DOWN"
    assert notified.proc.wait(10) == 0, notified.read_log()


def _load_status(wanted: str) -> Callable[[dict[str, str]], bool]:
    return lambda f: wanted in f.get("STATUS", "")


def test_watchdog_pings_and_status_follow_the_load(
    notified: DaemonProcess, notify: NotifySocket
) -> None:
    """WATCHDOG_USEC=200000, no WATCHDOG_PID: WATCHDOG=1 about every 100 ms.

    STATUS= (what ``systemctl status lockd`` shows) follows held locks and
    waiters within a ping or two.
    """
    start_notified(notified, notify, WATCHDOG_USEC="200000")
    window = notify.collect(1.0)
    pings = [r.at for r in window if r.fields.get("WATCHDOG") == "1"]
    assert len(pings) >= 4, [r.message for r in window]
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert 0.03 <= statistics.median(gaps) <= 0.3, gaps

    with wire(notified.socket) as holder, wire(notified.socket) as waiter:
        first = holder.result("tryAcquire", key="load", ttlMs=600_000)
        notify.wait_for(_load_status("1 lock held, 0 waiters"), PROMPT)
        parked = waiter.send("acquire", key="load", ttlMs=60_000, timeoutMs=60_000)
        notify.wait_for(_load_status("1 lock held, 1 waiter"), PROMPT)
        second = holder.result("tryAcquire", key="load2", ttlMs=600_000)
        notify.wait_for(_load_status("2 locks held, 1 waiter"), PROMPT)
        holder.result("release", key="load2", handle=second["handle"])
        holder.result("release", key="load", handle=first["handle"])
        # The key went to the parked acquire: still one lock held, nobody waiting.
        assert waiter.reply(parked)["result"]["key"] == "load"
        notify.wait_for(_load_status("1 lock held, 0 waiters"), PROMPT)
    # Pings went on the whole time.
    late = notify.collect(0.5)
    assert any(r.fields.get("WATCHDOG") == "1" for r in late), [r.message for r in late]


@pytest.mark.parametrize(
    ("watchdog_pid", "pings"),
    [("self", True), ("other", False)],
    ids=["WATCHDOG_PID=daemon", "WATCHDOG_PID=other"],
)
def test_watchdog_pid_decides_who_pings(
    daemon_paths: DaemonProcess, notify: NotifySocket, watchdog_pid: str, pings: bool
) -> None:
    """systemd sets WATCHDOG_PID to the main pid; a process that is not it must not ping."""
    pid_expr = "$$" if watchdog_pid == "self" else "1"
    log = daemon_paths.log.open("ab")
    proc = subprocess.Popen(
        ["/bin/sh", "-c", f'WATCHDOG_PID={pid_expr} exec "$@"', "sh", *serve_args(daemon_paths)],
        stdout=log,
        stderr=log,
        env=clean_env(
            NOTIFY_SOCKET=str(notify.path),
            WATCHDOG_USEC="200000",
            LOCKD_SOCKET=str(daemon_paths.socket),
        ),
    )
    log.close()
    try:
        notify.wait_for(is_ready, START)
        window = notify.collect(0.6)
        got = [r for r in window if r.fields.get("WATCHDOG") == "1"]
        assert bool(got) is pings, [r.message for r in window]
    finally:
        stop_quietly(proc)


def test_start_failure_exits_nonzero_without_ready(
    notified: DaemonProcess, notify: NotifySocket
) -> None:
    """A bad lockd.toml: exit 2 with one clear line and no READY=1 (systemd marks it failed)."""
    notified.write_config("acquire_per_hour = 0\n")
    notified.start(wait=False, env=clean_env(NOTIFY_SOCKET=str(notify.path)))
    assert notified.proc is not None
    assert notified.proc.wait(START) == 2
    log = notified.read_log()
    assert "lockd: cannot start: config:" in log and "acquire_per_hour" in log, log
    assert not any(is_ready(r.fields) for r in notify.collect(0.1)), notify.seen


RULES_A = (
    '[ruleSet]\nname = "lock-policy"\nresourceType = "lock"\n\n'
    "[rules.lock]\nacquire = \"record.key.startsWith('a')\"\n"
)


def _blocked_writing_stderr(pid: int) -> bool:
    """True while ``pid`` sits in write(2, ...) (``/proc/PID/syscall``: nr 1, fd 0x2)."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return fields[:2] == ["1", "0x2"]


def test_rule_set_written_during_start_up_is_loaded(
    notified: DaemonProcess, notify: NotifySocket
) -> None:
    """A rule set written while the daemon starts is in force once it is up.

    Start-up reads rule-sets/ long before the watcher is armed, and under
    socket activation clients already connect in between. The test pauses
    the daemon right after that first read: its stderr is a pipe the test
    has filled, so the daemon blocks writing its first log line
    (``rules_loaded``, the open default). The rule set is written then, and
    the pipe drained.
    """
    if not Path(f"/proc/{os.getpid()}/syscall").exists():
        pytest.skip("no /proc/PID/syscall to see where the daemon waits")
    (notified.config / "rule-sets").mkdir(parents=True)
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(write_end, False)
    filler = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            filler += os.write(write_end, b"#" * 512)
    os.set_blocking(write_end, True)
    proc = subprocess.Popen(
        [*serve_args(notified), "--socket", str(notified.socket)],
        stdout=subprocess.DEVNULL,
        stderr=write_end,
        env=clean_env(NOTIFY_SOCKET=str(notify.path)),
    )
    os.close(write_end)
    drained = b""
    try:
        wait_until(lambda: _blocked_writing_stderr(proc.pid), START, "the first log write")
        notified.write_rules("lock.toml", RULES_A)
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while len(drained) < filler or b"event=started" not in drained:
                chunk = pipe.read(65536)
                assert chunk, drained
                drained += chunk
            first_line = drained[filler:].split(b"\n", 1)[0].decode()
            # The pause was where the test meant it: after the first read.
            assert "event=rules_loaded" in first_line and "open default" in first_line
            notify.wait_for(is_ready, START)
            with wire(notified.socket) as conn:
                wait_for(
                    lambda: conn.result("rules")["policy"] is not None,
                    PROMPT,
                    "the rule set written at start-up loaded",
                    interval=0.05,
                )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
    finally:
        stop_quietly(proc)


# --------------------------------------------------------------------------
# the operator docs stay true


def _doc_text() -> str:
    if not DOCS.exists():
        pytest.fail(f"{DOCS} is missing")
    return DOCS.read_text()


def _toml_default(value: object) -> str:
    """A Settings default as it would be written in lockd.toml."""
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def test_operations_doc_lists_every_setting_with_its_default() -> None:
    """docs/operations.md has a table row per lockd.toml key: `key` | `default` | meaning."""
    rows: dict[str, str] = {}
    for line in _doc_text().splitlines():
        match = re.match(r"^\|\s*`([a-z_.]+)`\s*\|\s*(?:`([^`]*)`|[^|]*?)\s*\|", line)
        if match:
            rows[match.group(1)] = match.group(2) or ""
    keys = set()
    for field in fields(Settings):
        if field.name == "backend":  # a table: a row per key, `backend.<key>`
            for key in fields(BackendSettings):
                keys.add(f"backend.{key.name}")
                assert f"backend.{key.name}" in rows, f"docs/operations.md: backend.{key.name}"
            continue
        keys.add(field.name)
        assert field.name in rows, f"docs/operations.md does not document {field.name}"
        assert rows[field.name] == _toml_default(field.default), field.name
    unknown = set(rows) - keys
    assert not unknown, f"docs/operations.md documents keys lockd.toml refuses: {unknown}"


def _doc_blocks(marker: str) -> list[str]:
    """Fenced code blocks of the doc whose first line is ``# <marker>``."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", _doc_text(), flags=re.DOTALL)
    return [b for b in blocks if b.startswith(f"# {marker}")]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze absent")
def test_operations_doc_metrics_units_verify(tmp_path: Path) -> None:
    """The node_exporter timer example in the doc is a valid pair of units."""
    service = _doc_blocks("/etc/systemd/system/lockd-metrics.service")
    timer = _doc_blocks("/etc/systemd/system/lockd-metrics.timer")
    assert len(service) == 1 and len(timer) == 1
    (tmp_path / "lockd-metrics.service").write_text(service[0])
    (tmp_path / "lockd-metrics.timer").write_text(timer[0])
    proc = subprocess.run(
        ["systemd-analyze", "verify", "./lockd-metrics.service", "./lockd-metrics.timer"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), (
        proc.stdout + proc.stderr
    )
