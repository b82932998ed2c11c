"""Which build of the daemon's hot path runs: compiled by mypyc, or pure Python.

``setup.py`` compiles the modules in :data:`COMPILED` with mypyc when it can
(mypy is a build requirement, gcc and the Python headers are on the machine),
and leaves them pure otherwise. The sources always ship beside the compiled
extensions, and Python prefers an extension to a source of the same name; so
:func:`install`, run when ``lockd`` is first imported, routes these modules back
to their sources when compiled ones must not run:

- ``LOCKD_PURE_PYTHON`` is set to anything but ``""`` or ``0`` (the operator's,
  or a developer's, way to force pure Python without reinstalling);
- one of the sources is newer than its extension (a developer edited it in an
  editable install and has not rebuilt: running the old compiled code would
  test something else than the file on disk).

It is all or nothing: the compiled modules call into each other directly and
take each other's classes only, so a compiled ``service`` with a pure
``engine`` would refuse the engine's objects. :func:`hot_path` says what runs,
for the daemon's start-up line and ``lockd --version``.

This module itself is never compiled, and imports nothing of lockd.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: The pure, synchronous modules of the request path that setup.py compiles
#: (parse, decide, engine bookkeeping, encode), all in lockd.daemon (the CLI
#: imports none of them). Not here: the trio server and its socket code
#: (async), the store (its time is inside SQLite, and tests subclass it), the
#: cold index (bisects a sequence view, which a compiled class is not).
COMPILED = (
    "lockd.daemon.clock",
    "lockd.daemon.engine",
    "lockd.daemon.holds",
    "lockd.daemon.leases",
    "lockd.daemon.protocol",
    "lockd.daemon.ratelimit",
    "lockd.daemon.service",
    "lockd.daemon.stats",
    "lockd.daemon.undo",
)
#: The extension that holds the code of all of them (each module's own
#: extension is a small shim that loads its part from here).
SHARED_LIB = "lockd.daemon._hotpath__mypyc"
PURE_ENV = "LOCKD_PURE_PYTHON"
#: A source this much newer than its extension is an edit, not the install
#: writing both files one after the other.
STALE_AFTER_S = 2.0

_ROOT = Path(__file__).resolve().parent.parent
_STALE = "pure Python (stale build: "
_state = "pure Python (not compiled)"


def hot_path() -> str:
    """What runs the hot path, e.g. ``mypyc`` or ``pure Python (LOCKD_PURE_PYTHON=1)``."""
    return _state


def needs_rebuild() -> bool:
    """A compiled build is there but older than its sources (scripts/_venv.sh asks)."""
    return _state.startswith(_STALE)


def build_state(root: Path, env: str | None, modules: Sequence[str] = COMPILED) -> str:
    """``mypyc`` when the compiled modules under ``root`` may run, else why not."""
    if env not in (None, "", "0"):
        return f"pure Python ({PURE_ENV}={env})"
    extensions = [_extension(root, name) for name in (*modules, SHARED_LIB)]
    if not all(extensions):
        return "pure Python (not compiled)"
    for name, extension in zip(modules, extensions, strict=False):
        assert extension is not None
        source = _source(root, name)
        if source.stat().st_mtime > extension.stat().st_mtime + STALE_AFTER_S:
            return f"{_STALE}{source.name} is newer than its compiled module: rebuild)"
    return "mypyc"


def install() -> None:
    """Decide once; when pure, make the compiled modules load from their sources."""
    global _state
    _state = build_state(_ROOT, os.environ.get(PURE_ENV))
    if _state != "mypyc" and any(_extension(_ROOT, name) for name in COMPILED):
        sys.meta_path.insert(0, _SourcesFirst(_ROOT, COMPILED))


def _source(root: Path, name: str) -> Path:
    return root.joinpath(*name.split(".")).with_suffix(".py")


def _extension(root: Path, name: str) -> Path | None:
    *package, leaf = name.split(".")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = root.joinpath(*package, leaf + suffix)
        if path.exists():
            return path
    return None


class _SourcesFirst:
    """A meta path finder that loads the named modules from their ``.py`` files."""

    def __init__(self, root: Path, modules: Sequence[str]) -> None:
        self._sources = {name: _source(root, name) for name in modules}

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        source = self._sources.get(name)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(name, source)
