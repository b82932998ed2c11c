"""The record of the last run, kept outside the state folder (issue 21).

The database cannot testify to its own loss: a WAL cut short or damaged
makes SQLite stop, silently, at the last commit it can verify, and a state
folder deleted while the daemon runs takes the fence mark with it. So the
daemon keeps a second, tiny account of what it acknowledged in the
*runtime* folder, beside its socket (``/run/lockd``, ``$XDG_RUNTIME_DIR/lockd``):
a tmpfs that lives exactly as long as the boot, which is as long as any
lease can matter (a new boot drops every lease anyway).

What it holds, for one database (the file name carries a hash of the
database's absolute path, so daemons sharing a runtime folder keep apart):

- the boot id of the run that wrote it;
- ``seq``: how many lease rows were written (inserted or deleted); the
  database counts the same in ``meta`` by trigger, inside each commit. A
  start on a database whose count is below the record's lost commits it
  had acknowledged;
- ``fence``: the highest fence reserved (the fence mark's value, kept here
  too: the mark lives in the state folder, which may be the thing deleted);
- ``deadline``: the latest lease deadline (CLOCK_BOOTTIME ms) ever
  committed in this boot: after an accepted loss, no key is granted again
  before it, since any lost lease may have run until then.

Cost: the record is a shared memory map of its file. Each commit stores
one to three aligned 8-byte integers into it (no system call, well under a
microsecond); the kernel keeps the page, so ``kill -9`` cannot lose them.
An aligned 8-byte store is not torn, and each field on its own is only ever
a lower bound, so a crash between two stores leaves a record that is still
true. A power loss loses the record with the tmpfs, and with it every lease
it could speak for.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

_MAGIC = b"lockd-run-record\x00\x00\x00\x00\x00\x00\x00\x01"  # 24 bytes, version 1
_SIZE = 4096
_BOOT_AT = 24  # 40 bytes of ASCII boot id (36 used), NUL padded
_SEQ_AT = 64
_FENCE_AT = 72
_DEADLINE_AT = 80
_PATH_AT = 96  # u16 length, then the database's path (UTF-8), for people reading it
#: Native order and size: CPython packs a native "Q" with one 8-byte memcpy, a
#: single store at these aligned offsets (the standard-size packers store byte
#: by byte). The file never leaves the machine (it lives on a tmpfs).
_U64 = struct.Struct("Q")


class RunRecordError(Exception):
    """The record exists but cannot be read or written."""


@dataclass(frozen=True)
class LastRun:
    """What the record said at start."""

    boot_id: str
    seq: int
    fence: int
    deadline: int
    db: str


def record_path(runtime_dir: Path, db: Path) -> Path:
    """Where the record of database ``db`` lives in ``runtime_dir``."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(db))).hexdigest()[:16]
    return runtime_dir / f"lockd-run.{digest}"


class RunRecord:
    """The record file of one database; :meth:`read` at start, then :meth:`begin`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        #: the map as native 8-byte words: an item store is one aligned 8-byte
        #: store, and ~3x cheaper than struct.pack_into (measured: 57 vs 165 ns).
        self._words: memoryview | None = None
        self.seq = 0
        self.fence = 0
        self.deadline = 0
        #: the temporary file :meth:`reserve` opened for :meth:`begin`.
        self._reserved: int | None = None

    def read(self) -> LastRun | None:
        """The last run's record; None when there is none."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RunRecordError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()):
                # In a shared sticky folder (--socket /tmp/...) another user
                # could plant one: never trusted, said so like <socket>.lock.
                raise RunRecordError(
                    f"{self.path} is not a regular file of ours; remove it and start again"
                )
            data = f.read(_SIZE)
        if len(data) != _SIZE or not data.startswith(_MAGIC):
            raise RunRecordError(f"{self.path}: not a lockd run record (damaged?)")
        (length,) = struct.unpack_from("<H", data, _PATH_AT)
        return LastRun(
            boot_id=data[_BOOT_AT:_SEQ_AT].rstrip(b"\x00").decode("ascii", "replace"),
            seq=_U64.unpack_from(data, _SEQ_AT)[0],
            fence=_U64.unpack_from(data, _FENCE_AT)[0],
            deadline=_U64.unpack_from(data, _DEADLINE_AT)[0],
            db=data[_PATH_AT + 2 : _PATH_AT + 2 + length].decode("utf-8", "replace"),
        )

    def begin(self, boot_id: str, db: Path, *, seq: int, fence: int, deadline: int) -> None:
        """Write this run's record (atomically: temporary file, rename) and map it."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        page = bytearray(_SIZE)
        page[: len(_MAGIC)] = _MAGIC
        page[_BOOT_AT : _BOOT_AT + 40] = boot_id.encode("ascii")[:40].ljust(40, b"\x00")
        name = os.fsencode(os.path.abspath(db))[: _SIZE - _PATH_AT - 2]
        struct.pack_into("<H", page, _PATH_AT, len(name))
        page[_PATH_AT + 2 : _PATH_AT + 2 + len(name)] = name
        _U64.pack_into(page, _SEQ_AT, seq)
        _U64.pack_into(page, _FENCE_AT, fence)
        _U64.pack_into(page, _DEADLINE_AT, deadline)
        tmp = self._tmp()
        fd, self._reserved = self._reserved, None
        if fd is None:
            fd = self._open_tmp(tmp)
        try:
            os.write(fd, page)
            os.replace(tmp, self.path)
            self._map = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._words = memoryview(self._map).cast("Q")
        finally:
            os.close(fd)
        self.seq, self.fence, self.deadline = seq, fence, deadline

    def reserve(self) -> None:
        """Open the record's file now, for a :meth:`begin` that comes later.

        The daemon answers before its integrity check has passed and begins
        the record only then: opened on the start's path, the record does
        not need a descriptor at a moment when clients may hold every free
        one. An error here is left for :meth:`begin` to meet and report.
        """
        if self._reserved is None:
            try:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._reserved = self._open_tmp(self._tmp())
            except OSError:
                pass

    def _tmp(self) -> Path:
        return self.path.with_name(f".{self.path.name}.tmp")

    @staticmethod
    def _open_tmp(tmp: Path) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(tmp, flags, 0o600)

    def set_seq(self, seq: int) -> None:
        self.seq = seq
        if self._words is not None:
            self._words[_SEQ_AT // 8] = seq

    def set_fence(self, fence: int) -> None:
        if fence > self.fence:
            self.fence = fence
            if self._words is not None:
                self._words[_FENCE_AT // 8] = fence

    def set_deadline(self, deadline: int) -> None:
        if deadline > self.deadline:
            self.deadline = deadline
            if self._words is not None:
                self._words[_DEADLINE_AT // 8] = deadline

    def close(self) -> None:
        fd, self._reserved = self._reserved, None
        if fd is not None:  # reserved, never begun: the last run's record stays
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self._tmp())
        if self._words is not None:
            self._words.release()
            self._words = None
        if self._map is not None:
            self._map.close()
            self._map = None
