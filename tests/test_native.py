"""The hot path's build: compiled by mypyc or pure Python, chosen and shown (lockd.native)."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lockd import native
from lockd.cli import main

from .conftest import DaemonProcess
from .test_logging import wait_for_event

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
MODULES = ("pkg.fast", "pkg.sub.faster")


def fake_build(root: Path, compiled: bool = True) -> None:
    """Sources of MODULES under ``root``, and (``compiled``) an extension beside each."""
    for name in MODULES:
        source = root.joinpath(*name.split(".")).with_suffix(".py")
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
    if compiled:
        for name in (*MODULES, native.SHARED_LIB):
            *package, leaf = name.split(".")
            extension = root.joinpath(*package, leaf + SUFFIX)
            extension.parent.mkdir(parents=True, exist_ok=True)
            extension.write_bytes(b"")


def test_a_fresh_build_runs_compiled(tmp_path: Path) -> None:
    fake_build(tmp_path)
    assert native.build_state(tmp_path, None, MODULES) == "mypyc"
    assert native.build_state(tmp_path, "0", MODULES) == "mypyc"
    assert native.build_state(tmp_path, "", MODULES) == "mypyc"


def test_no_build_is_pure(tmp_path: Path) -> None:
    fake_build(tmp_path, compiled=False)
    assert native.build_state(tmp_path, None, MODULES) == "pure Python (not compiled)"


def test_a_missing_shared_library_is_no_build(tmp_path: Path) -> None:
    fake_build(tmp_path)
    *package, leaf = native.SHARED_LIB.split(".")
    tmp_path.joinpath(*package, leaf + SUFFIX).unlink()
    assert native.build_state(tmp_path, None, MODULES) == "pure Python (not compiled)"


def test_the_environment_forces_pure_python(tmp_path: Path) -> None:
    fake_build(tmp_path)
    assert native.build_state(tmp_path, "1", MODULES) == "pure Python (LOCKD_PURE_PYTHON=1)"


def test_a_source_edited_after_the_build_makes_it_all_pure(tmp_path: Path) -> None:
    fake_build(tmp_path)
    source = tmp_path / "pkg" / "sub" / "faster.py"
    built = (tmp_path / "pkg" / "sub" / ("faster" + SUFFIX)).stat().st_mtime
    # Written by the same install a moment later: still the build's source.
    os.utime(source, (built + 1, built + 1))
    assert native.build_state(tmp_path, None, MODULES) == "mypyc"
    os.utime(source, (built + 60, built + 60))
    state = native.build_state(tmp_path, None, MODULES)
    assert state.startswith("pure Python (stale build: faster.py is newer")


def test_pure_python_loads_every_hot_module_from_its_source() -> None:
    """With LOCKD_PURE_PYTHON=1 no compiled module is imported, built or not."""
    code = (
        "import importlib, lockd.native as n\n"
        "print(n.hot_path())\n"
        "for name in n.COMPILED:\n"
        "    print(importlib.import_module(name).__spec__.origin)\n"
    )
    env = {**os.environ, native.PURE_ENV: "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "pure Python (LOCKD_PURE_PYTHON=1)"
    assert len(out) == 1 + len(native.COMPILED)
    assert all(origin.endswith(".py") for origin in out[1:]), out


def test_a_compiled_build_compiles_every_hot_module() -> None:
    if native.hot_path() != "mypyc":
        pytest.skip(f"this checkout runs {native.hot_path()}")
    for name in native.COMPILED:
        module = importlib.import_module(name)
        assert not (module.__file__ or "").endswith(".py"), name


def test_version_names_the_hot_path() -> None:
    out = CliRunner().invoke(main, ["--version"], prog_name="lockd").output
    assert out == f"lockd 0.1.0 (hot path: {native.hot_path()})\n"


def test_the_start_up_line_names_the_hot_path(daemon: DaemonProcess) -> None:
    started = wait_for_event(daemon, "started")
    assert started.fields is not None
    assert started.fields["hot_path"] == native.hot_path()
