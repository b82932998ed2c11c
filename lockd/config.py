"""Where lockd keeps things, and the strictly validated ``lockd.toml``.

Two layers: :class:`Paths` (socket, database, config folder) come from flags,
``LOCKD_SOCKET`` and platformdirs; :class:`Settings` come from the optional
``<config>/lockd.toml``. Unknown keys and wrong types are errors naming the key:
a typo in a config file must never be silently ignored.
"""

from __future__ import annotations

import os
import tomllib
import warnings
from dataclasses import dataclass, fields
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
    #: CPU milliseconds one rule evaluation may use; over it the request is denied.
    rule_budget_ms: int = 50
    #: log level: debug, info, warning or error.
    log_level: str = "info"
    #: SQLite ``synchronous`` setting: NORMAL (survives a daemon crash) or FULL.
    sqlite_synchronous: str = "NORMAL"

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "lockd.toml") -> Settings:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"{source}: unknown key {key!r}")
            default = known[key].default
            if isinstance(default, tuple):
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(f"{source}: {key!r} must be a list of strings")
                values[key] = tuple(value)
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"{source}: {key!r} must be an integer")
                if value < 1:
                    raise ConfigError(f"{source}: {key!r} must be at least 1")
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
        raise ConfigError(f"{path}: {exc}") from exc
    return Settings.from_mapping(data, source=str(path))
