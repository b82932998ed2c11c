"""Strings other users chose cannot drive the reader's terminal (issue 21, item 6).

A holder's process name (/proc/PID/comm: newlines, escape sequences, bidi
overrides allowed), its owner and its key reach other users through ``lockd
locks list``/``status``/``acquire`` (busy) and ``break``; the text output
shows them escaped, ``--json`` output keeps them exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from lockd.cli import main
from lockd.logfmt import kv
from lockd.testing.daemon import DaemonProcess
from lockd.textsafe import visible

pytestmark = pytest.mark.both_backends

#: 15 bytes, the most comm holds: a newline, "clear screen", a bidi override.
HOSTILE_COMM = "a\n\x1b[2J\u202eexe"
KEY = "esc:\u202ekey"
OWNER = "run\u202e1\u200f"
#: what must never reach a terminal raw
RAW = ("\x1b", "\u202e", "\u200f", "\r")


def test_visible_escapes_what_is_not_printable_and_keeps_the_rest() -> None:
    assert visible("backup.sh") == "backup.sh"
    assert visible("café ünï 漢字") == "café ünï 漢字"
    assert visible("a\nb\tc\rd") == "a\\nb\\tc\\rd"
    assert visible("\x1b[31mred") == "\\x1b[31mred"
    assert visible("\u202egnp.exe\u2028\U000e0001") == "\\u202egnp.exe\\u2028\\U000e0001"
    assert visible(None) == "None" and visible(42) == "42"


def test_log_lines_escape_the_same_characters() -> None:
    line = kv(event="denied", process=HOSTILE_COMM, owner=OWNER)
    assert "\n" not in line and not any(raw in line for raw in RAW)


@pytest.fixture
def hostile_holder(daemon: DaemonProcess) -> Iterator[int]:
    """A process named HOSTILE_COMM holding KEY with owner OWNER; its pid."""
    script = (
        "import sys\n"
        "with open('/proc/self/comm', 'w') as comm:\n"
        f"    comm.write({HOSTILE_COMM!r})\n"
        "from lockd_client import LockClient\n"
        f"client = LockClient({str(daemon.socket)!r})\n"
        f"client.acquire({KEY!r}, ttl=60, timeout=5, owner={OWNER!r})\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def _terminal_safe(text: str) -> None:
    assert not any(raw in text for raw in RAW), repr(text)


def test_tables_and_messages_escape_the_holders_strings(
    daemon: DaemonProcess, hostile_holder: int
) -> None:
    env = {"LOCKD_SOCKET": str(daemon.socket)}
    runner = CliRunner()
    status = runner.invoke(main, ["locks", "status", KEY], env=env)
    assert status.exit_code == 0, status.output
    _terminal_safe(status.stdout)
    assert "Process:  a\\n\\x1b[2J\\u202eexe" in status.stdout
    assert "Owner:    run\\u202e1\\u200f" in status.stdout

    listing = runner.invoke(main, ["locks", "list", "--prefix", "esc:"], env=env)
    assert listing.exit_code == 0, listing.output
    _terminal_safe(listing.stdout)
    header, row, *rest = listing.stdout.splitlines()
    assert header.split()[0] == "KEY"
    assert rest == []  # the newline in the name forged no second row
    assert str(hostile_holder) in row.split() and "esc:\\u202ekey" in row

    busy = runner.invoke(main, ["locks", "acquire", KEY, "--ttl", "1m"], env=env)
    assert busy.exit_code == 1
    _terminal_safe(busy.stderr)
    assert "\n" not in busy.stderr.rstrip("\n")

    broken = runner.invoke(main, ["locks", "break", KEY, "--reason", "test"], env=env)
    assert broken.exit_code == 0, broken.output
    _terminal_safe(broken.stdout)


def test_json_output_keeps_the_strings_exact(daemon: DaemonProcess, hostile_holder: int) -> None:
    env = {"LOCKD_SOCKET": str(daemon.socket)}
    status = CliRunner().invoke(main, ["locks", "status", KEY, "--json"], env=env)
    assert status.exit_code == 0, status.output
    document = json.loads(status.stdout)
    assert document["process"] == HOSTILE_COMM
    assert document["owner"] == OWNER and document["key"] == KEY
