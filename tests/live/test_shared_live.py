"""Shared holds and semaphores against a real daemon, on the wire (docs/contract.md §10)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lockd.testing.polling import wait_for
from lockd.testing.wire import RawConn, check_error, unique

pytestmark = pytest.mark.both_backends


def my_process_name() -> str:
    return Path("/proc/self/comm").read_text().strip()


def take(conn: RawConn, rid: int, key: str, **args: Any) -> Any:
    return conn.result({"id": rid, "op": "tryAcquire", "key": key, "ttlMs": 60_000, **args})


def status(conn: RawConn, key: str) -> dict[str, Any]:
    result: dict[str, Any] = conn.result({"id": "st", "op": "status", "key": key})
    return result


def test_readers_share_a_key_and_a_writer_gets_it_after_the_last_one(
    conns: list[RawConn],
) -> None:
    key = unique("rw")
    r1, r2, writer, other = conns
    h1 = take(r1, 1, key, mode="shared")
    h2 = take(r2, 2, key, mode="shared")
    assert h1 and h2 and h2["fence"] > h1["fence"]
    writer.send({"id": 3, "op": "acquire", "key": key, "ttlMs": 60_000, "timeoutMs": 30_000})
    # Another connection: wait until the daemon has parked the writer.
    wait_for(lambda: status(other, key)["waiters"] == 1, timeout=10)
    st = status(other, key)
    assert (st["held"], st["mode"], st["limit"], st["holderCount"]) == (True, "shared", 1, 2)
    assert st["waiters"] == 1
    assert [h["fence"] for h in st["holders"]] == [h1["fence"], h2["fence"]]
    assert st["fence"] == h1["fence"]  # the singular fields are the oldest grant
    assert all("handle" not in h for h in st["holders"])
    assert all(h["pid"] == os.getpid() and h["process"] == my_process_name() for h in st["holders"])
    # A reader arriving behind the waiting writer does not overtake it.
    assert take(other, 4, key, mode="shared") is None
    assert r1.result({"id": 5, "op": "release", "key": key, "handle": h1["handle"]})["released"]
    assert r2.result({"id": 6, "op": "release", "key": key, "handle": h2["handle"]})["released"]
    granted = writer.reply()
    assert granted["id"] == 3 and granted["ok"], granted
    st = status(other, key)
    assert (st["mode"], st["holderCount"], st["fence"]) == (
        "exclusive",
        1,
        granted["result"]["fence"],
    )


def test_three_backups_at_a_time(conns: list[RawConn]) -> None:
    key = unique("backup")
    a, b, c, d = conns
    handles = [take(conn, i, key, limit=3) for i, conn in enumerate((a, b, c))]
    assert all(handles)
    assert take(d, 9, key, limit=3) is None  # no slot free
    st = status(d, key)
    assert (st["mode"], st["limit"], st["holderCount"]) == ("exclusive", 3, 3)
    assert b.result({"id": 10, "op": "release", "key": key, "handle": handles[1]["handle"]})[
        "released"
    ]
    assert take(d, 11, key, limit=3)


def test_contradicting_requests_are_refused_and_leave_the_holds_alone(
    conns: list[RawConn],
) -> None:
    key = unique("sem")
    a, b, _, _ = conns
    held = take(a, 1, key, limit=3, owner="run-1")
    before = status(b, key)
    for request, field, details in [
        ({"limit": 2}, "limit", {"limit": 3}),
        ({}, "limit", {"limit": 3}),  # limit 1 on a semaphore of 3
        ({"mode": "shared", "limit": 3}, "limit", {}),
        ({"mode": "read"}, "mode", {}),
        ({"limit": 1001}, "limit", {}),
    ]:
        reply = b.error(
            {"id": 2, "op": "acquire", "key": key, "ttlMs": 1000, "timeoutMs": 5000, **request}
        )
        error = check_error(reply, "INVALID_REQUEST", 400)
        assert error["details"]["field"] == field, (request, error)
        assert {k: error["details"][k] for k in details} == details
    # A re-take in another mode names the hold's mode and limit.
    reply = a.error({"id": 3, "op": "tryAcquire", "key": key, "ttlMs": 1000, "owner": "run-1"})
    error = check_error(reply, "INVALID_REQUEST", 400)
    assert error["details"]["field"] == "limit" and error["details"]["limit"] == 3
    after = status(b, key)
    assert after["holders"][0]["fence"] == held["fence"] and after["waiters"] == 0
    moving = ("expiresInMs", "leaseExpiresAt", "holders")  # wall time moves on
    assert {k: v for k, v in after.items() if k not in moving} == {
        k: v for k, v in before.items() if k not in moving
    }


def test_retake_of_a_shared_hold_with_another_mode_names_the_mode(conns: list[RawConn]) -> None:
    key = unique("retake")
    a = conns[0]
    take(a, 1, key, mode="shared", owner="job")
    reply = a.error({"id": 2, "op": "tryAcquire", "key": key, "ttlMs": 1000, "owner": "job"})
    error = check_error(reply, "INVALID_REQUEST", 400)
    assert error["details"] == {"field": "mode", "mode": "shared", "limit": 1}
    again = take(a, 3, key, mode="shared", owner="job")  # same mode: a re-take
    assert again and status(a, key)["holderCount"] == 1


def test_break_frees_every_holder_and_says_how_many(conns: list[RawConn]) -> None:
    key = unique("brk")
    first = take(conns[0], 1, key, mode="shared")
    take(conns[1], 2, key, mode="shared")
    broken = conns[2].result({"id": 3, "op": "break", "key": key, "reason": "test"})
    assert broken == {
        "broken": True,
        "holders": 2,
        "heldBy": "user:root",
        "owner": None,
        "fence": first["fence"],
    }
    st = status(conns[2], key)
    assert st["held"] is False and st["holders"] == [] and st["mode"] is None


def test_list_entries_show_every_holder(conns: list[RawConn]) -> None:
    prefix = unique("lst")
    take(conns[0], 1, f"{prefix}:a", limit=2)
    take(conns[1], 2, f"{prefix}:a", limit=2)
    take(conns[0], 3, f"{prefix}:b")
    listed = conns[2].result({"id": 4, "op": "list", "prefix": prefix})["locks"]
    assert [(e["key"], e["holderCount"], len(e["holders"])) for e in listed] == [
        (f"{prefix}:a", 2, 2),
        (f"{prefix}:b", 1, 1),
    ]
