"""``lockd rules ...``: check a rule file, show the daemon's rules, test a decision.

``check`` and ``test`` are local: they load rule sets with the daemon's own
code (:mod:`lockd.rules.policy`), so they see exactly the verdicts the daemon
would, without a daemon running. ``show`` asks the daemon (``rules`` op).
:mod:`lockd.rules.policy` pulls in celpy (~0.2 s to build its grammar), so it is
imported inside the commands, never at start-up: shell completion runs
``lockd`` on every <TAB>.

Exit codes of the local commands (documented in ``lockd rules --help``):
``check``: 0 valid, 1 invalid (``FILE:LINE:COLUMN: message`` on stderr, the
form compilers use, so editors can jump to it), 2 usage (e.g. no such file).
``test``: 0 allowed, 3 denied, 1 the config or rule sets cannot be loaded
(the daemon would refuse to start with them), 2 usage.
"""

from __future__ import annotations

import grp
import os
import pwd
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import click

from lockd import timefmt
from lockd.cli.common import (
    client_command,
    echo_error,
    fail,
    format_relative,
    format_time,
    json_option,
    ms_until,
    open_client,
    parse_time,
    print_json,
    render_fields,
    socket_option,
)
from lockd.exitcodes import EXIT_DENIED, EXIT_OK, USAGE

if TYPE_CHECKING:
    from lockd.config import Settings
    from lockd.identity import Caller
    from lockd.rules.policy import Policy

#: Exit code of ``rules check`` / ``rules test`` when a rule set or config is invalid.
EXIT_INVALID = 1

#: Protocol ops ``rules test --op`` accepts (docs/contract.md §2).
OPS = ("acquire", "tryAcquire", "renew", "release", "status", "list", "stats", "rules", "break")
#: Ops a KEY is needed for (the rules see ``record.key``).
KEYED_OPS = frozenset({"acquire", "tryAcquire", "renew", "release", "status", "break"})
ROLES = ("owner", "admin", "member", "service")

RULES_HELP_EPILOG = """\b
Exit codes:
  check  0 valid; 1 invalid (FILE:LINE:COLUMN: message on stderr); 2 usage
  show   as every daemon command (see lockd --help)
  test   0 allowed; 3 denied; 1 the config or a rule set is invalid; 2 usage
"""


@click.group(epilog=RULES_HELP_EPILOG)
def rules() -> None:
    """Check, show and try out access rules (CEL rule sets)."""


# --------------------------------------------------------------------------- check


@rules.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, readable=False))
@json_option
@client_command
def check(file: str, as_json: bool) -> None:
    """Validate the rule file FILE as the daemon would load it (local).

    Valid: "ok: NAME: RULES" and exit 0. Invalid: the error as
    FILE:LINE:COLUMN: message on stderr and exit 1.
    """
    from lockd.rules.files import RuleSetError
    from lockd.rules.policy import load_rule_set

    try:
        policy = load_rule_set(Path(file))
    except RuleSetError as err:
        line = " ".join(str(err).split())
        if as_json:  # the one error line; details: file, line, column, message, at
            at = timefmt.format_epoch_ms(timefmt.wall_ms())
            fail(line, EXIT_INVALID, code=USAGE, details=err.as_dict(at=at))
        click.echo(line, err=True)
        raise click.exceptions.Exit(EXIT_INVALID) from None
    if as_json:
        print_json({"ok": True, **(policy.info or {}), "rules": list(policy.rule_names)})
        return
    names = ", ".join(policy.rule_names) or "no rules (members are denied acquire and renew)"
    click.echo(f"ok: {policy.name}: {names}")


# --------------------------------------------------------------------------- show


@rules.command()
@socket_option
@json_option
@client_command
def show(socket_path: str | None, as_json: bool) -> None:
    """The daemon's rule set and last reload error (owners, admins, services)."""
    with open_client(socket_path) as client:
        result = client.rules()
    if as_json:
        print_json(result)
        return
    click.echo(render_rules(result))


def render_rules(result: dict[str, Any]) -> str:
    """Human form of the ``rules`` result."""
    policy = result.get("policy")
    error = result.get("lastError")
    pairs: list[tuple[str, object]] = []
    if policy is None:
        pairs.append(("Rule set", "none: every member may use every key"))
    else:
        loaded = parse_time(policy.get("loadedAt"))
        pairs += [
            ("Rule set", policy.get("name")),
            ("File", policy.get("file")),
            ("SHA-256", policy.get("sha256")),
            ("Loaded at", f"{format_time(loaded)} ({format_relative(ms_until(loaded))})"),
        ]
    if error is None:
        pairs.append(("Last error", "none"))
    else:
        where = str(error.get("file"))
        for part in ("line", "column"):
            if error.get(part) is not None:
                where += f":{error[part]}"
        at = parse_time(error.get("at"))
        pairs.append(("Last error", f"{where}: {' '.join(str(error.get('message')).split())}"))
        pairs.append(("Error at", f"{format_time(at)} ({format_relative(ms_until(at))})"))
        if policy is not None:
            pairs.append(("Note", "the rule set above stays in force until the file is fixed"))
    return render_fields(pairs)


# --------------------------------------------------------------------------- test


@rules.command("test")
@click.option(
    "--config",
    "config_dir",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="Config folder (lockd.toml, rule-sets/). Default: as `lockd serve` "
    "(the user config dir; /etc/lockd with --system).",
)
@click.option("--system", is_flag=True, help="Use the system config folder (/etc/lockd).")
@click.option("--user", "user", required=True, metavar="U", help="Login name or uid to test as.")
@click.option(
    "--group",
    "extra_groups",
    multiple=True,
    metavar="G",
    help="A Unix group the caller is in, besides its login groups (repeatable).",
)
@click.option(
    "--role",
    type=click.Choice(ROLES),
    help="Force the role (default: as the daemon would: root is owner, "
    "admin_groups make admin, service_users make service, else member).",
)
@click.option("--op", required=True, type=click.Choice(OPS), help="The operation to decide.")
@click.argument("key", required=False)
@json_option
@client_command
def test_cmd(
    config_dir: str | None,
    system: bool,
    user: str,
    extra_groups: tuple[str, ...],
    role: str | None,
    op: str,
    key: str | None,
    as_json: bool,
) -> None:
    """Would --user be allowed --op on KEY? (local, no daemon)

    Loads lockd.toml and rule-sets/ from the config folder, builds the caller
    the way the daemon does from peer credentials (login groups from the
    passwd and group databases, plus --group), and asks the same policy code.
    Exit 0 allowed, 3 denied; prints what decided.
    """
    from lockd.config import ConfigError, load_settings, resolve_paths
    from lockd.rules.files import RuleSetError
    from lockd.rules.policy import load_policy

    if op in KEYED_OPS and key is None:
        raise click.UsageError(f"KEY is required for --op {op}")
    try:
        with warnings.catch_warnings():  # it computes the socket's runtime dir too: unused here
            warnings.simplefilter("ignore")
            paths = resolve_paths(system=system, config=config_dir)
        settings = load_settings(paths.config_dir)
        policy = load_policy(paths.rule_sets_dir)
    except ConfigError as err:
        fail(f"cannot load the config: {' '.join(str(err).split())}", EXIT_INVALID, code=USAGE)
    except RuleSetError as err:
        text = " ".join(str(err).split())
        fail(f"cannot load the rule sets: {text}", EXIT_INVALID, code=USAGE)
    caller, notes = build_caller(user, extra_groups, role, settings)
    decision = policy.decide(caller, op, key or "")
    if as_json:
        print_json(
            {
                "allowed": decision.allowed,
                "reason": decision.reason,
                "op": op,
                "key": key,
                "caller": {
                    "principal": caller.principal,
                    "role": caller.role,
                    "uid": caller.uid,
                    "groups": sorted(caller.groups),
                },
                "policy": policy.info,
                "notes": notes,
            }
        )
    else:
        verdict = "allowed" if decision.allowed else "denied"
        click.echo(f"{verdict}: {decision.reason}")
        click.echo(_describe(caller, policy, paths.rule_sets_dir))
        for note in notes:
            click.echo(f"note: {note}", err=True)
    if not decision.allowed and as_json:  # the verdict is on stdout; the failure line too
        echo_error(f"denied: {decision.reason}", "LOCK_ACCESS_DENIED", {"op": op, "key": key})
    raise click.exceptions.Exit(EXIT_OK if decision.allowed else EXIT_DENIED)


def _describe(caller: Caller, policy: Policy, rule_sets_dir: Path) -> str:
    groups = ", ".join(sorted(caller.groups)) or "none"
    if policy.info is None:
        rule_set = f"none in {rule_sets_dir} (open default)"
    else:
        rule_set = f"{policy.name} ({policy.file}; rules: {', '.join(policy.rule_names) or 'none'})"
    return render_fields(
        [
            ("  caller", f"{caller.principal} (role {caller.role}, uid {caller.uid})"),
            ("  groups", groups),
            ("  rule set", rule_set),
        ]
    )


def build_caller(
    user: str,
    extra_groups: tuple[str, ...],
    role: str | None,
    settings: Settings,
) -> tuple[Caller, list[str]]:
    """The :class:`Caller` the daemon would see for ``user``, and notes on guesses.

    ``user`` is a login name or a uid. A known login gets its uid, passwd gid
    and supplementary groups (as :func:`lockd.identity.login_groups`); an
    unknown one gets uid -1 and only the ``--group`` groups. The role follows
    the daemon's order unless forced: ``service_users`` -> service, uid 0 ->
    owner, a group in ``admin_groups`` -> admin, else member. The daemon's own
    uid is an owner too, which a local test cannot know: pass ``--role owner``.
    """
    from lockd.identity import Caller, login_groups

    notes: list[str] = []
    entry: pwd.struct_passwd | None = None
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, OverflowError):
        entry = None
    if entry is not None:
        name, uid = entry.pw_name, entry.pw_uid
        groups = set(login_groups(name, uid, entry.pw_gid))
    else:
        name = user
        uid = int(user) if user.isdigit() else -1
        groups = set()
        notes.append(
            f"no passwd entry for {user!r}: uid {uid}, groups only from --group"
            if extra_groups
            else f"no passwd entry for {user!r}: uid {uid}, no groups"
        )
    for group in extra_groups:
        groups.add(_group_name(group))
    if role is None:
        if name in settings.service_users:
            role = "service"
        elif uid == 0:
            role = "owner"
        elif groups & set(settings.admin_groups):
            role = "admin"
        else:
            role = "member"
    kind: Literal["user", "service"] = "service" if role == "service" else "user"
    caller = Caller(
        kind=kind,
        name=name,
        role=role,  # type: ignore[arg-type]  # a Role literal, checked by click.Choice
        uid=uid,
        gid=entry.pw_gid if entry is not None else -1,
        pid=os.getpid(),
        groups=frozenset(groups),
    )
    return caller, notes


def _group_name(group: str) -> str:
    """A group given by gid becomes its name (rules see names)."""
    if group.isdigit():
        try:
            return grp.getgrgid(int(group)).gr_name
        except (KeyError, OverflowError):
            return group
    return group
