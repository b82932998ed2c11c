"""A real ``lockd serve`` subprocess on a temporary socket, database and config.

:class:`DaemonProcess` is what the live tests (through the fixtures in
``tests/conftest.py``) and the benchmarks that need a daemon of this checkout
(``bench/abuse.py``, ``bench/rule_cost.py``) start. Paths should live under a
short folder: AF_UNIX paths are limited to 107 bytes.

No process may outlive a test session. Every process started here carries
``LOCKD_TEST_SESSION=<token>`` in its environment (set in ``os.environ`` when
this module is imported, so children inherit it, and added explicitly by
:meth:`DaemonProcess.start`); :func:`session_processes` finds the live ones by
looking for the token in ``/proc/*/environ``. Other sessions running on the
same machine at the same time have other tokens and are left alone.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lockd.testing.etcd_cluster import EtcdBackend
from lockd.testing.polling import wait_for

LOCKD = [sys.executable, "-m", "lockd"]

#: Marks every process this test session starts (see the module docstring).
SESSION_ENV = "LOCKD_TEST_SESSION"
SESSION_TOKEN = os.environ.setdefault(SESSION_ENV, secrets.token_hex(8))


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
        """Until the socket accepts a connection; RuntimeError if lockd exits or never does."""
        try:
            wait_for(self.accepts, timeout, "lockd's socket accepting", interval=0.02)
        except TimeoutError:
            raise RuntimeError(f"lockd did not come up:\n{self.read_log()}") from None

    def accepts(self) -> bool:
        """The socket takes a connection now; RuntimeError once the process has exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"lockd exited with {self.proc.returncode}:\n{self.read_log()}")
        try:
            with socket.socket(socket.AF_UNIX) as probe:
                probe.connect(str(self.socket))
        except OSError:
            return False
        return True

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


@contextlib.contextmanager
def temporary_daemon(
    config: str | None = None,
    rules: str | None = None,
    *,
    rules_file: str = "policy.toml",
    etcd: EtcdBackend | None = None,
    prefix: str = "lockd-",
) -> Iterator[DaemonProcess]:
    """A running daemon in a fresh short folder under /tmp; stopped and removed after.

    ``config`` is its ``lockd.toml`` (top-level keys), ``rules`` a rule set
    written as ``rule-sets/<rules_file>`` before it starts.
    """
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    daemon = DaemonProcess.in_folder(root, etcd)
    try:
        if config is not None:
            daemon.write_config(config)
        if rules is not None:
            daemon.write_rules(rules_file, rules)
        yield daemon.start()
    finally:
        daemon.terminate()
        shutil.rmtree(root, ignore_errors=True)


def session_processes(token: str = SESSION_TOKEN) -> dict[int, str]:
    """Live processes (pid -> command line) started with this session's token.

    The process that imported this module is not one: its token was set after
    exec, so its ``/proc/PID/environ`` does not show it.
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
