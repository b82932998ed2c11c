"""Shared fixtures: a real ``lockd serve`` on a temporary socket.

Integration tests talk to a real daemon process through the real client and
CLI. Paths live under a short /tmp folder because AF_UNIX paths are limited
to 107 bytes and pytest's tmp_path can be longer.

The daemon runner itself, :class:`lockd.testing.daemon.DaemonProcess`, lives
in the ``lockd.testing`` package so that ``bench/`` can use it too; this file
holds the pytest side (fixtures, markers, hooks).

No process may outlive the session. Every process the tests start carries
``LOCKD_TEST_SESSION=<token of this session>`` in its environment (see
``lockd.testing.daemon``); at the end, :func:`pytest_sessionfinish` looks for
live processes with this session's token, kills them and fails the run naming
them. Other test sessions running on the same machine at the same time have
other tokens and are left alone.

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
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lockd.testing.daemon import DaemonProcess, session_processes, temporary_daemon
from lockd.testing.etcd_cluster import EtcdBackend, EtcdCluster
from lockd.testing.polling import wait_for
from lockd.testing.wire import RawConn
from tests.backend_differences import difference
from tests.depth import register_profiles

# Before any test module is imported: their settings(max_examples=examples(N))
# read the loaded profile (quick, or deep under LOCKD_SLOW=1; tests/depth.py).
register_profiles()

# The etcd cluster fixtures (etcd_cluster, new_etcd_cluster).
pytest_plugins = ["tests.etcd_fixtures"]


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


def running_daemon(
    config: str | None = None, backend: Backend | None = None
) -> contextlib.AbstractContextManager[DaemonProcess]:
    """A daemon in its own short temp folder (on ``backend``), for module-scoped fixtures."""
    return temporary_daemon(config, etcd=backend.etcd_settings() if backend else None)


@pytest.fixture(scope="module")
def lockd(backend: Backend) -> Iterator[DaemonProcess]:
    """One running daemon for a whole module (on the module's backend)."""
    with running_daemon(backend=backend) as proc:
        yield proc


@pytest.fixture
def conns(lockd: DaemonProcess) -> Iterator[list[RawConn]]:
    """Four raw connections to the module's daemon, closed afterwards."""
    opened = [RawConn(lockd.socket) for _ in range(4)]
    try:
        yield opened
    finally:
        for conn in opened:
            conn.close()


# ------------------------------------------------------------ leftover processes


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process started by it is still alive; kill it."""
    # Processes stopped a moment ago may still be exiting: give them 5 s.
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not session_processes(), 5.0, interval=0.1)
        return
    left = session_processes()
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
