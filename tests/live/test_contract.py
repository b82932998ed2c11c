"""Contracts written down in more than one place must agree.

Where a copy cannot be avoided (``lockd_client`` is a separate,
standard-library-only distribution; README is prose), these tests fail as
soon as the copies drift apart.
"""

from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path

import click
import pytest
from lockd_client import LockClient, _wire
from lockd_client import default_socket_path as client_default_socket

import lockd
from lockd import contract, metrics
from lockd.cli.common import TTL, WAIT
from lockd.config import user_socket_path
from lockd.daemon.protocol import ProtocolError, parse_request
from lockd.exitcodes import ERROR_STATUS, EXIT_CODE_MEANINGS
from lockd.testing.daemon import DaemonProcess

pytestmark = pytest.mark.both_backends

README = Path(__file__).resolve().parents[2] / "README.md"


def test_client_limits_are_the_daemons() -> None:
    assert _wire.MAX_MS == contract.MAX_TTL_MS == contract.MAX_TIMEOUT_MS
    assert _wire.MAX_KEY_BYTES == contract.MAX_KEY_BYTES
    assert _wire.MAX_OWNER_CHARS == contract.MAX_OWNER_CHARS
    assert _wire.MAX_REASON_CHARS == contract.MAX_REASON_CHARS


def _daemon_takes(ttl_ms: int, timeout_ms: int) -> bool:
    line = f'{{"id":1,"op":"acquire","key":"k","ttlMs":{ttl_ms},"timeoutMs":{timeout_ms}}}'
    try:
        parse_request(line)
    except ProtocolError:
        return False
    return True


def _cli_takes(param: click.ParamType, text: str) -> bool:
    try:
        param.convert(text, None, None)
    except click.BadParameter:
        return False
    return True


def _client_takes(seconds: float, *, allow_zero: bool) -> bool:
    try:
        _wire.seconds_to_ms(seconds, "ttl", allow_zero=allow_zero)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    ("cli_text", "seconds", "ms"),
    [("1ms", 0.001, 1), ("24h", 86_400, 86_400_000), ("86400001ms", 86_400.001, 86_400_001)],
)
def test_durations_have_one_range_in_cli_client_and_daemon(
    cli_text: str, seconds: float, ms: int
) -> None:
    """A duration the command line takes, the client and the daemon take too, and back."""
    daemon_ttl, daemon_wait = _daemon_takes(ms, 0), _daemon_takes(1, ms)
    assert _cli_takes(TTL, cli_text) == _client_takes(seconds, allow_zero=False) == daemon_ttl
    assert _cli_takes(WAIT, cli_text) == _client_takes(seconds, allow_zero=True) == daemon_wait


def test_cli_durations_reach_the_daemon_unchanged() -> None:
    for text, ms in (("1.5s", 1500), ("0.0004s", 1), ("2m", 120_000), ("250", 250)):
        assert TTL.convert(text, None, None) == ms
        assert parse_request(f'{{"id":1,"op":"tryAcquire","key":"k","ttlMs":{ms}}}').ttl_ms == ms  # type: ignore[attr-defined]


def test_default_socket_of_client_and_daemon_agree(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LOCKD_SOCKET", raising=False)
    xdg = tempfile.mkdtemp(dir=tmp_path)  # 0700 and ours, as platformdirs wants it
    monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    assert client_default_socket() == str(user_socket_path())
    assert LockClient().socket_path == str(user_socket_path())
    # Without XDG_RUNTIME_DIR both fall back the same way (/run/user/<uid> or a temp folder).
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        daemon_default = str(user_socket_path())
    assert client_default_socket() == daemon_default


def test_wire_error_statuses_are_the_cli_error_statuses() -> None:
    assert contract.ERROR_STATUS.items() <= ERROR_STATUS.items()


def _readme_exit_codes() -> dict[int, str]:
    text = README.read_text()
    table = text[text.index("### Exit codes") :].split("\n\n###", 1)[0]
    return {
        int(m.group(1)): m.group(2).strip()
        for m in re.finditer(r"^\| (\d+) \| (.+?) \|$", table, re.MULTILINE)
    }


def test_readme_exit_codes_say_what_the_help_says() -> None:
    readme = _readme_exit_codes()
    assert sorted(readme) == [code for code, _ in EXIT_CODE_MEANINGS]
    for code, meaning in EXIT_CODE_MEANINGS:
        assert readme[code].startswith(meaning), (code, readme[code], meaning)


def test_stats_names_are_the_documented_ones(daemon: DaemonProcess) -> None:
    with LockClient(str(daemon.socket)) as client:
        snapshot = client.stats()
    counters = snapshot.pop("counters")
    snapshot.pop("latency")
    assert list(counters) == list(metrics.COUNTERS)
    assert set(snapshot) == set(metrics.GAUGES)


def test_every_counter_the_daemon_counts_is_documented() -> None:
    counted = {
        m.group(1)
        for path in (Path(lockd.__file__).parent / "daemon").rglob("*.py")
        for m in re.finditer(r"""\.count\(\s*["']([A-Za-z]+)["']""", path.read_text())
    }
    assert counted, "no stats.count() calls found"
    assert counted <= set(metrics.COUNTERS)
