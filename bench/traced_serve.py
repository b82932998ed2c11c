"""``python [-X tracemalloc=1] bench/traced_serve.py CONTROL -m lockd ARGS...``: a measured lockd.

Runs ``python -m lockd ARGS`` in this process (the lockd that ``sys.path``
finds: the bench sets PYTHONPATH for another checkout), beside a thread that
waits on the FIFO ``CONTROL/ask``. Each line written there names a report:
the thread answers with ``CONTROL/NAME.json`` (written whole, then renamed)
holding what :func:`measure` sees in this process at that moment. No signal
and no change to lockd: the daemon only needs to be started this way.
``bench/memory_breakdown.py`` drives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import json
import linecache
import os
import runpy
import sys
import tempfile
import threading
import traceback
import tracemalloc
from pathlib import Path
from typing import Any

#: pymalloc's counters in sys._debugmallocstats(), by the start of their line.
_PYMALLOC_LINES = {
    "# bytes in allocated blocks": "allocated",
    "# bytes in available blocks": "available",
    "# bytes lost to pool headers": "pool_headers",
    "# bytes lost to quantization": "quantization",
    "# bytes lost to arena alignment": "arena_alignment",
    "Total": "arenas_total",
}
#: the other lines sys._debugmallocstats() prints without a "=".
_STATS_HEADINGS = ("Small block", "class", "---", " ", "arena map counts")


def pymalloc_stats() -> dict[str, int]:
    """pymalloc's arenas: bytes in use, free in used pools, in unused pools, lost.

    ``sys._debugmallocstats`` prints to the C stderr only, so fd 2 goes to a
    file for the call (a line the daemon logs meanwhile is passed back on).
    """
    stats: dict[str, int] = {}
    with tempfile.TemporaryFile("w+") as out:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        for line in out:
            name, sep, value = line.partition("=")
            key = name.strip()
            if sep and "unused pools *" in key:
                stats["unused_pools"] = int(value.replace(",", ""))
            elif sep and key in _PYMALLOC_LINES:  # the first "Total" is the arenas'
                stats.setdefault(_PYMALLOC_LINES[key], int(value.replace(",", "")))
            elif line.strip() and not sep and not line.startswith(_STATS_HEADINGS):
                sys.stderr.write(line)
    return stats


def sqlite_memory_used() -> int | None:
    """Bytes SQLite has allocated (page cache, statements, schema): sqlite3_memory_used()."""
    name = ctypes.util.find_library("sqlite3")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)  # the library _sqlite3 loaded: dlopen hands back the same one
    except OSError:
        return None
    lib.sqlite3_memory_used.restype = ctypes.c_int64
    return int(lib.sqlite3_memory_used())


def _category_of(obj: object) -> str | None:
    """Where an object of a lockd or sortedcontainers class is counted (None: elsewhere)."""
    module = type(obj).__module__
    if module.startswith("sortedcontainers"):
        return "key index (sortedcontainers)"
    if module.startswith("lockd"):
        return f"lockd objects: {type(obj).__name__}"
    return None


def objects_by_kind() -> dict[str, dict[str, int]]:
    """Every object the collector tracks, and what they refer to, grouped: bytes, count.

    ``sys.getsizeof`` (a list's and a dict's tables included). An object is
    counted once, in the first group that claims it:

    * a sortedcontainers object with its lists (the key index);
    * a list held by a lockd object under a name with ``heap`` in it, with
      its entries (tuples) and their ints (the timers' heaps);
    * a lockd object with its ``__dict__`` (by class);
    * arrays, bytes and bytearrays a lockd object holds (flat tables);
    * then the rest by type: ``str`` (keys, handles, principals, owners:
      shared strings once), ``int``, ``dict``, ``list``, ``tuple``, ...
    """
    groups: dict[str, list[int]] = {}
    seen: set[int] = set()
    # The daemon freezes what it made at start (gc.freeze): get_objects()
    # skips frozen objects, among them the engine's tables, so they are
    # thawed for the call and frozen again (with whatever is young now).
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    tracked = gc.get_objects()
    if frozen:
        gc.freeze()
    seen.update((id(groups), id(seen), id(tracked)))  # the walk's own, and the ids in seen

    def count(group: str, obj: object) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        entry = groups.setdefault(group, [0, 0])
        entry[0] += sys.getsizeof(obj)
        entry[1] += 1

    for obj in tracked:
        group = _category_of(obj)
        if group is None:
            continue
        if group.startswith("key index"):
            count(group, obj)
            for name in ("_lists", "_maxes", "_index", "_keys"):
                inner = getattr(obj, name, None)
                if isinstance(inner, list):
                    count(group, inner)
                    for item in inner:
                        if isinstance(item, list):
                            count(group, item)
            continue
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            count(group, attrs)
            values = list(attrs.items())
        else:
            values = [(n, getattr(obj, n, None)) for n in getattr(type(obj), "__slots__", ())]
        count(group, obj)
        for name, value in values:
            if "heap" in name and isinstance(value, list):
                count("timer heaps (list + entries)", value)
                for entry in value:
                    if isinstance(entry, tuple):
                        count("timer heaps (list + entries)", entry)
                        for part in entry:
                            if type(part) is int:
                                count("timer heaps (list + entries)", part)
                    elif type(entry) is int:
                        count("timer heaps (list + entries)", entry)
            elif isinstance(value, (bytes, bytearray)) or type(value).__name__ == "array":
                count("flat arrays and bytes (lockd)", value)
    for obj in tracked:
        if id(obj) in seen:
            continue
        count(type(obj).__name__, obj)
    for obj in tracked:  # untracked objects (str, int, float, ...) are found as referents
        if obj is seen or obj is groups:
            continue
        for ref in gc.get_referents(obj):
            if not gc.is_tracked(ref):
                count(type(ref).__name__, ref)
    del tracked
    return {name: {"bytes": b, "count": n} for name, (b, n) in groups.items()}


def _where(stat: tracemalloc.Statistic) -> str:
    """filename:lineno of an allocation site; ``<no Python frame>`` for one made from C alone."""
    if not len(stat.traceback):
        return "<no Python frame>:0"
    return f"{stat.traceback[0].filename}:{stat.traceback[0].lineno}"


def _source(stat: tracemalloc.Statistic) -> str:
    if not len(stat.traceback):
        return ""
    return linecache.getline(stat.traceback[0].filename, stat.traceback[0].lineno).strip()


def measure(sites: int = 60) -> dict[str, Any]:
    """This process now: RSS, pymalloc, SQLite, and tracemalloc's total and sites if tracing.

    Without tracemalloc, every object too (:func:`objects_by_kind`); under
    it pymalloc tells nothing (its stats are off while tracemalloc hooks
    the allocator) and the walk would take long, so a plain daemon is
    asked for those.
    """
    gc.collect()
    with open("/proc/self/status", encoding="ascii") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    report: dict[str, Any] = {
        "rss": rss_kb * 1024,
        "tracing": tracemalloc.is_tracing(),
        "pymalloc": pymalloc_stats(),
        "sqlite_memory_used": sqlite_memory_used(),
    }
    if tracemalloc.is_tracing():
        # What this module, linecache and tracemalloc keep (source lines read
        # for the sites, the last answer's leftovers) is not the daemon's.
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [
                tracemalloc.Filter(False, __file__),
                tracemalloc.Filter(False, linecache.__file__),
                tracemalloc.Filter(False, tracemalloc.__file__),
            ]
        )
        report["traced"] = sum(stat.size for stat in snapshot.statistics("filename"))
        report["tracemalloc_overhead"] = tracemalloc.get_tracemalloc_memory()
        by_line = snapshot.statistics("lineno")
        report["sites"] = [
            {"site": _where(stat), "line": _source(stat), "bytes": stat.size, "count": stat.count}
            for stat in by_line[:sites]
        ]
        report["files"] = {
            _where(stat).rsplit(":", 1)[0]: stat.size for stat in snapshot.statistics("filename")
        }
        del snapshot, by_line
    else:
        report["objects"] = objects_by_kind()  # last: its own allocations are not in the above
    return report


def _answer(control: Path) -> None:
    while True:
        with (control / "ask").open(encoding="utf-8") as ask:
            names = [line.strip() for line in ask if line.strip()]
        for name in names:
            try:
                text = json.dumps(measure())
            except Exception as e:  # the bench shows it rather than waiting in vain
                text = json.dumps({"error": repr(e), "where": traceback.format_exc()})
            (control / f"{name}.tmp").write_text(text)
            (control / f"{name}.tmp").rename(control / f"{name}.json")


def main() -> None:
    control = Path(sys.argv[1])
    if sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    here = str(Path(__file__).resolve().parent)
    with contextlib.suppress(ValueError):
        sys.path.remove(here)  # bench/ has modules of its own (common, run, ...)
    threading.Thread(target=_answer, args=(control,), daemon=True, name="breakdown").start()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
