"""One user must not shut out the others (issue 9, items 1 and 2), against real daemons.

Before: a member holding idle connections took every slot and everyone,
root included, was refused; a partial request line was kept for ever and
each stalled connection could pin ``max_line_bytes`` of memory. Now one uid
holds at most ``max_connections_per_uid`` connections, the last slots are
kept for owners, a refusal says why, and incomplete lines are bounded in
time and in total bytes.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lockd_client import LockClient

from lockd.testing.daemon import DaemonProcess
from lockd.testing.users import Accounts, Agent, User, missing_prerequisite, share_socket

SYSTEM_PYTHON = "/usr/bin/python3"

_WHY = missing_prerequisite()
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[User, User]]:
    with Accounts() as accounts:
        yield accounts.user(), accounts.user()


#: Opens up to N connections as its user, says hello on each, keeps them all
#: open, prints what each got, then waits for a line on stdin.
HOARDER = """
import json, socket, sys
path, count = sys.argv[1], int(sys.argv[2])
outcomes, kept = [], []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    kept.append(s)
    try:
        s.sendall(b'{"id": 1, "op": "hello"}\\n')
        line = s.makefile("rb").readline()
        reply = json.loads(line) if line else None
    except OSError as exc:
        reply = {"oserror": str(exc)}
    if reply is None:
        outcomes.append("closed")
    elif reply.get("ok"):
        outcomes.append("served")
    else:
        outcomes.append(reply.get("error", reply))
print(json.dumps(outcomes), flush=True)
sys.stdin.readline()
"""


class Hoarder:
    def __init__(self, user: User, socket_path: Path, count: int) -> None:
        self.proc = subprocess.Popen(
            [SYSTEM_PYTHON, "-c", textwrap.dedent(HOARDER), str(socket_path), str(count)],
            user=user.uid,
            group=user.gid,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.outcomes: list[Any] = json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _start(daemon: DaemonProcess, config: str) -> LockClient:
    daemon.write_config(config)
    daemon.start()
    share_socket(daemon.socket)
    return LockClient(str(daemon.socket))


def test_one_member_cannot_take_every_connection(
    daemon_paths: DaemonProcess, users: tuple[User, User]
) -> None:
    mallory, alice = users
    root = _start(daemon_paths, "max_connections = 40\nmax_connections_per_uid = 5\n")
    hoarder = Hoarder(mallory, daemon_paths.socket, 30)
    try:
        outcomes = hoarder.outcomes
        assert outcomes[:5] == ["served"] * 5
        refusals = outcomes[5:]
        assert len(refusals) == 25
        for refusal in refusals:  # a reply that says why, not a silent close
            assert refusal["code"] == "RATE_LIMITED", refusal
            assert refusal["details"] == {"limit": 5, "reason": "max_connections_per_uid"}
            assert "too many connections to uid" in refusal["message"]
        with Agent(alice, daemon_paths.socket) as agent:  # other members still get in
            assert agent.call("hello")["role"] == "member"
        assert root.hello()["role"] == "owner"
        assert root.stats()["counters"]["connectionsRefused"] >= 25
    finally:
        hoarder.close()
        root.close()
        daemon_paths.terminate()
    # A storm of refusals is one warning line per interval, not one per refusal.
    assert daemon_paths.read_log().count("reason=max_connections_per_uid") == 1


def test_the_last_slots_are_kept_for_owners(
    daemon_paths: DaemonProcess, users: tuple[User, User]
) -> None:
    mallory, alice = users
    root = _start(daemon_paths, "max_connections = 20\nmax_connections_per_uid = 100\n")
    assert root.hello()["role"] == "owner"
    hoarder = Hoarder(mallory, daemon_paths.socket, 30)
    try:
        served = hoarder.outcomes.count("served")
        assert served == 20 - 5 - 1  # the owner reserve, and root's own connection
        refused = [o for o in hoarder.outcomes if o != "served"]
        assert all(o["details"]["reason"] == "max_connections" for o in refused)
        with LockClient(str(daemon_paths.socket)) as second_root:  # root always gets in
            assert second_root.hello()["role"] == "owner"
        with Agent(alice, daemon_paths.socket) as agent:
            error = agent.error("hello")
        assert "too many connections to the daemon" in error.message
    finally:
        hoarder.close()
        root.close()
        daemon_paths.terminate()


def _partial(path: Path, data: bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(path))
    s.sendall(data)
    return s


def test_a_partial_line_is_closed_after_its_timeout(daemon_paths: DaemonProcess) -> None:
    root = _start(daemon_paths, "partial_line_timeout_ms = 500\n")
    try:
        idle = _partial(daemon_paths.socket, b"")
        stalled = _partial(daemon_paths.socket, b'{"id": 1, "op": "hel')
        reader = stalled.makefile("rb")
        line = reader.readline()  # before: nothing ever came (socket.timeout)
        error = json.loads(line)["error"]
        assert error["code"] == "INVALID_REQUEST"
        assert error["details"]["reason"] == "partial_line_timeout"
        assert reader.readline() == b""  # and the connection is closed
        # A connection idle between requests is not touched: idle was opened before
        # stalled, so had the bound wrongly applied to it, it would have been closed
        # before stalled's answer came.
        idle.sendall(b'{"id": 2, "op": "hello"}\n')
        assert json.loads(idle.makefile("rb").readline())["ok"] is True
        assert root.stats()["counters"]["connectionsStalled"] == 1
    finally:
        root.close()
        daemon_paths.terminate()


def test_incomplete_lines_are_bounded_in_total(daemon_paths: DaemonProcess) -> None:
    root = _start(daemon_paths, "max_buffered_bytes = 1048576\npartial_line_timeout_ms = 600000\n")
    chunk = b'{"id": 1, "op": "hello", "x": "' + b"a" * 60_000
    kept: list[socket.socket] = []
    try:
        for _ in range(40):
            kept.append(_partial(daemon_paths.socket, chunk))
        assert root.hello()["role"] == "owner"  # the daemon still serves
        answered: set[socket.socket] = set()
        while True:  # collect the refusals until none comes for a second
            ready, _, _ = select.select([s for s in kept if s not in answered], [], [], 1.0)
            if not ready:
                break
            answered.update(ready)
        for s in answered:
            line = s.makefile("rb").readline()
            assert json.loads(line)["error"]["details"]["reason"] == "max_buffered_bytes"
        closed = len(answered)
        held = len(kept) - closed
        assert held * len(chunk) <= 1_048_576 + len(chunk)  # at most the bound (plus the last)
        assert closed >= 40 - 1_048_576 // len(chunk) - 1
        assert root.stats()["counters"]["connectionsStalled"] == closed
    finally:
        for s in kept:
            s.close()
        root.close()
        daemon_paths.terminate()
