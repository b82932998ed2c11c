"""The store's files on disk: checked before SQLite opens them, watched while it has them.

SQLite opens an empty or damaged file as a new database without a word, and
keeps writing to a file that was deleted or replaced under it: either way
what was acknowledged would be gone at the next start. The checks before
opening refuse such files (:class:`~lockd.daemon.storeerrors.StoreError`);
:class:`FileWatch` notices the files we write vanish while the daemon runs.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

from lockd.daemon.storeerrors import StorageUnavailable, StoreError
from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.store")


class FileWatch:
    """Whether the database and WAL files we opened are still the ones at their paths.

    Deleted (``st_nlink == 0`` for the open file) or replaced, every later
    commit would vanish at the next restart: from the first failed
    :meth:`check_files` on, :attr:`lost` says why, and every write fails as
    :class:`StorageUnavailable` until a restart. ``watching`` is False for an
    in-memory database (no files).
    """

    def __init__(self, path: Path, watching: bool) -> None:
        self.watching = watching
        #: path -> (st_dev, st_ino) of the files we write, to notice them vanish.
        self._identities: dict[Path, tuple[int, int]] = {}
        #: why the files are no longer ours, once a check found it (then no writes).
        self.lost: str | None = None
        self.wal = path.with_name(path.name + "-wal")

    def remember_identity(self, path: Path) -> None:
        st = os.stat(path)
        self._identities[path] = (st.st_dev, st.st_ino)

    def check_files(self) -> None:
        """Raise :class:`StorageUnavailable` if a file we write was deleted or replaced."""
        if self.lost is not None:
            raise StorageUnavailable(self.lost)
        if not self.watching:
            return
        if self.wal not in self._identities and self.wal.exists():
            self.remember_identity(self.wal)
        for path, identity in self._identities.items():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if st is None or (st.st_dev, st.st_ino) != identity:
                self.lost = (
                    f"{path} was deleted or replaced while lockd had it open: "
                    "nothing written now would survive a restart"
                )
                raise StorageUnavailable(self.lost)


#: The first 16 bytes of every SQLite database file.
_SQLITE_HEADER = b"SQLite format 3\x00"
#: The first 4 bytes of a WAL file (big-endian magic, either checksum order).
_WAL_MAGICS = (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")


def check_files_before_open(db: Path) -> None:
    """Refuse a database or WAL that SQLite would quietly treat as empty.

    SQLite opens a zero-length file as a new database and ignores a WAL
    whose header is damaged: either way the leases and the fence would be
    gone without a word. A missing file is fine (a new database).
    """
    for path, magics, what in (
        (db, (_SQLITE_HEADER,), "not a SQLite database"),
        (db.with_name(db.name + "-wal"), _WAL_MAGICS, "not a SQLite WAL"),
    ):
        try:
            with path.open("rb") as f:
                head = f.read(len(magics[0]))
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        if path == db and not head:
            raise StoreError(f"{path} is empty (0 bytes): it was truncated or damaged")
        if head and head not in magics:
            raise StoreError(f"{path} is damaged: {what} (its first bytes are wrong)")


def open_failed(path: Path, exc: sqlite3.Error) -> StoreError:
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return StoreError(f"{path} is in use by another process (another lockd on this database?)")
    return StoreError(f"{path}: {exc}")


def prepare_directory(directory: Path) -> None:
    """Create the state directory private to the daemon's user."""
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    mode = directory.stat().st_mode & 0o777
    if mode & 0o077 and directory.stat().st_uid == os.getuid():
        log.warning(kv(event="state_dir_open", dir=directory, mode=oct(mode), hint="chmod 700 it"))
