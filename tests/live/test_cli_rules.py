"""``lockd rules check | show | test``.

``check`` and ``test`` are local (no daemon): they must give the daemon's own
verdicts and point at errors by file, line and column. ``show`` asks a real
daemon, including after a broken hot reload.
"""

from __future__ import annotations

import grp
import hashlib
import json
import pwd
import re
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from lockd.cli import main
from lockd.exitcodes import EXIT_DENIED, EXIT_USAGE
from lockd.testing.daemon import DaemonProcess
from lockd.testing.polling import wait_for

GOOD = """\
[ruleSet]
name = "lock-policy"
resourceType = "lock"

[rules.lock]
acquire = "record.key.startsWith('user:' + user.userId + ':') || isMemberOf('ops')"
renew   = "record.key.startsWith('user:' + user.userId + ':')"
"""

# A typo in a variable name: cel-python alone would accept it and deny at run time.
BAD_NAME = """\
[ruleSet]
name = "lock-policy"
resourceType = "lock"

[rules.lock]
acquire = "record.key.startsWith('user:' + usr.userId + ':')"
"""

BAD_TOML = """\
[ruleSet]
name = "lock-policy
resourceType = "lock"
"""


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), prog_name="lockd", env=env)


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def config_dir(root: Path, rules: str | None = GOOD, toml: str | None = None) -> Path:
    config = root / "config"
    config.mkdir(parents=True, exist_ok=True)
    if rules is not None:
        write(config / "rule-sets", "policy.toml", rules)
    if toml is not None:
        write(config, "lockd.toml", toml)
    return config


def one_line(text: str) -> str:
    assert "Traceback" not in text
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# --------------------------------------------------------------------------- check


def test_check_good_file(tmp_path: Path) -> None:
    path = write(tmp_path, "good.toml", GOOD)
    result = invoke("rules", "check", str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout == "ok: lock-policy: acquire, renew\n"


def test_check_reports_file_line_column(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.toml", BAD_NAME)
    result = invoke("rules", "check", str(path))
    assert result.exit_code == 1
    assert result.stdout == ""
    line_no = 6
    column = BAD_NAME.splitlines()[line_no - 1].index("usr") + 1
    assert one_line(result.stderr) == (
        f"{path}:{line_no}:{column}: unknown name 'usr': rules see 'user' and 'record'"
    )


def test_check_toml_syntax_error_has_a_position(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.toml", BAD_TOML)
    result = invoke("rules", "check", str(path))
    assert result.exit_code == 1
    assert re.match(rf"^{re.escape(str(path))}:2:\d+: TOML: ", one_line(result.stderr))


def test_check_json(tmp_path: Path) -> None:
    good = write(tmp_path, "good.toml", GOOD)
    ok = invoke("rules", "check", str(good), "--json")
    assert ok.exit_code == 0
    doc = json.loads(ok.stdout)
    assert doc["ok"] is True and doc["name"] == "lock-policy"
    assert doc["rules"] == ["acquire", "renew"]
    assert doc["sha256"] == hashlib.sha256(GOOD.encode()).hexdigest()

    bad = write(tmp_path, "bad.toml", BAD_NAME)
    err = invoke("rules", "check", str(bad), "--json")
    assert err.exit_code == 1 and err.stdout == ""
    # docs/contract.md §9: one error line, the shape of every command
    (line,) = err.stderr.splitlines()
    error = json.loads(line)["error"]
    assert (error["code"], error["status"]) == ("USAGE", 400)
    assert (error["details"]["file"], error["details"]["line"]) == (str(bad), 6)
    assert isinstance(error["details"]["column"], int) and str(bad) in error["message"]


def test_check_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke("rules", "check", str(tmp_path / "nope.toml"))
    assert result.exit_code == EXIT_USAGE
    assert "does not exist" in one_line(result.stderr)


# --------------------------------------------------------------------------- test


def test_allowed_and_denied_by_the_rule(tmp_path: Path) -> None:
    config = str(config_dir(tmp_path))
    base = ("rules", "test", "--config", config, "--user", "alice", "--op", "acquire")
    allowed = invoke(*base, "user:alice:report")
    assert allowed.exit_code == 0, allowed.output
    assert allowed.stdout.startswith("allowed: rule acquire in ")
    assert "user:alice (role member, uid -1)" in allowed.stdout
    assert "no passwd entry for 'alice'" in allowed.stderr

    denied = invoke(*base, "user:bob:report")
    assert denied.exit_code == EXIT_DENIED
    assert denied.stdout.startswith("denied: rule acquire in ")

    by_group = invoke(*base, "--group", "ops", "user:bob:report")
    assert by_group.exit_code == 0
    assert re.search(r"groups:\s+ops$", by_group.stdout, re.M)


def test_ops_not_named_by_the_rule_set_and_role_gates(tmp_path: Path) -> None:
    only_acquire = GOOD.replace("renew   =", "# renew =")
    config = str(config_dir(tmp_path, only_acquire))
    base = ("rules", "test", "--config", config, "--user", "alice")
    renew = invoke(*base, "--op", "renew", "user:alice:x")
    assert renew.exit_code == EXIT_DENIED
    assert "names no 'renew' rule" in renew.stdout
    listing = invoke(*base, "--op", "stats")
    assert listing.exit_code == EXIT_DENIED
    assert "stats is for owners, admins and services" in listing.stdout
    own = invoke(*base, "--op", "list")  # docs/contract.md §12: open, a member sees its own
    assert own.exit_code == 0 and "list is open to every caller" in own.stdout
    release = invoke(*base, "--op", "release", "anything")
    assert release.exit_code == 0 and "release is open" in release.stdout
    as_admin = invoke(*base, "--role", "admin", "--op", "acquire", "user:bob:x")
    assert as_admin.exit_code == 0 and "role admin passes" in as_admin.stdout


def test_root_is_owner_and_passes(tmp_path: Path) -> None:
    config = str(config_dir(tmp_path))
    result = invoke("rules", "test", "--config", config, "--user", "root", "--op", "acquire", "k")
    assert result.exit_code == 0
    assert "role owner passes" in result.stdout
    assert "user:root (role owner, uid 0)" in result.stdout
    by_uid = invoke("rules", "test", "--config", config, "--user", "0", "--op", "break", "k")
    assert by_uid.exit_code == 0 and "user:root" in by_uid.stdout


def test_roles_come_from_lockd_toml(tmp_path: Path) -> None:
    toml = 'admin_groups = ["lockd-ops"]\nservice_users = ["deploy"]\n'
    config = str(config_dir(tmp_path, toml=toml))
    base = ("rules", "test", "--config", config, "--op", "acquire", "someone:else")
    admin = invoke(*base, "--user", "alice", "--group", "lockd-ops")
    assert admin.exit_code == 0 and "role admin passes" in admin.stdout
    service = invoke(*base, "--user", "deploy", "--json")
    assert service.exit_code == 0
    doc = json.loads(service.stdout)
    assert doc["caller"]["principal"] == "service:deploy"
    assert doc["caller"]["role"] == "service"
    assert doc["allowed"] is True and doc["reason"] == "role service passes"


def test_login_groups_come_from_the_group_database(tmp_path: Path) -> None:
    try:
        entry = pwd.getpwnam("nobody")
        primary = grp.getgrgid(entry.pw_gid).gr_name
    except KeyError:
        pytest.skip("no 'nobody' user or its group on this system")
    rules = GOOD.replace("isMemberOf('ops')", f"isMemberOf('{primary}')")
    config = str(config_dir(tmp_path, rules))
    result = invoke(
        "rules", "test", "--config", config, "--user", "nobody", "--op", "acquire", "any", "--json"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["caller"]["uid"] == entry.pw_uid
    assert primary in doc["caller"]["groups"]


def test_no_rule_set_is_open(tmp_path: Path) -> None:
    config = str(config_dir(tmp_path, rules=None))
    result = invoke("rules", "test", "--config", config, "--user", "alice", "--op", "acquire", "k")
    assert result.exit_code == 0
    assert "allowed: no lock rule set installed: open" in result.stdout


def test_json_document(tmp_path: Path) -> None:
    config = str(config_dir(tmp_path))
    result = invoke(
        "rules", "test", "--config", config, "--user", "alice", "--op", "renew", "k", "--json"
    )
    assert result.exit_code == EXIT_DENIED
    doc = json.loads(result.stdout)
    assert doc["allowed"] is False
    assert doc["reason"].startswith("rule renew in ")
    assert (doc["op"], doc["key"]) == ("renew", "k")
    assert doc["policy"]["name"] == "lock-policy"


def test_broken_rule_set_or_config_exits_1(tmp_path: Path) -> None:
    broken = str(config_dir(tmp_path / "a", BAD_NAME))
    result = invoke("rules", "test", "--config", broken, "--user", "u", "--op", "acquire", "k")
    assert result.exit_code == 1
    line = one_line(result.stderr)
    assert "cannot load the rule sets" in line and "policy.toml:6:" in line

    bad_toml = str(config_dir(tmp_path / "b", toml="acquire_per_hours = 3\n"))
    result = invoke("rules", "test", "--config", bad_toml, "--user", "u", "--op", "acquire", "k")
    assert result.exit_code == 1
    assert "unknown key 'acquire_per_hours'" in one_line(result.stderr)


@pytest.mark.parametrize(
    "args",
    [
        ["--user", "u", "--op", "acquire"],  # KEY missing
        ["--user", "u", "--op", "steal", "k"],
        ["--op", "acquire", "k"],  # --user missing
        ["--user", "u", "--op", "acquire", "--role", "king", "k"],
    ],
)
def test_usage_errors(tmp_path: Path, args: list[str]) -> None:
    config = str(config_dir(tmp_path))
    result = invoke("rules", "test", "--config", config, *args)
    assert result.exit_code == EXIT_USAGE
    assert one_line(result.stderr).startswith("lockd rules test: ")


def test_default_config_is_the_user_config_dir(tmp_path: Path) -> None:
    # As `lockd serve`: platformdirs' user config dir, i.e. $XDG_CONFIG_HOME/lockd.
    write(tmp_path / "lockd" / "rule-sets", "policy.toml", GOOD)
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    result = invoke("rules", "test", "--user", "alice", "--op", "acquire", "k", env=env)
    assert result.exit_code == EXIT_DENIED
    assert str(tmp_path / "lockd" / "rule-sets" / "policy.toml") in result.stdout


# --------------------------------------------------------------------------- show


def test_show_without_rules(daemon: DaemonProcess) -> None:
    result = invoke("rules", "show", "--socket", str(daemon.socket))
    assert result.exit_code == 0, result.stderr
    assert re.search(r"^Rule set:\s+none", result.stdout, re.M)
    assert re.search(r"^Last error:\s+none$", result.stdout, re.M)


def test_show_policy_then_a_broken_reload(daemon_paths: DaemonProcess) -> None:
    path = daemon_paths.write_rules("policy.toml", GOOD)
    daemon_paths.start()
    try:
        sock = ("--socket", str(daemon_paths.socket))
        result = invoke("rules", "show", *sock)
        assert result.exit_code == 0, result.stderr
        pairs = (line.split(":", 1) for line in result.stdout.splitlines())
        fields = {k.strip(): v.strip() for k, v in pairs}
        assert fields["Rule set"] == "lock-policy"
        assert fields["File"] == str(path)
        assert fields["SHA-256"] == hashlib.sha256(GOOD.encode()).hexdigest()
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+ \(\S+ ago\)$", fields["Loaded at"])
        assert fields["Last error"] == "none"

        daemon_paths.write_rules("policy.toml", BAD_NAME)
        doc: dict[str, object] = {}

        def broken_reload_reported() -> bool:
            nonlocal doc
            doc = json.loads(invoke("rules", "show", "--json", *sock).stdout)
            return doc["lastError"] is not None

        wait_for(broken_reload_reported, 10, "the broken reload reported", interval=0.05)
        assert doc["policy"]["name"] == "lock-policy"  # the old policy stays in force
        text = invoke("rules", "show", *sock).stdout
        assert f"{path}:6:" in text and "unknown name 'usr'" in text
        assert "stays in force" in text
    finally:
        daemon_paths.stop()
