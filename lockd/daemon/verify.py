"""Checks of the database's content that SQLite does not make (issue 21).

SQLite verifies the structure of its pages (``PRAGMA quick_check``) and the
checksums of WAL frames, but not the bytes of a row: a flipped bit in a
key, a fence or a deadline reads back as a valid, different lease. Every
lease row therefore carries ``chk``, the CRC-32 of its columns in a fixed
text form (:func:`row_checksum` writes it; :data:`ROW_TEXT_SQL` lets SQLite
build the same text at start, so only the CRC itself runs in Python).

A row is also looked up by its primary key: in a WITHOUT ROWID table the
interior pages hold copies of keys, and a damaged one hides rows from a
lookup that a scan still finds (``quick_check`` does not compare them).

:func:`inspect` runs every check on one connection and reports what it
found; the store decides what it means (:mod:`lockd.daemon.store`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import zlib
from dataclasses import dataclass, field
from pathlib import Path

#: Separates the columns in the checksummed text; NULL is written as _NULL.
_SEP = "\x1f"
_NULL = "\x1e"

#: The checksummed text of a row, built by SQLite (integers as decimal text,
#: as Python's ``str`` writes them).
ROW_TEXT_SQL = " || char(31) || ".join(
    (
        "key",
        "slot",
        "handle",
        "fence",
        "ifnull(owner, char(30))",
        "principal",
        "ttl_ms",
        "expires_at",
        "boot_id",
        "mode",
        "hold_limit",
        "ifnull(pid, char(30))",
        "ifnull(process, char(30))",
    )
)


def row_checksum(
    key: str,
    slot: int,
    handle: str,
    fence: int,
    owner: str | None,
    principal: str,
    ttl_ms: int,
    expires_at: int,
    boot_id: str,
    mode: str,
    limit: int,
    pid: int | None,
    process: str | None,
) -> int:
    """The ``chk`` of a lease row (~1 us: one f-string and one CRC)."""
    owner_text = _NULL if owner is None else owner
    pid_text = _NULL if pid is None else pid
    process_text = _NULL if process is None else process
    text = (
        f"{key}\x1f{slot}\x1f{handle}\x1f{fence}\x1f{owner_text}\x1f{principal}\x1f{ttl_ms}"
        f"\x1f{expires_at}\x1f{boot_id}\x1f{mode}\x1f{limit}\x1f{pid_text}\x1f{process_text}"
    )
    return zlib.crc32(text.encode())


@dataclass
class Findings:
    """What :func:`inspect` found in a database."""

    #: ``PRAGMA user_version`` (0: a new, empty file).
    version: int = 0
    #: rows written so far, as the database counts them (None before schema 3).
    seq: int | None = None
    #: the fence kept in ``meta``.
    fence: int = 0
    #: rows in the lease table.
    rows: int = 0
    #: ``quick_check``'s complaints (empty: the structure is sound).
    structure: list[str] = field(default_factory=list)
    #: (key as stored, slot) of rows whose checksum does not match.
    damaged: list[tuple[bytes, int]] = field(default_factory=list)
    #: rows a scan finds that a lookup by their key does not.
    unreachable: int = 0

    @property
    def sound(self) -> bool:
        return not (self.structure or self.damaged or self.unreachable)

    def describe(self) -> str:
        """One line: what is wrong (for the refusal and the log)."""
        parts = []
        if self.structure:
            shown = "; ".join(" ".join(p.split()) for p in self.structure[:3])  # one line
            parts.append(f"failed its integrity check: {shown}")
        if self.damaged:
            parts.append(f"{len(self.damaged)} of {self.rows} lease rows fail their checksum")
        if self.unreachable:
            parts.append(f"{self.unreachable} lease rows cannot be found by their key")
        return ", ".join(parts)


#: The first schema version whose rows carry ``chk`` and whose ``meta`` counts ``seq``.
CHECKED_SINCE = 3


def inspect(conn: sqlite3.Connection, *, structure: bool = True) -> Findings:
    """Run every check on ``conn``; raises sqlite3.Error when the file cannot be read."""
    found = Findings()
    found.version = conn.execute("PRAGMA user_version").fetchone()[0]
    if structure:
        problems = [str(row[0]) for row in conn.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            found.structure = problems
            return found  # reading rows of a damaged tree tells nothing more
    if found.version == 0:
        return found
    found.fence = conn.execute("SELECT value FROM meta WHERE name = 'fence'").fetchone()[0]
    if found.version < CHECKED_SINCE:
        found.rows = conn.execute("SELECT count(*) FROM leases").fetchone()[0]
        return found
    found.seq = conn.execute("SELECT seq FROM meta WHERE name = 'fence'").fetchone()[0]
    crc32 = zlib.crc32
    old_factory = conn.text_factory
    conn.text_factory = bytes  # damaged text may not even be UTF-8
    try:
        rows = conn.execute(f"SELECT chk, {ROW_TEXT_SQL}, CAST(key AS BLOB), slot FROM leases")
        while batch := rows.fetchmany(8192):
            found.rows += len(batch)
            found.damaged.extend(
                (key, slot) for chk, text, key, slot in batch if text is None or crc32(text) != chk
            )
    finally:
        conn.text_factory = old_factory
    found.unreachable = conn.execute(
        "SELECT count(*) FROM leases AS a WHERE NOT EXISTS "
        "(SELECT 1 FROM leases AS b WHERE b.key = a.key AND b.slot = a.slot)"
    ).fetchone()[0]
    return found


def inspect_readonly(path: Path) -> Findings:
    """:func:`inspect` on a read-only connection that sees the WAL: it writes nothing.

    The daemon's own connection would checkpoint the WAL into the database
    (and delete the WAL) when closed after a refusal, which destroys what
    the operator needs to look at. A read-only connection cannot
    checkpoint; it needs a ``-shm`` index, which is removed again when this
    made it. Raises sqlite3.Error.
    """
    shm = path.with_name(path.name + "-shm")
    had_shm = shm.exists()
    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=0)
    try:
        return inspect(conn)
    finally:
        conn.close()
        if not had_shm:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm)
