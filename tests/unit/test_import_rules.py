"""Which module may import what: the architecture, checked.

Like click's own tests of its import allow-list, each check imports a module
in a fresh interpreter and looks at ``sys.modules``: only a new process shows
what an import really pulls in (this test process has imported everything).

- ``lockd.cli`` starts for every shell command and every <TAB> of shell
  completion: no trio, CEL (celpy, lark) or SQLite at start-up, and none of
  the daemon or the rules (commands that need them import them when run).
- The engine and the wire-format parser are pure: no trio.
- ``lockd_client`` is its own distribution, standard library only.
- Arrows run one way: ``lockd.rules`` and ``lockd.run`` import nothing from
  ``lockd.daemon``, not even inside a function (checked on the source, since
  a lazy import does not show in ``sys.modules``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lockd

LOCKD_DIR = Path(lockd.__file__).parent


def modules_after_import(*modules: str) -> set[str]:
    """Every module in ``sys.modules`` after importing ``modules`` in a new interpreter."""
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return set(json.loads(out))


def _within(loaded: set[str], packages: tuple[str, ...]) -> set[str]:
    return {m for m in loaded if m.split(".")[0] in packages or m.startswith(packages)}


def test_cli_starts_without_trio_cel_sqlite_or_the_daemon() -> None:
    loaded = modules_after_import("lockd.cli")
    heavy = _within(loaded, ("trio", "celpy", "lark", "sqlite3", "_sqlite3"))
    assert heavy == set()
    assert {m for m in loaded if m.startswith(("lockd.daemon", "lockd.rules"))} == set()
    # Needed by one command each (serve, run): imported when that command runs.
    assert {"lockd.config", "platformdirs", "lockd.run.supervisor"} & loaded == set()


@pytest.mark.parametrize("module", ["lockd.daemon.engine", "lockd.daemon.protocol"])
def test_engine_and_protocol_do_not_import_trio(module: str) -> None:
    loaded = modules_after_import(module)
    assert _within(loaded, ("trio", "sqlite3", "_sqlite3", "celpy")) == set()


def test_client_imports_only_the_standard_library() -> None:
    baseline = modules_after_import()
    loaded = modules_after_import("lockd_client") - baseline
    foreign = {
        m
        for m in loaded
        if m.split(".")[0] != "lockd_client" and m.split(".")[0] not in sys.stdlib_module_names
    }
    assert foreign == set()


def _package_modules(package: str) -> list[str]:
    folder = LOCKD_DIR / package.split(".", 1)[1]
    return sorted(
        f"{package}.{path.stem}" if path.stem != "__init__" else package
        for path in folder.glob("*.py")
    )


@pytest.mark.parametrize("package", ["lockd.rules", "lockd.run"])
def test_rules_and_run_load_nothing_of_the_daemon(package: str) -> None:
    loaded = modules_after_import(*_package_modules(package))
    assert {m for m in loaded if m.startswith("lockd.daemon")} == set()


def _imported_names(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in ``path``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", ["rules", "run"])
def test_rules_and_run_source_never_names_the_daemon(package: str) -> None:
    offenders = {
        f"{path.name}: {name}"
        for path in sorted((LOCKD_DIR / package).glob("*.py"))
        for name in _imported_names(path)
        if name == "lockd.daemon" or name.startswith("lockd.daemon.")
    }
    assert offenders == set()


def test_shared_modules_import_no_program_package() -> None:
    """identity, config, exitcodes, logfmt, timefmt sit below all three programs."""
    shared = [p for p in sorted(LOCKD_DIR.glob("*.py")) if p.stem not in ("__init__", "__main__")]
    assert shared, "no shared modules found"
    offenders = {
        f"{path.name}: {name}"
        for path in shared
        for name in _imported_names(path)
        if name.startswith(("lockd.daemon", "lockd.cli", "lockd.rules", "lockd.run"))
    }
    assert offenders == set()


def test_product_code_never_imports_the_test_support_package() -> None:
    """``lockd.testing`` serves tests and benchmarks; the daemon, CLI and runner never need it."""
    product = [p for p in sorted(LOCKD_DIR.rglob("*.py")) if "testing" not in p.parts]
    assert product, "no product modules found"
    offenders = {
        f"{path.relative_to(LOCKD_DIR)}: {name}"
        for path in product
        for name in _imported_names(path)
        if name == "lockd.testing" or name.startswith("lockd.testing.")
    }
    assert offenders == set()


def test_polling_helpers_import_neither_pytest_nor_trio() -> None:
    """``lockd.testing.polling`` is for any test or benchmark: trio only when a trio test waits."""
    loaded = modules_after_import("lockd.testing.polling")
    assert _within(loaded, ("trio", "pytest", "_pytest", "sqlite3")) == set()
