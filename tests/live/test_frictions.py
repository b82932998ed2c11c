"""Small frictions of issue 24 (docs/contract.md §12 "Durations and defaults"): compound
durations, 60 s TTL by default, waits without limit, ``--socket`` anywhere,
``--`` before a key starting with ``-``, invalid UTF-8 keys, the client's
lost-lease warning, the new error classes, key=value etcd logs and the
configurable stats window."""

from __future__ import annotations

import ast
import inspect
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import lockd_client._client
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from lockd_client import (
    DEFAULT_TTL,
    BackendUnavailableError,
    DeadlockError,
    Handle,
    LockClient,
    LockTimeoutError,
)
from lockd_client._ahold import _lose as async_lose
from lockd_client._errors import error_from_reply
from lockd_client._lock import AutoRenewer
from lockd_client.aio import AsyncLockClient

from lockd.cli import main
from lockd.cli.common import WAIT, failure_for, parse_duration_ms
from lockd.config import ConfigError, Settings
from lockd.contract import MAX_TIMEOUT_MS, WAIT_FOREVER
from lockd.daemon.stats import StatsRecorder
from lockd.exitcodes import EXIT_DEADLOCK, exit_code_for
from lockd.testing.daemon import LOCKD, DaemonProcess

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """One daemon for the module (conftest's ``lockd``): each test uses keys of its own."""
    return lockd


REPO = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("1m30s", 90_000),
        ("1h5m", 3_900_000),
        ("250ms", 250),
        ("2s250ms", 2_250),
        ("1.5s", 1_500),
        ("60000", 60_000),  # a bare number stays milliseconds (docs/contract.md §9)
        ("1h0m0s", 3_600_000),
    ],
)
def test_compound_durations(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["5m1h", "1m1m", "30s1m", "1m 30s", "m", "", "1x", "1ms5s"])
def test_durations_out_of_order_or_garbled_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration_ms(text)


@given(st.integers(0, 23), st.integers(0, 59), st.integers(0, 59), st.integers(0, 999))
def test_compound_durations_add_up(h: int, m: int, s: int, ms: int) -> None:
    text = f"{h}h{m}m{s}s{ms}ms"
    assert parse_duration_ms(text) == ((h * 60 + m) * 60 + s) * 1000 + ms


def test_wait_forever_is_its_own_value() -> None:
    assert WAIT.convert("forever", None, None) == WAIT_FOREVER
    assert WAIT.convert("1m30s", None, None) == 90_000


# --------------------------------------------------------------------- defaults


def test_python_defaults_are_60s_and_no_limit() -> None:
    for method in (
        LockClient.acquire,
        LockClient.try_acquire,
        LockClient.lock,
        AsyncLockClient.acquire,
        AsyncLockClient.try_acquire,
        AsyncLockClient.lock,
    ):
        params = inspect.signature(method).parameters
        assert params["ttl"].default == DEFAULT_TTL == 60.0, method
        if "timeout" in params:
            assert params["timeout"].default is None, method


def test_acquire_without_timeout_sends_the_longest_wait_and_parks_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = LockClient("/nowhere")
    sent: list[dict[str, Any]] = []

    def fake_call(_client: Any, op: str, args: dict[str, Any], *rest: Any, **kw: Any) -> Any:
        sent.append(args)
        if len(sent) < 3:
            raise LockTimeoutError("timed out", code="LOCK_TIMEOUT", details={"key": "k"})
        return {
            "key": "k",
            "handle": "h" * 22,
            "fence": 7,
            "owner": None,
            "ttlMs": 60_000,
            "leaseExpiresAt": "2026-12-03T10:00:00.000Z",
        }

    monkeypatch.setattr(lockd_client._client, "_call", fake_call)  # the client's request loop
    handle = client.acquire("k")
    assert handle.fence == 7
    assert [a["timeoutMs"] for a in sent] == [MAX_TIMEOUT_MS] * 3
    assert all(a["ttlMs"] == 60_000 for a in sent)


def test_cli_acquire_defaults_to_60s(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKD_SOCKET", "/nowhere")  # restored after the test
    # --socket before the subcommand (it becomes LOCKD_SOCKET for the command).
    result = CliRunner().invoke(
        main, ["--socket", str(daemon.socket), "locks", "acquire", "dflt", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert '"ttlMs":60000' in result.stdout
    status = CliRunner().invoke(main, ["--socket", str(daemon.socket), "locks", "status", "dflt"])
    assert status.exit_code == 0 and "Held:" in status.stdout and "yes" in status.stdout
    # ... and after it, as before.
    again = CliRunner().invoke(main, ["locks", "status", "dflt", "--socket", str(daemon.socket)])
    assert again.exit_code == 0


# --------------------------------------------------------------------- lockd run and keys


def test_run_takes_a_key_starting_with_a_dash_after_double_dash(daemon: DaemonProcess) -> None:
    out = subprocess.run(
        [*LOCKD, "run", "--ttl", "5s", "--", "-dash", "--", "sh", "-c", 'echo "$LOCKD_KEY"'],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "-dash\n"
    # With KEY before the first '--', a later '--' belongs to COMMAND.
    out = subprocess.run(
        [*LOCKD, "run", "k", "--", "echo", "--", "x"],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "-- x\n"


@pytest.mark.sqlite_only("a usage error: the CLI refuses it before anything reaches the daemon")
@pytest.mark.parametrize("command", [["locks", "status"], ["locks", "acquire"], ["run"]])
def test_an_invalid_utf8_key_is_a_usage_error(daemon: DaemonProcess, command: list[str]) -> None:
    args = [*(a.encode() for a in [*LOCKD, *command]), b"bad\xffkey"]
    if command == ["run"]:
        args += [b"--", b"true"]
    out = subprocess.run(args, env=daemon.env, capture_output=True, timeout=60)
    assert out.returncode == 2
    err = out.stderr.decode("utf-8", "replace")
    assert err.count("\n") == 1 and "not valid UTF-8" in err and "Traceback" not in err


# --------------------------------------------------------------------- the client


def _handle() -> Handle:
    return Handle.from_result(
        {
            "key": "k",
            "handle": "h" * 22,
            "fence": 1,
            "owner": None,
            "ttlMs": 1000,
            "leaseExpiresAt": "2026-12-03T10:00:00.000Z",
        }
    )


def test_lost_lease_warns_only_without_on_lost(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Handle] = []
    caplog.set_level(logging.WARNING, logger="lockd_client")
    renewer = AutoRenewer(LockClient("/nowhere"), _handle(), 1000, seen.append, expires_at=0.0)
    renewer._lose("renew answered lease_lost")
    assert len(seen) == 1 and not caplog.records
    async_lose(_handle(), seen.append, [], "lease_lost")
    assert len(seen) == 2 and not caplog.records
    quiet = AutoRenewer(LockClient("/nowhere"), _handle(), 1000, None, expires_at=0.0)
    quiet._lose("renew answered lease_lost")
    async_lose(_handle(), None, [], "lease_lost")
    assert [r.getMessage().startswith("lockd: lease on 'k' lost") for r in caplog.records] == [
        True,
        True,
    ]


def test_new_error_classes_and_the_deadlock_exit_code() -> None:
    backend = error_from_reply({"code": "BACKEND_UNAVAILABLE", "status": 503, "message": "etcd"})
    assert isinstance(backend, BackendUnavailableError) and backend.status == 503
    deadlock = error_from_reply(
        {
            "code": "DEADLOCK",
            "status": 409,
            "message": "cycle",
            "details": {"cycle": ["k1", "k2"]},
        }
    )
    assert isinstance(deadlock, DeadlockError) and deadlock.cycle == ["k1", "k2"]
    assert exit_code_for(deadlock) == EXIT_DEADLOCK == 7
    failure = failure_for(deadlock)
    assert failure.exit_code == 7 and failure.code == "DEADLOCK"


# --------------------------------------------------------------------- daemon side


def test_etcd_log_lines_are_key_value() -> None:
    """Every log call of the etcd backend formats its message with ``kv(...)``."""
    folder = REPO / "lockd" / "daemon" / "backends" / "etcd"
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "log"
                and node.func.attr in {"debug", "info", "warning", "error", "exception"}
            ):
                first = node.args[0]
                assert (
                    isinstance(first, ast.Call)
                    and isinstance(first.func, ast.Name)
                    and first.func.id == "kv"
                ), f"{path.name}:{node.lineno} logs a message that is not key=value"


def test_stats_window_is_configurable() -> None:
    assert Settings.from_mapping({"stats_window": 16}).stats_window == 16
    with pytest.raises(ConfigError, match="stats_window"):
        Settings.from_mapping({"stats_window": 8})
    stats = StatsRecorder(window=16)
    for ms in range(100):
        stats.observe("status", float(ms))
    summary = stats.snapshot({})["latency"]["status"]
    assert summary["count"] == 100
    assert summary["maxMs"] == 99 and summary["p50Ms"] >= 84  # only the last 16 samples


def test_readme_cron_example_sets_path_and_socket() -> None:
    text = (REPO / "README.md").read_text()
    (block,) = re.findall(r"```cron\n(.*?)```", text, re.S)
    lines = block.splitlines()
    assert any(re.fullmatch(r"PATH=.*/usr/local/bin.*", line) for line in lines)
    assert any(line.startswith("LOCKD_SOCKET=/") for line in lines)
    assert os.path.basename(lines[-1].split(" -- ")[0].split()[5]) == "lockd"
