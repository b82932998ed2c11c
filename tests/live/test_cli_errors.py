"""Errors a person can act on (issue 24): config mistakes, a second daemon,
``--json`` all or nothing, and every ``--help`` page.

A config mistake is one line on stderr naming the file and the fix, exit 2,
no traceback; a second ``lockd serve`` on a live socket names the daemon's
pid; ``locks list --json`` prints the whole document or nothing.
"""

from __future__ import annotations

import importlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from lockd.cli import main
from lockd.testing.daemon import LOCKD, DaemonProcess

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """One daemon for the module (conftest's ``lockd``): tests read it or use keys of their own."""
    return lockd


# --------------------------------------------------------------------- config mistakes


def _serve(root: Path, toml: str) -> subprocess.CompletedProcess[str]:
    config = root / "config"
    config.mkdir(exist_ok=True)
    (config / "lockd.toml").write_text(toml)
    return subprocess.run(
        [
            *LOCKD,
            "serve",
            "--socket",
            str(root / "s.sock"),
            "--db",
            str(root / "d.db"),
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


# ``lockd.cli.locks`` the attribute is the click group; the module is this.
LOCKS_MODULE = importlib.import_module("lockd.cli.locks")

ETCD = '[backend]\nkind = "etcd"\nendpoints = ["{scheme}://127.0.0.1:9"]\n'


@pytest.mark.parametrize(
    ("case", "extra", "named", "fix"),
    [
        ("missing ca_file", 'ca_file = "{root}/nope/ca.pem"\n', "'backend.ca_file'", "point it"),
        ("bad PEM", 'ca_file = "{root}/bad.pem"\n', "not a PEM certificate", "point it"),
        (
            "bad client certificate",
            'cert_file = "{root}/bad.pem"\nkey_file = "{root}/bad.pem"\n',
            "'backend.cert_file'",
            "point them",
        ),
        (
            "missing password_file",
            'username = "lockd"\npassword_file = "{root}/nope/password"\n',
            "'backend.password_file'",
            "point it",
        ),
        ("bad TOML", None, "not valid TOML", "fix that line"),
    ],
)
def test_a_config_mistake_is_one_line_naming_the_file_and_the_fix(
    short_tmp: Path, case: str, extra: str | None, named: str, fix: str
) -> None:
    (short_tmp / "bad.pem").write_text("this is not a certificate\n")
    scheme = "http" if "password" in case else "https"
    toml = "[backend\nkind = 'etcd'\n" if extra is None else ETCD.format(scheme=scheme) + extra
    result = _serve(short_tmp, toml.replace("{root}", str(short_tmp)))
    assert result.returncode == 2, (case, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, (case, result.stderr)
    (line,) = lines
    assert "Traceback" not in result.stderr
    assert line.startswith("lockd: cannot start: config: ")
    assert str(short_tmp / "config" / "lockd.toml") in line
    assert named in line and fix in line, line
    assert not (short_tmp / "s.sock").exists()


def test_a_second_serve_names_the_running_daemon(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    second = daemon.serve_once()
    assert second.returncode == 1
    assert second.stderr.splitlines() == [
        f"lockd: cannot start: a daemon is already running on {daemon.socket} "
        f"(pid {daemon.proc.pid})"
    ]


# --------------------------------------------------------------------- --json all or nothing


class _FailingClient:
    """A client whose ``list`` fails on page ``fail_on`` (1 = the first)."""

    def __init__(self, fail_on: int) -> None:
        self.fail_on = fail_on
        self.calls = 0

    def __enter__(self) -> _FailingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def list_page(self, prefix: str | None, limit: int, after: str | None) -> Any:
        from lockd_client import DaemonUnavailableError, LockStatus

        self.calls += 1
        if self.calls == self.fail_on:
            raise DaemonUnavailableError("/x", "connection lost")
        status = LockStatus.from_result({"key": f"k{self.calls}", "held": True, "waiters": 0})
        return [status], f"k{self.calls}"


@pytest.mark.parametrize("fail_on", [1, 2, 3])
def test_list_json_prints_the_whole_document_or_nothing(
    monkeypatch: pytest.MonkeyPatch, fail_on: int
) -> None:
    monkeypatch.setattr(LOCKS_MODULE, "open_client", lambda path: _FailingClient(fail_on))
    result = CliRunner().invoke(main, ["locks", "list", "--json"], prog_name="lockd")
    assert result.exit_code == 5
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and '"DAEMON_UNAVAILABLE"' in result.stderr


def test_list_json_whole_document(daemon: DaemonProcess) -> None:
    from lockd_client import LockClient

    with LockClient(str(daemon.socket)) as client:
        client.try_acquire("json:a", ttl=60)
        result = CliRunner().invoke(
            main, ["locks", "list", "--json", "--socket", str(daemon.socket)], prog_name="lockd"
        )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith('{"locks":[{') and result.stdout.endswith('"next":null}\n')


# --------------------------------------------------------------------- every --help page


def _commands(group: click.Group, path: list[str]) -> Iterator[list[str]]:
    yield path
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # lazy subcommands included
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from _commands(command, [*path, name])
        else:
            yield [*path, name]


ALL_COMMANDS = list(_commands(main, []))


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=lambda p: " ".join(p) or "lockd")
def test_every_help_page_renders(path: list[str]) -> None:
    result = CliRunner().invoke(main, [*path, "--help"], prog_name="lockd")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.startswith("Usage: lockd")
    description = text.split("\n\n", 1)[1].split("\nOptions:", 1)[0]
    for line in description.splitlines():
        # click indents paragraphs by 2 and \b blocks keep their own 4 more;
        # a docstring mangled by an escape (a real newline from "\n") shows
        # as lines at other depths or a dangling quote.
        indent = len(line) - len(line.lstrip(" "))
        assert line == "" or indent in (2, 4, 6, 8), (path, line)
        assert not re.fullmatch(r"\s*'.*", line), (path, line)
