"""Rule files on disk: finding, reading, TOML parsing, and line:column for errors.

The part of docs/contract.md §5 that knows nothing about CEL. :mod:`lockd.rules.policy` asks
this module for the ``*.toml`` files of a ``rule-sets/`` folder and their
bytes, parses each with :func:`parse_toml`, and reports every problem as a
:class:`RuleSetError` carrying file, line and column.

Why it is built this way:

- **Fail closed.** An unreadable file or folder is a :class:`RuleSetError`,
  not "no rules": the daemon must never fall back to "open" by mistake. A
  missing folder, or a file removed between listing and reading, does count
  as absent.
- **Positions without a position-keeping parser.** ``tomllib`` keeps no
  positions, so :class:`RuleSource` finds where a key is written with a
  best-effort scanner (:func:`_locate`) and maps an offset inside a decoded
  TOML string (what CEL parsed) back to the file (:func:`_string_offsets`).
- **No celpy here.** Importing this module is cheap, so code that only needs
  file names (:func:`is_rule_file_name`) need not pay for the CEL grammar.
- **Only regular files, read without blocking, of bounded size.** A FIFO
  named ``x.toml`` would hang the daemon in ``open()``, a symlink to
  ``/dev/zero`` would eat memory, a huge file would stall the loop: each
  file is opened ``O_NONBLOCK | O_NOFOLLOW``, must be a regular file, and is
  read up to :data:`MAX_RULE_FILE_BYTES`; anything else is a load error
  naming the file.
- **Nobody else may write the policy.** For the daemon (``trusted_owners``
  given), a ``rule-sets/`` folder, a folder above it (up to ``/``) or a rule
  file that another user owns or can write is a load error: a member who can
  delete or rename the policy opens the namespace. ``lockd rules check``
  reads any file it is pointed at.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- errors


class RuleSetError(Exception):
    """A rule set that cannot be used; ``str()`` is ``FILE:LINE:COL: message``."""

    def __init__(self, file: str, line: int | None, column: int | None, message: str) -> None:
        self.file = file
        self.line = line
        self.column = column
        self.message = message
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where}: {self.message}"

    def as_dict(self, at: str) -> dict[str, Any]:
        """The ``lastError`` shape of the ``rules`` op."""
        return {
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "message": self.message,
            "at": at,
        }


# --------------------------------------------------------------------------- files


def is_rule_file_name(name: str) -> bool:
    """Visible ``*.toml`` names count; editor swap, backup and hidden files do not."""
    return name.endswith(".toml") and not name.startswith(".")


#: Largest rule file read (a policy is a few rules; 1 MiB is far beyond any).
MAX_RULE_FILE_BYTES = 1024 * 1024


def _foreign_writer(st: os.stat_result, trusted_owners: frozenset[int]) -> str | None:
    """Why users other than ``trusted_owners`` could change this file or folder; None if not."""
    if st.st_uid not in trusted_owners:
        return f"belongs to uid {st.st_uid}, not to the daemon's user or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _foreign_ancestor(rule_sets_dir: Path, trusted_owners: frozenset[int]) -> str | None:
    """The first folder (or symlink) above ``rule_sets_dir`` another user could change.

    Whoever can write any folder on the way to ``/`` can rename the folder
    below it and put another ``rule-sets/`` (or none: the open default) in
    its place, so each one is checked as the rule files are, on the path as
    given and on the path its symlinks lead to: owned by a trusted user, not
    writable by group or others -- unless the sticky bit is set (``/tmp``),
    which keeps others from renaming what they do not own. A symlink must be
    owned by a trusted user. Folders that do not exist change nothing: with
    no ``rule-sets/``, the open default is in force anyway.
    """
    absolute = Path(os.path.abspath(rule_sets_dir))
    seen: set[Path] = set()
    for start in (absolute, Path(os.path.realpath(absolute))):
        for folder in start.parents:
            if folder in seen:
                continue
            seen.add(folder)
            try:
                st = os.lstat(folder)
            except OSError:
                continue
            if st.st_uid not in trusted_owners:
                kind = "symlink" if stat.S_ISLNK(st.st_mode) else "folder"
                return (
                    f"the {kind} {folder} above it belongs to uid {st.st_uid}, "
                    "not to the daemon's user or root"
                )
            if stat.S_ISLNK(st.st_mode) or st.st_mode & stat.S_ISVTX:
                continue
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                mode = stat.S_IMODE(st.st_mode)
                return f"the folder {folder} above it is writable by other users (mode {mode:04o})"
    return None


def rule_files(rule_sets_dir: Path, *, trusted_owners: frozenset[int] | None = None) -> list[Path]:
    """``*.toml`` files, sorted; hidden files and editor leftovers do not count.

    With ``trusted_owners``, a folder someone else owns or can write is an
    error: ``rule_sets_dir`` itself and every folder above it.
    """
    if trusted_owners is not None:
        problem = _foreign_ancestor(rule_sets_dir, trusted_owners)
        if problem is None:
            try:
                problem = _foreign_writer(rule_sets_dir.stat(), trusted_owners)
            except OSError:
                problem = None  # missing (open default) or unreadable: listing says which
        if problem is not None:
            raise RuleSetError(
                str(rule_sets_dir),
                None,
                None,
                f"{problem}: anyone who can write it sets the policy",
            )
    try:
        entries = list(rule_sets_dir.iterdir())
    except FileNotFoundError:
        return []
    except NotADirectoryError as exc:
        raise RuleSetError(str(rule_sets_dir), None, None, "not a directory") from exc
    except OSError as exc:
        raise RuleSetError(
            str(rule_sets_dir), None, None, f"cannot list: {exc.strerror or exc}"
        ) from exc
    return sorted(p for p in entries if is_rule_file_name(p.name) and not p.is_dir())


def read_files(
    paths: Iterable[Path], *, trusted_owners: frozenset[int] | None = None
) -> list[tuple[Path, bytes]]:
    """``(path, bytes)`` of each file; one removed since listing is skipped.

    Raises :class:`RuleSetError` for anything but a regular file of at most
    :data:`MAX_RULE_FILE_BYTES` (and, with ``trusted_owners``, for a file
    another user owns or can write).
    """
    out: list[tuple[Path, bytes]] = []
    for path in paths:
        try:
            data = _read_rule_file(path, trusted_owners)
        except FileNotFoundError:
            continue  # removed between listing and reading: it no longer counts
        except OSError as exc:
            raise RuleSetError(
                str(path), None, None, f"cannot read: {exc.strerror or exc}"
            ) from exc
        out.append((path, data))
    return out


def _read_rule_file(path: Path, trusted_owners: frozenset[int] | None) -> bytes:
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RuleSetError(
                str(path), None, None, "is a symbolic link; rule files must be regular files"
            ) from None
        raise
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise RuleSetError(
                str(path), None, None, f"is a {kind}; rule files must be regular files"
            )
        if trusted_owners is not None:
            problem = _foreign_writer(st, trusted_owners)
            if problem is not None:
                raise RuleSetError(
                    str(path), None, None, f"{problem}: anyone who can write it sets the policy"
                )
        data = f.read(MAX_RULE_FILE_BYTES + 1)
    if len(data) > MAX_RULE_FILE_BYTES:
        raise RuleSetError(
            str(path), None, None, f"larger than {MAX_RULE_FILE_BYTES} bytes; not read"
        )
    return data


_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFSOCK: "socket",
    stat.S_IFDIR: "directory",
}


#: ``(file, sha256)`` of every rule file a policy was built from.
Fingerprint = tuple[tuple[str, str], ...]


def fingerprint_of(files: Iterable[tuple[Path, bytes]]) -> Fingerprint:
    """``(file, sha256)`` pairs: unchanged files on reload need no recompiling."""
    return tuple((str(p), hashlib.sha256(b).hexdigest()) for p, b in files)


# --------------------------------------------------------------------------- TOML


_BARE_KEY = r"[A-Za-z0-9_-]+"
_QUOTED_KEY = r'"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\''
_KEY = rf"(?:{_BARE_KEY}|{_QUOTED_KEY})"
_DOTTED = rf"{_KEY}(?:[ \t]*\.[ \t]*{_KEY})*"
_KEY_RE = re.compile(_KEY)
_KEYVAL_RE = re.compile(rf"[ \t]*({_DOTTED})[ \t]*=[ \t]*")
_HEADER_RE = re.compile(rf"[ \t]*(\[\[?)[ \t]*({_DOTTED})[ \t]*\]")
_TOML_POS_RE = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_TOML_END_RE = re.compile(r"\s*\(at end of document\)$")


def _split_key(dotted: str) -> tuple[str, ...]:
    parts: list[str] = []
    for raw in _KEY_RE.findall(dotted):
        if raw[0] in "\"'":
            try:
                raw = tomllib.loads(f"k = {raw}")["k"]
            except tomllib.TOMLDecodeError:
                raw = raw[1:-1]
        parts.append(raw)
    return tuple(parts)


@dataclass(frozen=True)
class _Located:
    key_offset: int
    value_offset: int


def _locate(text: str, path: tuple[str, ...]) -> _Located | None:
    """Where the key ``path`` (e.g. ``("rules", "lock", "acquire")``) is written.

    A best-effort scanner (tomllib keeps no positions) for the shapes people
    write: ``[table]`` headers, dotted keys, one level of inline table. It
    skips multi-line strings. A table is found where it is first written,
    also implicitly (``[rules.lock]`` defines ``rules``). None when not found.
    """
    table: tuple[str, ...] = ()
    pos = 0
    n = len(text)
    while pos < n:
        end = text.find("\n", pos)
        end = n if end < 0 else end
        header = _HEADER_RE.match(text, pos, end)
        if header:
            table = _split_key(header.group(2))
            if table[: len(path)] == path:
                return _Located(header.start(1), header.start(1))
            pos = end + 1
            continue
        kv = _KEYVAL_RE.match(text, pos, end)
        if kv:
            keys = table + _split_key(kv.group(1))
            value_at = kv.end()
            if keys[: len(path)] == path:
                return _Located(kv.start(1), value_at)
            rest = path[len(keys) :]
            if path[: len(keys)] == keys and len(rest) == 1 and text.startswith("{", value_at):
                inner = re.compile(rf"[{{,][ \t]*({_KEY})[ \t]*=[ \t]*")
                for m in inner.finditer(text, value_at, end):
                    if _split_key(m.group(1)) == rest:
                        return _Located(m.start(1), m.end())
            for delim in ('"""', "'''"):
                if text.startswith(delim, value_at):
                    close = text.find(delim, value_at + 3)
                    if close >= 0:
                        newline = text.find("\n", close)
                        end = n if newline < 0 else newline
                    break
        pos = end + 1
    return None


def _string_offsets(text: str, start: int, value: str) -> list[int] | None:
    """Raw offsets in ``text`` of each character of the TOML string at ``start``.

    Maps a position inside the decoded string (what CEL parsed) back to the
    file, through escapes and multi-line delimiters. The extra last entry is
    the offset just past the string's content. None if it does not line up.
    """
    for delim in ('"""', "'''", '"', "'"):
        if text.startswith(delim, start):
            break
    else:
        return None
    basic = delim[0] == '"'
    multiline = len(delim) == 3
    pos = start + len(delim)
    if multiline:
        if text.startswith("\r\n", pos):
            pos += 2
        elif text.startswith("\n", pos):
            pos += 1
    offsets: list[int] = []
    i = 0
    while i < len(value):
        if pos >= len(text):
            return None
        c = text[pos]
        if basic and c == "\\":
            nxt = text[pos + 1 : pos + 2]
            if multiline and nxt in (" ", "\t", "\r", "\n"):
                pos += 1
                while pos < len(text) and text[pos] in " \t\r\n":
                    pos += 1
                continue
            width = {"u": 6, "U": 10}.get(nxt, 2)
        elif c == "\r" and text.startswith("\r\n", pos) and value[i] == "\n":
            width = 2
        else:
            if c != value[i]:
                return None
            width = 1
        offsets.append(pos)
        pos += width
        i += 1
    offsets.append(pos)
    return offsets


def _line_col(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return line, column


class RuleSource:
    """One rule file's text, for turning keys and CEL positions into line:col."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.text = text

    def error(self, path: tuple[str, ...] | None, message: str) -> RuleSetError:
        """An error at the key ``path`` (its line and column), or with no position."""
        if path is not None:
            while path:
                found = _locate(self.text, path)
                if found is not None:
                    line, col = _line_col(self.text, found.key_offset)
                    return RuleSetError(self.file, line, col, message)
                path = path[:-1]
        return RuleSetError(self.file, None, None, message)

    def cel_error(
        self,
        path: tuple[str, ...],
        expr: str,
        cel_line: int | None,
        cel_column: int | None,
        message: str,
    ) -> RuleSetError:
        """An error inside the CEL string at ``path``, mapped to the file."""
        found = _locate(self.text, path)
        if found is None:
            return self.error(path, message)
        if cel_line is None or cel_column is None:
            line, _ = _line_col(self.text, found.key_offset)
            return RuleSetError(self.file, line, None, message)
        offsets = _string_offsets(self.text, found.value_offset, expr)
        if offsets is None:
            line, _ = _line_col(self.text, found.key_offset)
            return RuleSetError(self.file, line, None, message)
        lines = expr.split("\n")
        index = sum(len(part) + 1 for part in lines[: cel_line - 1]) + cel_column - 1
        index = max(0, min(index, len(expr)))
        line, col = _line_col(self.text, offsets[index])
        return RuleSetError(self.file, line, col, message)


def parse_toml(file: str, data: bytes) -> tuple[RuleSource, dict[str, Any]]:
    """Decode and parse one rule file; UTF-8 and TOML errors carry line:col."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        prefix = data[: exc.start].decode("utf-8", "replace")
        line, _ = _line_col(prefix, len(prefix))
        raise RuleSetError(file, line, None, "not valid UTF-8") from exc
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        m = _TOML_POS_RE.search(message)
        if m:
            raise RuleSetError(
                file, int(m.group(1)), int(m.group(2)), "TOML: " + message[: m.start()]
            ) from exc
        m = _TOML_END_RE.search(message)
        if m:
            line, col = _line_col(text, len(text))
            raise RuleSetError(file, line, col, "TOML: " + message[: m.start()]) from exc
        raise RuleSetError(file, None, None, f"TOML: {message}") from exc
    return RuleSource(file, text), doc
