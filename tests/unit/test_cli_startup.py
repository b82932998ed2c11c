"""The CLI starts light (issue 24): no heavy module at start-up.

Scripts call ``lockd`` in loops, so a command imports only what it uses
(``bench/startup.py`` measures the cost against ``python -c pass``). Each
case runs a command in a fresh interpreter (against a socket that does not
exist: the imports up to the request are what counts) and lists the modules
it imported: through the click group, and through the console script's
entry (``lockd.cli.fast``), which must run the hot commands without click.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockd.testing.daemon import DaemonProcess

LIST_MODULES = """
import json, sys
from lockd.cli import main
try:
    main(sys.argv[1:], prog_name="lockd", standalone_mode=False)
except BaseException:
    pass
print(json.dumps(sorted(sys.modules)))
"""

#: The console script's entry (``lockd.cli.fast:main``), listing the modules at exit.
ENTRY_MODULES = """
import atexit, json, sys
sys.argv[0] = "lockd"
atexit.register(lambda: print(json.dumps(sorted(sys.modules))))
from lockd.cli.fast import main
main()
"""

MISSING = "/nonexistent/lockd.sock"

#: never at CLI start: the daemon's machinery and its dependencies.
HEAVY = ("trio", "sqlite3", "celpy", "lark", "platformdirs", "lockd.daemon", "lockd.rules")


def imported(*args: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", LIST_MODULES, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    modules: list[str] = json.loads(out.stdout.splitlines()[-1])
    return set(modules)


def imported_by_entry(*args: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", ENTRY_MODULES, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    modules: list[str] = json.loads(out.stdout.splitlines()[-1])
    return set(modules)


def heavy_in(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["locks", "status", "k", "--socket", "/nonexistent/lockd.sock"],
        ["locks", "list", "--socket", "/nonexistent/lockd.sock"],
        ["locks", "acquire", "k", "--wait", "1s", "--socket", "/nonexistent/lockd.sock"],
        ["run", "k", "--socket", "/nonexistent/lockd.sock", "--", "true"],
        ["whoami", "--socket", "/nonexistent/lockd.sock"],
    ],
    ids=lambda args: " ".join(a for a in args if not a.startswith("/")),
)
def test_no_heavy_module_at_cli_start(args: list[str]) -> None:
    assert heavy_in(imported(*args)) == []


def test_locks_status_loads_neither_run_nor_rules_nor_the_renewer() -> None:
    modules = imported("locks", "status", "k", "--socket", "/nonexistent/lockd.sock")
    for module in (
        "lockd.cli.run",
        "lockd.run",
        "lockd.cli.rules",
        "lockd.cli.top",
        "lockd.waitline",
        "lockd_client._lock",  # threads and logging for background renewals
        "lockd_client.aio",
        "tempfile",
        "logging",
    ):
        assert module not in modules, module


def test_run_does_not_load_the_locks_commands() -> None:
    modules = imported("run", "k", "--socket", "/nonexistent/lockd.sock", "--", "true")
    assert "lockd.cli.locks" not in modules and "lockd.cli.rules" not in modules


HOT = [
    ["locks", "status", "k", "--socket", MISSING],
    ["--socket", MISSING, "locks", "status", "--json", "--", "-k"],
    ["run", "k", "--socket", MISSING, "--", "true"],
    ["run", "--ttl", "1m30s", "--wait", "forever", "--json", "k", "--socket", MISSING, "--", "id"],
    ["run", "--socket", MISSING, "--", "-k", "--", "true"],
]


@pytest.mark.parametrize("args", HOT, ids=lambda args: " ".join(args).replace(MISSING, "S"))
def test_hot_commands_never_import_click(args: list[str]) -> None:
    modules = imported_by_entry(*args)
    assert "click" not in modules
    assert not {m for m in modules if m.startswith(("lockd.cli.root", "lockd.cli.common"))}
    assert heavy_in(modules) == []


def test_the_entry_hands_other_commands_to_click() -> None:
    # The probe above can see click: a command the fast path does not take loads it.
    assert "click" in imported_by_entry("locks", "list", "--socket", MISSING)
    assert "click" in imported_by_entry("run", "--help")


def test_status_through_the_entry_loads_nothing_of_run() -> None:
    modules = imported_by_entry("locks", "status", "k", "--socket", MISSING)
    for module in ("lockd.run", "lockd.cli.run", "lockd.cli.locks", "lockd.waitline", "logging"):
        assert module not in modules, module


#: What the hot commands used to import at start and no longer do (issue 24):
#: dataclasses (with inspect, ast, dis, tokenize) for the client's results and
#: lockd run's options, typing, decimal (durations, fractional seconds), and
#: for lockd run, logging until something is logged and subprocess (the
#: guardian is forked).
NOT_AT_START = ("dataclasses", "inspect", "ast", "tokenize", "typing", "decimal")


def test_status_through_the_entry_imports_no_dataclasses_typing_or_decimal() -> None:
    modules = imported_by_entry("locks", "status", "k", "--socket", MISSING)
    for module in (*NOT_AT_START, "lockd.cli.durations"):
        assert module not in modules, module


def test_run_through_the_entry_imports_no_dataclasses_typing_logging_or_subprocess() -> None:
    modules = imported_by_entry("run", "k", "--socket", MISSING, "--", "true")
    assert "lockd.run.supervisor" in modules  # the probe saw lockd run itself start
    for module in (*NOT_AT_START, "logging", "subprocess"):
        assert module not in modules, module


#: What a status started through the entry used to import and no longer does
#: (issue 24): ``re`` (json's decoder, the key check), ``json`` itself,
#: socket's and threading's Python layers (their C modules do), ``datetime``'s
#: pure-Python twin (``_datetime`` does), and what those pulled in: enum,
#: functools, collections, contextlib. Counted beyond what the interpreter
#: loads before any command (a development venv's editable finder loads
#: ``re`` and others at start: they cost a command nothing there).
NOT_FOR_STATUS = (
    "re",
    "json",
    "socket",
    "selectors",
    "threading",
    "datetime",
    "enum",
    "functools",
    "collections",
    "contextlib",
)

#: The probes below list modules one a line: json, which the other probes use,
#: is among the modules watched.
PRELOADED = "import sys; print('\\n'.join(sorted(sys.modules)))"

#: The console script's entry, as ENTRY_MODULES, without importing json itself.
BARE_ENTRY_MODULES = """
import atexit, sys
sys.argv[0] = "lockd"
atexit.register(lambda: print("\\n".join(sorted(sys.modules))))
from lockd.cli.fast import main
main()
"""


def module_lines(argv: list[str], **kwargs: object) -> set[str]:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)  # type: ignore[call-overload]
    return set(out.stdout.split())


def preloaded() -> set[str]:
    """The modules this interpreter has loaded before running anything (site, .pth files)."""
    return module_lines([sys.executable, "-c", PRELOADED])


@pytest.mark.parametrize(
    "args",
    [
        ["locks", "status", "k", "--socket", MISSING],
        ["--socket", MISSING, "locks", "status", "--", "-k"],
    ],
    ids=["status", "status -- -k"],
)
def test_status_through_the_entry_imports_only_c_layers(args: list[str]) -> None:
    modules = module_lines([sys.executable, "-c", BARE_ENTRY_MODULES, *args]) - preloaded()
    assert "lockd_client._connection" in modules  # the probe saw the request being made
    assert sorted(m for m in NOT_FOR_STATUS if m in modules) == []


#: ``bin/lockd``, the installed ``lockd`` command, run as the interpreter runs a script.
SCRIPT_MODULES = """
import atexit, sys
path = sys.argv[1]
sys.argv[:2] = ["lockd"]
atexit.register(lambda: print("\\n".join(sorted(sys.modules))))
exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__"})
"""


def test_the_lockd_script_itself_imports_no_re() -> None:
    # pip's wrapper for a [project.scripts] entry imports re before lockd
    # starts: the command is a plain script instead (pyproject.toml).
    script = Path(__file__).resolve().parents[2] / "bin" / "lockd"
    argv = [sys.executable, "-c", SCRIPT_MODULES, str(script), "locks", "status", "k"]
    env = {**os.environ, "LOCKD_SOCKET": MISSING}
    modules = module_lines(argv, env=env) - preloaded()
    assert "lockd_client._connection" in modules  # lockd ran up to its request
    assert "re" not in modules and "click" not in modules


def test_run_through_the_entry_imports_no_json_socket_re_or_datetime() -> None:
    # lockd run needs threads and signals (threading, enum through signal),
    # but neither json nor socket's Python layer: the guardian's control
    # socket and COMMAND's environment go through their C modules.
    args = ["run", "k", "--socket", MISSING, "--", "true"]
    modules = module_lines([sys.executable, "-c", BARE_ENTRY_MODULES, *args]) - preloaded()
    assert "lockd.run.guardian" in modules  # the probe saw the guardian start
    for module in ("re", "json", "socket", "selectors", "datetime"):
        assert module not in modules, module


#: bin/lockd run as a script, saying at exit whether the collector is on.
SCRIPT_GC = """
import atexit, gc, sys
path = sys.argv[1]
sys.argv[:2] = ["lockd"]
atexit.register(lambda: print("collector", "on" if gc.isenabled() else "off"))
exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__"})
"""


@pytest.mark.parametrize(
    ("args", "collector"),
    [
        (["locks", "status", "k"], "off"),  # one request, then exit
        (["run", "k", "--", "true"], "on"),  # may supervise COMMAND for hours
        (["locks", "list"], "on"),  # click: serve, top and the rest
        (["run", "--help"], "on"),
    ],
    ids=["status", "run", "click", "run --help"],
)
def test_the_collector_is_off_only_while_a_command_loads(args: list[str], collector: str) -> None:
    script = Path(__file__).resolve().parents[2] / "bin" / "lockd"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT_GC, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LOCKD_SOCKET": MISSING},
    )
    assert out.stdout.split()[-2:] == ["collector", collector], out.stderr


EXIT_PROBE = """
import sys, threading
from lockd.cli import fast
if sys.argv[1] == "thread":
    done = threading.Event()
    waiter = threading.Thread(target=done.wait, args=(30,))
    waiter.start()
    print(fast._nothing_left_to_do())
    done.set()
elif sys.argv[1] == "atexit":
    import atexit
    atexit.register(print, "handler ran")
    print(fast._nothing_left_to_do())
else:
    print(fast._nothing_left_to_do())
"""


@pytest.mark.parametrize(
    ("case", "skips"), [("plain", "True"), ("thread", "False"), ("atexit", "False")]
)
def test_a_hot_command_skips_the_teardown_only_when_nothing_waits_for_it(
    case: str, skips: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", EXIT_PROBE, case], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split()[0] == skips, out.stderr
    if case == "atexit":  # and the handler still runs at the usual exit
        assert out.stdout.split("\n")[1] == "handler ran"


#: What ``lockd run`` imported at start and no longer does (issue 24): the
#: Python layers of threading (the renewer, the guardian's reader thread),
#: signal (its enums) and ctypes (prctl), contextlib, enum (signal's, and
#: ``--on-lost``'s StrEnum), array (descriptors for the guardian), queue's C
#: layer (no reader thread), what those load (functools, collections), the C
#: libraries math and grp, struct and its C library (descriptors for the
#: guardian, the client's socket options), and lockd's printing modules (no
#: table to print).
NOT_FOR_RUN = (
    "threading",
    "_weakrefset",
    "signal",
    "ctypes",
    "contextlib",
    "enum",
    "array",
    "_queue",
    "functools",
    "collections",
    "math",
    "grp",
    "struct",
    "_struct",
    "lockd.waitline",
    "lockd.cli.output",
    "lockd.describe",
    "lockd_client._lock",
)
#: ... and what neither hot command imports (status never did import the run's).
NOT_FOR_STATUS_BARE = (
    "math",
    "grp",
    "struct",
    "_struct",
    "threading",
    "enum",
    "collections",
    "functools",
)


def bare_modules(args: list[str], socket: str = MISSING) -> set[str]:
    """The modules the entry loads for ``args`` beyond a bare interpreter's own.

    ``python -S`` with the checkout on PYTHONPATH: no site, no editable
    finder, nothing preloaded that would hide a module (an installed copy
    preloads little, a development venv ``re``, ``enum``, ``collections``
    and more), so every module a command pulls in shows.
    """
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "client")]),
        "LOCKD_SOCKET": socket,
    }
    bare = [sys.executable, "-S"]
    before = module_lines([*bare, "-c", PRELOADED], env=env)
    return module_lines([*bare, "-c", BARE_ENTRY_MODULES, *args], env=env) - before


def test_run_in_a_bare_interpreter_imports_only_c_layers_of_the_stdlib() -> None:
    modules = bare_modules(["run", "k", "--", "true"])
    assert "lockd.run.guardian" in modules  # the probe saw the guardian start
    assert sorted(m for m in NOT_FOR_RUN if m in modules) == []
    assert sorted(m for m in NOT_FOR_STATUS if m in modules) == []


@pytest.mark.parametrize("wait", [[], ["--wait", "5s"]], ids=["try", "wait"])
def test_a_run_that_holds_its_key_imports_only_c_layers_of_the_stdlib(
    lockd: DaemonProcess, wait: list[str]
) -> None:
    """The whole of a run that gets its key: renewer, signal forwarding, the guardian's wait.

    Without a daemon (above) the run ends at its connect; here it takes the
    key, starts COMMAND, renews, forwards signals and waits for the
    guardian. ``--wait`` off a terminal (as in cron) loads the wait line's
    module but never its thread.
    """
    modules = bare_modules(["run", *wait, "startup-probe", "--", "true"], str(lockd.socket))
    assert "lockd_client._renewer" in modules and "lockd.run.supervisor" in modules
    allowed = {"lockd.waitline"} if wait else set()
    assert sorted(m for m in NOT_FOR_RUN if m in modules and m not in allowed) == []
    assert sorted(m for m in NOT_FOR_STATUS if m in modules) == []


def test_status_in_a_bare_interpreter_imports_only_c_layers_of_the_stdlib() -> None:
    modules = bare_modules(["locks", "status", "k"])
    assert "lockd_client._connection" in modules  # the probe saw the request being made
    assert sorted(m for m in (*NOT_FOR_STATUS, *NOT_FOR_STATUS_BARE) if m in modules) == []
