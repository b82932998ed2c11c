"""Rule sets under attack, against real daemons (issue 9, items 4, 5 and 11).

A member must not be able to hang the daemon with a rule file that is not a
file (a FIFO, a symlink to /dev/zero, a huge file), open the namespace by
deleting the policy from a folder it can write, or stall the event loop
with a rule that costs seconds per evaluation. Each test does the attack and
checks that the daemon keeps serving, keeps the previous policy and says
why in ``lockd rules show``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator

import pytest
from lockd_client import LockClient

from lockd.testing.daemon import LOCKD, DaemonProcess
from lockd.testing.polling import wait_for
from lockd.testing.users import Accounts, Agent, User, missing_prerequisite, share_socket

_WHY = missing_prerequisite()
if _WHY is not None:
    pytest.skip(_WHY, allow_module_level=True)

OWN_KEYS = (
    '[ruleSet]\nname = "own"\nresourceType = "lock"\n\n[rules.lock]\n'
    "acquire = \"record.key.startsWith('user:' + user.userId + ':')\"\n"
)


@pytest.fixture(scope="module")
def mallory() -> Iterator[User]:
    with Accounts() as accounts:
        yield accounts.user()


@pytest.fixture
def live(daemon_paths: DaemonProcess) -> Iterator[Callable[..., LockClient]]:
    """Start the daemon (rules and lockd.toml first); a root client; stopped afterwards."""
    clients: list[LockClient] = []

    def start(*, rules: str | None = None, config: str = "") -> LockClient:
        daemon_paths.write_config(config)
        if rules is not None:
            daemon_paths.write_rules("policy.toml", rules)
        daemon_paths.start()
        share_socket(daemon_paths.socket)
        client = LockClient(str(daemon_paths.socket), request_timeout=10)
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.close()
    daemon_paths.terminate()


def wait_error(client: LockClient, fragment: str) -> dict[str, object]:
    """Poll ``rules`` until its lastError mentions ``fragment``."""
    seen: dict[str, object] = {}

    def check() -> bool:
        seen.clear()
        seen.update(client.rules())
        error = seen.get("lastError")
        return isinstance(error, dict) and fragment in str(error.get("message"))

    try:
        wait_for(check, 10)
    except TimeoutError:
        raise AssertionError(f"no reload error with {fragment!r}; last: {seen}") from None
    return seen


# ------------------------------------------------- item 5: files that are not files


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_a_rule_file_that_is_not_a_file_is_an_error_and_the_daemon_serves_on(
    live: Callable[..., LockClient], daemon_paths: DaemonProcess, kind: str
) -> None:
    client = live(rules=OWN_KEYS)
    folder = daemon_paths.config / "rule-sets"
    bad = folder / "x.toml"
    expected = {
        "fifo": "is a FIFO; rule files must be regular files",
        "dev-zero": "is a symbolic link; rule files must be regular files",
        "huge": "larger than 1048576 bytes",
    }[kind]
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dev-zero":
        bad.symlink_to("/dev/zero")
    else:
        with bad.open("wb") as f:
            f.write(b"# " + b"x" * (100 * 1024 * 1024) + b"\n")
    result = wait_error(client, expected)
    error = result["lastError"]
    assert isinstance(error, dict) and error["file"] == str(bad)
    assert (result["policy"] or {}).get("name") == "own", "the previous policy must stay"
    assert client.hello()["role"] == "owner"  # the loop is not stuck in open() or read()
    assert "x.toml" in daemon_paths.read_log()


def test_a_fifo_at_start_up_stops_the_daemon_naming_it(daemon_paths: DaemonProcess) -> None:
    """Before: open() of the FIFO blocked for ever and even SIGTERM was ignored."""
    folder = daemon_paths.config / "rule-sets"
    folder.mkdir(parents=True)
    os.mkfifo(folder / "x.toml")
    daemon_paths.start(wait=False)
    assert daemon_paths.proc is not None
    assert daemon_paths.proc.wait(30) == 1
    assert f"{folder / 'x.toml'}: is a FIFO" in daemon_paths.read_log()


# ------------------------------------------------- item 11: a folder others can write


def test_member_cannot_open_the_namespace_through_a_writable_rule_folder(
    live: Callable[..., LockClient], daemon_paths: DaemonProcess, mallory: User
) -> None:
    client = live(rules=OWN_KEYS)
    folder = daemon_paths.config / "rule-sets"
    os.chmod(daemon_paths.root, 0o755)
    os.chmod(daemon_paths.config, 0o755)
    os.chmod(folder, 0o777)  # a careless chmod, or a folder made with umask 000
    with Agent(mallory, daemon_paths.socket) as agent:
        assert agent.error("try_acquire", "payroll", 60).code == "LOCK_ACCESS_DENIED"
        # mallory deletes the policy: before, the open default took over.
        agent_rm = subprocess.run(
            ["/usr/bin/python3", "-c", f"import os; os.unlink({str(folder / 'policy.toml')!r})"],
            user=mallory.uid,
            group=mallory.gid,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert agent_rm.returncode == 0, agent_rm.stderr
        result = wait_error(client, "is writable by other users (mode 0777)")
        assert (result["policy"] or {}).get("name") == "own"
        error = agent.error("try_acquire", "payroll", 60)
        assert error.code == "LOCK_ACCESS_DENIED", "the namespace was opened"
    shown = subprocess.run(
        [*LOCKD, "rules", "show"],
        env=daemon_paths.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "is writable by other users" in shown.stdout + shown.stderr


def test_a_rule_file_others_can_write_is_refused(
    live: Callable[..., LockClient], daemon_paths: DaemonProcess
) -> None:
    client = live(rules=OWN_KEYS)
    path = daemon_paths.config / "rule-sets" / "policy.toml"
    os.chmod(path, 0o666)
    daemon_paths.write_rules("policy.toml", OWN_KEYS.replace('"own"', '"changed"'))
    os.chmod(path, 0o666)  # write_rules replaced the file: make the new one loose too
    os.utime(path)
    client.rules()
    # The watch sees the rename; the file it finds is writable by everyone.
    result = wait_error(client, "is writable by other users (mode 0666)")
    assert (result["policy"] or {}).get("name") == "own"


def test_a_writable_rule_folder_at_start_up_stops_the_daemon(
    daemon_paths: DaemonProcess,
) -> None:
    folder = daemon_paths.config / "rule-sets"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o777)
    daemon_paths.start(wait=False)
    assert daemon_paths.proc is not None
    assert daemon_paths.proc.wait(30) == 1
    assert "is writable by other users (mode 0777)" in daemon_paths.read_log()


# ------------------------------------------------- item 4: costly rules


NESTED = (
    '[ruleSet]\nname = "nested"\nresourceType = "lock"\n\n[rules.lock]\n'
    'acquire = "[1,2,3].all(x, [1,2,3].exists(y, x == y))"\n'
)


def test_nested_comprehension_is_refused_at_load(
    live: Callable[..., LockClient], daemon_paths: DaemonProcess
) -> None:
    client = live(rules=OWN_KEYS)
    daemon_paths.write_rules("policy.toml", NESTED)
    result = wait_error(client, "exists() inside another comprehension")
    error = result["lastError"]
    assert isinstance(error, dict) and (error["line"], error["column"]) == (6, 35)
    assert (result["policy"] or {}).get("name") == "own"


def _costly_rule(elements: int) -> str:
    numbers = ",".join(str(i) for i in range(elements))
    return (
        '[ruleSet]\nname = "costly"\nresourceType = "lock"\n\n[rules.lock]\n'
        f'acquire = "[{numbers}].all(x, x >= 0 && record.key.size() > 0)"\n'
    )


def test_a_rule_over_its_budget_denies_and_the_daemon_serves_others(
    live: Callable[..., LockClient], daemon_paths: DaemonProcess, mallory: User
) -> None:
    """One level of comprehension over a long literal list: seconds per evaluation unbounded."""
    client = live(rules=_costly_rule(500), config="rule_budget_ms = 20\n")
    with Agent(mallory, daemon_paths.socket) as agent:
        for n in range(5):  # fresh keys: no verdict cache can help
            error = agent.error("try_acquire", f"fresh:{n}", 60)
            assert error.code == "LOCK_ACCESS_DENIED", error
        assert client.hello()["role"] == "owner"
    log = daemon_paths.read_log()
    assert log.count("event=rule_over_budget") == 1, "later requests were not evaluated"
    assert f"principal=user:{mallory.name}" in log


def test_the_costly_rule_is_allowed_without_a_budget_cut(
    live: Callable[..., LockClient], daemon_paths: DaemonProcess, mallory: User
) -> None:
    """The same rule, small enough to fit its budget, still decides (it allows)."""
    live(rules=_costly_rule(20), config="rule_budget_ms = 5000\n")
    with Agent(mallory, daemon_paths.socket) as agent:
        handle = agent.call("try_acquire", "fresh:1", 60)
        assert handle is not None and handle["key"] == "fresh:1"


# ------------------------------------------- issue 21, item 12: folders above rule-sets/


def test_member_cannot_open_the_namespace_by_renaming_the_folder_above(
    live: Callable[..., LockClient], daemon_paths: DaemonProcess, mallory: User
) -> None:
    """Every folder up to / is checked like the rule files themselves."""
    client = live(rules=OWN_KEYS)
    os.chmod(daemon_paths.root, 0o755)
    os.chown(daemon_paths.config, mallory.uid, mallory.gid)  # a config folder handed over
    with Agent(mallory, daemon_paths.socket) as agent:
        assert agent.error("try_acquire", "payroll", 60).code == "LOCK_ACCESS_DENIED"
        folder = daemon_paths.config / "rule-sets"
        moved = subprocess.run(
            [
                "/usr/bin/python3",
                "-c",
                f"import os; os.rename({str(folder)!r}, {str(folder)!r} + '.x')",
            ],
            user=mallory.uid,
            group=mallory.gid,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert moved.returncode == 0, moved.stderr
        assert daemon_paths.proc is not None
        daemon_paths.proc.send_signal(signal.SIGHUP)
        result = wait_error(client, f"the folder {daemon_paths.config} above it belongs to uid")
        assert (result["policy"] or {}).get("name") == "own"
        error = agent.error("try_acquire", "payroll", 60)
        assert error.code == "LOCK_ACCESS_DENIED", "the namespace was opened"


def test_a_writable_folder_above_the_rules_at_start_up_stops_the_daemon(
    daemon_paths: DaemonProcess,
) -> None:
    daemon_paths.write_rules("policy.toml", OWN_KEYS)
    os.chmod(daemon_paths.config, 0o777)
    daemon_paths.start(wait=False)
    assert daemon_paths.proc is not None
    assert daemon_paths.proc.wait(30) == 1
    log = daemon_paths.read_log()
    assert f"the folder {daemon_paths.config} above it is writable by other users" in log
