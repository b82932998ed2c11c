"""File descriptors: the limit is raised, max_connections fits under it, and a
connection the daemon has no descriptor for is refused at once, never left hanging.

The daemon tests lower RLIMIT_NOFILE in the daemon process only: at its start
(``preexec_fn``) or while it runs (``prlimit`` on its pid), never in pytest's.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from lockd_client import LockClient

from lockd.daemon import fdlimit
from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for

#: generous: a refused connection sees EOF at once, a hanging one never does.
REFUSAL_TIMEOUT = 10.0


def _connect_and_hello(path: Path) -> str:
    """'served' if hello is answered, 'refused' on a refusal line, EOF or reset.

    Raises TimeoutError if it hangs.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(REFUSAL_TIMEOUT)
    try:
        sock.connect(str(path))
        try:
            sock.sendall(b'{"id": 1, "op": "hello"}\n')
            data = sock.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            return "refused"
        return "served" if b'"protocol"' in data else "refused"
    finally:
        sock.close()


def _open_served(path: Path) -> socket.socket:
    """A connection the daemon has answered once (so it counts as open)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(REFUSAL_TIMEOUT)
    sock.connect(str(path))
    sock.sendall(b'{"id": 1, "op": "hello"}\n')
    assert b'"protocol"' in sock.recv(65536)
    return sock


def _highest_fd(pid: int) -> int:
    return max(int(name) for name in os.listdir(f"/proc/{pid}/fd"))


# --------------------------------------------------------------------------
# pieces


def test_connection_budget_sets_aside_the_daemons_own_descriptors() -> None:
    assert fdlimit.connection_budget(1024) == 1024 - fdlimit.RESERVED_FDS
    assert fdlimit.connection_budget(65536) == 65536 - fdlimit.RESERVED_FDS
    assert fdlimit.connection_budget(10) == 1
    assert fdlimit.connection_budget(resource.RLIM_INFINITY) >= 2**30


_RAISE_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from lockd.daemon import fdlimit
    soft, hard = (int(x) for x in sys.argv[1:3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(json.dumps(fdlimit.raise_soft_limit()))
    """
)


def test_raise_soft_limit_lifts_soft_to_hard() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _RAISE_CHILD, "256", "512"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert json.loads(out.stdout) == [512, 512]


def test_spare_fd_refuses_a_connection_when_no_descriptor_is_left(tmp_path: Path) -> None:
    """In a child: exhaust the descriptors, then refuse_one still ends the waiting client."""
    child = textwrap.dedent(
        """
        import os, resource, socket, sys
        from lockd.daemon import fdlimit
        listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listen.bind(sys.argv[1]); listen.listen(8); listen.setblocking(False)
        spare = fdlimit.SpareFd()
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        hog = []
        try:
            while True:
                hog.append(os.open("/", os.O_RDONLY))
        except OSError:
            pass
        print("full", flush=True)
        sys.stdin.readline()              # the parent has connected
        try:
            listen.accept()
            print("accepted without a descriptor?!", flush=True)
        except OSError as exc:
            print("emfile" if exc.errno in fdlimit.OUT_OF_FDS else exc, flush=True)
        print("refused" if spare.refuse_one(listen) else "not refused", flush=True)
        print("again" if spare.refuse_one(listen) else "nothing waiting", flush=True)
        """
    )
    path = tmp_path / "s.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "full"
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(REFUSAL_TIMEOUT)
        client.connect(str(path))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "emfile"
        assert proc.stdout.readline().strip() == "refused"
        assert client.recv(10) == b""  # EOF at once: the client is not left hanging
        client.close()
        assert proc.stdout.readline().strip() == "nothing waiting"
    finally:
        proc.kill()
        proc.wait()


def test_throttled_warnings_log_a_burst_once_with_its_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(fdlimit.time, "monotonic", lambda: now[0])
    logger = logging.getLogger("lockd.test.throttle")
    warnings = fdlimit.ThrottledWarnings(logger, interval=10.0)
    caplog.set_level(logging.WARNING, logger="lockd.test.throttle")
    for _ in range(500):
        warnings.warn("connection_refused", "max_connections", limit=3)
    warnings.warn("accept_failed", "ENOBUFS")
    assert [r.getMessage() for r in caplog.records] == [
        "event=connection_refused reason=max_connections count=1 limit=3",
        "event=accept_failed reason=ENOBUFS count=1",
    ]
    now[0] += 10.0
    warnings.warn("connection_refused", "max_connections", limit=3)
    assert caplog.records[-1].getMessage() == (
        "event=connection_refused reason=max_connections count=500 limit=3"
    )


# --------------------------------------------------------------------------
# a real daemon


def _low_nofile(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def test_max_connections_is_lowered_to_fit_the_descriptor_limit(
    daemon_paths: DaemonProcess,
) -> None:
    limit = fdlimit.RESERVED_FDS + 8
    daemon_paths.start(preexec_fn=lambda: _low_nofile(limit))
    log = daemon_paths.read_log()
    assert "event=max_connections_lowered configured=1024 max_connections=8" in log
    assert f"nofile={limit}" in log
    with LockClient(str(daemon_paths.socket)) as observer:
        served: list[socket.socket] = []
        try:
            # observer is one of the 8; the readiness probe may still count.
            wait_for(lambda: observer.stats()["connections"] == 1, REFUSAL_TIMEOUT, "one left")
            served = [_open_served(daemon_paths.socket) for _ in range(7)]
            assert _connect_and_hello(daemon_paths.socket) == "refused"
            assert observer.stats()["counters"]["connectionsRefused"] == 1
        finally:
            for sock in served:
                sock.close()


def test_a_connection_without_a_descriptor_is_refused_at_once(
    daemon: DaemonProcess,
) -> None:
    """Descriptors run out while the daemon runs: refused and counted, not left hanging."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    with LockClient(str(daemon.socket)) as observer:
        assert observer.hello()["protocol"] == 1
        # No descriptor number above the highest one in use: the holes below
        # it (if any) fill up with connections kept open, then accept() fails
        # with EMFILE.
        soft, hard = resource.prlimit(
            pid, resource.RLIMIT_NOFILE, (_highest_fd(pid) + 1, hard_of(pid))
        )
        kept: list[socket.socket] = []
        try:
            for _ in range(40):
                try:
                    kept.append(_open_served(daemon.socket))
                except (AssertionError, BrokenPipeError, ConnectionResetError):
                    break  # refused: EOF or reset instead of a reply
            else:
                pytest.fail("40 connections served under a limit with no room")
            # Every further one too, at once (TimeoutError if one hung).
            assert [_connect_and_hello(daemon.socket) for _ in range(20)] == ["refused"] * 20
            # The open connections are served as before; every refusal counts.
            assert observer.stats()["counters"]["connectionsRefused"] == 21
            for sock in kept:
                sock.sendall(b'{"id": 2, "op": "hello"}\n')
                assert b'"protocol"' in sock.recv(65536)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
            for sock in kept:
                sock.close()
        # Room again once descriptors are back.
        assert _connect_and_hello(daemon.socket) == "served"
    log = daemon.read_log()
    # One line for the burst, not one per connection (nor ten a second).
    assert log.count("event=connection_refused reason=no_file_descriptors") == 1
    assert "accept_failed" not in log


def hard_of(pid: int) -> int:
    return resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
