"""docs/cookbook.md's recipes, run as written against a real daemon.

Each recipe is the fenced block after a ``<!-- recipe: NAME -->`` marker.
Shell and Python recipes run verbatim with ``LOCKD_SOCKET`` pointing at the
test daemon and this venv's ``bin`` first on ``PATH``. The cron and systemd
recipes name paths of an installed system (``/usr/local/bin/lockd``,
``/run/lockd/lockd.sock``, ``/usr/local/bin/import.sh``); their tests swap
exactly those for the test's own and keep every other word.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def daemon(lockd: DaemonProcess) -> DaemonProcess:
    """One daemon for the module (conftest's ``lockd``): each recipe uses keys of its own."""
    return lockd


REPO = Path(__file__).resolve().parents[2]
COOKBOOK = REPO / "docs" / "cookbook.md"
BIN = Path(sys.executable).parent


def recipe(name: str) -> str:
    text = COOKBOOK.read_text()
    found = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```\w*\n(.*?)```", text, re.S)
    assert found is not None, f"no recipe {name!r} in docs/cookbook.md"
    return found.group(1)


def env_for(daemon: DaemonProcess) -> dict[str, str]:
    return {**daemon.env, "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def run(argv: list[str], daemon: DaemonProcess, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env_for(daemon), capture_output=True, text=True, timeout=120, **kw
    )  # type: ignore[call-overload]


def test_every_recipe_named_in_the_contents_exists() -> None:
    names = re.findall(r"<!-- recipe: ([\w-]+) -->", COOKBOOK.read_text())
    assert set(names) == {
        "cron",
        "systemd-service",
        "systemd-timer",
        "ci-deploy",
        "python-with",
        "asyncio",
        "trio",
        "shared",
        "python-semaphore",
    }


def test_cron_recipe_runs_under_crons_environment(daemon: DaemonProcess, tmp_path: Path) -> None:
    lines = recipe("cron").splitlines()
    assignments = dict(line.split("=", 1) for line in lines if re.match(r"^[A-Z_]+=", line))
    assert assignments["PATH"].split(":")[0] == "/usr/local/bin"
    assert assignments["LOCKD_SOCKET"] == "/run/lockd/lockd.sock"
    (entry,) = [line for line in lines if line.startswith("*/5 ")]
    command = entry.split(None, 5)[5]
    job = tmp_path / "import.sh"
    job.write_text(f"#!/bin/sh\necho ran >> {tmp_path}/runs\n")
    job.chmod(0o755)
    command = command.replace("/usr/local/bin/import.sh", str(job))
    # cron's environment: nothing but what the crontab sets (our lockd stands
    # in for /usr/local/bin, our daemon for /run/lockd).
    cron_env = {
        "PATH": assignments["PATH"].replace("/usr/local/bin", str(BIN)),
        "LOCKD_SOCKET": str(daemon.socket),
        "HOME": str(tmp_path),
        "SHELL": "/bin/sh",
    }
    done = subprocess.run(
        ["/bin/sh", "-c", command], env=cron_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done
    assert (tmp_path / "runs").read_text() == "ran\n"
    # The previous run still going: a quiet success, and the job does not run.
    from lockd_client import LockClient

    with LockClient(str(daemon.socket)) as client:
        held = client.try_acquire("nightly-import")
        assert held is not None
        skipped = subprocess.run(
            ["/bin/sh", "-c", command], env=cron_env, capture_output=True, text=True, timeout=60
        )
        client.release(held)
    assert (skipped.returncode, skipped.stdout, skipped.stderr) == (0, "", "")
    assert (tmp_path / "runs").read_text() == "ran\n"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_recipes_verify(tmp_path: Path) -> None:
    service = recipe("systemd-service").replace("/usr/local/bin/lockd", str(BIN / "lockd"))
    service = service.replace("/usr/local/bin/import.sh", "/bin/true")
    (tmp_path / "nightly-import.service").write_text(service)
    (tmp_path / "nightly-import.timer").write_text(recipe("systemd-timer"))
    verified = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            str(tmp_path / "nightly-import.timer"),
            str(tmp_path / "nightly-import.service"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Only complaints about our own units count (the host's units are not ours).
    ours = [line for line in verified.stderr.splitlines() if "nightly-import" in line]
    assert ours == [], verified.stderr


def test_ci_deploy_recipe_waits_its_turn_and_a_retry_takes_back(daemon: DaemonProcess) -> None:
    from lockd_client import LockClient

    script = recipe("ci-deploy")
    env = {**env_for(daemon), "DEPLOY_ENV": "prod"}
    with LockClient(str(daemon.socket)) as client:
        other = client.acquire("deploy:prod", owner="pipeline-1")  # pipeline 1 is deploying
        waiting = subprocess.Popen(
            ["bash", "-c", script],
            env={**env, "CI_PIPELINE_ID": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def parked() -> bool:
            assert waiting.poll() is None
            return client.status("deploy:prod").waiters == 1

        wait_for(parked, 30, "pipeline 2 parked", interval=0.05)
        # A retried job of pipeline 1 takes its own hold back at once.
        retry = subprocess.run(
            ["bash", "-c", script],
            env={**env, "CI_PIPELINE_ID": "1"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert retry.returncode == 0 and retry.stdout.startswith("deploying with fence ")
        assert not client.release(other).released  # fenced by the re-take
        out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    assert out.startswith("deploying with fence ")


@pytest.mark.parametrize(
    ("name", "expect"),
    [
        ("python-with", ["building the report with fence", "someone else is building it"]),
        ("asyncio", ["refreshed 0 fence", "gave up waiting; the waiter left the queue"]),
        ("trio", ["rebuilding with fence", "gave up waiting: True"]),
        ("python-semaphore", ["readers: 3", "writer now: None", "gpu slots taken: 2"]),
    ],
)
def test_python_recipes(daemon: DaemonProcess, name: str, expect: list[str]) -> None:
    done = run([sys.executable, "-c", recipe(name)], daemon)
    assert done.returncode == 0, done.stderr
    for text in expect:
        assert text in done.stdout, (text, done.stdout)


def test_shared_recipe_readers_together_writer_alone(daemon: DaemonProcess) -> None:
    done = run(["bash", "-e", "-c", recipe("shared")], daemon)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sorted(lines[:2]) == ["reader 1", "reader 2"]
    assert lines[2] == "writer, alone"
    assert sorted(lines[3:]) == ["backup 1", "backup 2", "backup 3"]
