"""The fast path (lockd.cli.fast) is the click path, only without click.

For a table of command lines, against one real daemon, the console script's
entry (``lockd.cli.fast.main``) and the click group (``lockd.cli.main``) are
run in fresh interpreters and must give the same stdout, stderr and exit
status. Each row also says whether the fast path must take it (click never
imported) or hand it to click (anything it does not fully understand), and
the entry's run is checked for that too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from lockd_client import MAX_LIMIT, LockClient

from lockd.cli.fast import RunCall, ServeCall, StatusCall, recognise
from lockd.run.options import MIN_TTL_MS, OnLost, RunOptions
from lockd.testing.daemon import DaemonProcess

#: Stand-in for the daemon's socket in the table (replaced per run).
S = "@SOCKET@"
MISSING = "/nonexistent/lockd.sock"
HELD = "fast:held"

# Both paths as the console script runs them: argv[0] "lockd", so click names
# the program "lockd" in its messages either way. The entry writes whether
# click was loaded to $PROBE at exit.
FAST = """
import atexit, os, sys
sys.argv[0] = "lockd"
atexit.register(lambda: open(os.environ["PROBE"], "w").write(str("click" in sys.modules)))
from lockd.cli.fast import main
main()
"""
CLICK = """
import sys
sys.argv[0] = "lockd"
from lockd.cli import main
main(prog_name="lockd")
"""

#: (argv, extra environment, taken by the fast path?)
Row = tuple[list[str], dict[str, str], bool]

ROWS: list[Row] = [
    # locks status
    (["locks", "status", "fast:free", "--socket", S], {}, True),
    (["--socket", S, "locks", "status", "fast:free"], {}, True),
    (["--socket=" + S, "locks", "status", "--json", "fast:free"], {}, True),
    (["locks", "status", "--socket=" + S, "--json", "fast:free"], {}, True),
    (["locks", "status", HELD, "--socket", S], {}, True),
    (["locks", "status", HELD, "--socket", S, "--json"], {}, True),
    (["locks", "status", "--socket", S, "--", "-dash"], {}, True),
    (["locks", "status", "--socket", S, "--", "--json"], {}, True),  # a key, not the option
    (["locks", "status", "fast:free"], {"LOCKD_SOCKET": S}, True),
    (["locks", "status", "fast:free", "--socket", S], {"LOCKD_SOCKET": MISSING}, True),
    (["--socket", MISSING, "locks", "status", "fast:free"], {"LOCKD_SOCKET": S}, True),
    (["locks", "status", "fast:free", "--socket", MISSING], {}, True),
    (["locks", "status", "fast:free", "--socket", MISSING, "--json"], {}, True),
    (["locks", "status", "x" * 1100, "--socket", S], {}, True),  # the client refuses it
    (["locks", "status", "--socket", S], {}, False),
    (["locks", "status", "a", "b", "--socket", S], {}, False),
    (["locks", "status", "k", "--bogus", "--socket", S], {}, False),
    (["locks", "status", "k", "--json", "--json", "--socket", S], {}, False),
    (["locks", "status", "k", "--socket", "/tmp"], {}, False),
    (["locks", "status", "--help"], {}, False),
    (["locks", "list", "--prefix", "fast:free", "--socket", S], {}, False),
    # run
    (["run", "fast:r", "--socket", S, "--", "true"], {}, True),
    (["--socket", S, "run", "fast:r", "--", "sh", "-c", "echo o; echo e >&2; exit 3"], {}, True),
    (["run", "fast:r", "--", "sh", "-c", 'echo "$LOCKD_KEY"'], {"LOCKD_SOCKET": S}, True),
    (["run", "--socket", S, "--", "-dash", "--", "sh", "-c", 'echo "$LOCKD_KEY"'], {}, True),
    (["run", "--ttl", "1m30s", "--wait=forever", "fast:r", "--socket=" + S, "--", "id"], {}, True),
    (["run", "--ttl=500", "fast:r", "--socket", S, "--", "true"], {}, True),  # warns: 500 ms
    (["run", "--ttl", "500", "--json", "fast:r", "--socket", S, "--", "true"], {}, True),
    (
        [
            "run",
            "-q",
            "--owner",
            "job-1",
            "--on-lost",
            "kill",
            "--grace",
            "2s",
            "--kill-descendants",
            "--shared",
            "fast:r",
            "--socket",
            S,
            "--",
            "true",
        ],
        {},
        True,
    ),
    (["run", "--limit", "3", "fast:sem", "--socket", S, "--", "true"], {}, True),
    (["run", HELD, "--socket", S, "--", "true"], {}, True),  # busy
    (["run", HELD, "--socket", S, "--json", "--", "true"], {}, True),
    (["run", "-q", "--conflict-exit-code", "0", HELD, "--socket", S, "--", "true"], {}, True),
    (["run", "--wait", "100ms", HELD, "--socket", S, "--", "true"], {}, True),  # times out
    (["run", "fast:r", "--socket", MISSING, "--", "true"], {}, True),
    (["run", "fast:r", "--json", "--socket", MISSING, "--", "true"], {}, True),
    (["run", "fast:r", "--socket", S, "--", "/nonexistent/command"], {}, True),
    (["run", "--ttl", "5x", "fast:r", "--socket", S, "--", "true"], {}, False),
    (["run", "--ttl", "50ms", "fast:r", "--socket", S, "--", "true"], {}, False),
    (["run", "--wait", "1m30x", "fast:r", "--socket", S, "--", "true"], {}, False),
    (["run", "--ttl", "1s", "--ttl", "2s", "fast:r", "--socket", S, "--", "true"], {}, False),
    (["run", "--on-lost", "KILL", "fast:r", "--socket", S, "--", "true"], {}, False),
    (["run", "--shared", "--limit", "2", "fast:r", "--socket", S, "--", "true"], {}, False),
    (["run", "--conflict-exit-code", "256", "k", "--socket", S, "--", "true"], {}, False),
    (["run", "fast:r", "true"], {}, False),  # no '--'
    (["run", "fast:r", "--socket", S, "--"], {}, False),  # no COMMAND
    (["run", "--socket", S, "--", "true"], {}, False),  # no KEY
    (["run", "--help"], {}, False),
    (["run", "-x", "fast:r", "--", "true"], {}, False),
]


@pytest.fixture(scope="module")
def held_daemon() -> Iterator[DaemonProcess]:
    """One daemon for the whole table, with :data:`HELD` held by this test process."""
    root = Path(tempfile.mkdtemp(prefix="lockd-", dir="/tmp"))
    daemon = DaemonProcess.in_folder(root).start()
    try:
        with LockClient(str(daemon.socket)) as client:
            assert client.try_acquire(HELD, ttl=600) is not None
            yield daemon
    finally:
        daemon.terminate()
        shutil.rmtree(root, ignore_errors=True)


def _run(code: str, argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    return proc.returncode, _steady(proc.stdout), _steady(proc.stderr)


def _steady(text: str) -> str:
    """The output without what moves between two runs: the time left on HELD's lease
    (the daemon derives its end's wall time anew for each status: a millisecond may move)."""
    text = re.sub(r'"expiresInMs":\d+', '"expiresInMs":N', text)
    text = re.sub(r'"leaseExpiresAt":"[^"]*"', '"leaseExpiresAt":T', text)
    return re.sub(r"(?m)^Expires:.*$", "Expires: N", text)


@pytest.mark.parametrize(
    ("argv", "extra_env", "fast"),
    ROWS,
    ids=[" ".join(a[:14] for a in row[0]) + (" +env" if row[1] else "") for row in ROWS],
)
def test_fast_path_and_click_path_agree(
    held_daemon: DaemonProcess,
    tmp_path: Path,
    argv: list[str],
    extra_env: dict[str, str],
    fast: bool,
) -> None:
    socket = str(held_daemon.socket)
    argv = [a.replace(S, socket) for a in argv]
    env = {k: v for k, v in os.environ.items() if k != "LOCKD_SOCKET"}
    env.update({k: v.replace(S, socket) for k, v in extra_env.items()})
    probe = tmp_path / "probe"
    via_click = _run(CLICK, argv, env)
    via_entry = _run(FAST, argv, {**env, "PROBE": str(probe)})
    assert via_entry == via_click
    assert probe.read_text() == str(not fast), "click loaded" if fast else "click not loaded"


# ------------------------------------------------------------- reading, without a daemon


def test_recognise_reads_status_options_in_any_order() -> None:
    call = recognise(["--socket", "/a", "locks", "status", "--json", "k", "--socket=/b"])
    assert isinstance(call, StatusCall)
    assert (call.key, call.socket_path, call.as_json, call.root_socket) == ("k", "/b", True, "/a")


def test_recognise_reads_run_into_run_options() -> None:
    call = recognise(
        ["run", "--ttl", "1m30s", "--wait=forever", "--limit", "3", "k", "--", "ls", "--help"]
    )
    assert isinstance(call, RunCall)
    fields = dict(call.fields)
    assert fields == {
        "ttl_ms": 90_000,
        "wait_ms": -1,
        "limit": 3,
        "key": "k",
        "command": ("ls", "--help"),
    }
    RunOptions(**fields)  # type: ignore[arg-type]  # every name is a RunOptions field
    assert call.hints == [] and not call.json_output


def test_recognise_takes_a_dash_key_between_two_double_dashes() -> None:
    call = recognise(["run", "-q", "--", "-k", "--", "true"])
    assert isinstance(call, RunCall)
    assert (call.fields["key"], call.fields["command"], call.fields["quiet"]) == (
        "-k",
        ("true",),
        True,
    )
    # With KEY before the first '--', everything after it is COMMAND.
    call = recognise(["run", "k", "--", "-x", "--", "true"])
    assert isinstance(call, RunCall) and call.fields["command"] == ("-x", "--", "true")


def test_a_bare_number_under_a_second_is_remembered_as_clicks_warning() -> None:
    call = recognise(["run", "--wait", "5", "k", "--", "true"])
    assert isinstance(call, RunCall)
    assert call.hints == ["--wait 5 is 5 ms; write 5s for seconds"]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--help"],
        ["--version"],
        ["locks"],
        ["locks", "status", "k", "-h"],
        ["locks", "status", "k", "--socket"],  # no value
        ["locks", "status", "k", "--socket", "--json"],  # a value click may read otherwise
        ["locks", "status", "--", "a", "b"],
        ["locks", "status", "\udcff"],  # not UTF-8: click's message
        ["run", "k", "--", "true", "--socket"][:3],  # no COMMAND
        ["run", "--grace", "-1s", "k", "--", "true"],
        ["run", "--limit", "0", "k", "--", "true"],
        ["run", "--limit", "+3", "k", "--", "true"],
        ["run", "--limit", str(MAX_LIMIT + 1), "k", "--", "true"],
        ["run", "-qq", "k", "--", "true"],
        ["run", "-q", "--quiet", "k", "--", "true"],
        ["run", "k", "stray", "--", "true"],
        ["--socket", "/a", "--socket", "/b", "run", "k", "--", "true"],
        ["whoami"],
        ["serve", "--help"],
        ["serve", "stray"],
        ["serve", "--system=yes"],
        ["serve", "--json", "--json"],
        ["serve", "--db"],  # no value
        ["serve", "--db", "--json"],  # a value click may read otherwise
        ["serve", "--db", ""],
        ["serve", "--db", "/tmp"],  # click.Path(dir_okay=False)
        ["serve", "--config", "/etc/hostname"],  # click.Path(file_okay=False)
        ["serve", "--bogus"],
    ],
)
def test_anything_not_fully_understood_goes_to_click(argv: list[str]) -> None:
    assert recognise(argv) is None


def test_recognise_reads_serve_options() -> None:
    call = recognise(
        ["--socket", "/r/s", "serve", "--db=/d/x.db", "--json", "--etcd", "http://a:1,http://b:2"]
    )
    assert isinstance(call, ServeCall)
    assert call.root_socket == "/r/s"
    assert call.options == {
        "system": False,
        "json_output": True,
        "adopt_fence_mark": False,
        "accept_data_loss": False,
        "socket_path": None,
        "db": "/d/x.db",
        "config_dir": None,
        "etcd": "http://a:1,http://b:2",
    }
    call = recognise(["serve"])
    assert isinstance(call, ServeCall) and not any(call.options.values())


def test_the_fast_path_uses_lockd_runs_own_limits() -> None:
    short = str(MIN_TTL_MS - 1) + "ms"
    assert recognise(["run", "--ttl", short, "k", "--", "true"]) is None
    assert recognise(["run", "--ttl", f"{MIN_TTL_MS}ms", "k", "--", "true"]) is not None


# ------------------------------------------------------------- the two paths' option tables


def _option_names(command: click.Command) -> set[str]:
    return {
        name
        for param in command.params
        if isinstance(param, click.Option)
        for name in (*param.opts, *param.secondary_opts)
    }


def test_the_fast_path_knows_every_option_of_run_and_status() -> None:
    """A new option of the click commands must be taught to the fast path (or left out here)."""
    from lockd.cli import fast
    from lockd.cli.locks import status
    from lockd.cli.run import run

    assert _option_names(run) == set(fast._RUN_VALUES) | set(fast._RUN_FLAGS)
    assert _option_names(status) == {"--socket", "--json"}


def test_the_fast_path_knows_every_option_of_serve() -> None:
    from lockd.cli import fast
    from lockd.cli.root import serve

    assert _option_names(serve) == set(fast._SERVE_OPTIONS)
    for param in serve.params:
        assert isinstance(param, click.Option)
        assert fast._SERVE_OPTIONS[param.opts[0]] == (param.name, param.is_flag)


# ------------------------------------------------------------- lockd serve on both paths

# The entry writes, at exit, whether click was loaded before the daemon's
# modules: a refused start prints its line through click (imported for it).
SERVE_FAST = """
import atexit, os, sys
sys.argv[0] = "lockd"
def probe():
    names = list(sys.modules)
    daemon = names.index("lockd.daemon.serve") if "lockd.daemon.serve" in names else len(names)
    early = "click" in names and names.index("click") < daemon
    open(os.environ["PROBE"], "w").write(str(early))
atexit.register(probe)
from lockd.cli.fast import main
main()
"""


def test_serve_on_the_fast_path_refuses_a_start_as_click_does(
    held_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The same stderr line and status; click loaded only for the refusal's line."""
    bad = tmp_path / "bad-config"
    bad.mkdir()
    (bad / "lockd.toml").write_text("max_connections = = 3\n")
    good = tmp_path / "config"
    good.mkdir()
    db = str(tmp_path / "state" / "lockd.db")
    fresh = str(tmp_path / "run" / "lockd.sock")
    (tmp_path / "run").mkdir(mode=0o700)
    live = str(held_daemon.socket)
    rows: list[tuple[list[str], bool]] = [
        (["serve", "--socket", fresh, "--db", db, "--config", str(bad)], True),
        (["serve", "--json", "--socket", fresh, "--db", db, "--config", str(bad)], True),
        (["--socket", fresh, "serve", "--db=" + db, "--config=" + str(bad)], True),
        (["serve", "--socket", live, "--db", db, "--config", str(good)], True),  # in use
        (["serve", "--socket", live, "--db", db, "--config", str(good), "--json"], True),
        (["serve", "--socket", fresh, "--bogus"], False),
        (["serve", "--socket", fresh, "--db", "/tmp", "--config", str(good)], False),
    ]
    env = {k: v for k, v in os.environ.items() if k != "LOCKD_SOCKET"}
    for argv, fast in rows:
        probe = tmp_path / "probe"
        via_click = _run(CLICK, argv, env)
        via_entry = _run(SERVE_FAST, argv, {**env, "PROBE": str(probe)})
        assert via_entry == via_click, argv
        assert via_entry[0] in (1, 2) and via_entry[2], argv  # refused, one line said why
        assert probe.read_text() == str(not fast), argv
    assert not Path(db).exists()  # nothing was created by any of them


def test_run_defaults_are_the_same_on_both_paths() -> None:
    """The fast path leaves unset options to RunOptions' defaults; click has its own."""
    from lockd.cli.run import run

    defaults = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    ctx = click.Context(run)
    for param in run.params:
        if not isinstance(param, click.Option) or param.name in (None, "json_output"):
            continue
        value = param.type_cast_value(ctx, param.get_default(ctx))
        assert param.name in defaults, param.name
        if param.name == "on_lost":
            value = OnLost(value)
        assert value == defaults[param.name], param.name


def test_ctrl_c_before_the_daemon_handles_sigint_says_aborted_as_click_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt while serve imports or opens its database: click's words and status."""
    from lockd.cli import serve_command

    def interrupted(**options: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_command, "serve_daemon", interrupted)
    call = recognise(["serve"])
    assert isinstance(call, ServeCall)
    assert call() == 1
    assert capsys.readouterr().err == "Aborted!\n"
