"""docs/contract.md §9: one ``--json`` error shape for every command and failure, the bare-number
warning, and the permission-denied message (real daemons, real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from lockd_client import LockClient

from lockd.testing.daemon import LOCKD, DaemonProcess

NOBODY = 65534


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:  # the fixture, not the function below
    """The module's one daemon: each test has keys of its own and leaves it as it was.

    The permission test opens the daemon's folder to everyone: it starts its own.
    """
    return lockd


def lockd(
    *args: str, env: dict[str, str] | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LOCKD, *args], capture_output=True, text=True, timeout=60, env=env, **kw
    )


def the_error(result: subprocess.CompletedProcess[str], *, log: bool = False) -> dict[str, Any]:
    """The one stderr line, parsed; it must have exactly the documented keys.

    ``log``: stderr is also a log (``serve``): only its JSON lines count.
    """
    lines = result.stderr.splitlines()
    if log:
        lines = [line for line in lines if line.startswith("{")]
    assert len(lines) == 1, result.stderr
    error = json.loads(lines[0])["error"]
    assert set(error) == {"code", "status", "message", "details"}
    assert isinstance(error["status"], int) and isinstance(error["details"], dict)
    assert error["message"] and "\n" not in error["message"]
    return error


def test_every_failure_is_one_json_line(daemon: DaemonProcess, short_tmp: Path) -> None:
    env = daemon.env
    with LockClient(daemon.socket) as client:
        # An hour: "busy" must hold for the whole test, which took over 60 s on a loaded box.
        client.acquire("j:busy", ttl=3600, timeout=1, owner="first")
        handle = client.acquire("j:lost", ttl=60, timeout=1)
        assert client.break_lock("j:lost", "test").broken
    nowhere = {**os.environ, "LOCKD_SOCKET": str(short_tmp / "none.sock")}
    open_dir = short_tmp / "open"  # anyone could swap a socket here: not trusted
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    bad_rules = short_tmp / "bad.toml"
    bad_rules.write_text("[ruleSet\n")
    cases: list[tuple[list[str], dict[str, str], int, str]] = [
        (["locks", "acquire", "j:busy", "--ttl", "1m"], env, 1, "KEY_BUSY"),
        (["locks", "acquire", "j:busy", "--ttl", "1m", "--wait", "50ms"], env, 1, "LOCK_TIMEOUT"),
        (["locks", "status", "k"], nowhere, 5, "DAEMON_UNAVAILABLE"),
        (["whoami"], nowhere, 5, "DAEMON_UNAVAILABLE"),
        (["locks", "acquire", "k", "--ttl", "5x"], env, 2, "USAGE"),
        (["locks", "acquire", "k" * 2000, "--ttl", "1s"], env, 2, "USAGE"),
        (
            ["locks", "renew", "j:lost", "--handle", handle.handle, "--ttl", "1m"],
            env,
            6,
            "LEASE_LOST",
        ),
        (["locks", "release", "j:lost", "--handle", handle.handle], env, 6, "LEASE_LOST"),
        (["run", "j:busy", "--", "true"], env, 1, "KEY_BUSY"),
        (["run", "j:free", "--", "/nonexistent/cmd"], env, 127, "USAGE"),
        (["run", "j:free"], env, 2, "USAGE"),
        (["run", "j:free", "--", "true"], nowhere, 5, "DAEMON_UNAVAILABLE"),
        (["rules", "check", str(bad_rules)], env, 1, "USAGE"),
        (
            ["whoami"],
            {**os.environ, "LOCKD_SOCKET": str(open_dir / "s.sock")},
            5,
            "DAEMON_UNAVAILABLE",
        ),
        (
            ["serve", "--socket", str(daemon.socket), "--db", str(short_tmp / "x.db")],
            env,
            1,
            "USAGE",
        ),
    ]

    def check(args: list[str], environ: dict[str, str], exit_code: int, code: str) -> None:
        cut = args.index("--") if "--" in args else len(args)
        result = lockd(*args[:cut], "--json", *args[cut:], env=environ)
        assert result.returncode == exit_code, (args, result.stderr)
        error = the_error(result, log=args[0] == "serve")
        assert error["code"] == code, (args, error)
        if args[0] != "locks" or args[1] not in ("renew", "release"):
            assert result.stdout == "", (args, result.stdout)
        # The same failure without --json: same exit code, one plain line.
        plain = lockd(*args, env=environ)
        assert plain.returncode == exit_code and not plain.stderr.startswith("{")

    # 30 CLI processes: the cases run side by side (no two touch the same key
    # at the daemon; each case's two runs stay in order), so the run costs the
    # processes' CPU time rather than their sum of start-ups one after another.
    with ThreadPoolExecutor(max_workers=4) as pool:
        for checked in [pool.submit(check, *case) for case in cases]:
            checked.result()  # a failed case's AssertionError, raised here
    busy = the_error(lockd("locks", "acquire", "j:busy", "--ttl", "1m", "--json", env=env))
    assert busy["status"] == 409 and busy["details"]["holder"]["owner"] == "first"


@pytest.mark.both_backends
def test_run_json_lease_lost_is_one_error_line(daemon: DaemonProcess) -> None:
    # COMMAND breaks its own key, then would go on for 5 s: --on-lost kill ends it first.
    script = 'lockd locks break "$LOCKD_KEY" --reason test >/dev/null; sleep 5'
    result = lockd(
        "run",
        "--json",
        "--ttl",
        "300ms",
        "--on-lost",
        "kill",
        "j:run-lost",
        "--",
        "sh",
        "-c",
        script,
        env={**daemon.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    assert result.returncode == 6, result.stderr
    error = the_error(result)
    assert (error["code"], error["status"]) == ("LEASE_LOST", 410)


@pytest.mark.parametrize(
    ("args", "warned"),
    [
        (["--wait", "10"], "--wait 10 is 10 ms; write 10s for seconds"),
        (["--wait", "999"], "--wait 999 is 999 ms; write 999s for seconds"),
        (["--wait", "1000"], None),
        (["--wait", "10s"], None),
        (["--wait", "0"], None),
        (["--wait", "500ms"], None),
    ],
)
def test_bare_numbers_below_1000_warn(
    daemon: DaemonProcess, args: list[str], warned: str | None
) -> None:
    result = lockd("locks", "acquire", f"bare:{args[1]}", "--ttl", "60000", *args, env=daemon.env)
    assert result.returncode == 0, result.stderr
    if warned is None:
        assert result.stderr == ""
    else:
        assert result.stderr == f"lockd: warning: {warned}\n"
    # Under --json stderr is kept for the one error document: no warning there.
    as_json = lockd(
        "locks", "acquire", f"bare2:{args[1]}", "--ttl", "60000", *args, "--json", env=daemon.env
    )
    assert as_json.returncode == 0 and as_json.stderr == ""


def test_run_ttl_bare_number_warns(daemon: DaemonProcess) -> None:
    result = lockd("run", "--ttl", "500", "bare:run", "--", "true", env=daemon.env)
    assert result.returncode == 0
    assert "--ttl 500 is 500 ms; write 500s for seconds" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_permission_denied_on_the_socket_names_owner_and_mode(
    daemon_paths: DaemonProcess,
) -> None:
    """A user who may not open the socket is told so (exit 3), not "start the daemon"."""
    daemon = daemon_paths.start()
    os.chmod(daemon.root, 0o755)  # the folder is open; the socket (0600, root) is not
    # The interpreter lives where nobody may not read: import everything as
    # root, then become nobody and run the command in the same process.
    code = (
        "import os, sys, json, pwd, grp, click, lockd.cli.root, lockd_client\n"
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "sys.argv = ['lockd', *sys.argv[1:]]\n"
        "lockd.cli.main()\n"
    )

    def whoami(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, "whoami", *extra],
            capture_output=True,
            text=True,
            timeout=60,
            env=daemon.env,
        )

    result = whoami()
    assert result.returncode == 3, result.stderr
    line = result.stderr.strip()
    assert "may not use its socket" in line and str(daemon.socket) in line
    assert "owner root" in line and "mode 0600" in line and "user nobody" in line
    assert "unavailable" not in line
    error = the_error(whoami("--json"))
    assert (error["code"], error["status"]) == ("LOCK_ACCESS_DENIED", 403)
    assert error["details"]["mode"] == "0600" and error["details"]["owner"] == "root"


@pytest.mark.parametrize(
    "command",
    [("locks", "status", "pipe:k"), ("locks", "status", "pipe:k", "--json"), ("locks", "list")],
    ids=["status (no click)", "status --json", "list (click)"],
)
def test_a_reader_gone_ends_the_command_quietly_with_141(
    daemon: DaemonProcess, command: tuple[str, ...]
) -> None:
    # ``lockd locks list | head -0``: stdout's reader is gone before lockd
    # writes. Like a tool SIGPIPE ends: status 141 and nothing on stderr --
    # not "unexpected error ... BrokenPipeError" and 70.
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [*LOCKD, *command],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=daemon.env,
        )
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, "")
