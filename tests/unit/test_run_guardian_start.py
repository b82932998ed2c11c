"""The guardian forked from ``lockd run`` starts as the one run as a program would (issue 24).

``lockd run`` forks its guardian when it has no other thread, and runs
``python -I -S guardian.py`` otherwise (lockd/run/forked.py). Each case
here starts a guardian both ways, from a fresh interpreter that has opened a
descriptor of its own and installed a Python signal handler first, and
COMMAND writes down what its parent (the guardian) looks like: its open
descriptors, its signal dispositions and mask, its process group. Both must
match, and neither guardian may hold the extra descriptor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

#: argv[1]: "fork" or "exec" (a thread kept alive forces the program); argv[2]: the output file.
STARTER = r"""
import os, signal, sys, threading
from lockd.run.process import Guardian
from lockd.run.guardian import NO_TERMINAL

how, out = sys.argv[1], sys.argv[2]
stray = os.open("/dev/null", os.O_RDONLY)  # lockd run's own descriptor: not the guardian's
signal.signal(signal.SIGTERM, lambda *_: None)  # a Python handler: not the guardian's
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: stays ignored
if how == "exec":
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
probe = (
    'p=$PPID; {'
    ' echo "comm $(cat /proc/$p/comm)";'
    ' grep -E "^Sig(Blk|Ign|Cgt)" /proc/$p/status;'
    ' echo "pgid $(ps -o pgid= -p $p | tr -d " ") pid $p";'
    ' for fd in /proc/$p/fd/*; do echo "fd ${fd##*/} $(readlink $fd | cut -d: -f1)"; done;'
    ' } > "$1"'
)
g = Guardian(["sh", "-c", probe, "sh", out], NO_TERMINAL)
g.go(dict(os.environ), None)
while not g.finished and g.next_message(30) is not None:
    pass
g.close()
print(json.dumps({"stray": stray}))
"""


def guardian_state(tmp_path: Path, how: str) -> tuple[dict[str, str], list[tuple[int, str]], int]:
    out = tmp_path / f"{how}.txt"
    done = subprocess.run(
        [sys.executable, "-c", "import json\n" + STARTER, how, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    stray = json.loads(done.stdout)["stray"]
    fields: dict[str, str] = {}
    fds: list[tuple[int, str]] = []
    for line in out.read_text().splitlines():
        word, rest = line.split(None, 1)
        if word == "fd":
            number, _, kind = rest.partition(" ")
            fds.append((int(number), kind))
        else:
            fields[word.rstrip(":")] = rest.strip()
    return fields, sorted(fds), stray


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    tmp = tmp_path_factory.mktemp("guardian")
    return {how: guardian_state(tmp, how) for how in ("fork", "exec")}


def test_the_forked_guardian_is_named_and_the_program_is_python(both: dict[str, tuple]) -> None:
    assert both["fork"][0]["comm"] == "lockd-guardian"
    assert both["exec"][0]["comm"].startswith("python")


def test_signal_dispositions_and_mask_match(both: dict[str, tuple]) -> None:
    for field in ("SigBlk", "SigIgn", "SigCgt"):
        assert both["fork"][0][field] == both["exec"][0][field], field


def test_each_guardian_leads_a_process_group_of_its_own(both: dict[str, tuple]) -> None:
    for how in ("fork", "exec"):
        fields = both[how][0]
        pgid, _, pid = fields["pgid"].partition(" pid ")
        assert pgid == pid, how


def test_the_same_descriptors_and_never_lockd_runs_own(both: dict[str, tuple]) -> None:
    fork_fds, exec_fds = both["fork"][1], both["exec"][1]
    assert [kind for _, kind in fork_fds] == [kind for _, kind in exec_fds]
    for how in ("fork", "exec"):
        _, fds, stray = both[how]
        assert stray not in {n for n, kind in fds if kind == "/dev/null"}, how
        assert [n for n, _ in fds][:3] == [0, 1, 2]


# COMMAND's environment travels as JSON written and read with json's C pieces
# (lockd.run.guardian.dump_env / load_env, issue 24): the same text as
# json.dumps, read back as json.loads reads it, undecodable bytes included.
_env_text = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x10FFFF))


@given(st.dictionaries(_env_text, _env_text, max_size=8))
def test_the_environment_travels_as_json_dumps_writes_it(env: dict[str, str]) -> None:
    from lockd.run.guardian import dump_env, load_env

    text = dump_env(env)
    assert text == json.dumps(env)
    assert load_env(text) == env == json.loads(text)


def test_descriptors_ride_along_with_the_go_line() -> None:
    import _socket

    from lockd.run.guardian import recv_fds, send_fds

    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    read_end, write_end = os.pipe()
    try:
        send_fds(ours, b"go ", [write_end])
        data, fds = recv_fds(theirs, 1 << 16, 4)
        assert data == b"go " and len(fds) == 1
        os.write(fds[0], b"x")  # the copy is the pipe's write end
        assert os.read(read_end, 1) == b"x"
        os.close(fds[0])
        send_fds(ours, b"kill 0\n", [])
        assert recv_fds(theirs, 1 << 16, 4) == (b"kill 0\n", [])
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        ours.close()
        theirs.close()
