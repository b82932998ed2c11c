"""``lockd.toml`` and the daemon's paths (docs/contract.md §7): strict, named errors, defaults.

The key lists are derived from :class:`Settings` itself, so a key added
later is type-checked here without editing this file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from lockd.config import (
    SOCKET_ENV,
    SYSTEM_CONFIG_DIR,
    SYSTEM_SOCKET,
    SYSTEM_STATE_DIR,
    BackendSettings,
    ConfigError,
    Settings,
    load_settings,
    resolve_paths,
)

FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
LIST_KEYS = sorted(n for n, f in FIELDS.items() if isinstance(f.default, tuple))
INT_KEYS = sorted(n for n, f in FIELDS.items() if type(f.default) is int)
STR_KEYS = sorted(n for n, f in FIELDS.items() if isinstance(f.default, str))

#: A valid value for each key, to check the happy path and round trips.
GOOD: dict[str, Any] = {
    "service_units": ["backup.service", "cron.service"],
    "service_users": ["deploy"],
    "admin_groups": ["wheel", "ops"],
    "acquire_per_hour": 50,
    "max_connections": 10,
    "max_line_bytes": 4096,
    "max_pending_per_connection": 3,
    "max_connections_per_uid": 8,
    "partial_line_timeout_ms": 5000,
    "max_buffered_bytes": 1048576,
    "rule_budget_ms": 20,
    "rule_cpu_ms_per_second": 50,
    "max_pending_per_user": 100,
    "busy_poll_us": 0,
    "break_grace": 2.5,
    "stats_window": 4096,
    "log_level": "debug",
    "sqlite_synchronous": "FULL",
}


def write(folder: Path, text: str | bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "lockd.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def refused(tmp_path: Path, text: str | bytes) -> str:
    write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "lockd.toml") in message, "the error must name the file"
    return message


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def test_every_key_is_known_here() -> None:
    # ``backend`` is a table of its own, tested below.
    assert set(GOOD) | {"backend"} == set(FIELDS), "add the new key to GOOD (and the README)"


def test_defaults() -> None:
    s = Settings()
    assert s.service_units == () and s.service_users == ()
    assert s.admin_groups == ("lockd-admin",)
    assert s.acquire_per_hour == 600
    assert s.max_line_bytes == 65536
    assert s.max_connections >= 1
    assert s.max_pending_per_connection >= 1
    assert s.log_level == "info" and s.sqlite_synchronous == "NORMAL"
    assert s.busy_poll_us == 200


def test_missing_or_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load_settings(tmp_path / "absent") == Settings()
    write(tmp_path, "# nothing set\n")
    assert load_settings(tmp_path) == Settings()


def test_every_key_round_trips(tmp_path: Path) -> None:
    write(tmp_path, "".join(f"{k} = {toml_value(v)}\n" for k, v in GOOD.items()))
    settings = load_settings(tmp_path)
    for key, value in GOOD.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(settings, key) == expected, key


@pytest.mark.parametrize("key", ["colour", "ttl", "max_line_byte", "Log_level", "rules"])
def test_unknown_key_is_named(tmp_path: Path, key: str) -> None:
    assert repr(key) in refused(tmp_path, f'{key} = "x"\n')


def test_a_table_is_an_unknown_key(tmp_path: Path) -> None:
    assert "'limits'" in refused(tmp_path, "[limits]\nmax_connections = 5\n")


@pytest.mark.parametrize("key", LIST_KEYS)
@pytest.mark.parametrize("value", ['"wheel"', "[1, 2]", '["a", 3]', "5", "true", "{a = 1}"])
def test_list_keys_need_a_list_of_strings(tmp_path: Path, key: str, value: str) -> None:
    message = refused(tmp_path, f"{key} = {value}\n")
    assert repr(key) in message and "list of strings" in message


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", ["true", "1.5", "10.0", '"10"', "[10]"])
def test_int_keys_need_an_integer(tmp_path: Path, key: str, value: str) -> None:
    message = refused(tmp_path, f"{key} = {value}\n")
    assert repr(key) in message and "integer" in message


#: integer keys whose 0 turns something off.
ZERO_OK = {"busy_poll_us"}


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", ["0", "-1"])
def test_int_keys_must_be_positive(tmp_path: Path, key: str, value: str) -> None:
    if key in ZERO_OK and value == "0":
        write(tmp_path, f"{key} = 0\n")
        assert getattr(load_settings(tmp_path), key) == 0
        return
    message = refused(tmp_path, f"{key} = {value}\n")
    assert repr(key) in message and f"at least {0 if key in ZERO_OK else 1}" in message


@pytest.mark.parametrize("key", STR_KEYS)
@pytest.mark.parametrize("value", ["1", "true", '["info"]'])
def test_string_keys_need_a_string(tmp_path: Path, key: str, value: str) -> None:
    message = refused(tmp_path, f"{key} = {value}\n")
    assert repr(key) in message and "string" in message


@pytest.mark.parametrize(("key", "value"), [("log_level", "loud"), ("sqlite_synchronous", "OFF")])
def test_string_keys_have_a_closed_set_of_values(tmp_path: Path, key: str, value: str) -> None:
    assert repr(key) in refused(tmp_path, f'{key} = "{value}"\n')


@pytest.mark.parametrize(
    ("key", "value"), [("log_level", "WARNING"), ("sqlite_synchronous", "full")]
)
def test_string_values_ignore_case(tmp_path: Path, key: str, value: str) -> None:
    write(tmp_path, f'{key} = "{value}"\n')
    assert getattr(load_settings(tmp_path), key) == value


@pytest.mark.parametrize(
    ("key", "value", "ok"),
    [
        ("max_line_bytes", 1023, False),
        ("max_line_bytes", 1024, True),
        ("max_line_bytes", 2**24, True),
        ("max_line_bytes", 2**24 + 1, False),
        ("busy_poll_us", 0, True),
        ("busy_poll_us", 1000, True),
        ("busy_poll_us", 1001, False),
    ],
)
def test_bounded_int_keys(tmp_path: Path, key: str, value: int, ok: bool) -> None:
    text = f"{key} = {value}\n"
    if ok:
        write(tmp_path, text)
        assert getattr(load_settings(tmp_path), key) == value
    else:
        assert f"{key!r} must be" in refused(tmp_path, text)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("0", True),
        ("5", True),
        ("0.25", True),
        ("600", True),
        ("600.5", False),
        ("-1", False),
        ('"5s"', False),
        ("true", False),
        ("nan", False),
        ("inf", False),
    ],
)
def test_break_grace_is_bounded_seconds(tmp_path: Path, value: str, ok: bool) -> None:
    text = f"break_grace = {value}\n"
    if ok:
        write(tmp_path, text)
        assert load_settings(tmp_path).break_grace == float(value)
    else:
        assert "'break_grace' must be" in refused(tmp_path, text)


def test_break_grace_defaults_to_five_seconds() -> None:
    assert Settings().break_grace == 5.0


def test_bad_toml_and_bad_encoding_name_the_file(tmp_path: Path) -> None:
    refused(tmp_path, "max_connections = \n")
    refused(tmp_path, 'admin_groups = ["a",\n')
    refused(tmp_path, b'log_level = "\xff"\n')


def test_from_mapping_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"^here: unknown key 'x'$"):
        Settings.from_mapping({"x": 1}, source="here")


# ------------------------------------------------------------------ [backend]


def test_the_backend_is_sqlite_by_default(tmp_path: Path) -> None:
    backend = Settings().backend
    assert backend.kind == "sqlite" and backend.prefix == "/lockd/"
    assert backend.etcd_timeout == 5.0 and backend.session_ttl == 5
    assert backend.node_name  # the hostname
    write(tmp_path, "[backend]\n")
    assert load_settings(tmp_path).backend == BackendSettings()


def test_every_backend_key_is_read(tmp_path: Path) -> None:
    write(
        tmp_path,
        """
[backend]
kind = "etcd"
endpoints = ["https://10.0.0.5:2379", "http://etcd-2:2379/"]
prefix = "/locks/"
node = "web-3"
etcd_timeout = 2.5
session_ttl = 10
ca_file = "/etc/lockd/ca.pem"
cert_file = "client.pem"
key_file = "client.key"
username = "lockd"
password_file = "etcd.password"
""",
    )
    backend = load_settings(tmp_path).backend
    assert backend.kind == "etcd" and backend.node_name == "web-3"
    assert backend.endpoints == ("https://10.0.0.5:2379", "http://etcd-2:2379/")
    assert (backend.prefix, backend.etcd_timeout, backend.session_ttl) == ("/locks/", 2.5, 10)
    assert backend.ca_file == Path("/etc/lockd/ca.pem")
    # Relative file names are read from the config folder.
    assert backend.cert_file == tmp_path / "client.pem"
    assert backend.key_file == tmp_path / "client.key"
    assert backend.password_file == tmp_path / "etcd.password"
    assert backend.username == "lockd"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('backend = "etcd"', "'backend'"),
        ('[backend]\nkind = "redis"', "'backend.kind'"),
        ('[backend]\nkind = "etcd"', "'backend.endpoints'"),
        ('[backend]\nendpoints = "http://a:1"', "'backend.endpoints'"),
        ('[backend]\nendpoints = ["a:2379"]', "'backend.endpoints'"),
        ('[backend]\nendpoints = ["ftp://a:2379"]', "'backend.endpoints'"),
        ("[backend]\netcd_timeout = 0", "'backend.etcd_timeout'"),
        ("[backend]\netcd_timeout = true", "'backend.etcd_timeout'"),
        ('[backend]\netcd_timeout = "5"', "'backend.etcd_timeout'"),
        ("[backend]\nsession_ttl = 1", "'backend.session_ttl'"),
        ("[backend]\nsession_ttl = 11", "'backend.session_ttl'"),
        ("[backend]\nsession_ttl = 5.0", "'backend.session_ttl'"),
        ('[backend]\nnode = "web 3"', "'backend.node'"),
        ('[backend]\nnode = "-x"', "'backend.node'"),
        ("[backend]\nnode = 3", "'backend.node'"),
        ('[backend]\nprefix = ""', "'backend.prefix'"),
        ('[backend]\ncert_file = "c.pem"', "'backend.cert_file'"),
        ('[backend]\nusername = "u"', "'backend.username'"),
        ('[backend]\nendpoint = ["http://a:1"]', "'backend.endpoint'"),
    ],
)
def test_bad_backend_settings_are_named(tmp_path: Path, text: str, named: str) -> None:
    assert named in refused(tmp_path, text + "\n")


def test_the_etcd_flag_makes_the_backend_etcd() -> None:
    configured = BackendSettings(node="n1", etcd_timeout=2.0)
    backend = configured.with_etcd(("http://127.0.0.1:2379",))
    assert backend.kind == "etcd" and backend.endpoints == ("http://127.0.0.1:2379",)
    assert backend.node == "n1" and backend.etcd_timeout == 2.0
    with pytest.raises(ConfigError, match="--etcd"):
        configured.with_etcd(("127.0.0.1:2379",))


# ------------------------------------------------------------------ paths


@pytest.fixture(autouse=True)
def _runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Defaults are computed even when flags win; keep platformdirs from warning."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))


def test_flags_win(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "env.sock"))
    paths = resolve_paths(socket=tmp_path / "s", db=tmp_path / "d", config=tmp_path / "c")
    assert (paths.socket, paths.db, paths.config_dir) == (
        tmp_path / "s",
        tmp_path / "d",
        tmp_path / "c",
    )
    assert paths.config_file == tmp_path / "c" / "lockd.toml"
    assert paths.rule_sets_dir == tmp_path / "c" / "rule-sets"


def test_lockd_socket_env_is_used_without_the_flag(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "env.sock"))
    assert resolve_paths().socket == tmp_path / "env.sock"
    assert resolve_paths(system=True).socket == tmp_path / "env.sock"
    monkeypatch.setenv(SOCKET_ENV, "")
    assert resolve_paths().socket != Path("")


def test_user_mode_defaults_follow_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    paths = resolve_paths()
    assert paths.socket == tmp_path / "run" / "lockd" / "lockd.sock"
    assert paths.db.parent == tmp_path / "state" / "lockd" and paths.db.name == "lockd.db"
    assert paths.config_dir == tmp_path / "config" / "lockd"
    assert paths.socket_mode == 0o600


def test_system_mode_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    paths = resolve_paths(system=True)
    assert paths.socket == SYSTEM_SOCKET == Path("/run/lockd/lockd.sock")
    assert paths.db == Path("/var/lib/lockd/lockd.db") == SYSTEM_STATE_DIR / "lockd.db"
    assert paths.config_dir == SYSTEM_CONFIG_DIR == Path("/etc/lockd")
    assert paths.socket_mode == 0o666
