"""Where lockd keeps things, and the strictly validated ``lockd.toml``.

Two layers: :class:`Paths` (socket, database, config folder) come from flags,
``LOCKD_SOCKET`` and platformdirs; :class:`Settings` come from the optional
``<config>/lockd.toml``. Unknown keys and wrong types are errors naming the key:
a typo in a config file must never be silently ignored.
"""

from __future__ import annotations

import math
import os
import re
import socket
import tomllib
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import platformdirs

APP = "lockd"
SYSTEM_SOCKET = Path("/run/lockd/lockd.sock")
SYSTEM_STATE_DIR = Path("/var/lib/lockd")
SYSTEM_CONFIG_DIR = Path("/etc/lockd")
SOCKET_ENV = "LOCKD_SOCKET"

# platformdirs warns when XDG_RUNTIME_DIR is unset and falls back to
# /tmp/runtime-<uid>; the client computes the same fallback, so it is noise.
warnings.filterwarnings("ignore", module="platformdirs")


class ConfigError(Exception):
    """The configuration is unusable; the message names the file and key."""


@dataclass(frozen=True)
class Paths:
    socket: Path
    db: Path
    config_dir: Path
    socket_mode: int

    @property
    def config_file(self) -> Path:
        return self.config_dir / "lockd.toml"

    @property
    def rule_sets_dir(self) -> Path:
        return self.config_dir / "rule-sets"


def user_socket_path() -> Path:
    """The user-mode default socket: ``$XDG_RUNTIME_DIR/lockd/lockd.sock``.

    Raises ConfigError when platformdirs refuses the fallback runtime folder
    (``/tmp/runtime-<uid>`` made by another user: a trap for the socket).
    """
    try:
        return Path(platformdirs.user_runtime_dir(APP)) / "lockd.sock"
    except PermissionError as exc:
        raise ConfigError(f"the socket folder is not safe: {exc}") from None


def resolve_paths(
    *,
    system: bool = False,
    socket: str | os.PathLike[str] | None = None,
    db: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | None = None,
) -> Paths:
    """Paths for ``lockd serve``: flags win, then ``LOCKD_SOCKET``, then defaults.

    Raises ConfigError when the default socket folder is not safe to use.
    """
    if socket is None and os.environ.get(SOCKET_ENV):
        socket = os.environ[SOCKET_ENV]
    if system:
        default_db = SYSTEM_STATE_DIR / "lockd.db"
        default_config = SYSTEM_CONFIG_DIR
        mode = 0o666
    else:
        default_db = Path(platformdirs.user_state_dir(APP)) / "lockd.db"
        default_config = Path(platformdirs.user_config_dir(APP))
        mode = 0o600
    # The user default only when needed: platformdirs may refuse its folder.
    socket_path = Path(socket) if socket else SYSTEM_SOCKET if system else user_socket_path()
    return Paths(
        socket=socket_path,
        db=Path(db) if db else default_db,
        config_dir=Path(config) if config else default_config,
        socket_mode=mode,
    )


BACKEND_KINDS = ("sqlite", "etcd")
#: A node name: what ``status`` shows as the host that granted a hold.
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_ENDPOINT = re.compile(r"https?://[^/\s]+/?")


@dataclass(frozen=True)
class BackendSettings:
    """The ``[backend]`` table: where the lock state lives (docs/contract.md §11).

    ``kind = "sqlite"`` (the default) keeps it in the local database; with
    ``"etcd"`` it lives in the etcd cluster at ``endpoints`` and nothing of
    it is written locally. Relative file names are read from the config folder.
    """

    kind: str = "sqlite"
    endpoints: tuple[str, ...] = ()
    #: every etcd key lockd writes starts with it.
    prefix: str = "/lockd/"
    #: this host's name in status; empty: the hostname.
    node: str = ""
    #: seconds one etcd request may take, failover included, before BACKEND_UNAVAILABLE.
    etcd_timeout: float = 5.0
    #: seconds of the daemon's etcd session lease (its waiters and releaseOnClose holds).
    session_ttl: int = 5
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None

    @property
    def node_name(self) -> str:
        return self.node or socket.gethostname()

    def with_etcd(self, endpoints: tuple[str, ...]) -> BackendSettings:
        """``lockd serve --etcd URL,...``: kind etcd at those endpoints, the rest as configured."""
        for url in endpoints:
            _check_endpoint(url, "--etcd")
        return replace(self, kind="etcd", endpoints=endpoints)

    @classmethod
    def from_mapping(
        cls, data: object, source: str = "lockd.toml", base: Path | None = None
    ) -> BackendSettings:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: 'backend' must be a table ([backend])")
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            name = f"backend.{key}"
            if key not in known:
                raise ConfigError(f"{source}: unknown key {name!r}")
            if key == "endpoints":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(f"{source}: {name!r} must be a list of strings")
                for url in value:
                    _check_endpoint(url, f"{source}: {name!r}")
                values[key] = tuple(value)
            elif key == "etcd_timeout":
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ConfigError(f"{source}: {name!r} must be a number of seconds")
                if not (math.isfinite(value) and 0 < value <= 300):
                    raise ConfigError(f"{source}: {name!r} must be above 0 and at most 300")
                values[key] = float(value)
            elif key == "session_ttl":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"{source}: {name!r} must be an integer")
                if not 2 <= value <= 10:
                    raise ConfigError(f"{source}: {name!r} must be 2 to 10 seconds")
                values[key] = value
            else:
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{source}: {name!r} must be a non-empty string")
                if key.endswith("_file"):
                    path = Path(value)
                    values[key] = (
                        base / path if base is not None and not path.is_absolute() else path
                    )
                else:
                    values[key] = value
        settings = cls(**values)
        settings._check(source)
        return settings

    def _check(self, source: str) -> None:
        if self.kind not in BACKEND_KINDS:
            raise ConfigError(f'{source}: \'backend.kind\' must be "sqlite" or "etcd"')
        if self.kind == "etcd" and not self.endpoints:
            raise ConfigError(f"{source}: 'backend.endpoints' must list etcd URLs for kind etcd")
        if self.node and not _NODE_NAME.fullmatch(self.node):
            raise ConfigError(
                f"{source}: 'backend.node' must be letters, digits, '.', '_' or '-' "
                "(at most 253, starting with a letter or digit)"
            )
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError(f"{source}: 'backend.cert_file' and 'backend.key_file' go together")
        if (self.username is None) != (self.password_file is None):
            raise ConfigError(
                f"{source}: 'backend.username' and 'backend.password_file' go together"
            )

    def check_files(self, source: str) -> None:
        """The etcd TLS and password files can be read and used, or ConfigError.

        Checked at start-up, before anything else opens, so that a wrong path
        or a bad PEM is one line naming the key, the file and what to do, not
        a traceback from deep inside the etcd client.
        """
        needs = {
            "ca_file": "the PEM certificate of the CA that signed the etcd servers' certificates",
            "cert_file": "this host's client certificate (PEM) for etcd",
            "key_file": "the private key (PEM) of cert_file",
            "password_file": "a file holding the etcd password of 'username' on its first line",
        }
        for key, what in needs.items():
            path: Path | None = getattr(self, key)
            if path is None:
                continue
            try:
                with path.open("rb"):
                    pass
            except OSError as exc:
                reason = exc.strerror or str(exc)
                raise ConfigError(
                    f"{source}: 'backend.{key}' {path}: {reason}; "
                    f"point it at {what}, or remove the key"
                ) from None
        if not any(url.startswith("https:") for url in self.endpoints):
            return
        import ssl  # only for https endpoints

        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{source}: 'backend.ca_file' {self.ca_file}: not a PEM certificate "
                f"({exc.reason or exc}); point it at {needs['ca_file']}"
            ) from None
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except ssl.SSLError as exc:
                raise ConfigError(
                    f"{source}: 'backend.cert_file' {self.cert_file} with 'backend.key_file' "
                    f"{self.key_file}: not a PEM certificate and its private key "
                    f"({exc.reason or exc}); point them at {needs['cert_file']} and its key"
                ) from None


def _check_endpoint(url: str, where: str) -> None:
    if not _ENDPOINT.fullmatch(url):
        raise ConfigError(f"{where}: {url!r} is not an etcd URL (http://HOST:PORT or https://...)")


#: the longest ``break_grace``: a hung holder must not keep a broken key for long.
MAX_BREAK_GRACE = 600.0

#: integer keys for which 0 is a value (it turns the feature off).
_ZERO_TURNS_OFF = frozenset({"busy_poll_us"})


@dataclass(frozen=True)
class Settings:
    """Every key ``lockd.toml`` accepts, with its default (documented in README)."""

    #: systemd units whose processes act as services (``service:<unit>``).
    service_units: tuple[str, ...] = ()
    #: login names whose processes act as services (``service:<user>``).
    service_users: tuple[str, ...] = ()
    #: members of these Unix groups get the ``admin`` role.
    admin_groups: tuple[str, ...] = ("lockd-admin",)
    #: acquire attempts per member or admin per rolling hour.
    acquire_per_hour: int = 600
    #: simultaneous client connections; further ones are closed at once.
    max_connections: int = 1024
    #: simultaneous connections of one uid (root and the daemon's user: not counted).
    max_connections_per_uid: int = 64
    #: milliseconds a connection may sit on an incomplete request line.
    partial_line_timeout_ms: int = 10_000
    #: bytes of incomplete request lines held for all connections together.
    max_buffered_bytes: int = 16 * 1024 * 1024
    #: longest request line in bytes (newline not counted).
    max_line_bytes: int = 65536
    #: blocking acquires one connection may have waiting; more are refused.
    max_pending_per_connection: int = 1024
    #: blocking acquires one user (principal) may have waiting, all connections together.
    max_pending_per_user: int = 1024
    #: CPU milliseconds one rule evaluation may use; over it the request is denied.
    rule_budget_ms: int = 50
    #: CPU milliseconds per second each member's rule evaluations may use together.
    rule_cpu_ms_per_second: int = 100
    #: microseconds a connection's task polls for the next request before it
    #: parks in epoll (adaptive; 0 turns it off). See bench/README.md, "Busy-polling".
    busy_poll_us: int = 200
    #: seconds a ``break`` waits for a holder listening for events to say it
    #: stopped (``stopped``) before the key goes to the next holder (docs/contract.md §12).
    break_grace: float = 5.0
    #: latency samples ``stats`` keeps per op (its percentiles describe the last N requests).
    stats_window: int = 2048
    #: log level: debug, info, warning or error.
    log_level: str = "info"
    #: SQLite ``synchronous`` setting: NORMAL (survives a daemon crash) or FULL.
    sqlite_synchronous: str = "NORMAL"
    #: the ``[backend]`` table: SQLite (default) or etcd.
    backend: BackendSettings = field(default_factory=BackendSettings)

    @classmethod
    def from_mapping(
        cls, data: dict[str, Any], source: str = "lockd.toml", base: Path | None = None
    ) -> Settings:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"{source}: unknown key {key!r}")
            if key == "backend":
                values[key] = BackendSettings.from_mapping(value, source, base)
                continue
            default = known[key].default
            if isinstance(default, float):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ConfigError(f"{source}: {key!r} must be a number of seconds")
                values[key] = float(value)
            elif isinstance(default, tuple):
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(f"{source}: {key!r} must be a list of strings")
                values[key] = tuple(value)
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"{source}: {key!r} must be an integer")
                least = 0 if key in _ZERO_TURNS_OFF else 1
                if value < least:
                    raise ConfigError(f"{source}: {key!r} must be at least {least}")
                values[key] = value
            else:
                if not isinstance(value, str):
                    raise ConfigError(f"{source}: {key!r} must be a string")
                values[key] = value
        settings = cls(**values)
        settings._check(source)
        return settings

    def _check(self, source: str) -> None:
        if self.log_level.lower() not in {"debug", "info", "warning", "error"}:
            raise ConfigError(f"{source}: 'log_level' must be debug, info, warning or error")
        if self.sqlite_synchronous.upper() not in {"NORMAL", "FULL"}:
            raise ConfigError(f"{source}: 'sqlite_synchronous' must be NORMAL or FULL")
        if not 1024 <= self.max_line_bytes <= 16 * 1024 * 1024:
            raise ConfigError(f"{source}: 'max_line_bytes' must be between 1024 and 16777216")
        if not 0 <= self.break_grace <= MAX_BREAK_GRACE:
            raise ConfigError(
                f"{source}: 'break_grace' must be between 0 and {MAX_BREAK_GRACE:g} seconds"
            )
        if not 16 <= self.stats_window <= 1_000_000:
            raise ConfigError(f"{source}: 'stats_window' must be between 16 and 1000000")
        if self.busy_poll_us > 1000:
            raise ConfigError(f"{source}: 'busy_poll_us' must be at most 1000")
        if self.max_buffered_bytes < self.max_line_bytes:
            raise ConfigError(f"{source}: 'max_buffered_bytes' must be at least 'max_line_bytes'")


def load_settings(config_dir: Path) -> Settings:
    """Read ``<config_dir>/lockd.toml``; a missing file means all defaults."""
    path = config_dir / "lockd.toml"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Settings()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}; fix that line") from exc
    return Settings.from_mapping(data, source=str(path), base=config_dir)
