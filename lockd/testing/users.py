"""Throwaway Unix users and groups, and client code that runs as them.

Access rules and rate limits are about *other* uids: docs/contract.md §1 makes root and
the daemon's own uid ``owner``, so a test running as root can only play a
member through a second process with another uid. This module gives the live
tests (and ``bench/rule_cost.py``, ``bench/abuse.py``) what they need for that:

- :class:`Accounts` creates ``lockdt_<random>`` users and groups with
  ``useradd``/``groupadd`` and removes every one it created, also when the
  test failed half-way (use it as a context manager).
- :class:`Agent` is a long-lived client process running as such a user. It
  holds one :class:`lockd_client.LockClient` (one connection, as a real
  program would) and answers JSON-lines commands, so a test can hold a lease
  across a rule change, park a blocking acquire, or time round trips inside
  the member process.
- :func:`share_socket` opens a user-mode daemon's socket to other uids.

Why the agent drops privileges itself instead of ``Popen(user=...)``: the
venv's interpreter lives under ``/root/.pyenv`` and ``/root`` is mode 0700 on
CI, so exec'ing it after ``setuid`` fails with EACCES (and ``preexec_fn``
runs before exec, so it has the same problem). The agent therefore starts as
root, imports everything it will ever need, then calls ``setgroups``,
``setgid`` and ``setuid`` (which, as root, set real, effective and saved
ids) and checks it cannot get root back -- all before it connects, so the
daemon's SO_PEERCRED sees only the throwaway user. Run as a script
(``python -m lockd.testing.users agent CONFIG``, or by its path) this file
*is* the agent.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pwd
import secrets
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

PREFIX = "lockdt_"
_TOOLS = ("useradd", "userdel", "groupadd", "groupdel")
#: useradd/groupadd exit status when /etc/passwd or /etc/group is locked by
#: another process (e.g. a parallel test run): worth a retry.
_BUSY_EXIT = {1, 10}


def missing_prerequisite() -> str | None:
    """Why live user tests cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root: creates throwaway users and runs clients as them"
    for tool in _TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


def random_name() -> str:
    """``lockdt_`` + 8 hex digits: short, valid for useradd, easy to spot."""
    return PREFIX + secrets.token_hex(4)


def _run_tool(args: list[str], *, attempts: int = 20) -> None:
    """Run useradd & co., retrying while another process holds the passwd lock."""
    for attempt in range(attempts):
        proc = subprocess.run(args, capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return
        if proc.returncode not in _BUSY_EXIT or "lock" not in proc.stderr.lower():
            break
        # Back off while another process holds the lock on /etc/passwd (no event to wait on).
        time.sleep(0.05 * (attempt + 1))
    raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")


@dataclass(frozen=True)
class User:
    """A throwaway login: its name, ids and the groups a login would get."""

    name: str
    uid: int
    gid: int

    @property
    def login_gids(self) -> list[int]:
        """Primary gid plus supplementary groups from /etc/group (as initgroups)."""
        return os.getgrouplist(self.name, self.gid)


@dataclass
class Accounts:
    """Creates throwaway users and groups; :meth:`remove_all` deletes them all."""

    users: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)

    def group(self) -> str:
        name = random_name()
        _run_tool(["groupadd", name])
        self.groups.append(name)
        return name

    def user(self, *, groups: tuple[str, ...] = (), primary: str | None = None) -> User:
        """A user without home or user group (``-M -N``), shell nologin."""
        name = random_name()
        args = ["useradd", "-M", "-N", "-s", "/usr/sbin/nologin"]
        if primary is not None:
            args += ["-g", primary]
        if groups:
            args += ["-G", ",".join(groups)]
        _run_tool([*args, name])
        self.users.append(name)
        entry = pwd.getpwnam(name)
        return User(name, entry.pw_uid, entry.pw_gid)

    def remove_all(self) -> list[str]:
        """Delete users, then groups; returns the failures instead of raising."""
        failures: list[str] = []
        for name in reversed(self.users):
            try:
                _run_tool(["userdel", name])
            except RuntimeError as exc:
                failures.append(str(exc))
        self.users.clear()
        for name in reversed(self.groups):
            try:
                _run_tool(["groupdel", name])
            except RuntimeError as exc:
                failures.append(str(exc))
        self.groups.clear()
        return failures

    def __enter__(self) -> Accounts:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        failures = self.remove_all()
        if failures and exc_type is None:
            raise RuntimeError("cleanup of throwaway accounts failed: " + "; ".join(failures))


def share_socket(socket_path: Path) -> None:
    """Let other uids reach a user-mode daemon started by a test.

    User mode binds the socket 0600 inside the test's 0700 temp folder (it
    serves one user). ``lockd serve --system`` makes its socket 0666 by design
    -- identity comes from peer credentials and rules do the gating -- and
    that is the situation these tests are about; system mode's fixed paths
    (/run/lockd, /etc/lockd) cannot be used by parallel tests, so we keep user
    mode's private paths and open them up the way system mode would.
    """
    os.chmod(socket_path, 0o666)
    os.chmod(socket_path.parent, 0o755)


# --------------------------------------------------------------------- agent


class AgentError(Exception):
    """An error the agent's client raised, carried back as data.

    ``kind`` is the exception class name (``LockAccessDeniedError`` ...);
    ``code``/``status``/``details`` are :class:`lockd_client.LockdError`'s;
    ``retry_after``/``limit`` are :class:`RateLimitedError`'s (else None).
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.kind: str = data.get("kind", "")
        self.code: str | None = data.get("code")
        self.status: int | None = data.get("status")
        self.message: str = data.get("message", "")
        self.details: dict[str, Any] = data.get("details") or {}
        self.retry_after: float | None = data.get("retryAfter")
        self.limit: int | None = data.get("limit")
        super().__init__(f"{self.kind} {self.code}: {self.message}")


class Agent:
    """A client process running as ``user``; call client methods by name.

    Results come back as the daemon's JSON (a handle as its ``raw`` dict,
    ``None`` for a busy ``try_acquire``). Pass a handle back as that dict.
    ``gid``/``groups`` override the primary and supplementary gids the
    process runs with (default: what a login of ``user`` would get).
    """

    def __init__(
        self,
        user: User,
        socket_path: Path,
        *,
        gid: int | None = None,
        groups: list[int] | None = None,
        reply_timeout: float = 30.0,
    ) -> None:
        self.user = user
        self.gid = user.gid if gid is None else gid
        self.groups = user.login_gids if groups is None else groups
        self.reply_timeout = reply_timeout
        config = {"socket": str(socket_path), "uid": user.uid, "gid": self.gid}
        config["groups"] = self.groups
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "agent", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"},
        )
        self._buffer = b""
        self._pending = 0
        try:
            ready = self._read_reply(self.reply_timeout)
            if ready.get("uid") != user.uid:
                raise RuntimeError(f"agent did not drop to {user.name}: {ready}")
        except BaseException:
            self.close()
            raise

    def send(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Start a call without waiting (e.g. a blocking acquire that will park)."""
        assert self.proc.stdin is not None
        line = json.dumps({"method": method, "args": args, "kwargs": kwargs}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        self._pending += 1

    def receive(self, timeout: float | None = None) -> Any:
        """The result of the oldest call sent; raises :class:`AgentError` for errors."""
        assert self._pending > 0, "nothing sent"
        reply = self._read_reply(self.reply_timeout if timeout is None else timeout)
        self._pending -= 1
        if reply.get("ok"):
            return reply.get("result")
        raise AgentError(reply["error"])

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.send(method, *args, **kwargs)
        return self.receive()

    def error(self, method: str, *args: Any, **kwargs: Any) -> AgentError:
        """Call and return the error it must raise (fails if it succeeded)."""
        try:
            result = self.call(method, *args, **kwargs)
        except AgentError as exc:
            return exc
        raise AssertionError(f"{method} as {self.user.name} succeeded: {result!r}")

    def _read_reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([fd], [], [], max(0.0, left))
            if not readable:
                raise TimeoutError(f"agent {self.user.name} gave no reply within {timeout} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"agent {self.user.name} died:\n{self._stderr()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _stderr(self) -> str:
        assert self.proc.stderr is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        return self.proc.stderr.read().decode(errors="replace")

    def close(self) -> None:
        """End the agent (its connection closes with it)."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for stream in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------- agent process side


def _agent_main(config: dict[str, Any]) -> None:  # pragma: no cover - runs as a child
    """Import, drop privileges, then serve JSON-lines calls on stdin/stdout."""
    # Besides what the agent uses: what lockd_client imports only when first
    # needed (its start-up stays short). After setuid this interpreter's
    # standard library, under /root on CI, can no longer be read, so load them
    # while root: decimal (a timeout with a fraction of a millisecond), logging
    # (the client's first log message), tempfile (the default socket path
    # without XDG_RUNTIME_DIR).
    import dataclasses
    import decimal  # noqa: F401
    import logging  # noqa: F401
    import tempfile  # noqa: F401
    import traceback

    import lockd_client
    import lockd_client._lock  # imported lazily by LockClient.lock(): do it while root
    from lockd_client import LockdError

    os.setgroups(config["groups"])
    os.setgid(config["gid"])
    os.setuid(config["uid"])
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise SystemExit("privileges were not dropped")

    client = lockd_client.LockClient(config["socket"], request_timeout=30.0)
    methods: dict[str, Callable[..., Any]] = {
        name: getattr(client, name)
        for name in (
            "hello",
            "acquire",
            "try_acquire",
            "renew",
            "release",
            "status",
            "list",
            "break_lock",
            "stats",
            "rules",
        )
    }

    fresh = itertools.count()

    def bench(key: str, iterations: int, ttl: float = 30.0, distinct: bool = False) -> list[int]:
        """tryAcquire + release round trips of ``key``, each timed in ns.

        ``distinct``: a key never used before on every round trip
        (``key:<n>``), so no verdict the daemon remembered can apply.
        """
        samples: list[int] = []
        for _ in range(iterations):
            this_key = f"{key}:{next(fresh)}" if distinct else key
            t0 = time.perf_counter_ns()
            handle = client.try_acquire(this_key, ttl)
            if handle is None:
                raise RuntimeError(f"{key} is busy")
            client.release(handle)
            samples.append(time.perf_counter_ns() - t0)
        return samples

    methods["bench"] = bench

    def as_json(value: Any) -> Any:
        raw = getattr(value, "raw", None)
        if isinstance(raw, dict):
            return raw
        if isinstance(value, list):
            return [as_json(v) for v in value]
        if dataclasses.is_dataclass(value):
            return repr(value)
        return value

    def handle_ref(value: Any) -> Any:
        if isinstance(value, dict) and set(value) >= {"key", "handle"}:
            return (value["key"], value["handle"])
        return value

    def write(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    write({"ready": True, "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()})
    for line in sys.stdin:
        call = json.loads(line)
        try:
            method = methods[call["method"]]
            args = [handle_ref(a) for a in call["args"]]
            result = method(*args, **call["kwargs"])
            write({"ok": True, "result": as_json(result)})
        except LockdError as exc:
            write(
                {
                    "ok": False,
                    "error": {
                        "kind": type(exc).__name__,
                        "code": exc.code,
                        "status": exc.status,
                        "message": exc.message,
                        "details": exc.details,
                        "retryAfter": getattr(exc, "retry_after", None),
                        "limit": getattr(exc, "limit", None),
                    },
                }
            )
        except Exception as exc:
            write(
                {
                    "ok": False,
                    "error": {
                        "kind": type(exc).__name__,
                        "code": None,
                        "message": traceback.format_exc(),
                    },
                }
            )
    client.close()


if __name__ == "__main__":  # pragma: no cover - the agent process
    if len(sys.argv) != 3 or sys.argv[1] != "agent":
        raise SystemExit("usage: python -m lockd.testing.users agent CONFIG_JSON")
    _agent_main(json.loads(sys.argv[2]))
