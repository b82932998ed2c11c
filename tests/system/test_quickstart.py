"""README's Quick start, run verbatim on a fresh ``pip install .`` (issue 24).

The repository root is installed with pip into an empty venv (pip may use
its cache and PyPI; nothing else), then the README's Quick start blocks are
read from the README itself and run as written: the first block's
``pip install .`` and ``lockd serve`` (the daemon, kept running), the second
block with bash, ``-e``, under a clean user-mode environment (its own
``XDG_RUNTIME_DIR``, state and config dirs; no ``LOCKD_SOCKET``). So the
README cannot drift from what a newcomer's copy-paste does.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lockd.testing.daemon import SESSION_ENV, SESSION_TOKEN
from lockd.testing.polling import wait_for

REPO = Path(__file__).resolve().parents[2]


def quick_start_blocks() -> list[list[str]]:
    """The lines of each ```sh block of README's "## Quick start" section.

    The second block is given to bash whole (a command may span lines inside
    a quote); comments at the ends of lines are bash's to skip.
    """
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return [
        block.strip("\n").split("\n") for block in re.findall(r"```sh\n(.*?)```", section, re.S)
    ]


def test_readme_has_a_quick_start_at_the_top() -> None:
    text = (REPO / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[0] == "Quick start"
    install, serve = quick_start_blocks()[0]
    assert install.startswith("pip install .") and "pipx install ." in install
    assert serve.startswith("lockd serve")


def _venv_with_pip(venv: Path) -> None:
    """A fresh venv with pip in it, the version this run's own venv has.

    Made without ensurepip, whose install byte-compiles all of pip (~6 s of
    CPU, 30-50 s on a loaded machine); pip compiles what it runs as it goes.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    version = f"pip=={importlib.metadata.version('pip')}"
    subprocess.run([*pip, "install", "-q", "--no-compile", version], check=True, timeout=300)


def test_quick_start_verbatim_after_pip_install(tmp_path: Path) -> None:
    (install, serve), commands = quick_start_blocks()[:2]
    venv = tmp_path / "venv"
    _venv_with_pip(venv)
    bin_dir = venv / "bin"
    # A user-mode environment of its own: the socket lands in XDG_RUNTIME_DIR.
    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"lockd-qs-{os.getpid()}"
    run_dir.mkdir(mode=0o700)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("LOCKD_", "VIRTUAL_ENV", "PYTHON"))
    }
    env.update(
        PATH=f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        XDG_RUNTIME_DIR=str(run_dir),
        XDG_STATE_HOME=str(tmp_path / "state"),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        XDG_DATA_HOME=str(tmp_path / "data"),
        HOME=str(tmp_path),
        # pip's own cache, which HOME above would hide: what it holds is what
        # pip would fetch again (on CI, scripts/test's install just filled it).
        PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        **{SESSION_ENV: SESSION_TOKEN},
    )
    installed = subprocess.run(
        ["bash", "-ec", install],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    site = subprocess.run(
        [bin_dir / "python", "-c", "import lockd, lockd_client; print(lockd_client.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert str(venv) in site.stdout  # the installed copy, not the checkout

    daemon = subprocess.Popen(
        ["bash", "-c", f"exec {serve}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        socket = run_dir / "lockd" / "lockd.sock"

        def socket_made() -> bool:
            assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
            return socket.exists()

        wait_for(socket_made, 60, "the daemon's socket", interval=0.05)
        done = subprocess.run(
            ["bash", "-ec", "\n".join(commands)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        lines = done.stdout.splitlines()
        assert "demo" in lines[0]  # status names the key ...
        assert any(line.startswith("Held by:") or "Held by" in line for line in lines)
        assert "None" in lines  # try_acquire on a held key
        assert any(line.startswith("holding demo with fence ") for line in lines)
        assert lines[-1].startswith("holding demo with fence ")  # lockd run's COMMAND
        assert "Traceback" not in done.stderr
    finally:
        daemon.terminate()
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        for path in sorted(run_dir.rglob("*"), reverse=True):
            path.unlink() if not path.is_dir() else path.rmdir()
        run_dir.rmdir()


@pytest.mark.slow  # ~2 min: pipx resolves lockd's dependencies into a venv of its own
def test_pipx_install_gives_a_working_lockd(tmp_path: Path) -> None:
    """``pipx install .`` (the README's other first command): lockd with its client.

    pipx is not a test dependency: the test runs where ``pipx`` is on PATH
    (or ``$PIPX`` names it) and is skipped elsewhere.
    """
    pipx = os.environ.get("PIPX") or shutil.which("pipx")
    if pipx is None:
        pytest.skip("pipx is not installed (set PIPX=/path/to/pipx to run this)")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("LOCKD_", "VIRTUAL_ENV"))},
        "PIPX_HOME": str(tmp_path / "pipx"),
        "PIPX_BIN_DIR": str(tmp_path / "bin"),
        "PIPX_MAN_DIR": str(tmp_path / "man"),
    }
    installed = subprocess.run(
        [pipx, "install", str(REPO)], env=env, capture_output=True, text=True, timeout=600
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    lockd = tmp_path / "bin" / "lockd"
    version = subprocess.run(
        [lockd, "--version"], env=env, capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0 and "lockd, version" in version.stdout
    # The client came along, in lockd's own environment.
    status = subprocess.run(
        [lockd, "locks", "status", "k", "--socket", str(tmp_path / "none.sock")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 5 and "daemon unavailable" in status.stderr
