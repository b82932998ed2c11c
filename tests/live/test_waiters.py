"""Who waits for whom (issue 24, docs/contract.md §12): ``waiterList`` in status and list,
the CLI's queue table, the live wait line, and ``lockd locks top``, on both
backends. (Members listing their own holds and waits: tests/live/test_access.py.)"""

from __future__ import annotations

import io
import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from lockd_client import LockStatus

from lockd.cli import main
from lockd.cli.top import rates, render_frame
from lockd.daemon.waiterview import QueuedWaiter, concerns, waiter_list
from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for
from lockd.testing.wire import RawConn, unique
from lockd.waitline import WaitLine, wait_text

pytestmark = pytest.mark.both_backends


def _status(conn: RawConn, key: str) -> dict[str, Any]:
    result: dict[str, Any] = conn.result({"id": "s", "op": "status", "key": key})
    return result


def _park(conn: RawConn, rid: int, key: str, **args: Any) -> None:
    conn.send(
        {"id": rid, "op": "acquire", "key": key, "ttlMs": 60_000, "timeoutMs": 30_000, **args}
    )


def _queued(conn: RawConn, key: str, count: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def ready() -> bool:
        seen.update(_status(conn, key))
        return bool(seen.get("waiters") == count)

    wait_for(ready, 15)
    return seen


def test_status_lists_waiters_in_queue_order(conns: list[RawConn]) -> None:
    holder, first, second, watcher = conns
    key = unique("wl")
    held = holder.result({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60_000})
    assert held is not None
    before = datetime.now(UTC)
    _park(first, 2, key)
    _queued(watcher, key, 1)
    _park(second, 3, key, mode="shared")
    status = _queued(watcher, key, 2)
    entries = status["waiterList"]
    assert [e["position"] for e in entries] == [1, 2]
    assert [e["mode"] for e in entries] == ["exclusive", "shared"]
    comm = Path("/proc/self/comm").read_text().strip()
    for entry in entries:
        assert entry["principal"] == "user:root"
        assert entry["pid"] == os.getpid() and entry["process"] == comm
        assert entry["limit"] == 1
        since = datetime.fromisoformat(entry["since"])
        assert before.timestamp() - 1 <= since.timestamp() <= datetime.now(UTC).timestamp() + 1
        assert 0 <= entry["waitingMs"] < 60_000
        assert "handle" not in entry
    # A release hands the key to position 1; the shared request is next.
    holder.result({"id": 4, "op": "release", "key": key, "handle": held["handle"]})
    granted = first.reply()
    assert granted["ok"] is True
    status = _queued(watcher, key, 1)
    assert [(e["position"], e["mode"]) for e in status["waiterList"]] == [(1, "shared")]
    first.result({"id": 5, "op": "release", "key": key, "handle": granted["result"]["handle"]})
    assert second.reply()["ok"] is True


def test_list_entries_carry_the_waiter_list(conns: list[RawConn]) -> None:
    holder, waiter, watcher, _ = conns
    key = unique("wlist")
    assert holder.result({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60_000}) is not None
    _park(waiter, 2, key)
    _queued(watcher, key, 1)
    listed = watcher.result({"id": 3, "op": "list", "prefix": key})
    (entry,) = listed["locks"]
    assert entry["waiters"] == 1 and entry["waiterList"][0]["position"] == 1


def test_free_key_has_an_empty_waiter_list(conns: list[RawConn]) -> None:
    status = _status(conns[0], unique("free"))
    assert status["waiters"] == 0 and status["waiterList"] == []


def test_cli_status_and_top_show_the_queue(lockd: DaemonProcess, conns: list[RawConn]) -> None:
    holder, waiter, watcher, _ = conns
    key = unique("cli")
    assert holder.result({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60_000}) is not None
    _park(waiter, 2, key, limit=1)
    _queued(watcher, key, 1)
    sock = str(lockd.socket)
    status = CliRunner().invoke(main, ["locks", "status", key, "--socket", sock])
    assert status.exit_code == 0, status.output
    lines = status.stdout.splitlines()
    queue_at = lines.index("Queue:")
    assert lines[queue_at + 1].split()[:2] == ["POS", "WAITER"]
    assert lines[queue_at + 2].split()[:3] == ["1", "user:root", str(os.getpid())]
    top = CliRunner().invoke(main, ["--socket", sock, "locks", "top", "--once", "--prefix", key])
    assert top.exit_code == 0, top.output
    frame = top.stdout
    assert frame.startswith("lockd top - ") and "1 keys held, 1 waiting" in frame
    assert "grants 0.0/s" in frame and "hand-offs 0.0/s" in frame  # root reads stats
    assert f"{key}  [exclusive]" in frame and "POS" in frame and "\x1b" not in frame


def test_wait_line_names_holder_and_position(lockd: DaemonProcess, conns: list[RawConn]) -> None:
    holder = conns[0]
    key = unique("line")
    held = holder.result({"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60_000})
    assert held is not None
    from lockd_client import LockClient

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    ours = "1st of 1 in the queue"
    freed: list[BaseException] = []

    def release_once_drawn() -> None:
        # The holder lets go once the line has shown our place, not after a
        # fixed wait: the first draw comes 0.5 s in, later on a loaded box.
        try:
            wait_for(lambda: ours in out.getvalue(), timeout=60, what="the line to show our place")
        except BaseException as exc:
            freed.append(exc)
        holder.result({"id": 2, "op": "release", "key": key, "handle": held["handle"]})

    line = WaitLine(key, str(lockd.socket), stream=out)
    releaser = threading.Thread(target=release_once_drawn)
    with LockClient(str(lockd.socket)) as client, line:
        assert line.enabled
        releaser.start()
        client.acquire(key, ttl=5, timeout=120)
    releaser.join()
    assert not freed, freed
    text = out.getvalue()
    assert text.endswith("\r\x1b[K")  # erased before anything else is printed
    drawn = [part for part in text.split("\r\x1b[K") if part]
    shown = next(part for part in drawn if ours in part)
    assert shown.startswith("waiting ") and f"for '{key}': held by user:root" in shown


# --------------------------------------------------------------------- plain functions


def test_wait_line_is_silent_off_a_terminal() -> None:
    assert not WaitLine("k", None, stream=io.StringIO()).enabled


def test_waiter_list_and_member_visibility() -> None:
    waiters = [
        QueuedWaiter("user:a", 1, "sh", "exclusive", 1, 1_000),
        QueuedWaiter("user:b", None, None, "shared", 1, None, node="web-2"),
    ]
    entries = waiter_list(waiters, 4_000)
    assert entries[0]["since"] == "1970-01-01T00:00:01.000Z" and entries[0]["waitingMs"] == 3000
    assert entries[1]["since"] is None and entries[1]["node"] == "web-2"
    assert "node" not in entries[0]
    assert len(waiter_list([waiters[0]] * 150, 0)) == 100
    entry = {"holders": [{"heldBy": "user:c"}], "waiterList": entries}
    assert concerns(entry, "user:b") and concerns(entry, "user:c") and not concerns(entry, "user:d")


def test_top_frame_and_rates() -> None:
    status = LockStatus.from_result(
        {
            "key": "k",
            "held": True,
            "heldBy": "user:a",
            "waiters": 2,
            "mode": "exclusive",
            "limit": 1,
            "holderCount": 1,
            "holders": [{"heldBy": "user:a", "fence": 3, "pid": 7, "expiresInMs": 5000}],
            "waiterList": [
                {
                    "principal": "user:b",
                    "pid": 8,
                    "mode": "exclusive",
                    "limit": 1,
                    "waitingMs": 1500,
                    "position": 1,
                },
            ],
        }
    )
    per_second = rates({"grants": 10, "handoffs": 2}, {"grants": 30, "handoffs": 12}, 2.0)
    assert per_second is not None and per_second["grants"] == 10 and per_second["handoffs"] == 5
    frame = render_frame([status], per_second, now="10:00:00")
    lines = frame.splitlines()
    assert lines[0] == "lockd top - 10:00:00 - 1 keys held, 2 waiting"
    assert lines[1].startswith("grants 10.0/s, hand-offs 5.0/s")
    assert "k  [exclusive]" in lines
    assert any(line.split()[:3] == ["1", "user:b", "8"] for line in lines)
    assert lines[-1] == "  ... 1 more waiting"
    assert "rates: -" in render_frame([], None, now="x")
    text = wait_text(status, 12_000, pid=8)
    assert text.startswith("waiting 12s for 'k': held by user:a") and "1st of 2" in text


def test_shared_request_behind_a_queued_writer_says_so(
    lockd: DaemonProcess, conns: list[RawConn]
) -> None:
    reader, writer, watcher, _ = conns
    key = unique("behind")
    took = reader.result(
        {"id": 1, "op": "tryAcquire", "key": key, "ttlMs": 60_000, "mode": "shared"}
    )
    assert took is not None
    _park(writer, 2, key)  # an exclusive request queues behind the reader
    _queued(watcher, key, 1)
    busy = CliRunner().invoke(
        main, ["locks", "acquire", key, "--shared", "--socket", str(lockd.socket)]
    )
    assert busy.exit_code == 1
    line = busy.stderr.strip()
    assert "1 queued ahead (user:root, exclusive)" in line
    assert "a shared request never overtakes a queued exclusive one" in line


def test_member_sees_only_entries_it_holds_or_waits_for() -> None:
    from lockd.daemon.service import visible_locks
    from lockd.identity import Caller

    def caller(role: str, name: str) -> Caller:
        return Caller("user", name, role, 1000, 1000, 1, frozenset())  # type: ignore[arg-type]

    entries = [
        {"key": "a", "heldBy": "user:alice", "holders": [{"heldBy": "user:alice"}]},
        {
            "key": "b",
            "heldBy": "user:bob",
            "holders": [],
            "waiterList": [{"principal": "user:alice"}],
        },
        {"key": "c", "heldBy": "user:bob", "holders": [{"heldBy": "user:bob"}], "waiterList": []},
    ]
    assert [e["key"] for e in visible_locks(caller("member", "alice"), entries)] == ["a", "b"]
    assert [e["key"] for e in visible_locks(caller("admin", "carol"), entries)] == ["a", "b", "c"]
    assert visible_locks(caller("member", "dave"), entries) == []
