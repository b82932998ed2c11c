"""Hunt flaky tests: run pytest several times beside busy CPU burners, tabulate the failures.

Started by `scripts/flake-hunt` and `scripts/test --repeat N` (which set up .venv first):

    python scripts/flake_hunt.py [--repeat N] [--load K] [--out DIR] [--] [PYTEST-ARGS...]

Each run is a whole pytest session with the given arguments (the whole suite by default).
Beside them, K processes spin at full speed for the whole hunt, so the tests see the starved
CPU of a shared CI machine. The burners are this script's children: they are stopped when the
hunt ends, fails or is interrupted (Ctrl-C, SIGTERM, SIGHUP), and the kernel kills them should
this script itself die without a word (PR_SET_PDEATHSIG).

Into DIR go, per run, `run-N.log` (pytest's output), `run-N.xml` (junit, xunit1: it names
each test's file), and at the end `summary.txt` (one line per run) and `table.txt` (test id ->
failures out of the runs that finished). Exit status: 0 if every run passed, 1 if a run
failed, 130 if interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

# A burner: the kernel sends it SIGKILL when its parent dies (PR_SET_PDEATHSIG = 1),
# so a hunt killed with SIGKILL leaves no loop spinning; and it leaves at once if the
# parent was already gone before prctl took effect.
BURNER = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
while True:
    pass
"""

# Once pytest has been asked to stop (it saw the Ctrl-C or was sent SIGINT), how long it may
# take to tear its daemons and clusters down before it is killed.
PYTEST_STOP_GRACE_S = 60.0


class Interrupted(Exception):
    """The hunt was asked to stop (SIGINT, SIGTERM or SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class RunResult:
    number: int
    exit_code: int
    seconds: float
    load_before: str
    load_after: str
    counts: dict[str, int] = field(default_factory=dict)
    # test id -> first line of the failure's message
    failures: dict[str, str] = field(default_factory=dict)
    note: str = ""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        own, pytest_args = argv[:cut], argv[cut + 1 :]
    else:
        own, pytest_args = argv, []
    parser = argparse.ArgumentParser(
        prog="scripts/flake-hunt",
        description="Run the suite N times beside K busy CPU burners; list tests that failed.",
        epilog="Anything after -- goes to pytest as it is (a group: -- tests/live -k cli).",
    )
    parser.add_argument("-n", "--repeat", type=int, default=5, metavar="N", help="runs (5)")
    parser.add_argument(
        "-l", "--load", type=int, default=2, metavar="K", help="busy CPU burners beside them (2)"
    )
    parser.add_argument(
        "-o",
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder for each run's log and junit and the summary "
        "($FLAKE_HUNT_DIR, else a new folder under /tmp)",
    )
    args, unknown = parser.parse_known_args(own)
    if unknown:
        # Without "--", whatever this script does not know goes to pytest.
        pytest_args = unknown + pytest_args
    if args.repeat < 1 or args.load < 0:
        parser.error("--repeat takes 1 or more, --load 0 or more")
    return args, pytest_args


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def start_burners(count: int) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [sys.executable, "-c", BURNER, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            # Its own session: a Ctrl-C at the terminal is the hunt's to handle, and the
            # hunt stops the burners itself (after pytest has finished tearing down).
            start_new_session=True,
        )
        for _ in range(count)
    ]


def stop_burners(burners: list[subprocess.Popen[bytes]]) -> None:
    for burner in burners:
        if burner.poll() is None:
            burner.kill()
    for burner in burners:
        burner.wait()


def test_id(case: ET.Element) -> str:
    """The pytest node id of a junit (xunit1) testcase: file::Class::name."""
    name = case.get("name", "")
    classname = case.get("classname", "")
    file = case.get("file")
    if not file:  # a collection error: pytest names the module in classname/name
        return f"{classname}::{name}" if classname else name
    module = file.removesuffix(".py").replace("/", ".")
    classes = classname[len(module) + 1 :].split(".") if classname.startswith(module + ".") else []
    return "::".join([file, *classes, name])


def read_junit(path: Path, result: RunResult) -> None:
    suite = ET.parse(path).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    for key in ("tests", "failures", "errors", "skipped"):
        result.counts[key] = int(suite.get(key, "0"))
    for case in suite.iter("testcase"):
        for outcome in ("failure", "error"):
            problem = case.find(outcome)
            if problem is not None:
                message = (problem.get("message") or problem.text or outcome).strip()
                # The message is often a repr, with its line breaks escaped.
                first_line = message.splitlines()[0].split("\\n")[0] if message else outcome
                result.failures.setdefault(test_id(case), f"{outcome}: {first_line}"[:120])


def run_pytest(number: int, out: Path, pytest: Path, pytest_args: list[str]) -> RunResult:
    junit = out / f"run-{number}.xml"
    log = out / f"run-{number}.log"
    command = [
        str(pytest),
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
        *pytest_args,
    ]
    load_before = loadavg()
    started = time.monotonic()
    with log.open("wb") as log_file:
        child = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            exit_code = child.wait()
        except Interrupted as stop:
            # A terminal's Ctrl-C reached pytest as well; any other signal is passed on as
            # SIGINT, so pytest ends the way it does for a user: tears down, then reports.
            if stop.signum != signal.SIGINT:
                child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=PYTEST_STOP_GRACE_S)
            finally:
                # Out of time, or asked a second time: pytest goes now.
                if child.poll() is None:
                    child.kill()
                    child.wait()
            raise
    result = RunResult(
        number=number,
        exit_code=exit_code,
        seconds=time.monotonic() - started,
        load_before=load_before,
        load_after=loadavg(),
    )
    if junit.exists():
        read_junit(junit, result)
    else:
        result.note = "no junit written"
    if exit_code not in (0, 1):
        # 2 interrupted, 3 internal error, 4 usage error, 5 no tests: not a test's failure.
        result.note = f"pytest exit {exit_code} (see {log.name})"
    elif exit_code == 1 and not result.failures:
        result.note = f"failed, but junit names no test (see {log.name})"
    return result


def summary_lines(results: list[RunResult], burners: int) -> list[str]:
    lines = [f"{'run':>3}  {'exit':>4}  {'seconds':>7}  {'load before -> after':<32}  result"]
    for r in results:
        if r.counts:
            passed = r.counts["tests"] - r.counts["failures"] - r.counts["errors"]
            passed -= r.counts["skipped"]
            outcome = (
                f"{passed} passed, {r.counts['skipped']} skipped, "
                f"{len(r.failures)} failed or errored"
            )
        else:
            outcome = "-"
        if r.note:
            outcome += f"; {r.note}"
        lines.append(
            f"{r.number:>3}  {r.exit_code:>4}  {r.seconds:>7.0f}  "
            f"{r.load_before + ' -> ' + r.load_after:<32}  {outcome}"
        )
    lines.append(f"burners: {burners}; loads are /proc/loadavg's 1, 5 and 15 minute averages")
    return lines


def table_lines(results: list[RunResult]) -> list[str]:
    runs = len(results)
    failed_in: dict[str, list[RunResult]] = {}
    for r in results:
        for test in r.failures:
            failed_in.setdefault(test, []).append(r)
    if not failed_in:
        return [f"no test failed in {runs} run(s)"]
    ordered = sorted(failed_in.items(), key=lambda item: (-len(item[1]), item[0]))
    lines = ["failures  runs  test id (first failure's message)"]
    for test, where in ordered:
        which = ",".join(str(r.number) for r in where)
        lines.append(f"{len(where):>3}/{runs:<4}  {which:<5} {test}")
        lines.append(f"{'':>16}{where[0].failures[test]}")
    return lines


def on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


def main(argv: list[str]) -> int:
    args, pytest_args = parse_args(argv)
    repo = Path(__file__).resolve().parent.parent
    pytest = Path(sys.executable).parent / "pytest"
    out_dir = args.out or os.environ.get("FLAKE_HUNT_DIR")
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="lockd-flake-hunt."))
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(repo)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)

    results: list[RunResult] = []
    interrupted = False
    burners: list[subprocess.Popen[bytes]] = []
    print(f"flake-hunt: {args.repeat} run(s) of pytest {' '.join(pytest_args)}".rstrip())
    print(f"flake-hunt: {args.load} burner(s); load now {loadavg()}; output in {out}")
    try:
        burners = start_burners(args.load)
        for number in range(1, args.repeat + 1):
            result = run_pytest(number, out, pytest, pytest_args)
            results.append(result)
            print(summary_lines([result], args.load)[1], flush=True)
    except Interrupted as stop:
        interrupted = True
        print(f"flake-hunt: stopped by {stop}; {len(results)} run(s) finished", flush=True)
    finally:
        stop_burners(burners)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)

    summary = summary_lines(results, args.load)
    table = table_lines(results)
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    (out / "table.txt").write_text("\n".join(table) + "\n")
    print("\n".join(["", *summary, "", *table, "", f"logs and junit in {out}"]))
    if interrupted:
        return 130
    return 0 if all(r.exit_code == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
