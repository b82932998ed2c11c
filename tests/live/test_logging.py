"""The daemon's log, read from a real ``lockd serve``'s stderr.

Operators read it with ``journalctl -u lockd`` and grep it, so it is held to
what ``lockd/logfmt.py`` and docs/contract.md promise:

- one line per event, ``<time> level=<LEVEL> logger=<name> event=<what> k=v ...``,
  values quoted (``reason="stuck job"``) when they hold spaces, quotes or ``=``;
- the busy path is quiet: grants and releases only at ``log_level = "debug"``;
- what an operator must see is there at the default level: a ``break`` at
  warning with who, key and reason; the expiry of a held lease at info;
- no handle id ever, at any level: presenting a handle id is what proves a
  hold, so a log reader must not be able to release or renew someone's lease.

Each test runs one short session against its own daemon (one lease expires,
with a 150 ms TTL, polled for rather than slept on).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from lockd_client import LockClient

from lockd.testing.daemon import DaemonProcess
from tests.system.test_systemd_live import PROMPT, Wire, wait_until, wire

LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
    r"level=(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"logger=(?P<logger>lockd(?:\.\w+)*) "
    r"(?P<message>.*)$"
)
PAIR = re.compile(r'(?P<name>[A-Za-z_]\w*)=(?P<value>"(?:[^"\\]|\\.)*"|[^\s"=]*)')

#: A reason with everything that needs quoting in a key=value line.
REASON = 'stuck "nightly" job = run 7'


@dataclass
class LogLine:
    raw: str
    level: str
    logger: str
    fields: dict[str, str] | None  #: None when the message is not key=value pairs

    @property
    def event(self) -> str | None:
        return None if self.fields is None else self.fields.get("event")


def _unquote(value: str) -> str:
    if not value.startswith('"'):
        return value
    inner = value[1:-1]
    return re.sub(r"\\(.)", r"\1", inner)


def parse_pairs(message: str) -> dict[str, str] | None:
    """``a=1 b="x y"`` -> {a: 1, b: x y}; None unless the whole message is such pairs."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(message):
        match = PAIR.match(message, pos)
        if match is None:
            return None
        out[match.group("name")] = _unquote(match.group("value"))
        pos = match.end()
        if pos < len(message):
            if message[pos] != " ":
                return None
            pos += 1
    return out or None


def parse_log(text: str) -> list[LogLine]:
    lines = []
    for raw in text.splitlines():
        match = LINE.match(raw)
        if match is None:
            lines.append(LogLine(raw, "", "", None))
            continue
        lines.append(LogLine(raw, match["level"], match["logger"], parse_pairs(match["message"])))
    return lines


def events(daemon: DaemonProcess, name: str) -> list[LogLine]:
    return [line for line in parse_log(daemon.read_log()) if line.event == name]


def wait_for_event(
    daemon: DaemonProcess, name: str, match: Callable[[LogLine], bool] = lambda _: True
) -> LogLine:
    found: list[LogLine] = []

    def seen() -> bool:
        found[:] = [line for line in events(daemon, name) if match(line)]
        return bool(found)

    try:
        wait_until(seen, 5.0, f"event={name} in the log")
    except AssertionError:
        raise AssertionError(f"no event={name}; log:\n{daemon.read_log()}") from None
    return found[0]


# --------------------------------------------------------------------------
# one session of everything that touches a lease


@dataclass
class Session:
    principal: str
    handles: list[str]


def run_session(daemon: DaemonProcess) -> Session:
    """Grant, release, re-take, renew, hand over, release on close, break, expire.

    Returns every handle id the daemon gave out (and the caller's principal),
    after stopping the daemon, so the whole log is on disk.
    """
    handles: list[str] = []

    def grant(conn: Wire, op: str, **args: object) -> dict[str, object]:
        result = conn.result(op, **args)
        handles.append(str(result["handle"]))
        return dict(result)

    sock = daemon.socket
    with wire(sock) as a, wire(sock) as b:
        principal = str(a.result("hello")["principal"])
        plain = grant(a, "tryAcquire", key="log:plain", ttlMs=60_000)
        assert a.result("release", key="log:plain", handle=plain["handle"])["released"]
        # A stale handle sent again, and one inside a request the daemon refuses.
        assert not a.result("release", key="log:plain", handle=plain["handle"])["released"]
        bad = a.call("release", key="log:plain", handle=plain["handle"], bogus=1)
        assert bad["error"]["code"] == "INVALID_REQUEST"

        grant(a, "acquire", key="log:owned", ttlMs=60_000, timeoutMs=1000, owner="run-1")
        retaken = grant(a, "acquire", key="log:owned", ttlMs=60_000, timeoutMs=1000, owner="run-1")
        assert a.result("renew", key="log:owned", handle=retaken["handle"], ttlMs=60_000)["renewed"]

        first = grant(a, "tryAcquire", key="log:queue", ttlMs=60_000)
        parked = b.send("acquire", key="log:queue", ttlMs=60_000, timeoutMs=10_000)
        wait_until(lambda: a.result("status", key="log:queue")["waiters"] == 1, PROMPT, "a waiter")
        a.result("release", key="log:queue", handle=first["handle"])
        handed = b.reply(parked)["result"]
        handles.append(str(handed["handle"]))

        with wire(sock) as c:
            grant(c, "tryAcquire", key="log:bound", ttlMs=60_000, releaseOnClose=True)
        wait_until(
            lambda: not a.result("status", key="log:bound")["held"], PROMPT, "release on close"
        )

        broken = a.result("break", key="log:queue", reason=REASON)
        assert broken["broken"] is True

        grant(a, "tryAcquire", key="log:short", ttlMs=150)
        wait_for_event(daemon, "expired", lambda line: line.fields["key"] == "log:short")  # type: ignore[index]
    assert daemon.stop() == 0
    return Session(principal, handles)


def assert_no_handles(log: str, handles: list[str]) -> None:
    assert len(set(handles)) == len(handles) >= 7
    leaked = [h for h in handles if h in log]
    assert not leaked, f"handle ids in the log: {leaked}\n{log}"


def assert_operator_events(lines: list[LogLine], principal: str) -> None:
    """What must be there whatever the level: the break and the expiry."""
    (broken,) = [line for line in lines if line.event == "broken"]
    assert broken.level == "WARNING", broken.raw
    assert broken.fields is not None
    assert broken.fields["by"] == principal
    assert broken.fields["key"] == "log:queue"
    assert broken.fields["reason"] == REASON
    assert broken.fields["holder"] == principal
    expired = [line for line in lines if line.event == "expired"]
    assert [line.fields["key"] for line in expired if line.fields] == ["log:short"]
    assert all(line.level == "INFO" for line in expired), expired
    for name in ("started", "stopping", "stopped"):
        assert any(line.event == name and line.level == "INFO" for line in lines), name


def test_debug_log_has_every_grant_and_release_and_no_handle(
    daemon_paths: DaemonProcess,
) -> None:
    daemon_paths.write_config('log_level = "debug"\n')
    daemon_paths.start()
    session = run_session(daemon_paths)
    log = daemon_paths.read_log()
    assert_no_handles(log, session.handles)
    lines = parse_log(log)
    assert_operator_events(lines, session.principal)

    granted = [line for line in lines if line.event == "granted"]
    keys = sorted(line.fields["key"] for line in granted if line.fields)
    assert keys == sorted(
        ["log:plain", "log:owned", "log:owned", "log:queue", "log:queue", "log:bound", "log:short"]
    ), keys
    assert {line.level for line in granted} == {"DEBUG"}
    for line in granted:
        assert line.fields is not None
        assert line.fields["principal"] == session.principal
        assert line.fields["fence"].isdigit()
    released = [line for line in lines if line.event == "released"]
    assert [line.fields["key"] for line in released if line.fields] == [
        "log:plain",
        "log:queue",
    ]
    assert {line.level for line in released} == {"DEBUG"}
    (on_close,) = [line for line in lines if line.event == "released_on_close"]
    assert on_close.level == "DEBUG" and on_close.fields is not None
    assert on_close.fields["key"] == "log:bound"
    # Every event line is key=value from its first field to its last.
    for line in lines:
        if "event=" in line.raw and line.level:
            assert line.fields is not None, line.raw


def test_default_level_keeps_grants_and_releases_out(daemon_paths: DaemonProcess) -> None:
    """log_level "info" (the default): the busy path writes nothing, breaks and expiries do."""
    daemon_paths.start()
    session = run_session(daemon_paths)
    log = daemon_paths.read_log()
    assert_no_handles(log, session.handles)
    lines = parse_log(log)
    assert_operator_events(lines, session.principal)
    quiet = {"granted", "released", "released_on_close", "connected", "disconnected"}
    noisy = [line.raw for line in lines if line.event in quiet]
    assert not noisy, noisy
    assert not [line.raw for line in lines if line.level == "DEBUG"]


@pytest.mark.both_backends
def test_debug_log_has_the_grant_handed_to_a_parked_acquire(
    daemon_paths: DaemonProcess,
) -> None:
    daemon_paths.write_config('log_level = "debug"\n')
    daemon_paths.start()
    with wire(daemon_paths.socket) as a, wire(daemon_paths.socket) as b:
        first = a.result("tryAcquire", key="log:handover", ttlMs=60_000)
        parked = b.send("acquire", key="log:handover", ttlMs=60_000, timeoutMs=10_000)
        wait_until(
            lambda: a.result("status", key="log:handover")["waiters"] == 1, PROMPT, "a waiter"
        )
        a.result("release", key="log:handover", handle=first["handle"])
        handed = b.reply(parked)["result"]
    assert daemon_paths.stop() == 0
    log = daemon_paths.read_log()
    assert handed["handle"] not in log and first["handle"] not in log
    granted = [line.fields for line in parse_log(log) if line.event == "granted"]
    fences = [int(f["fence"]) for f in granted if f and f["key"] == "log:handover"]
    assert fences == [first["fence"], handed["fence"]], log


def test_rule_set_loads_and_rejections_are_key_value_events(
    daemon_paths: DaemonProcess,
) -> None:
    """No rule set, then one, then a broken edit: each is an event= line an operator can grep."""
    daemon_paths.start()
    with wire(daemon_paths.socket) as conn:
        # A reply (not just a connect) means the rule watcher is armed.
        conn.result("hello")
        rules = daemon_paths.write_rules(
            "lock.toml",
            '[ruleSet]\nname = "lock-policy"\nresourceType = "lock"\n\n'
            "[rules.lock]\nacquire = \"record.key.startsWith('a')\"\n",
        )
        wait_until(lambda: conn.result("rules")["policy"] is not None, 5.0, "the rule set")
        rules.write_text(rules.read_text().replace("startsWith('a')", "startsWith("))
        wait_until(lambda: conn.result("rules")["lastError"] is not None, 5.0, "the error")
    assert daemon_paths.stop() == 0
    lines = parse_log(daemon_paths.read_log())
    prose = [line.raw for line in lines if line.event is None]
    assert not prose, "\n".join(prose)
    loaded = [line for line in lines if line.event == "rules_loaded"]
    assert len(loaded) == 2 and {line.level for line in loaded} == {"INFO"}
    assert loaded[1].fields is not None and loaded[1].fields["file"] == str(rules)
    (rejected,) = [line for line in lines if line.event == "rules_rejected"]
    assert rejected.level == "WARNING" and rejected.fields is not None
    assert rejected.fields["file"] == str(rules)
    assert rejected.fields["line"] == "6" and rejected.fields["column"].isdigit()


def test_open_state_dir_warning_is_a_key_value_line(daemon_paths: DaemonProcess) -> None:
    """A state folder others can read is worth a warning: the database holds handle ids."""
    state: Path = daemon_paths.db.parent
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    daemon_paths.start()
    assert daemon_paths.stop() == 0
    (line,) = [line for line in parse_log(daemon_paths.read_log()) if "state_dir_open" in line.raw]
    assert line.level == "WARNING"
    assert line.fields is not None, line.raw
    assert line.fields["event"] == "state_dir_open"
    assert line.fields["dir"] == str(state)


def test_log_timestamps_follow_the_session(daemon_paths: DaemonProcess) -> None:
    """Lines come out in order and promptly (no buffering hides a line until exit)."""
    daemon_paths.start()
    started = wait_for_event(daemon_paths, "started")
    with wire(daemon_paths.socket) as conn:
        conn.result("tryAcquire", key="log:prompt", ttlMs=60_000)
        conn.result("break", key="log:prompt", reason="prompt check")
        before = time.monotonic()
        broken = wait_for_event(daemon_paths, "broken")
        assert time.monotonic() - before < PROMPT
    assert daemon_paths.stop() == 0
    assert started.raw < broken.raw  # same day, zero-padded: text order is time order


def test_journal_stream_gets_syslog_priority_prefixes(daemon_paths: DaemonProcess) -> None:
    """Under systemd (JOURNAL_STREAM names our stderr) lines carry <N> priorities."""
    daemon_paths.write_config('log_level = "debug"\n')
    log_fd = os.open(daemon_paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        st = os.fstat(log_fd)
    finally:
        os.close(log_fd)
    env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    daemon_paths.start(env=env)
    with LockClient(str(daemon_paths.socket)) as client:
        handle = client.acquire("journal:k", ttl=60, timeout=1)
        client.break_lock("journal:k", "priority test")
    assert daemon_paths.stop() == 0
    lines = [line for line in daemon_paths.read_log().splitlines() if line.strip()]
    assert lines and all(line[:3] in ("<7>", "<6>", "<4>", "<3>") for line in lines), lines
    assert any(line.startswith("<4>") and "event=broken" in line for line in lines)
    assert any(line.startswith("<7>") and "event=granted" in line for line in lines)
    assert handle.handle not in daemon_paths.read_log()
