"""Who holds a key, in the CLI (docs/contract.md §9, §10): PID and PROCESS columns, the mode,
every holder of a shared key or semaphore, and the busy message naming them.

The rendering is checked against status objects in docs/contract.md's wire format
(``holders``, ``mode``, ``limit``, ``pid``, ``process``), and the PID against
a real daemon, which records the holder's process at the grant.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from click.testing import CliRunner, Result
from lockd_client import LockClient, LockStatus

from lockd.cli import main
from lockd.testing.daemon import DaemonProcess

EXPIRES = "2026-12-01T12:00:00.000Z"


def holder(who: str, owner: str | None, fence: int, pid: int, process: str) -> dict[str, Any]:
    return {
        "heldBy": who,
        "owner": owner,
        "fence": fence,
        "leaseExpiresAt": EXPIRES,
        "expiresInMs": 30_000 + fence,
        "pid": pid,
        "process": process,
    }


def wire_status(key: str, mode: str, limit: int, holders: list[dict[str, Any]]) -> dict[str, Any]:
    first = holders[0]
    return {
        "key": key,
        "held": True,
        **first,
        "waiters": 2,
        "mode": mode,
        "limit": limit,
        "holderCount": len(holders),
        "holders": holders,
    }


SEMAPHORE = wire_status(
    "backups",
    "exclusive",
    3,
    [
        holder("user:root", "nightly", 11, 4242, "backup.sh"),
        holder("user:alice", None, 12, 4300, "rsync"),
        holder("service:db.service", "db", 13, 77, "pg_dump"),
    ],
)
READERS = wire_status(
    "config",
    "shared",
    1,
    [holder("user:bob", None, 5, 901, "cat"), holder("user:eve", None, 6, 902, "less")],
)


@pytest.fixture
def fake_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client answers from the wire documents above (no daemon needed)."""
    by_key = {s["key"]: s for s in (SEMAPHORE, READERS)}

    def status(self: LockClient, key: str) -> LockStatus:
        return LockStatus.from_result(by_key[key])

    def list_page(self: LockClient, *args: object) -> tuple[list[LockStatus], None]:
        return [LockStatus.from_result(s) for s in (SEMAPHORE, READERS)], None

    monkeypatch.setattr(LockClient, "status", status)
    monkeypatch.setattr(LockClient, "list_page", list_page)
    monkeypatch.setattr(LockClient, "try_acquire", lambda self, *a, **k: None)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--socket", "/nowhere"], prog_name="lockd")


def test_status_shows_mode_pid_process_and_every_holder(fake_daemon: None) -> None:
    result = invoke("locks", "status", "backups")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Held:     yes, by 3 holders" in out
    assert "Mode:     3 slots" in out
    assert "Pid:      4242" in out and "Process:  backup.sh" in out
    lines = out.splitlines()
    at = lines.index("Holders:")
    table = lines[at + 1 :]
    assert table[0].split() == ["HELD", "BY", "OWNER", "PID", "PROCESS", "FENCE", "EXPIRES", "IN"]
    assert table[2].split()[:5] == ["user:alice", "-", "4300", "rsync", "12"]
    assert table[3].split()[:5] == ["service:db.service", "db", "77", "pg_dump", "13"]


def test_list_has_a_row_per_holder(fake_daemon: None) -> None:
    result = invoke("locks", "list")
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split()[:8] == ["KEY", "MODE", "HELD", "BY", "OWNER", "PID", "PROCESS", "FENCE"]
    assert rows[0].split()[:8] == [
        "backups",
        "3",
        "slots",
        "user:root",
        "nightly",
        "4242",
        "backup.sh",
        "11",
    ]
    assert rows[0].split()[-1] == "2"  # waiters, on the key's first row
    assert rows[1].split()[:5] == ["user:alice", "-", "4300", "rsync", "12"]  # key left blank
    assert rows[3].split()[:6] == ["config", "shared", "user:bob", "-", "901", "cat"]
    assert rows[4].split()[:4] == ["user:eve", "-", "902", "less"]
    as_json = invoke("locks", "list", "--json")
    assert json.loads(as_json.stdout)["locks"][0]["holders"][2]["process"] == "pg_dump"


def test_busy_message_names_the_holders(fake_daemon: None) -> None:
    result = invoke("locks", "acquire", "backups", "--ttl", "1m", "--limit", "3")
    assert result.exit_code == 1
    line = result.stderr.strip()
    assert "3 holders (3 slots)" in line
    assert "user:root (owner nightly, pid 4242 backup.sh)" in line and "pid 77 pg_dump" in line
    as_json = invoke("locks", "acquire", "backups", "--ttl", "1m", "--limit", "3", "--json")
    details = json.loads(as_json.stderr)["error"]["details"]
    assert details["holderCount"] == 3 and details["limit"] == 3
    assert details["holder"]["pid"] == 4242 and details["holder"]["process"] == "backup.sh"


@pytest.mark.parametrize(
    "args",
    [
        ["locks", "acquire", "k", "--ttl", "1m", "--shared", "--limit", "2"],
        ["locks", "acquire", "k", "--ttl", "1m", "--limit", "0"],
        ["locks", "acquire", "k", "--ttl", "1m", "--limit", "1001"],
        ["run", "--limit", "2", "--shared", "k", "--", "true"],
    ],
)
def test_bad_shared_and_limit_are_usage_errors(args: list[str]) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert "limit" in result.stderr


@pytest.mark.both_backends
def test_status_and_busy_name_the_real_holders_pid(daemon: DaemonProcess) -> None:
    with LockClient(daemon.socket) as client:
        client.acquire("pid:k", ttl=60, timeout=1, owner="me")
        env = {"LOCKD_SOCKET": str(daemon.socket)}
        status = CliRunner().invoke(main, ["locks", "status", "pid:k"], env=env)
        assert f"Pid:      {os.getpid()}" in status.stdout
        busy = CliRunner().invoke(main, ["locks", "acquire", "pid:k", "--ttl", "1m"], env=env)
        assert busy.exit_code == 1 and f"pid {os.getpid()}" in busy.stderr
        listing = CliRunner().invoke(main, ["locks", "list", "--prefix", "pid:"], env=env)
        assert str(os.getpid()) in listing.stdout.splitlines()[1].split()
