"""bench/memory_breakdown.py and the wrapper it runs lockd under (bench/traced_serve.py)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from bench import memory_breakdown, traced_serve
from lockd.daemon.deadlines import Deadlines


def test_pymalloc_stats_read_the_arenas() -> None:
    stats = traced_serve.pymalloc_stats()
    assert stats["allocated"] > 0
    assert stats["arenas_total"] >= stats["allocated"] + stats["available"]
    assert "unused_pools" in stats


def test_sqlite_memory_used_counts_an_open_database() -> None:
    import sqlite3

    before = traced_serve.sqlite_memory_used()
    assert before is not None
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("create table t (k text)")
        conn.executemany("insert into t values (?)", ((f"key{i}",) for i in range(2000)))
        after = traced_serve.sqlite_memory_used()
        assert after is not None and after > before
    finally:
        conn.close()


def test_objects_by_kind_finds_frozen_heaps_and_their_entries() -> None:
    deadlines = Deadlines({})
    deadlines.lease_heap.extend((10**12 + i, 10**9 + i, None) for i in range(500))  # type: ignore[misc]
    gc.freeze()  # as the daemon does after its start: get_objects() alone would miss it
    try:
        groups = traced_serve.objects_by_kind()
        assert gc.get_freeze_count() > 0, "the walk must leave the frozen objects frozen"
    finally:
        gc.unfreeze()
    heaps = groups["timer heaps (list + entries)"]
    # the list, 500 tuples and their 1,000 big ints (None is shared, not an entry's)
    assert heaps["count"] >= 1 + 500 + 1000
    assert groups["lockd objects: Deadlines"]["count"] >= 1
    assert deadlines.lease_heap  # kept alive until here


def _answer(rss: int, traced: int, sqlite: int, free: int, leases: int) -> dict[str, Any]:
    return {
        "rss": rss,
        "traced": traced,
        "tracemalloc_overhead": traced // 2,
        "sqlite_memory_used": sqlite,
        "pymalloc": {"allocated": traced, "available": free},
        "sites": [{"site": "/x/lockd/daemon/keytable.py:9", "line": "Lease(", "bytes": traced}],
        "objects": {"lockd objects: Lease": {"bytes": 100 * leases, "count": leases}},
    }


def test_breakdown_rows_add_up_to_the_plain_daemons_rss() -> None:
    plain = {"before": _answer(1000, 0, 10, 5, 0), "after": _answer(9000, 0, 410, 105, 10)}
    traced = {"before": _answer(3000, 100, 0, 0, 0), "after": _answer(20000, 5100, 0, 0, 10)}
    per = memory_breakdown.breakdown(plain, traced, count=10)
    assert per["rss_plain"] == 800
    assert per["traced"] == 500
    assert per["sqlite"] == 40
    assert per["pymalloc_slack"] == 10
    assert per["rest"] == 800 - 500 - 40 - 10
    assert per["rss_traced"] == 1700
    assert per["lease_objects"] == 10
    assert per["objects"] == {"lockd objects: Lease": 100}
    assert per["sites"][0][0] == "lockd/daemon/keytable.py:9"


@pytest.mark.parametrize("tracing", [False, True])
def test_a_measured_daemon_answers_before_and_after_a_fill(tracing: bool) -> None:
    result = memory_breakdown.measured(None, 200, tracing=tracing)
    before, after = result["before"], result["after"]
    assert after["rss"] > 0 and before["rss"] > 0
    if tracing:
        assert after["traced"] > before["traced"]
        assert any("lockd/" in site["site"] for site in after["sites"])
    else:
        leases = after["objects"]["lockd objects: Lease"]["count"]
        assert leases - before["objects"].get("lockd objects: Lease", {}).get("count", 0) == 200
        assert after["pymalloc"]["allocated"] > 0
