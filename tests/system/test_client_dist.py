"""``lockd-client`` as its own distribution (docs/contract.md §8): the wheel built from
``client/``, installed into an empty venv, imports only the standard library
and talks to a real daemon (sync and asyncio), with its type information."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from lockd.testing.daemon import DaemonProcess

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"

USE_IT = """
import asyncio, json, sys
before = set(sys.modules)
import lockd_client, lockd_client.aio
from lockd_client import LockClient, LockLostError
from lockd_client.aio import AsyncLockClient
new = {m.split(".")[0] for m in set(sys.modules) - before}
foreign = sorted(m for m in new if m != "lockd_client" and m not in sys.stdlib_module_names)

with LockClient(sys.argv[1]) as client:
    with client.lock("dist:k", ttl=30, timeout=5) as handle:
        held = client.status("dist:k").fence == handle.fence

async def main():
    async with AsyncLockClient(sys.argv[1]) as client:
        h = await client.acquire("dist:a", ttl=30, timeout=5)
        return (await client.release(h)).released

released = asyncio.run(main())
print(json.dumps({"foreign": foreign, "held": held, "released": released,
                  "file": lockd_client.__file__}))
"""


def test_wheel_in_an_empty_venv_uses_only_the_standard_library(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--wheel-dir",
            wheels,
            CLIENT_DIR,
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("lockd_client-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lockd_client/py.typed" in names  # type information reaches users
    assert "lockd_client/trio.py" in names and not [n for n in names if n.startswith("lockd/")]
    metadata = zipfile.ZipFile(wheel).read("lockd_client-0.1.0.dist-info/METADATA").decode()
    assert "Requires-Dist" not in metadata.replace("Requires-Dist: trio", "")  # no dependencies

    # An empty venv, without even pip: this run's pip installs into it and
    # lists it from outside (pip --python), which spares ensurepip's install
    # and byte-compilation of pip (~6 s of CPU, ~45 s on a loaded machine).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=300)
    python = venv / "bin" / "python"
    pip_into_venv = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run(
        [*pip_into_venv, "install", "-q", "--no-index", "--no-deps", wheel],
        check=True,
        timeout=300,
    )
    listed = subprocess.run(
        [*pip_into_venv, "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert installed - {"pip", "setuptools"} == {"lockd-client"}  # nothing else came along

    run = subprocess.run(
        [python, "-I", "-c", USE_IT, str(daemon.socket)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the checkout: the installed copy is used
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["foreign"] == [] and result["held"] and result["released"]
    assert result["file"].startswith(str(venv))
