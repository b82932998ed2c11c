"""Baselines run in the same run as lockd: fcntl flock, PostgreSQL advisory
locks and (when present) Redis.

Machines here are shared and noisy, so an absolute number means little; the
ratio to a peer measured minutes apart on the same box does. Each baseline
that cannot run here (no binary, no Python driver) is skipped with a one-line
reason instead of failing the run.

The servers are throwaway: a cluster or instance in a fresh /tmp folder,
listening on a Unix socket only (no TCP port is ever opened), stopped and
deleted at the end. PostgreSQL refuses to run as root, so as root it runs as
the ``postgres`` user (else ``nobody``) through ``runuser``.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import LockerSpec

# ---------------------------------------------------------------------- flock


class FlockLocker:
    """fcntl.flock on one file per key in ``folder``; the fd stays open, as a
    lockd client keeps its connection."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._fds: dict[str, int] = {}

    def _fd(self, key: str) -> int:
        fd = self._fds.get(key)
        if fd is None:
            name = key.replace("/", "_")
            fd = os.open(os.path.join(self.folder, name), os.O_RDWR | os.O_CREAT, 0o600)
            self._fds[key] = fd
        return fd

    def prepare(self, key: str) -> None:
        self._fd(key)

    def try_pair(self, key: str) -> bool:
        fd = self._fds[key]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    def acquire(self, key: str) -> None:
        fcntl.flock(self._fds[key], fcntl.LOCK_EX)

    def release(self, key: str) -> None:
        fcntl.flock(self._fds[key], fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@contextlib.contextmanager
def flock_baseline() -> Iterator[LockerSpec]:
    """A fresh folder of lock files for the flock baseline."""
    folder = tempfile.mkdtemp(prefix="lockd-bench-flock-", dir="/tmp")
    try:
        yield LockerSpec("flock", FlockLocker, (folder,))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ----------------------------------------------------------------- PostgreSQL


def _pg_key(key: str) -> int:
    """A stable bigint for a string key (advisory locks take integers)."""
    return zlib.crc32(key.encode())


class PgLocker:
    """pg_try_advisory_lock / pg_advisory_lock / pg_advisory_unlock, one
    autocommit session per process (session-level locks, as a lock client
    holding a connection would use them)."""

    def __init__(self, socket_dir: str, user: str) -> None:
        import psycopg

        self.conn = psycopg.connect(host=socket_dir, user=user, dbname="postgres", autocommit=True)

    def prepare(self, key: str) -> None:
        self.conn.execute("SELECT 1").fetchone()

    def try_pair(self, key: str) -> bool:
        k = _pg_key(key)
        row = self.conn.execute("SELECT pg_try_advisory_lock(%s)", (k,)).fetchone()
        if not (row and row[0]):
            return False
        self.conn.execute("SELECT pg_advisory_unlock(%s)", (k,)).fetchone()
        return True

    def acquire(self, key: str) -> None:
        self.conn.execute("SELECT pg_advisory_lock(%s)", (_pg_key(key),)).fetchone()

    def release(self, key: str) -> None:
        row = self.conn.execute("SELECT pg_advisory_unlock(%s)", (_pg_key(key),)).fetchone()
        if not (row and row[0]):
            raise RuntimeError(f"pg_advisory_unlock({key!r}) found no lock held")

    def close(self) -> None:
        self.conn.close()


def _pg_bindir() -> Path | None:
    """The newest PostgreSQL server binaries found (Debian layout first, then PATH)."""
    candidates = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")]
    candidates.sort(key=lambda p: _version_key(p.parent.name), reverse=True)
    which = shutil.which("initdb")
    if which:
        candidates.append(Path(which).resolve().parent)
    for bindir in candidates:
        if all((bindir / tool).exists() for tool in ("initdb", "pg_ctl", "postgres")):
            return bindir
    return None


def _version_key(name: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in name.split("."))
    except ValueError:
        return (0,)


def _run_as(user: str | None, cmd: list[str], timeout: float) -> None:
    """Run ``cmd`` (as ``user`` when given: we are root); raise with its output."""
    if user is not None:
        cmd = ["runuser", "-u", user, "--", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def _server_user() -> str | None:
    """As root, the account a throwaway server runs as; None when not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("running as root but neither a postgres nor a nobody user exists")


@contextlib.contextmanager
def postgres_baseline() -> Iterator[LockerSpec | str]:
    """Yield a PgLocker spec on a throwaway cluster, or a reason it is skipped."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        yield (
            "skipped: psycopg not importable "
            "(.venv/bin/pip install 'psycopg[binary]' to enable; not a project dependency)"
        )
        return
    bindir = _pg_bindir()
    if bindir is None:
        yield "skipped: no PostgreSQL server binaries (initdb/pg_ctl/postgres) found"
        return
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        yield "skipped: running as root and runuser(1) is missing"
        return
    user = _server_user()
    root = Path(tempfile.mkdtemp(prefix="lockd-bench-pg-", dir="/tmp"))
    data = root / "data"
    started = False
    try:
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        db_user = "bench"
        _run_as(
            user,
            [
                *(str(bindir / "initdb"), "-D", str(data), "-U", db_user, "--auth=trust"),
                *("-E", "UTF8", "--no-sync", "--no-instructions"),
            ],
            timeout=120,
        )
        options = (
            f"-c listen_addresses='' -k {root} -c fsync=off -c max_connections=40 "
            "-c shared_buffers=16MB"
        )
        _run_as(
            user,
            [
                *(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log")),
                *("-w", "-t", "60", "-o", options, "start"),
            ],
            timeout=90,
        )
        started = True
        yield LockerSpec("postgres", PgLocker, (str(root), db_user))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        if started:
            raise
        yield f"skipped: could not start a throwaway PostgreSQL ({exc})"
    finally:
        if started:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _run_as(
                    user,
                    [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                    timeout=60,
                )
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------- Redis


class RedisLocker:
    """redis-py's Lock (SET NX PX, token-checked release by Lua script).

    Only the uncontended pair is measured: redis-py waits by polling, so a
    blocking hand-off would measure its sleep interval, not the server.
    """

    def __init__(self, socket_path: str) -> None:
        import redis

        self.client = redis.Redis(unix_socket_path=socket_path)
        self._locks: dict[str, Any] = {}

    def prepare(self, key: str) -> None:
        self.client.ping()

    def try_pair(self, key: str) -> bool:
        lock = self.client.lock(key, timeout=30)
        if not lock.acquire(blocking=False):
            return False
        lock.release()
        return True

    def acquire(self, key: str) -> None:
        raise NotImplementedError("redis-py waits by polling; no hand-off baseline")

    def release(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.client.close()


@contextlib.contextmanager
def redis_baseline() -> Iterator[LockerSpec | str]:
    """Yield a RedisLocker spec on a throwaway redis-server, or a skip reason."""
    server = shutil.which("redis-server")
    if server is None:
        yield "skipped: redis-server not found"
        return
    try:
        import redis  # noqa: F401
    except ImportError:
        yield "skipped: redis-py not importable (.venv/bin/pip install redis to enable)"
        return
    root = Path(tempfile.mkdtemp(prefix="lockd-bench-redis-", dir="/tmp"))
    sock = root / "redis.sock"
    proc: subprocess.Popen[bytes] | None = None
    try:
        with (root / "log").open("wb") as log:
            proc = subprocess.Popen(
                [
                    *(server, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"),
                    *("--save", "", "--appendonly", "no", "--dir", str(root)),
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 15
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                yield f"skipped: redis-server did not start (see {root / 'log'})"
                return
            time.sleep(0.02)
        yield LockerSpec("redis", RedisLocker, (str(sock),))
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)
