"""The ``lockd`` CLI against a real daemon: exit codes, output, errors (docs/contract.md §9).

Most tests drive the click commands in-process (CliRunner) against a real
``lockd serve``; a few run the real program in ``bash`` the way scripts use
it (``H=$(lockd locks acquire ...)``), and one runs as a throwaway Unix user
(root only) to see the daemon refuse a member.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result
from lockd_client import (
    DaemonUnavailableError,
    InternalError,
    InvalidRequestError,
    LockAccessDeniedError,
    LockdError,
    LockTimeoutError,
    RateLimitedError,
    ShuttingDownError,
)

from lockd.cli import main, render_metrics
from lockd.cli.common import (
    DEBUG_ENV,
    client_command,
    exit_code_for,
    parse_duration_ms,
    render_table,
)
from lockd.exitcodes import (
    EXIT_BUSY,
    EXIT_DENIED,
    EXIT_LOST,
    EXIT_RATE_LIMITED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from lockd.testing.daemon import DaemonProcess
from tests.conftest import Backend

pytestmark = pytest.mark.both_backends

HANDLE_RE = re.compile(r"^[A-Za-z0-9_-]{22,}$")


def invoke(args: list[str], **kwargs: object) -> Result:
    """``lockd ARGS`` in-process (named ``lockd``, as the console script is)."""
    return CliRunner().invoke(main, args, prog_name="lockd", **kwargs)  # type: ignore[arg-type]


def run_cli(
    daemon: DaemonProcess | None, *args: str, socket: str | None = None, **kwargs: object
) -> Result:
    """Invoke ``lockd ARGS --socket <daemon's socket>`` in-process."""
    path = socket if socket is not None else str(daemon.socket) if daemon else None
    extra = ["--socket", path] if path is not None else []
    return invoke([*args, *extra], **kwargs)


def one_line(text: str) -> str:
    """The single stderr line (fails if there are more, or a traceback)."""
    assert "Traceback" not in text
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got: {text!r}"
    return lines[0]


def acquire(daemon: DaemonProcess, key: str, *args: str) -> str:
    result = run_cli(daemon, "locks", "acquire", key, *args)
    assert result.exit_code == 0, result.stderr
    return result.stdout.strip()


# --------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("500ms", 500),
        ("60s", 60_000),
        ("5m", 300_000),
        ("1h", 3_600_000),
        ("60000", 60_000),
        ("1.5s", 1500),
        ("1.1s", 1100),
        (".5s", 500),
        ("0.4", 1),
        (" 2s ", 2000),
        ("0", 0),
    ],
)
def test_parse_duration(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "5x", "-1s", "1e3", "s", "1.5.2s", "60 s", "30m1h", "5M"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration_ms(text)


@pytest.mark.parametrize(
    "args",
    [
        ["locks", "acquire", "k", "--ttl", "5x"],
        ["locks", "acquire", "k", "--ttl", "0"],
        ["locks", "acquire", "k", "--ttl", "25h"],
        # no --ttl is fine now: 60 s (docs/contract.md §12)
        ["locks", "acquire", "k", "--wait", "5m1h"],
        ["locks", "acquire", "k", "--ttl", "1s", "--wait", "soon"],
        ["locks", "renew", "k", "--handle", "h", "--ttl", "-5s"],
        ["locks", "nope"],
        ["stats", "--format", "openmetrics", "--json"],
    ],
)
def test_usage_errors_exit_2_on_one_line(args: list[str]) -> None:
    # No daemon needed: the command line is refused before any connection.
    result = invoke([*args, "--socket", "/nonexistent/lockd.sock"])
    assert result.exit_code == EXIT_USAGE, result.output
    line = one_line(result.stderr)
    if "--json" in args:
        assert json.loads(line)["error"]["code"] == "USAGE"
    else:
        assert line.startswith("lockd ")
        assert result.stdout == ""
    # The same failure with --json: one JSON line, same exit code.
    as_json = invoke([*args, "--socket", "/nonexistent/lockd.sock", "--json"])
    assert as_json.exit_code == EXIT_USAGE and as_json.stdout == ""
    error = json.loads(one_line(as_json.stderr))["error"]
    assert (error["code"], error["status"]) == ("USAGE", 400) and error["message"]


def test_bad_duration_message_names_the_option_and_the_forms() -> None:
    result = invoke(["locks", "acquire", "k", "--ttl", "5x"])
    line = one_line(result.stderr)
    assert "--ttl" in line and "'5x' is not a duration" in line and "500ms" in line


def test_render_table_aligns_without_trailing_spaces() -> None:
    text = render_table(("KEY", "OWNER", "N"), [("a", None, 1), ("longer-key", "run-1", 22)])
    assert text.splitlines() == [
        "KEY         OWNER  N",
        "a           -      1",
        "longer-key  run-1  22",
    ]


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (LockTimeoutError("t", code="LOCK_TIMEOUT"), EXIT_BUSY),
        (InvalidRequestError("bad", code="INVALID_REQUEST"), EXIT_USAGE),
        (LockAccessDeniedError("no", code="LOCK_ACCESS_DENIED"), EXIT_DENIED),
        (RateLimitedError("slow", code="RATE_LIMITED"), EXIT_RATE_LIMITED),
        (DaemonUnavailableError("/x.sock", "down"), EXIT_UNAVAILABLE),
        (ShuttingDownError("bye", code="SHUTTING_DOWN"), EXIT_UNAVAILABLE),
        (InternalError("bug", code="INTERNAL"), EXIT_UNAVAILABLE),
        (LockdError("garbled", code="PROTOCOL_ERROR"), EXIT_UNAVAILABLE),
    ],
)
def test_exit_code_for_each_error(exc: LockdError, code: int) -> None:
    assert exit_code_for(exc) == code


@pytest.mark.parametrize(
    ("raised", "code", "text"),
    [
        (RuntimeError("oops\nsecond line"), 70, "a bug in lockd"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (ShuttingDownError("stopping", code="SHUTTING_DOWN"), EXIT_UNAVAILABLE, "shutting down"),
        (ValueError("key must be 1-1024 bytes"), EXIT_USAGE, "invalid argument"),
    ],
)
def test_client_command_turns_anything_into_one_line(
    raised: BaseException, code: int, text: str
) -> None:
    @click.command()
    @client_command
    def boom() -> None:
        raise raised

    result = CliRunner().invoke(boom, [], env={DEBUG_ENV: ""})
    assert result.exit_code == code
    line = one_line(result.stderr)
    assert line.startswith("lockd: ") and text in line


def test_debug_env_gives_the_traceback_of_a_cli_bug() -> None:
    @click.command()
    @client_command
    def boom() -> None:
        raise RuntimeError("oops")

    result = CliRunner().invoke(boom, [], env={DEBUG_ENV: "1"})
    assert isinstance(result.exception, RuntimeError)


def test_help_lists_the_exit_codes() -> None:
    result = invoke(["--help"])
    assert result.exit_code == 0
    for line in ("0  done", "1  key busy", "2  usage", "3  access denied", "4  rate limited"):
        assert line in result.stdout
    assert "5  daemon unreachable" in result.stdout
    assert "6  lease lost" in result.stdout


SNAPSHOT = {
    "uptimeMs": 1500,
    "connections": 2,
    "counters": {"grants": 3, "rateLimited": 1},
    "latency": {"tryAcquire": {"count": 4, "p50Ms": 0.2, "p90Ms": 5.491, "p99Ms": 7, "maxMs": 9}},
}


def test_render_openmetrics_exact() -> None:
    assert render_metrics(SNAPSHOT, openmetrics=True) == (
        "# TYPE lockd_uptime_seconds gauge\n"
        "# UNIT lockd_uptime_seconds seconds\n"
        "# HELP lockd_uptime_seconds Time since the daemon started.\n"
        "lockd_uptime_seconds 1.5\n"
        "# TYPE lockd_connections gauge\n"
        "# HELP lockd_connections Open client connections.\n"
        "lockd_connections 2\n"
        "# TYPE lockd_grants counter\n"
        "# HELP lockd_grants Leases granted.\n"
        "lockd_grants_total 3\n"
        "# TYPE lockd_rate_limited counter\n"
        "# HELP lockd_rate_limited Acquire attempts refused by the rate limit.\n"
        "lockd_rate_limited_total 1\n"
        "# TYPE lockd_request_duration_seconds summary\n"
        "# UNIT lockd_request_duration_seconds seconds\n"
        "# HELP lockd_request_duration_seconds Request latency per op over the recent window "
        "(a blocking acquire includes its wait); quantile 1 is the window's maximum.\n"
        'lockd_request_duration_seconds{op="tryAcquire",quantile="0.5"} 0.0002\n'
        'lockd_request_duration_seconds{op="tryAcquire",quantile="0.9"} 0.005491\n'
        'lockd_request_duration_seconds{op="tryAcquire",quantile="0.99"} 0.007\n'
        'lockd_request_duration_seconds{op="tryAcquire",quantile="1"} 0.009\n'
        'lockd_request_duration_seconds_count{op="tryAcquire"} 4\n'
        "# EOF\n"
    )


def test_render_prometheus_types_the_total_and_has_no_eof() -> None:
    text = render_metrics(SNAPSHOT, openmetrics=False)
    assert "# TYPE lockd_grants_total counter\nlockd_grants_total 3\n" in text.replace(
        "# HELP lockd_grants_total Leases granted.\n", ""
    )
    assert "# EOF" not in text and "# UNIT" not in text


_SAMPLE_RE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+=\"[^\"]*\"(,[a-z_]+=\"[^\"]*\")*\})? "
    r"-?[0-9.]+(e-?[0-9]+)?$"
)


def check_openmetrics(text: str) -> dict[str, str]:
    """A structural check of OpenMetrics text; returns family name -> type."""
    assert text.endswith("# EOF\n")
    lines = text[: -len("# EOF\n")].splitlines()
    types: dict[str, str] = {}
    for line in lines:
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"family {name} declared twice"
            types[name] = kind
            continue
        if line.startswith(("# HELP ", "# UNIT ")):
            assert line.split(" ")[2] in types, line
            continue
        m = _SAMPLE_RE.match(line)
        assert m, f"not a sample line: {line!r}"
        name = m.group("name")
        family = next(
            (
                f
                for f in (name, *(name.removesuffix(s) for s in ("_total", "_count")))
                if f in types
            ),
            None,
        )
        assert family is not None, f"sample {name} before its # TYPE"
        if types[family] == "counter":
            assert name == f"{family}_total", line
    return types


# --------------------------------------------------------------------------- against a daemon


@pytest.fixture(scope="module")
def shared(backend: Backend) -> Iterator[DaemonProcess]:
    """One daemon for the tests of this module that use keys of their own.

    Starting a daemon per test costs most of this file's run time; tests that
    need a fresh daemon (exact counters, config, rules) use ``daemon``.
    """
    root = Path(tempfile.mkdtemp(prefix="lockd-", dir="/tmp"))
    proc = backend.daemon_in(root)
    proc.start()
    try:
        yield proc
    finally:
        with contextlib.suppress(Exception):
            proc.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_acquire_prints_the_handle_alone_and_release_frees(shared: DaemonProcess) -> None:
    result = run_cli(shared, "locks", "acquire", "job:1", "--ttl", "60s", "--owner", "run-7")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    handle = result.stdout.strip()
    assert result.stdout == handle + "\n"
    assert HANDLE_RE.match(handle)

    status = run_cli(shared, "locks", "status", "job:1")
    assert status.exit_code == 0
    fields = dict(line.split(":", 1) for line in status.stdout.splitlines())
    assert fields["Held"].strip() == "yes"
    assert fields["Owner"].strip() == "run-7"
    assert fields["Held by"].strip().startswith("user:")
    assert re.match(
        r"in (59|60)s \(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+\)$", fields["Expires"].strip()
    )
    assert handle not in status.stdout  # the daemon never shows a handle id to others

    released = run_cli(shared, "locks", "release", "job:1", "--handle", handle)
    assert released.exit_code == 0, released.stderr
    assert "released" in released.stdout
    status = run_cli(shared, "locks", "status", "job:1")
    assert "Held:     no" in status.stdout
    assert re.search(r"^Owner:\s+-$", status.stdout, re.M)


def test_list_is_an_aligned_table(shared: DaemonProcess) -> None:
    acquire(shared, "app:alpha", "--ttl", "5m", "--owner", "run-1")
    acquire(shared, "app:b", "--ttl", "90s")
    acquire(shared, "other", "--ttl", "1h")
    result = run_cli(shared, "locks", "list", "--prefix", "app:")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    headers = ["KEY", "MODE", "HELD BY", "OWNER", "PID", "PROCESS", "FENCE", "EXPIRES IN"]
    node = ["NODE"] if shared.etcd is not None else []  # the host of each hold, on etcd
    assert re.split(r"\s{2,}", lines[0]) == [*headers, "WAITERS", *node]
    assert len(lines) == 3  # "other" is not under the prefix
    columns = [lines[0].index(h) for h in (*headers[1:], "WAITERS")]
    for line in lines[1:]:
        assert not line.endswith(" ")
        for col in columns:
            assert line[col - 2 : col] == "  " and line[col] != " ", (line, col)
    rows = {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line) for line in lines[1:]}
    assert rows["app:alpha"][1] == "exclusive" and rows["app:alpha"][3] == "run-1"
    # The CLI ran in this process; the holder shown is the process that will
    # use the handle, the CLI's caller (docs/contract.md §12.2): here pytest's parent.
    assert rows["app:alpha"][4] == str(os.getppid())
    assert rows["app:alpha"][7].startswith("in 4m")
    assert rows["app:b"][3] == "-" and rows["app:b"][8] == "0"  # no owner; no waiters
    if node:
        expected = shared.etcd.node or socket.gethostname()  # type: ignore[union-attr]
        assert rows["app:b"][9] == expected

    empty = run_cli(shared, "locks", "list", "--prefix", "nothing-here:")
    assert empty.exit_code == 0 and "no locks held under 'nothing-here:'" in empty.stdout


def test_list_follows_next_across_pages(
    shared: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (``lockd.cli.locks`` the attribute is the click group, not the module)
    monkeypatch.setattr(sys.modules["lockd.cli.locks"], "LIST_PAGE", 2)  # 5 locks: 3 requests
    keys = [f"paged:{i}" for i in range(5)]
    for key in keys:
        acquire(shared, key, "--ttl", "5m")
    table = run_cli(shared, "locks", "list", "--prefix", "paged:")
    assert table.exit_code == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].startswith("KEY") and [line.split()[0] for line in lines[1:]] == keys
    assert len({line.index("HELD BY") for line in lines[:1]}) == 1

    limited = run_cli(shared, "locks", "list", "--prefix", "paged:", "--limit", "3", "--json")
    assert limited.exit_code == 0, limited.stderr
    doc = json.loads(limited.stdout)
    assert [lock["key"] for lock in doc["locks"]] == keys[:3] and doc["next"] == "paged:2"
    rest = run_cli(shared, "locks", "list", "--prefix", "paged:", "--after", doc["next"], "--json")
    doc = json.loads(rest.stdout)
    assert [lock["key"] for lock in doc["locks"]] == keys[3:] and doc["next"] is None
    after = run_cli(shared, "locks", "list", "--prefix", "paged:", "--after", "paged:3")
    assert [line.split()[0] for line in after.stdout.splitlines()[1:]] == ["paged:4"]
    bad = run_cli(shared, "locks", "list", "--after", "a\x01b")
    assert bad.exit_code == 2 and "after" in bad.stderr


def test_busy_key_exits_1_with_who_holds_it(shared: DaemonProcess) -> None:
    acquire(shared, "busy", "--ttl", "60s", "--owner", "first")
    result = run_cli(shared, "locks", "acquire", "busy", "--ttl", "60s")
    assert result.exit_code == EXIT_BUSY
    assert result.stdout == ""
    line = one_line(result.stderr)
    assert "'busy' is busy" in line and "held by user:" in line and "owner first" in line

    waited = run_cli(shared, "locks", "acquire", "busy", "--ttl", "60s", "--wait", "100ms")
    assert waited.exit_code == EXIT_BUSY
    assert "timed out after 100ms" in one_line(waited.stderr)

    as_json = run_cli(shared, "locks", "acquire", "busy", "--ttl", "60s", "--json")
    assert as_json.exit_code == EXIT_BUSY and as_json.stdout == ""
    error = json.loads(one_line(as_json.stderr))["error"]
    assert (error["code"], error["status"]) == ("KEY_BUSY", 409)
    assert error["details"]["key"] == "busy" and error["details"]["holder"]["owner"] == "first"


def test_wait_gets_the_key_when_the_holder_expires(shared: DaemonProcess) -> None:
    acquire(shared, "soon-free", "--ttl", "300ms")
    started = time.monotonic()
    result = run_cli(shared, "locks", "acquire", "soon-free", "--ttl", "10s", "--wait", "10s")
    assert result.exit_code == 0, result.stderr
    assert HANDLE_RE.match(result.stdout.strip())
    assert time.monotonic() - started < 8  # granted at expiry, not at the end of --wait


def test_same_owner_retakes_and_fences_the_old_handle(shared: DaemonProcess) -> None:
    first = acquire(shared, "retake", "--ttl", "60s", "--owner", "run-1")
    second = acquire(shared, "retake", "--ttl", "60s", "--owner", "run-1")
    assert first != second
    stale = run_cli(shared, "locks", "release", "retake", env={"LOCKD_HANDLE": first})
    assert stale.exit_code == EXIT_LOST
    assert "not the holder" in one_line(stale.stderr)
    assert run_cli(shared, "locks", "release", "retake", "--handle", second).exit_code == 0


def test_renew_and_stale_handles(shared: DaemonProcess) -> None:
    handle = acquire(shared, "renewme", "--ttl", "10s")
    renewed = run_cli(shared, "locks", "renew", "renewme", "--handle", handle, "--ttl", "2m")
    assert renewed.exit_code == 0, renewed.stderr
    assert re.match(r"renewed 'renewme': expires in (1m 59s|2m) \(", renewed.stdout)
    expires = run_cli(shared, "locks", "status", "renewme", "--json")
    assert json.loads(expires.stdout)["expiresInMs"] > 100_000

    lost = run_cli(
        shared, "locks", "renew", "renewme", "--handle", "-", "--ttl", "1m", input="x" * 22
    )
    assert lost.exit_code == EXIT_LOST
    assert "lease lost" in one_line(lost.stderr)
    lost_json = run_cli(
        shared, "locks", "renew", "renewme", "--handle", "x" * 22, "--ttl", "1m", "--json"
    )
    assert lost_json.exit_code == EXIT_LOST
    assert json.loads(lost_json.stdout) == {"renewed": False, "reason": "lease_lost"}

    not_holder = run_cli(shared, "locks", "release", "renewme", "--handle", "x" * 22, "--json")
    assert not_holder.exit_code == EXIT_LOST
    assert json.loads(not_holder.stdout) == {"released": False, "reason": "not_holder"}


def test_break_held_and_free(shared: DaemonProcess) -> None:
    handle = acquire(shared, "stuck", "--ttl", "1h", "--owner", "run-9")
    broke = run_cli(shared, "locks", "break", "stuck", "--reason", "operator test")
    assert broke.exit_code == 0, broke.stderr
    assert "broke 'stuck'" in broke.stdout and "owner run-9" in broke.stdout
    assert run_cli(shared, "locks", "release", "stuck", "--handle", handle).exit_code == EXIT_LOST

    free = run_cli(shared, "locks", "break", "stuck", "--reason", "again")
    assert free.exit_code == 0
    assert "was free" in free.stdout
    free_json = run_cli(shared, "locks", "break", "stuck", "--reason", "again", "--json")
    assert free_json.exit_code == 0
    assert json.loads(free_json.stdout) == {"broken": False}

    missing = run_cli(shared, "locks", "break", "stuck")
    assert missing.exit_code == EXIT_USAGE  # --reason is required


def test_json_outputs_are_one_document_each(shared: DaemonProcess) -> None:
    key = "json:j"
    raw = run_cli(shared, "locks", "acquire", key, "--ttl", "1m", "--owner", "o", "--json")
    assert raw.exit_code == 0
    handle = json.loads(raw.stdout)
    assert set(handle) == {"key", "handle", "fence", "owner", "ttlMs", "leaseExpiresAt"}
    assert handle["owner"] == "o" and handle["ttlMs"] == 60_000

    documents = {
        "status": run_cli(shared, "locks", "status", "json:j", "--json"),
        "list": run_cli(shared, "locks", "list", "--prefix", "json:", "--json"),
        "whoami": run_cli(shared, "whoami", "--json"),
        "stats": run_cli(shared, "stats", "--json"),
        "stats-format": run_cli(shared, "stats", "--format", "json"),
        "renew": run_cli(
            shared,
            "locks",
            "renew",
            "json:j",
            "--handle",
            handle["handle"],
            "--ttl",
            "1m",
            "--json",
        ),
        "rules": run_cli(shared, "rules", "show", "--json"),
        "release": run_cli(
            shared, "locks", "release", "json:j", "--handle", handle["handle"], "--json"
        ),
    }
    parsed = {}
    for name, result in documents.items():
        assert result.exit_code == 0, (name, result.stderr)
        assert result.stdout.count("\n") == 1, name  # one document, one line
        parsed[name] = json.loads(result.stdout)
    assert parsed["status"]["owner"] == "o" and parsed["status"]["held"] is True
    assert [lock["key"] for lock in parsed["list"]["locks"]] == ["json:j"]
    assert set(parsed["whoami"]) == {"protocol", "version", "principal", "role", "uid", "pid"}
    assert parsed["whoami"]["uid"] == os.geteuid()
    assert parsed["stats"]["counters"]["grants"] >= 1
    assert parsed["renew"]["renewed"] is True
    assert parsed["rules"] == {"policy": None, "lastError": None}
    assert parsed["release"] == {"released": True}


def test_whoami_text(shared: DaemonProcess) -> None:
    result = run_cli(shared, "whoami")
    assert result.exit_code == 0, result.stderr
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert re.search(rf"^Principal:\s+user:{re.escape(me)}$", result.stdout, re.M)
    assert re.search(r"^Role:\s+owner$", result.stdout, re.M)  # same uid as the daemon
    assert re.search(rf"^Uid:\s+{os.geteuid()}$", result.stdout, re.M)
    assert re.search(r"^Pid:\s+\d+$", result.stdout, re.M)
    assert str(shared.socket) in result.stdout


def test_stats_formats(daemon: DaemonProcess, backend: Backend) -> None:
    acquire(daemon, "m", "--ttl", "1m")
    text = run_cli(daemon, "stats")
    assert text.exit_code == 0, text.stderr
    assert "COUNTER" in text.stdout and re.search(r"^grants\s+1$", text.stdout, re.M)
    assert re.search(r"^OP\s+COUNT\s+P50 MS", text.stdout, re.M)

    om = run_cli(daemon, "stats", "--format", "openmetrics")
    assert om.exit_code == 0, om.stderr
    types = check_openmetrics(om.stdout)
    assert types["lockd_grants"] == "counter"
    # With etcd, held is null (no host counts every host's keys): no sample.
    assert types.get("lockd_held") == (None if backend.differs("held_is_null") else "gauge")
    assert types["lockd_request_duration_seconds"] == "summary"
    assert "lockd_grants_total 1\n" in om.stdout
    assert ("lockd_held 1\n" in om.stdout) is not backend.differs("held_is_null")
    assert re.search(
        r'^lockd_request_duration_seconds\{op="tryAcquire",quantile="0\.99"\} [0-9.]+$',
        om.stdout,
        re.M,
    )
    assert 'lockd_request_duration_seconds_count{op="tryAcquire"} 1\n' in om.stdout

    prom = run_cli(daemon, "stats", "--format", "prometheus")
    assert prom.exit_code == 0
    assert "# TYPE lockd_grants_total counter" in prom.stdout
    assert "# EOF" not in prom.stdout


def test_invalid_request_from_the_daemon_exits_2(shared: DaemonProcess) -> None:
    # The client lets a long handle through; the daemon refuses it (256 chars max).
    result = run_cli(shared, "locks", "release", "k", env={"LOCKD_HANDLE": "h" * 300})
    assert result.exit_code == EXIT_USAGE
    assert "invalid request" in one_line(result.stderr)


def test_client_side_invalid_key_exits_2(shared: DaemonProcess) -> None:
    result = run_cli(shared, "locks", "status", "tab\there")
    assert result.exit_code == EXIT_USAGE
    assert "control characters" in one_line(result.stderr)


@pytest.mark.parametrize(
    "args",
    [
        ["whoami"],
        ["locks", "list"],
        ["locks", "status", "k"],
        ["locks", "acquire", "k", "--ttl", "1s"],
        ["locks", "release", "k", "--handle", "-"],
        ["stats", "--format", "openmetrics"],
        ["rules", "show"],
    ],
)
def test_daemon_down_exits_5_naming_the_socket(short_tmp: Path, args: list[str]) -> None:
    socket = str(short_tmp / "absent.sock")
    result = run_cli(None, *args, socket=socket, input="h\n")
    assert result.exit_code == EXIT_UNAVAILABLE
    line = one_line(result.stderr)
    assert socket in line and "lockd serve" in line
    assert result.stdout == ""


def test_socket_from_environment(shared: DaemonProcess) -> None:
    result = invoke(["whoami", "--json"], env={"LOCKD_SOCKET": str(shared.socket)})
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["role"] == "owner"


# --------------------------------------------------------------------------- real processes


def lockd_argv() -> list[str]:
    """The installed console script if there is one, else ``python -m lockd``."""
    script = Path(sys.executable).with_name("lockd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lockd"]


def bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in bash with a ``lockd`` function calling the real program."""
    argv = " ".join(f"'{a}'" for a in lockd_argv())
    return subprocess.run(
        ["bash", "-c", f'lockd() {{ {argv} "$@"; }}\n{script}'],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_shell_script_round_trip(shared: DaemonProcess) -> None:
    script = """
    H=$(lockd locks acquire backup --ttl 60s); echo "acquire=$? len=${#H}"
    lockd locks acquire backup --ttl 60s; echo "busy=$?"
    printf '%s\\n' "$H" | lockd locks renew backup --handle - --ttl 2m >/dev/null; echo "renew=$?"
    LOCKD_HANDLE=$H lockd locks release backup >/dev/null; echo "release=$?"
    LOCKD_HANDLE=$H lockd locks release backup; echo "stale=$?"
    lockd locks renew backup --handle - --ttl 1m <<<"$H"; echo "lost=$?"
    lockd locks break backup --reason "nothing held"; echo "breakfree=$?"
    lockd locks acquire backup --ttl 5x; echo "baddur=$?"
    lockd whoami --socket "$ROOT/absent.sock"; echo "down=$?"
    """
    result = bash(script, {**shared.env, "ROOT": str(shared.root)})
    codes = dict(re.findall(r"^(\w+)=(\d+)", result.stdout, re.M))
    assert codes == {
        "acquire": "0",
        "busy": "1",
        "renew": "0",
        "release": "0",
        "stale": "6",
        "lost": "6",
        "breakfree": "0",
        "baddur": "2",
        "down": "5",
    }, result.stdout + result.stderr
    assert re.search(r"len=(2[2-9]|[3-9]\d)", result.stdout)
    assert "was free" in result.stdout
    assert "Traceback" not in result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 5, errors  # busy, stale, lost, bad duration, down: one line each
    assert f"{shared.root}/absent.sock" in errors[-1] and "lockd serve" in errors[-1]


def test_completion_scripts() -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_COMPLETE")}
    argv = lockd_argv()
    if len(argv) > 1:  # no console script: name the program as the shell would
        argv = [sys.executable, "-c", "from lockd.cli import main; main(prog_name='lockd')"]
    expected = {"bash_source": "complete -o nosort -F _lockd_completion lockd"}
    expected["zsh_source"] = "#compdef lockd"
    expected["fish_source"] = "complete --no-files --command lockd"
    for shell, marker in expected.items():
        out = subprocess.run(
            argv, env={**env, "_LOCKD_COMPLETE": shell}, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        assert marker in out.stdout, (shell, out.stdout)
    words = subprocess.run(
        argv,
        env={
            **env,
            "_LOCKD_COMPLETE": "bash_complete",
            "COMP_WORDS": "lockd lo",
            "COMP_CWORD": "1",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert words.stdout.split() == ["plain,locks"]


def test_key_completion_asks_the_daemon(shared: DaemonProcess) -> None:
    acquire(shared, "complete-me", "--ttl", "1m")
    env = {**shared.env, "_LOCKD_COMPLETE": "bash_complete"}
    env.update(COMP_WORDS="lockd locks status comp", COMP_CWORD="3")
    argv = [sys.executable, "-c", "from lockd.cli import main; main(prog_name='lockd')"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["plain,complete-me"], out.stderr


# --------------------------------------------------------------------------- another user


@contextlib.contextmanager
def throwaway_user() -> Iterator[pwd.struct_passwd]:
    """A system user with no home and no login, removed afterwards (root only)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to act as another user")
    name = f"lockdt{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def invoke_as(user: pwd.struct_passwd, commands: list[list[str]]) -> list[dict[str, object]]:
    """Run CLI commands in a forked child that has become ``user``.

    A fork, not an exec: the interpreter may live where the user cannot read
    (/root/.pyenv), and the point is only that the daemon sees the user's
    uid in SO_PEERCRED. Everything the commands import is imported by the
    parent first (the caller warms up with the same commands).
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            out = []
            for args in commands:
                res = invoke(args)
                out.append(
                    {
                        "code": res.exit_code,
                        "stdout": res.stdout,
                        "stderr": res.stderr,
                        "exception": None
                        if res.exception is None or isinstance(res.exception, SystemExit)
                        else repr(res.exception),
                    }
                )
            payload = json.dumps(out)
        except BaseException:
            payload = json.dumps([{"child_error": traceback.format_exc()}])
        with os.fdopen(write_fd, "w") as f:
            f.write(payload)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    os.waitpid(pid, 0)
    results = json.loads(data)
    assert "child_error" not in results[0], results[0].get("child_error")
    return results


RULES_OWN_PREFIX = (
    '[ruleSet]\nname = "mine"\nresourceType = "lock"\n\n[rules.lock]\n'
    "acquire = \"record.key.startsWith('user:' + user.userId + ':')\"\n"
)


def run_as_member(
    daemon_paths: DaemonProcess, config: str, commands: list[list[str]]
) -> tuple[pwd.struct_passwd, list[dict[str, object]]]:
    """Start a daemon (rules: own prefix only), run ``commands`` as a new user.

    ``USER:`` in an argument becomes the user's own key prefix ``user:<name>:``.
    """
    with throwaway_user() as user:
        daemon_paths.write_config(config)
        daemon_paths.write_rules("policy.toml", RULES_OWN_PREFIX)
        daemon_paths.start()
        try:
            os.chmod(daemon_paths.root, 0o755)
            os.chmod(daemon_paths.socket, 0o666)
            sock = ["--socket", str(daemon_paths.socket)]
            mine = f"user:{user.pw_name}:"
            as_user = [[a.replace("USER:", mine) for a in args] + sock for args in commands]
            # Warm up as root (owner: never denied nor counted) so that every
            # module the commands need is imported before the fork.
            for args in commands:
                invoke([a.replace("USER:", "warm:") for a in args] + sock)
            for key in {a for args in commands for a in args if a.startswith("USER:")}:
                invoke(["locks", "break", key.replace("USER:", "warm:"), "--reason", "w", *sock])
            return user, invoke_as(user, as_user)
        finally:
            daemon_paths.stop()


@pytest.mark.sqlite_only("roles and the rate limit act per host, before the backend")
def test_member_is_denied(daemon_paths: DaemonProcess) -> None:
    user, results = run_as_member(
        daemon_paths,
        "",
        [
            ["whoami", "--json"],
            ["locks", "list"],
            ["stats"],
            ["rules", "show"],
            ["locks", "break", "USER:a", "--reason", "x"],
            ["locks", "acquire", "someone-else", "--ttl", "1m"],
            ["locks", "acquire", "USER:a", "--ttl", "1m"],
        ],
    )
    assert all(r["exception"] is None for r in results), results
    hello = json.loads(str(results[0]["stdout"]))
    assert hello["principal"] == f"user:{user.pw_name}" and hello["role"] == "member"
    codes = [r["code"] for r in results[1:]]
    # list: open, the member's own keys only (none yet; docs/contract.md §12); stats, rules
    # show, break: roles; acquire outside the own prefix: the rule.
    assert codes == [0] + [EXIT_DENIED] * 4 + [0], results
    assert str(results[1]["stdout"]).strip() == "no locks held"
    for r in results[2:6]:
        assert "access denied" in one_line(str(r["stderr"]))
    assert HANDLE_RE.match(str(results[-1]["stdout"]).strip())


@pytest.mark.sqlite_only("roles and the rate limit act per host, before the backend")
def test_member_over_the_rate_limit_exits_4(daemon_paths: DaemonProcess) -> None:
    _, results = run_as_member(
        daemon_paths,
        "acquire_per_hour = 2\n",
        [
            ["locks", "acquire", "USER:a", "--ttl", "1m"],
            ["locks", "acquire", "USER:b", "--ttl", "1m"],
            ["locks", "acquire", "USER:c", "--ttl", "1m"],
        ],
    )
    assert [r["code"] for r in results] == [0, 0, EXIT_RATE_LIMITED], results
    line = one_line(str(results[-1]["stderr"]))
    assert "rate limited" in line and "limit 2 attempts per hour" in line
