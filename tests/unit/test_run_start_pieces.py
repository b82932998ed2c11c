"""The stdlib stand-ins ``lockd run`` and the client use to start light (issue 24).

``threading``, ``contextlib``, ``enum``, ``signal``'s enums, ``ctypes``,
``array``, ``math``, ``grp`` and the renewer's and guardian reader's thread
were most of what an installed ``lockd run`` cost beyond ``python -c pass``
(bench/startup.py). Each replacement here must behave as what it replaced:
the renewer's stop flag as an ``Event``, ``OnLost`` as the ``StrEnum`` it
was, the guardian's PATH search as ``os.execvpe``, prctl through
``_ctypes`` as through ``ctypes``, ``ceil`` as ``math.ceil``, descriptors
packed with ``int.to_bytes`` as ``socket.send_fds`` packs them, the
client's socket options packed and read as ``struct`` does, and the lockd
system user looked up only when an owner is neither root nor us.
"""

from __future__ import annotations

import copy
import errno
import math
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lockd_client import _trust
from lockd_client._events import Loss, LossBook
from lockd_client._renewer import AutoRenewer, Flag
from lockd_client._wire import C_INT, C_LONG, ceil, pack_native, unpack_native

from lockd.run import guardian
from lockd.run.options import OnLost, RunOptions
from lockd.run.process import Guardian, Message

# -- the renewer's stop flag and thread ------------------------------------------------


def test_flag_reads_as_an_event() -> None:
    flag = Flag()
    assert not flag.is_set()
    assert flag.wait(0) is False
    assert flag.wait(0.01) is False
    flag.set()
    flag.set()  # twice: no error, as Event.set
    assert flag.is_set() and flag.wait(0) and flag.wait(None) and flag.wait(-1)


def test_flag_wakes_every_waiter() -> None:
    flag = Flag()
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(flag.wait(30))) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    flag.set()
    for waiter in waiters:
        waiter.join(30)
    assert woke == [True, True, True]


def test_the_renewer_stop_waits_for_its_thread(tmp_path: Path) -> None:
    # No daemon at the socket: the thread starts, waits its first pause, and
    # stop() returns only once it has ended (as Thread.join did).
    from lockd_client import Handle, LockClient

    handle = Handle("k", "h" * 22, 1, None, 60_000, None)
    renewer = AutoRenewer(
        LockClient(str(tmp_path / "none.sock")), handle, 60_000, None, expires_at=1e12
    )
    renewer.start()
    assert renewer.alive  # (a count of /proc/self/task would race other tests' pool threads)
    renewer.stop()
    assert not renewer.alive
    assert renewer.lost_reason is None
    with pytest.raises(RuntimeError, match="only be started once"):
        renewer.start()


def test_a_renewer_never_started_stops_at_once(tmp_path: Path) -> None:
    from lockd_client import Handle, LockClient

    handle = Handle("k", "h" * 22, 1, None, 60_000, None)
    renewer = AutoRenewer(LockClient(str(tmp_path / "s")), handle, 60_000, None, expires_at=0.0)
    began = time.monotonic()
    renewer.stop()  # no thread to wait for: Thread.join's time-out must not be waited out
    assert time.monotonic() - began < 1.0
    assert not renewer.alive and renewer.lost_reason is None


def test_the_loss_book_drops_the_oldest_past_its_bound() -> None:
    book = LossBook()
    for n in range(1030):
        book.add(Loss("k", f"h{n}", n, "break", None, None, None))
    assert book.get("h0") is None and book.get("h5") is None
    assert book.get("h6") is not None and book.get("h1029") is not None


# -- OnLost without enum ------------------------------------------------------------------


def test_on_lost_reads_as_the_str_enum_it_was() -> None:
    assert list(OnLost) == [OnLost.TERM, OnLost.KILL, OnLost.IGNORE]
    assert [mode.value for mode in OnLost] == ["term", "kill", "ignore"]
    assert [mode.name for mode in OnLost] == ["TERM", "KILL", "IGNORE"]
    assert OnLost("kill") is OnLost.KILL and OnLost(OnLost.KILL) is OnLost.KILL
    assert OnLost.KILL == "kill" and isinstance(OnLost.KILL, str)
    assert str(OnLost.TERM) == "term" and f"{OnLost.IGNORE}" == "ignore"
    assert repr(OnLost.KILL) == "<OnLost.KILL: 'kill'>"
    assert {OnLost.KILL: 1}["kill"] == 1
    for bad in ("KILL", "", "stop", None, 3):
        with pytest.raises(ValueError, match="is not a valid OnLost"):
            OnLost(bad)  # type: ignore[arg-type]


def test_on_lost_copies_and_pickles_to_the_member_itself() -> None:
    assert copy.copy(OnLost.IGNORE) is OnLost.IGNORE
    assert copy.deepcopy(OnLost.IGNORE) is OnLost.IGNORE
    assert pickle.loads(pickle.dumps(OnLost.TERM)) is OnLost.TERM
    opts = pickle.loads(pickle.dumps(RunOptions("k", ("true",), on_lost=OnLost.KILL)))
    assert opts.on_lost is OnLost.KILL


# -- the guardian's pieces -----------------------------------------------------------------


def test_prctl_through_the_c_layer_answers_as_ctypes_does() -> None:
    c_layer = guardian._prctl_from_c_layer()
    through_ctypes = guardian._prctl_from_ctypes()
    assert c_layer is not None and through_ctypes is not None
    pr_get_dumpable, pr_get_timerslack = 3, 30
    for option in (pr_get_dumpable, pr_get_timerslack):
        assert c_layer(option, 0, 0, 0) == through_ctypes(option, 0, 0, 0)
    assert c_layer(-1, 0, 0, 0) == through_ctypes(-1, 0, 0, 0) == -1  # EINVAL


SUBREAPER_PROBE = r"""
import os, sys
from lockd.run import guardian
assert guardian.prctl(guardian.PR_SET_CHILD_SUBREAPER, 1)
assert "ctypes" not in sys.modules
r, w = os.pipe()
child = os.fork()
if child == 0:
    if os.fork() == 0:  # orphaned once its parent exits: re-parented to the subreaper
        os.close(w)
        os.read(r, 1)  # until the probe lets it go, after its parent is gone
        os._exit(0)
    os._exit(0)
os.close(r)
os.waitpid(child, 0)
os.close(w)
orphan, _ = os.wait()  # only a subreaper has the grandchild to wait for
print("reaped", orphan != child)
"""


def test_the_subreaper_is_set_without_the_ctypes_package() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SUBREAPER_PROBE], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["reaped", "True"], out.stderr


def test_descriptors_ride_along_as_socket_send_fds_sends_them() -> None:
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    try:
        guardian.send_fds(ours, b"go ", [r, w])
        data, fds = guardian.recv_fds(theirs, 1024, 4)
        assert data == b"go " and len(fds) == 2
        socket.send_fds(ours, [b"x"], [w])  # the stdlib's sender, our receiver
        data, more = guardian.recv_fds(theirs, 1024, 4)
        assert data == b"x" and len(more) == 1
        os.write(fds[1], b"!")
        assert os.read(r, 1) == b"!"
        guardian.send_fds(ours, b"y", [r, w, r])  # our sender, the stdlib's receiver
        data, got, _flags, _addr = socket.recv_fds(theirs, 1024, 4)
        assert data == b"y" and len(got) == 3
        os.write(got[1], b"?")
        assert os.read(got[0], 1) == b"?"
        for fd in (*fds, *more, *got):
            os.close(fd)
    finally:
        ours.close()
        theirs.close()
        os.close(r)
        os.close(w)


class _FakeExec:
    """os.execve that fails as the table says, recording each path tried."""

    def __init__(self, errors: dict[str, int]) -> None:
        self.errors = errors
        self.tried: list[str] = []

    def __call__(self, path: str | bytes, argv: object, env: object) -> None:
        name = os.fsdecode(path)
        self.tried.append(name)
        code = self.errors.get(name, errno.ENOENT)
        raise OSError(code, os.strerror(code), name)


@pytest.mark.parametrize(
    ("path", "errors"),
    [
        ("/a:/b:/c", {}),  # nowhere: the last "not found"
        ("/a:/b:/c", {"/b/tool": errno.EACCES}),  # a refusal beats "not found"
        ("/a:/b:/c", {"/a/tool": errno.ENOTDIR, "/c/tool": errno.ENOEXEC}),
        ("/a:/b", {"/a/tool": errno.EACCES, "/b/tool": errno.ENOEXEC}),  # the first refusal
        ("", {"tool": errno.EACCES}),  # an empty PATH: the current folder
        (None, {}),  # no PATH: os.defpath
    ],
)
def test_execvpe_searches_and_fails_as_os_execvpe(
    monkeypatch: pytest.MonkeyPatch, path: str | None, errors: dict[str, int]
) -> None:
    env = {"HOME": "/"} if path is None else {"PATH": path}
    outcomes = []
    for function in (os.execvpe, guardian.execvpe):
        fake = _FakeExec(errors)
        monkeypatch.setattr(os, "execve", fake)
        with pytest.raises(OSError) as raised:
            function("tool", ["tool"], env)
        outcomes.append((fake.tried, raised.value.errno, type(raised.value)))
    assert outcomes[0] == outcomes[1]


def test_execvpe_runs_a_path_with_a_slash_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeExec({})
    monkeypatch.setattr(os, "execve", fake)
    with pytest.raises(FileNotFoundError):
        guardian.execvpe("./bin/tool", ["tool"], {"PATH": "/a"})
    assert fake.tried == ["./bin/tool"]


EXEC_PROBE = r"""
import os, sys
from lockd.run import guardian
def execve(path, argv, env):  # where COMMAND would start: what the process holds by then
    print(" ".join(sorted(sys.modules)))
    sys.stdout.flush()
    os._exit(0)
os.execve = execve
guardian.execvpe("true", ["true"], {"PATH": "/nonexistent:/usr/bin:/bin"})
"""


def test_the_path_search_imports_no_warnings() -> None:
    # os.execvpe's get_exec_path imports warnings right before the exec.
    out = subprocess.run(
        [sys.executable, "-S", "-c", EXEC_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(_checkout_paths())},
    )
    modules = out.stdout.split()
    assert "lockd.run.guardian" in modules, out.stderr
    assert "warnings" not in modules


def _checkout_paths() -> list[str]:
    root = Path(__file__).resolve().parents[2]
    return [str(root), str(root / "client")]


def test_guardian_messages_come_in_order_and_a_post_ends_the_wait() -> None:
    g = Guardian(["sh", "-c", "exit 3"], guardian.NO_TERMINAL)
    try:
        g.go(dict(os.environ), None)
        assert g.next_message(30) == Message("exit", "3")
        g.post(Message("renewer"))
        assert g.next_message(30) == Message("renewer")
        assert g.next_message(30) == Message("empty")
        assert g.finished
        assert g.next_message(0.01) is None  # nothing more: the time-out
        g.post(Message("renewer"))
        assert g.next_message(0) == Message("renewer")  # a time-out of 0 still takes it
        waker = threading.Timer(0.05, g.post, (Message("signal", "15"),))
        waker.start()
        assert g.next_message(30) == Message("signal", "15")  # from another thread
        waker.join()
    finally:
        g.close()


# -- the client's pieces --------------------------------------------------------------------


@given(st.floats(min_value=-1e15, max_value=1e15, allow_nan=False) | st.integers(-(10**12), 10**12))
def test_ceil_is_math_ceil(value: float) -> None:
    assert ceil(value) == math.ceil(value)


def test_the_native_sizes_are_structs() -> None:
    assert struct.calcsize("i") == C_INT
    assert struct.calcsize("l") == C_LONG


C_INTS = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8)
C_LONGS = st.lists(st.integers(-(2 ** (8 * C_LONG - 1)), 2 ** (8 * C_LONG - 1) - 1), max_size=8)


@given(C_INTS, C_LONGS)
def test_native_packing_is_struct_pack(ints: list[int], longs: list[int]) -> None:
    assert pack_native(ints, C_INT) == struct.pack(f"@{len(ints)}i", *ints)
    assert pack_native(longs, C_LONG) == struct.pack(f"@{len(longs)}l", *longs)
    assert unpack_native(struct.pack(f"@{len(ints)}i", *ints), C_INT) == tuple(ints)
    assert unpack_native(struct.pack(f"@{len(longs)}l", *longs), C_LONG) == tuple(longs)


def test_native_packing_refuses_what_struct_refuses() -> None:
    with pytest.raises(OverflowError):
        pack_native([2**31], C_INT)  # struct.error in struct; out of range either way
    with pytest.raises(ValueError, match="whole number"):
        unpack_native(b"\0" * 5, C_INT)


def test_the_peer_check_reads_the_listeners_credentials() -> None:
    ours, theirs = socket.socketpair()
    try:
        _trust.check_peer("pair", ours, {os.getuid()})  # we are the peer: trusted
        with pytest.raises(_trust.UntrustedDaemonError, match=f"pid {os.getpid()}"):
            _trust.check_peer("pair", ours, {os.getuid() + 1})
    finally:
        ours.close()
        theirs.close()


def test_the_system_user_is_looked_up_only_for_a_stranger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked_up: list[str] = []

    class Entry:
        pw_uid = 4242

    def getpwnam(name: str) -> Entry:
        looked_up.append(name)
        return Entry()

    monkeypatch.setattr(_trust.pwd, "getpwnam", getpwnam)
    trusted = _trust.trusted_uids()
    assert 0 in trusted and os.geteuid() in trusted
    assert looked_up == []
    assert 4242 in trusted and 4243 not in trusted
    assert looked_up == [_trust.SYSTEM_USER]  # once


def test_no_system_user_trusts_root_and_us_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def getpwnam(name: str) -> object:
        raise KeyError(name)

    monkeypatch.setattr(_trust.pwd, "getpwnam", getpwnam)
    trusted = _trust.trusted_uids()
    assert 0 in trusted and os.geteuid() in trusted and 4242 not in trusted
