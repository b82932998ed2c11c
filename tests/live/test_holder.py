"""The holder's process in status and list (docs/contract.md §12.2): who, and is it alive.

A client may name the process that uses its hold (``pid`` on acquire); the
daemon believes it only for the peer's parent or a descendant of the same
uid, and records its start time so that ``alive`` is about that very
process, not a later one with the same pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from lockd_client import LockClient

from lockd.daemon.protocol import MAX_PID, Acquire, ProtocolError, parse_request
from lockd.identity import verified_holder_pid
from lockd.run import guardian
from lockd.testing.daemon import LOCKD, DaemonProcess

from .test_cli_run import LOCKD_RUN, RUN_EXIT, wait_until

pytestmark = pytest.mark.both_backends

# -- the wire field ------------------------------------------------------------------------


def _acquire(**extra: Any) -> bytes:
    req = {"id": 1, "op": "tryAcquire", "key": "k", "ttlMs": 1000, **extra}
    return json.dumps(req).encode()


def test_pid_is_optional_and_parsed() -> None:
    plain = parse_request(_acquire())
    named = parse_request(_acquire(pid=4242))
    assert isinstance(plain, Acquire) and plain.pid is None
    assert isinstance(named, Acquire) and named.pid == 4242


@pytest.mark.parametrize("bad", [0, -1, MAX_PID + 1, "4242", True, 1.5, [1]])
def test_a_bad_pid_is_invalid_request_naming_the_field(bad: object) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(_acquire(pid=bad))
    assert info.value.code == "INVALID_REQUEST"
    assert info.value.details.get("field") == "pid"


# -- what the daemon believes --------------------------------------------------------------

#: A process tree: pid -> parent. 100 is the peer (the client that connected).
TREE = {1: 0, 50: 1, 100: 50, 101: 100, 102: 101, 200: 1}
UIDS = {1: 0, 50: 1000, 100: 1000, 101: 1000, 102: 1000, 200: 1000}


def believed(claimed: int | None, *, uids: dict[int, int] = UIDS) -> int:
    return verified_holder_pid(100, 1000, claimed, parent_of=TREE.get, uid_of=uids.get)


def test_no_claim_or_the_peer_itself_is_the_peer() -> None:
    assert believed(None) == 100
    assert believed(100) == 100


def test_the_peers_parent_and_descendants_are_believed() -> None:
    assert believed(50) == 50  # the shell that ran `lockd locks acquire`
    assert believed(101) == 101  # lockd run's COMMAND (a child of its guardian)
    assert believed(102) == 102


def test_anything_else_falls_back_to_the_peer() -> None:
    assert believed(200) == 100  # same uid, but no relation
    assert believed(1) == 100  # init: another uid, and not related
    assert believed(999) == 100  # no such process
    assert believed(101, uids={**UIDS, 101: 0}) == 100  # a descendant that is another user


# -- live: lockd locks acquire and lockd run -----------------------------------------------


def status(daemon: DaemonProcess, key: str) -> dict[str, Any]:
    out = subprocess.run(
        [*LOCKD, "locks", "status", key, "--json"],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=RUN_EXIT,
    )
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_locks_acquire_names_the_calling_shell_and_alive_follows_it(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The CLI exits at once; the holder shown is the shell that will use the handle."""
    said = tmp_path / "shell"
    acquire = subprocess.list2cmdline([*LOCKD, "locks", "acquire", "by-shell", "--ttl", "1m"])
    # The shell stays until its stdin closes.
    script = f"{acquire} >/dev/null && echo $$ > {said}; read line || :"
    shell = subprocess.Popen(["sh", "-c", script], env=daemon.env, stdin=subprocess.PIPE)
    assert shell.stdin is not None
    try:
        wait_until(said.exists, RUN_EXIT, "the shell to take the key")
        shell_pid = int(said.read_text())
        st = status(daemon, "by-shell")
        assert st["pid"] == shell_pid and st["process"] == "sh" and st["alive"] is True
        assert st["holders"][0]["alive"] is True
        table = subprocess.run(
            [*LOCKD, "locks", "list"], env=daemon.env, capture_output=True, text=True
        ).stdout
        assert str(shell_pid) in table and "(gone)" not in table
        shell.stdin.close()
        assert shell.wait(RUN_EXIT) == 0
        st = status(daemon, "by-shell")
        assert st["held"] and st["pid"] == shell_pid and st["alive"] is False
        listed = subprocess.run(
            [*LOCKD, "locks", "list", "--json"], env=daemon.env, capture_output=True, text=True
        )
        entry = json.loads(listed.stdout)["locks"][0]
        assert entry["pid"] == shell_pid and entry["alive"] is False
        table = subprocess.run(
            [*LOCKD, "locks", "list"], env=daemon.env, capture_output=True, text=True
        ).stdout
        assert f"{shell_pid} (gone)" in table
    finally:
        shell.stdin.close()
        if shell.poll() is None:
            shell.kill()
            shell.wait(5)


def test_a_claim_the_daemon_cannot_verify_records_the_peer(daemon: DaemonProcess) -> None:
    with LockClient(daemon.socket) as client:
        handle = client.try_acquire("unrelated", 60, pid=1)  # init: not ours to name
        assert handle is not None
        st = client.status("unrelated")
        assert st.pid == os.getpid() and st.raw["alive"] is True


def test_lockd_run_names_command_with_its_name_and_alive(daemon: DaemonProcess) -> None:
    """Not ``lockd`` (the wrapper): COMMAND, by its pid and name."""
    run = subprocess.Popen(
        [*LOCKD_RUN, "by-run", "--", "sleep", "60"], env=daemon.env, stderr=subprocess.PIPE
    )

    def command() -> int | None:
        for pid in guardian.descendants(run.pid):
            if guardian.process_name(pid) == "sleep" and Path(f"/proc/{pid}/exe").exists():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/exe").endswith("/sleep"):
                        return pid
        return None

    try:
        wait_until(lambda: command() is not None, RUN_EXIT, "COMMAND to run")
        command_pid = command()
        st = status(daemon, "by-run")
        assert st["pid"] == command_pid != run.pid
        assert st["process"] == "sleep" and st["alive"] is True
        assert st["holders"][0]["pid"] == command_pid
        table = subprocess.run(
            [*LOCKD, "locks", "status", "by-run"], env=daemon.env, capture_output=True, text=True
        ).stdout
        assert re.search(rf"^Pid:\s+{command_pid}$", table, re.M), table
        assert re.search(r"^Process:\s+sleep$", table, re.M), table
    finally:
        run.terminate()
        run.wait(RUN_EXIT)


@pytest.mark.parametrize("parent", [0, 1])
def test_locks_acquire_with_no_visible_caller_names_itself(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, parent: int
) -> None:
    """getppid() is 0 when the caller is outside our pid namespace (systemd-run,
    nspawn) and 1 when it is gone: the CLI then claims no pid and the daemon
    records the CLI itself, instead of refusing the acquire."""
    from click.testing import CliRunner

    from lockd.cli import main

    monkeypatch.setattr(os, "getppid", lambda: parent)
    key = f"no-caller-{parent}"
    result = CliRunner().invoke(
        main, ["locks", "acquire", key, "--ttl", "1m"], env={"LOCKD_SOCKET": str(daemon.socket)}
    )
    assert result.exit_code == 0, result.output
    assert status(daemon, key)["pid"] == os.getpid()
