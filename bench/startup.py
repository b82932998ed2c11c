"""CLI start-up: what a ``lockd`` command costs before and after its one request.

Scripts call lockd in loops (flock(1) starts in ~1 ms), so the CLI must start
fast. This runs, alternately, ``python -c pass`` (the floor: the same
interpreter, the same site-packages), ``lockd locks status KEY`` and
``lockd run KEY -- true`` against a daemon of its own, and reports the CPU
time (user + system, from ``RUSAGE_CHILDREN``: on a shared machine CPU time
is steadier than wall time) and the wall time of each, their medians, and
each command's ratio to the floor. Issue 24 asks for at most 2x.

    .venv/bin/python bench/startup.py [--runs 30] [--installed] [--json] [--baseline PYTHON]

``--baseline PYTHON`` runs the same three commands with another copy (the
``python`` of a venv holding, say, the commit before a change) in the same
rounds, each copy's ratios against its own ``python -c pass``: a before/after
from one run, under one load.

The daemon runs from the same interpreter (``-m lockd serve``) in a temporary
folder and is stopped at the end. Bytecode is cached in that folder
(``PYTHONPYCACHEPREFIX``), as an installed copy has it. Runs alternate between the commands so a
load spike on the machine hits every command alike.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: name prefix of the --baseline copy's commands
BASELINE = "baseline: "


def commands(python: Path, socket: str) -> dict[str, list[str]]:
    """The commands, run with ``python`` and the ``lockd`` script beside it."""
    script = python.with_name("lockd")
    lockd = [str(script)] if script.exists() else [str(python), "-m", "lockd"]
    return {
        "python -c pass": [str(python), "-c", "pass"],
        "lockd locks status k": [*lockd, "locks", "status", "bench:k", "--socket", socket],
        "lockd run k -- true": [*lockd, "run", "bench:r", "--socket", socket, "--", "true"],
    }


def installed_copy(folder: Path) -> Path:
    """``pip install`` the checkout into a fresh venv (as a user gets it): its python.

    An editable install (the development .venv) adds an import finder to
    every start, ``python -c pass`` included, which hides part of the ratio.
    """
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(REPO)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return venv / "bin" / "python"


def measure(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU ms, wall ms) of one run of ``argv``, its children included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = (time.perf_counter() - started) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000
    return cpu, wall


def start_daemon(folder: Path) -> subprocess.Popen[bytes]:
    socket = folder / "lockd.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lockd",
            "serve",
            "--socket",
            str(socket),
            "--db",
            str(folder / "lockd.db"),
            "--config",
            str(folder / "config"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not socket.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the daemon did not start")
        time.sleep(0.05)
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs of each command (default 30)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="PYTHON",
        help="also measure the lockd of this interpreter's venv, in the same rounds",
    )
    parser.add_argument(
        "--installed",
        action="store_true",
        help="measure a pip-installed copy in a fresh venv (not this editable one)",
    )
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="lockd-startup-", dir="/tmp"))
    python = installed_copy(folder) if args.installed else Path(sys.executable)
    daemon = start_daemon(folder)
    # Bytecode as an installed copy has it (pip compiles at install time): a
    # cache of its own, written by the warm-up runs, so nothing lands in the
    # checkout and PYTHONDONTWRITEBYTECODE (set on some machines) does not
    # make every run compile lockd from source.
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(folder / "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("LOCKD_SOCKET", None)
    try:
        cmds = commands(python, str(folder / "lockd.sock"))
        if args.baseline is not None:
            baseline = commands(args.baseline, str(folder / "lockd.sock"))
            cmds.update({f"{BASELINE}{name}": argv for name, argv in baseline.items()})
        for _ in range(2):  # write the .pyc files, warm the page cache
            for argv in cmds.values():
                measure(argv, env)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cmds}
        for _ in range(args.runs):
            for name, argv in cmds.items():
                samples[name].append(measure(argv, env))
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(folder, ignore_errors=True)

    report = {}
    for name, values in samples.items():
        floor_samples = samples[(BASELINE if name.startswith(BASELINE) else "") + "python -c pass"]
        floor = statistics.median(cpu for cpu, _ in floor_samples)
        floor_wall = statistics.median(wall for _, wall in floor_samples)
        cpu = statistics.median(c for c, _ in values)
        wall = statistics.median(w for _, w in values)
        report[name] = {
            "cpuMs": round(cpu, 1),
            "wallMs": round(wall, 1),
            "cpuRatio": round(cpu / floor, 2),
            "wallRatio": round(wall / floor_wall, 2),
        }
    if args.json:
        print(json.dumps({"runs": args.runs, "python": sys.version.split()[0], **report}))
        return
    print(f"{args.runs} runs each, medians (python {sys.version.split()[0]})")
    print(f"{'command':<33} {'CPU ms':>8} {'wall ms':>8} {'CPU x':>7} {'wall x':>7}")
    for name, row in report.items():
        print(
            f"{name:<33} {row['cpuMs']:>8} {row['wallMs']:>8} "
            f"{row['cpuRatio']:>7} {row['wallRatio']:>7}"
        )


if __name__ == "__main__":
    main()
