"""Compiles the daemon's hot path with mypyc when it can; pure Python otherwise.

Everything else about the package is in pyproject.toml. The modules named in
``lockd/native.py`` (``COMPILED``) are compiled into C extensions that sit
beside their sources. The build falls back to a pure-Python install, with a
warning, when ``LOCKD_PURE_PYTHON`` is set, when mypyc is missing, or when
mypyc or the C compiler fails: lockd works the same either way, only slower.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _native() -> Any:
    """lockd/native.py, loaded alone: importing the lockd package needs its dependencies."""
    spec = importlib.util.spec_from_file_location("_lockd_native", HERE / "lockd" / "native.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warn(message: str) -> None:
    print(f"lockd setup.py: {message}; installing the pure-Python hot path", file=sys.stderr)


class BuildHotPath(build_ext):
    """Runs mypyc only when extensions are really built (not for metadata), all or none."""

    def finalize_options(self) -> None:
        if not self.distribution.ext_modules:
            self.distribution.ext_modules = self._mypyc_extensions()
        super().finalize_options()

    def _mypyc_extensions(self) -> list[Any]:
        native = _native()
        env = os.environ.get(native.PURE_ENV)
        if env not in (None, "", "0"):
            _warn(f"{native.PURE_ENV}={env}")
            return []
        try:
            from mypyc.build import mypycify
        except ImportError:
            _warn("mypyc is not installed")
            return []
        sources = [name.replace(".", "/") + ".py" for name in native.COMPILED]
        group = native.SHARED_LIB.removesuffix("__mypyc")
        try:
            return list(mypycify(sources, opt_level="3", group_name=group))
        except (Exception, SystemExit) as exc:  # mypyc reports type errors by exiting
            _warn(f"mypyc failed ({exc!r})")
            return []

    def run(self) -> None:
        if not self.extensions:
            return
        # Compile and link even when build/ looks up to date: lockd.native
        # takes an extension older than its source for a stale build.
        self.force = True
        self._remove_strays()
        try:
            super().run()
        except Exception as exc:  # no compiler, no Python headers, a compile error
            # Half a build cannot run (each module's shim needs the shared
            # library): remove what was built, here and in the source tree
            # (editable installs), and the package stays pure.
            for ext in self.extensions:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
                (HERE / self.get_ext_filename(ext.name)).unlink(missing_ok=True)
            self.extensions = []
            _warn(f"compiling failed ({exc})")

    def _remove_strays(self) -> None:
        """Extensions in the source tree of modules no longer compiled (an editable
        install copied them there): Python would still load them, and fail."""
        wanted = {HERE / self.get_ext_filename(ext.name) for ext in self.extensions}
        for path in (HERE / "lockd").rglob("*.so"):
            if path not in wanted:
                path.unlink()


class HotPathDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        # The extensions are only known once build_ext runs; say there are
        # some so that build, bdist_wheel and editable installs run it.
        return True


setup(distclass=HotPathDistribution, cmdclass={"build_ext": BuildHotPath})
