"""The fence high-water mark, kept beside the database but outside it.

A fence must never go backwards: that is its whole point. The database
keeps the fence, but a database can be lost (deleted with its folder while
the daemon runs, restored from an old backup, its WAL deleted or damaged),
and a daemon that starts on what is left would hand out fences it already
gave. So the mark lives in a second small file, ``<db>.fence``, written
apart from SQLite:

- **Reserved in blocks.** Before the first commit of a fence above the
  reserved value, the database's files are fsynced and the mark is
  rewritten (temporary file, fsync, rename, fsync of the folder) with two
  numbers: ``reserved = fence + BLOCK``, above every fence that will be
  handed out until the next write, and ``floor``, the highest fence the
  database durably holds at that moment. One such write per :data:`BLOCK`
  grants; the hot path only compares two integers.
- **Checked at start.** An intact database holds at least ``floor``. One
  below it was lost or rolled back: :func:`check_at_start` refuses to
  start, and the daemon never runs with a fence lower than the mark. With
  the operator's explicit consent (``lockd serve --adopt-fence-mark``) it
  starts anyway and continues above the mark.
- **Restarts skip ahead.** The engine starts at ``max(database fence,
  reserved)``: a fence acknowledged but lost with the database's last
  commits (a power loss, a WAL deleted or damaged) is never handed out
  again. Fences stay strictly increasing, not contiguous, across restarts.
- **A clean stop records the floor** (:meth:`Store.close`), so a database
  lost or rolled back while the daemon was stopped is noticed at the next
  start even when fewer than :data:`BLOCK` grants happened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Fences reserved per write of the mark (one fsync pair per BLOCK grants).
BLOCK = 10_000
_MAGIC = "lockd-fence-mark 1"


class FenceMarkError(Exception):
    """The mark cannot be read or written, or the database is below it."""


@dataclass
class FenceMark:
    path: Path
    #: Every fence granted so far is at most this (0: no mark yet).
    reserved: int = 0
    #: The database durably held at least this fence when the mark was written.
    floor: int = 0

    @classmethod
    def beside(cls, db_path: Path) -> FenceMark:
        return cls(db_path.with_name(db_path.name + ".fence"))

    def read(self) -> tuple[int, int] | None:
        """``(reserved, floor)`` on disk, None when there is no mark file."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise FenceMarkError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        with open(fd, encoding="ascii", errors="replace") as f:
            text = f.read(200)
        lines = text.split("\n")
        if len(lines) < 3 or lines[0] != _MAGIC or not (lines[1] + lines[2]).isdigit():
            raise FenceMarkError(f"{self.path}: not a lockd fence mark (damaged?)")
        return int(lines[1]), int(lines[2])

    def write(self, reserved: int, floor: int) -> None:
        """Durably replace the mark; raises OSError."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600)
        try:
            os.write(fd, f"{_MAGIC}\n{reserved}\n{floor}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self.reserved = reserved
        self.floor = floor


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_at_start(mark: FenceMark, db_fence: int, *, adopt: bool = False) -> int:
    """The fence the engine starts from; raises FenceMarkError when the database is below the mark.

    Reads the mark file into ``mark.reserved`` (no file: the database's
    fence is all there is, and the first grant writes the mark).
    """
    on_disk = mark.read()
    if on_disk is None:
        return db_fence
    mark.reserved, mark.floor = on_disk
    if db_fence < mark.floor and adopt:
        # The operator accepts this database: it is the floor from now on.
        try:
            mark.write(mark.reserved, db_fence)
        except OSError as exc:
            raise FenceMarkError(f"{mark.path}: cannot write: {exc.strerror or exc}") from None
    elif db_fence < mark.floor:
        raise FenceMarkError(
            f"the database's fence ({db_fence}) is below the fence it held for sure "
            f"({mark.floor}, recorded in {mark.path}): the database was deleted, replaced, "
            "rolled back or damaged, and starting on it would hand out fences again. "
            "See 'Lost or damaged database' in docs/operations.md "
            "(lockd serve --adopt-fence-mark continues above the mark)"
        )
    return max(db_fence, mark.reserved)
