"""Shared fixtures: a real ``lockd serve`` on a temporary socket.

Integration tests talk to a real daemon process through the real client and
CLI. Paths live under a short /tmp folder because AF_UNIX paths are limited
to 107 bytes and pytest's tmp_path can be longer.

No process may outlive the session. Every process the tests start carries
``LOCKD_TEST_SESSION=<token of this session>`` in its environment (set in
``os.environ`` here, so children inherit it, and added explicitly by
:meth:`DaemonProcess.start`); at the end, :func:`pytest_sessionfinish` looks
for live processes with this session's token in ``/proc/*/environ``, kills
them and fails the run naming them. Other test sessions running on the same
machine at the same time have other tokens and are left alone.

Both backends (docs/contract.md §11): the ``backend`` fixture says which store a test's
daemons serve from. It is ``sqlite`` unless the test (or its module) is
marked ``both_backends``: then the test runs once per backend, the etcd run
on the session's real 3-member cluster (``tests/etcd_fixtures.py``), each
daemon under a prefix of its own. Where the two may answer differently, the
test names an entry of ``tests/backend_differences.py`` (``backend.differs``,
the ``differs`` marker): nowhere else. ``sqlite_only(reason)`` keeps one test
of such a module on SQLite for a reason that is no difference (the code
under test never reaches the store, the database file, ...).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.backend_differences import difference
from tests.etcd_cluster import EtcdBackend, EtcdCluster

LOCKD = [sys.executable, "-m", "lockd"]

#: Marks every process this test session starts (see the module docstring).
SESSION_ENV = "LOCKD_TEST_SESSION"
SESSION_TOKEN = os.environ.setdefault(SESSION_ENV, secrets.token_hex(8))

# The etcd cluster fixtures (etcd_cluster, new_etcd_cluster).
pytest_plugins = ["tests.etcd_fixtures"]


@dataclass
class DaemonProcess:
    """A ``lockd serve`` subprocess and the paths it uses."""

    root: Path
    socket: Path
    db: Path
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    extra_args: list[str] = field(default_factory=list)
    #: serve from etcd with this ``[backend]`` table (None: the embedded SQLite store).
    etcd: EtcdBackend | None = None

    @classmethod
    def in_folder(cls, root: Path, etcd: EtcdBackend | None = None) -> DaemonProcess:
        """A daemon whose socket, database, config and log all live under ``root``."""
        return cls(
            root=root,
            socket=root / "lockd.sock",
            db=root / "state" / "lockd.db",
            config=root / "config",
            log=root / "lockd.log",
            etcd=etcd,
        )

    def terminate(self) -> None:
        """SIGTERM if still running; SIGKILL if it does not stop within 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "LOCKD_SOCKET": str(self.socket)}

    def serve_command(
        self, *extra: str, socket: Path | None = None, db: Path | None = None
    ) -> list[str]:
        """``lockd serve`` on this daemon's paths (``socket``/``db`` replace its own)."""
        return [
            *LOCKD,
            "serve",
            "--socket",
            str(socket or self.socket),
            "--db",
            str(db or self.db),
            "--config",
            str(self.config),
            *extra,
        ]

    def serve_once(
        self,
        *extra: str,
        socket: Path | None = None,
        db: Path | None = None,
        timeout: float = 30,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``lockd serve`` expecting it to exit (a refused start); its output."""
        return subprocess.run(
            self.serve_command(*extra, socket=socket, db=db),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(
        self,
        *,
        wait: bool = True,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], object] | None = None,
    ) -> DaemonProcess:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        if self.etcd is not None and not (self.config / "lockd.toml").exists():
            self.write_config("")
        logf = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.serve_command(*self.extra_args),
            stdout=logf,
            stderr=logf,
            env={**(env if env is not None else os.environ), SESSION_ENV: SESSION_TOKEN},
            preexec_fn=preexec_fn,
        )
        logf.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"lockd exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(self.socket))
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"lockd did not come up:\n{self.read_log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def read_log(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def write_rules(self, name: str, text: str) -> Path:
        folder = self.config / "rule-sets"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, folder / name)
        return folder / name

    def write_config(self, text: str) -> None:
        """Write ``lockd.toml`` (top-level keys): the ``[backend]`` table is added after them."""
        self.config.mkdir(parents=True, exist_ok=True)
        backend = "" if self.etcd is None else "\n" + self.etcd.toml()
        (self.config / "lockd.toml").write_text(text + backend)


# ------------------------------------------------------------ backends

BACKENDS = ("sqlite", "etcd")


@dataclass(frozen=True)
class Backend:
    """The store a test's daemons serve from: ``sqlite`` (embedded) or ``etcd``."""

    kind: str
    cluster: EtcdCluster | None = None

    def differs(self, name: str) -> bool:
        """Whether the allowed difference ``name`` (tests/backend_differences.py) applies here."""
        difference(name)  # an unknown name fails here, on SQLite too
        return self.cluster is not None

    def etcd_settings(self, **settings: object) -> EtcdBackend | None:
        """A ``[backend]`` table under a fresh prefix (None for SQLite)."""
        return None if self.cluster is None else EtcdBackend.on(self.cluster, **settings)

    def daemon_in(self, root: Path) -> DaemonProcess:
        """A daemon (not started) under ``root`` on this backend, alone under its prefix."""
        return DaemonProcess.in_folder(root, self.etcd_settings())

    def fence_follows(self, earlier: int, later: int, grants: int = 1) -> bool:
        """``later`` is the fence ``grants`` grants after ``earlier``.

        SQLite counts grants, so exactly ``earlier + grants``; etcd fences are
        the grants' revisions, which other writes (waiter keys) move too: higher.
        """
        if self.differs("fence_revisions"):
            return later > earlier
        return later == earlier + grants

    def effective_ttl_ms(self, ttl_ms: int) -> int:
        """The TTL a grant of ``ttl_ms`` gets: etcd counts whole seconds, at least 2 (§11)."""
        if not self.differs("whole_second_ttl"):
            return ttl_ms
        return max(2000, -(-ttl_ms // 1000) * 1000)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_backends: run the test against the SQLite and the etcd backend"
    )
    config.addinivalue_line(
        "markers",
        "sqlite_only(reason): keep this test of a both_backends module on SQLite "
        "(for a reason that is no backend difference)",
    )
    config.addinivalue_line(
        "markers",
        "differs(name): the test checks what etcd does not do at all "
        "(tests/backend_differences.py): its etcd run is skipped naming the entry",
    )
    config.addinivalue_line(
        "markers",
        "etcd_bug(what, run=True): a known etcd bug (the contract holds there too): its etcd "
        "run is expected to fail (strict: once fixed, remove the marker); run=False if it hangs",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run ``both_backends`` tests once per backend (``[sqlite]``, ``[etcd]``)."""
    node = metafunc.definition
    if "backend" not in metafunc.fixturenames or node.get_closest_marker("sqlite_only"):
        return
    if node.get_closest_marker("both_backends"):
        metafunc.parametrize("backend", [BACKENDS[0], _etcd_run(node)], indirect=True)


def _etcd_run(node: pytest.Function) -> object:
    """The etcd parameter: skipped for a ``differs`` entry, expected to fail for an ``etcd_bug``."""
    bug = node.get_closest_marker("etcd_bug")
    if bug is not None:
        reason = f"etcd bug, not an allowed difference: {bug.args[0]}"
        run = bool(bug.kwargs.get("run", True))
        return pytest.param(
            BACKENDS[1], marks=pytest.mark.xfail(reason=reason, strict=True, run=run)
        )
    marker = node.get_closest_marker("differs")
    if marker is None:
        return BACKENDS[1]
    entry = difference(*marker.args)
    if not entry.etcd_skips:
        raise pytest.UsageError(
            f"{node.nodeid}: differs({entry.name!r}) marks only tests of what etcd does not "
            "do at all; for this entry, ask backend.differs() in the test body"
        )
    return pytest.param(
        BACKENDS[1], marks=pytest.mark.skip(f"differs: {entry.name}: {entry.differs}")
    )


@pytest.fixture(scope="module")
def backend(request: pytest.FixtureRequest) -> Backend:
    """SQLite, or the etcd session cluster for the ``[etcd]`` run of a both_backends test."""
    kind = getattr(request, "param", "sqlite")
    if kind == "etcd":
        return Backend(kind, request.getfixturevalue("etcd_cluster"))
    return Backend(kind)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary folder (usable for Unix socket paths)."""
    path = Path(tempfile.mkdtemp(prefix="lockd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_paths(short_tmp: Path, backend: Backend) -> Iterator[DaemonProcess]:
    """Paths for a daemon, not started (write config/rules first, then .start()).

    Whatever the test started is stopped afterwards (SIGTERM, then SIGKILL).
    """
    daemon = backend.daemon_in(short_tmp)
    try:
        yield daemon
    finally:
        daemon.terminate()


@pytest.fixture
def daemon(daemon_paths: DaemonProcess) -> DaemonProcess:
    """A running daemon with default settings; stopped (SIGTERM) afterwards."""
    return daemon_paths.start()


# ------------------------------------------------------------ leftover processes


def session_processes(token: str = SESSION_TOKEN) -> dict[int, str]:
    """Live processes (pid -> command line) started with this session's token.

    The pytest process itself is not one: its token was set after exec, so
    its ``/proc/PID/environ`` does not show it.
    """
    marker = f"{SESSION_ENV}={token}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if cmdline:  # a zombie has none: it is dead, only not reaped yet
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process started by it is still alive; kill it."""
    deadline = time.monotonic() + 5.0  # processes stopped a moment ago may still be exiting
    left = session_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = session_processes()
    if not left:
        return
    for pid in left:
        with contextlib.suppress(OSError):  # gone meanwhile
            os.kill(pid, signal.SIGKILL)
    lines = "\n".join(f"  {pid}: {cmd}" for pid, cmd in sorted(left.items()))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"processes started by this test session outlived it (killed now):\n{lines}"
    if reporter is not None:
        reporter.write_line(message, red=True)
    else:
        print(message, file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
