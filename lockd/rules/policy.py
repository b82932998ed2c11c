"""Access rules: one lock rule set, loaded strictly, asked per request.

docs/contract.md §5 in code. A rule set lives in ``<config>/rule-sets/*.toml``::

    [ruleSet]
    name = "lock-policy"
    resourceType = "lock"

    [rules.lock]
    acquire = "record.key.startsWith('user:' + user.userId + ':')"
    renew   = "record.key.startsWith('user:' + user.userId + ':')"

This module holds the rule-set schema, the decision order (:class:`Policy`),
loading (:func:`load_policy`, :func:`load_rule_set`) and hot reloads
(:class:`PolicyManager`). Files, TOML and error positions are in
:mod:`lockd.rules.files`; compiling and running CEL is in :mod:`lockd.rules.celenv`.

Why it is built this way:

- **Pure except reading files.** No sockets, no trio, no clock reads inside
  :meth:`Policy.decide`; the daemon, ``lockd rules check`` and ``lockd rules
  test`` all share this code and see the same verdicts.
- **Strict loading, fail closed.** Anything unexpected in a rule file (unknown
  key or operation, wrong type, TOML or CEL syntax error, an unknown variable,
  field or function) is a :class:`RuleSetError` with file, line and column.
- **Any doubt denies.** An evaluation error, or a result that is not a CEL
  bool ``true`` (a string, an int, ``null``), denies.

Decision order (:meth:`Policy.decide`), in this order:

1. ``hello``, ``status``, ``release``: allowed for every caller (release is
   never rule-gated; holding the handle is the proof).
2. ``break``: owners and admins only. **Services are denied ``break``.**
   Reading: docs/contract.md §2's table lists ``break: owner, admin`` while it lists
   ``list``/``stats``/``rules`` as ``owner, admin, services`` — the difference
   is deliberate. docs/contract.md §1's "rules never refuse them" is about CEL rules (the
   ``acquire``/``renew`` gates), and ``break`` is not rule-gated but a role
   gate for human operators, whose use is logged with a reason.
3. ``list``, ``stats``, ``rules``: owners, admins and services; members denied.
4. ``acquire``/``tryAcquire`` (rule ``acquire``) and ``renew`` (rule
   ``renew``): owners, admins and services pass; with no lock rule set every
   member passes; with one installed, a rule it does not name denies members;
   otherwise the rule decides.
5. Anything else: denied (the server validates ops first; this is a backstop).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockd import timefmt
from lockd.identity import Caller
from lockd.logfmt import kv
from lockd.rules.files import (
    Fingerprint,
    RuleSetError,
    RuleSource,
    fingerprint_of,
    parse_toml,
    read_files,
    rule_files,
)

if TYPE_CHECKING:
    from lockd.rules.celenv import CompiledRule

# cel-python (with lark and pendulum) costs ~0.1 s to import: it is imported
# when a rule set is compiled, so a daemon without rule sets (the embedded
# default, and every restart measured in bench/scale.py) starts without it.

log = logging.getLogger("lockd.rules.policy")

RESOURCE_TYPE = "lock"
#: Operation names a ``[rules.lock]`` table may define.
RULE_NAMES: tuple[str, ...] = ("acquire", "renew")
#: Protocol op -> the rule that gates it.
GATED_OPS: Mapping[str, str] = {"acquire": "acquire", "tryAcquire": "acquire", "renew": "renew"}
#: Ops every caller may use.
OPEN_OPS = frozenset({"hello", "status", "release", "list"})
#: Ops for owners, admins and services.
PRIVILEGED_OPS = frozenset({"stats", "rules"})
#: Roles that may ``break`` (services may not; see the module docstring).
BREAK_ROLES = frozenset({"owner", "admin"})
#: Roles that rules never refuse.
PASS_ROLES = frozenset({"owner", "admin", "service"})

_RULESET_KEYS = frozenset({"name", "resourceType", "description"})
_OP_HINTS = {
    "tryAcquire": "the 'acquire' rule gates tryAcquire too",
    "release": "release is never rule-gated",
    "status": "status is open to every caller",
    "hello": "hello is open to every caller",
    "list": "list is open to every caller (a member sees the keys it holds or waits for)",
    "stats": "stats is for owners, admins and services, not rule-gated",
    "rules": "rules is for owners, admins and services, not rule-gated",
    "break": "break is for owners and admins, not rule-gated",
}


# --------------------------------------------------------------------------- rule sets


@dataclass(frozen=True)
class Decision:
    """A verdict. ``reason`` is for logs and ``lockd rules test``, never clients."""

    allowed: bool
    reason: str
    #: CPU seconds the rule evaluation behind it used (0: none ran, e.g. a cached verdict);
    #: not part of the verdict, so not compared.
    cpu_s: float = field(default=0.0, compare=False)


#: the verdict of every gated op for the roles that pass the rules: made once,
#: not on every acquire of an owner, admin or service.
_PASSES = {role: Decision(True, f"role {role} passes") for role in PASS_ROLES}


def _table(source: RuleSource, doc: Mapping[str, Any], key: str, path: tuple[str, ...]) -> Any:
    value = doc[key]
    if not isinstance(value, dict):
        raise source.error(path, f"{'.'.join(path)} must be a table")
    return value


def _parse_rule_set(file: str, data: bytes) -> tuple[str, str | None, dict[str, CompiledRule]]:
    """Validate and compile one rule file: ``(name, description, rules)``."""
    source, doc = parse_toml(file, data)

    for key in doc:
        if key not in ("ruleSet", "rules"):
            raise source.error((key,), f"unknown key {key!r} (expected [ruleSet] and [rules.lock])")
    if "ruleSet" not in doc:
        raise source.error(None, "missing [ruleSet] table")
    header = _table(source, doc, "ruleSet", ("ruleSet",))
    for key in header:
        if key not in _RULESET_KEYS:
            raise source.error(
                ("ruleSet", key),
                f"unknown key {key!r} in [ruleSet] (expected name, resourceType, description)",
            )
    name = header.get("name")
    if not isinstance(name, str) or not name.strip():
        where = ("ruleSet", "name") if "name" in header else ("ruleSet",)
        raise source.error(where, "[ruleSet] needs a non-empty string 'name'")
    if "resourceType" not in header:
        raise source.error(("ruleSet",), '[ruleSet] needs resourceType = "lock"')
    resource_type = header["resourceType"]
    if resource_type != RESOURCE_TYPE:
        raise source.error(
            ("ruleSet", "resourceType"),
            f'resourceType must be "lock", not {resource_type!r}',
        )
    description = header.get("description")
    if description is not None and not isinstance(description, str):
        raise source.error(("ruleSet", "description"), "description must be a string")

    if "rules" not in doc:
        raise source.error(None, "missing [rules.lock] table")
    rules_table = _table(source, doc, "rules", ("rules",))
    for key in rules_table:
        if key != RESOURCE_TYPE:
            raise source.error(
                ("rules", key), f"unknown resource type {key!r} in [rules] (only 'lock')"
            )
    if RESOURCE_TYPE not in rules_table:
        raise source.error(("rules",), "missing [rules.lock] table")
    lock_rules = _table(source, rules_table, RESOURCE_TYPE, ("rules", RESOURCE_TYPE))

    from lockd.rules.celenv import compile_rule

    compiled: dict[str, CompiledRule] = {}
    for op, expr in lock_rules.items():
        path = ("rules", RESOURCE_TYPE, op)
        if op not in RULE_NAMES:
            hint = _OP_HINTS.get(op)
            message = f"unknown operation {op!r} in [rules.lock] (valid: acquire, renew)"
            raise source.error(path, f"{message}: {hint}" if hint else message)
        if not isinstance(expr, str):
            raise source.error(path, f"rule {op!r} must be a string holding a CEL expression")
        if not expr.strip():
            raise source.error(path, f"rule {op!r} is empty")
        compiled[op] = compile_rule(source, path, expr)
    return name.strip(), description, compiled


# --------------------------------------------------------------------------- policy


#: rule verdicts remembered per policy (least recently used dropped first).
VERDICT_CACHE_SIZE = 4096


class Policy:
    """A compiled lock rule set, or the open default (no rule set installed)."""

    def __init__(
        self,
        rules: Mapping[str, CompiledRule] | None = None,
        *,
        file: str | None = None,
        name: str | None = None,
        description: str | None = None,
        sha256: str | None = None,
        loaded_at: str | None = None,
        fingerprint: Fingerprint = (),
    ) -> None:
        self._rules: dict[str, CompiledRule] | None = dict(rules) if rules is not None else None
        self.file = file
        self.name = name
        self.description = description
        self.sha256 = sha256
        self.loaded_at = loaded_at
        #: (file, sha256) of every rule file this policy was built from.
        self.fingerprint = fingerprint
        # Rule verdicts by everything a rule can see. CEL is deterministic and
        # our activation holds no clock, so a verdict never goes stale while
        # this policy object lives; a reload builds a new object and a new
        # cache. Interpreted evaluation costs ~350 us (celpy's tree walker),
        # and the same job asking for the same key again is the common case.
        self._verdicts: OrderedDict[tuple[Any, ...], Decision] = OrderedDict()
        #: CPU seconds one evaluation may use (None: unbounded, e.g. ``rules test``).
        self.budget: float | None = None
        # (rule, principal) pairs whose evaluation ran over budget: denied
        # without evaluating for this policy's life, so fresh keys cannot make
        # a member cost the loop a budget per request. A reload starts afresh.
        self._over_budget: OrderedDict[tuple[str, str], None] = OrderedDict()

    @classmethod
    def open(cls) -> Policy:
        """No lock rule set: every member may use every key."""
        return cls(None)

    @property
    def is_open(self) -> bool:
        return self._rules is None

    @property
    def rule_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._rules)) if self._rules is not None else ()

    @property
    def info(self) -> dict[str, Any] | None:
        """``{"file", "name", "sha256", "loadedAt"}``, or None for the open default."""
        if self._rules is None:
            return None
        return {
            "file": self.file,
            "name": self.name,
            "sha256": self.sha256,
            "loadedAt": self.loaded_at,
        }

    def decide(
        self, caller: Caller, op: str, key: str, mode: str = "exclusive", limit: int = 1
    ) -> Decision:
        """docs/contract.md §5 decision order; see the module docstring.

        ``mode`` and ``limit`` are what the rule sees as ``record.mode`` and
        ``record.limit`` (docs/contract.md §10).
        """
        role = caller.role
        if op in OPEN_OPS:
            return Decision(True, f"{op} is open to every caller")
        if op == "break":
            if role in BREAK_ROLES:
                return Decision(True, f"role {role} may break")
            return Decision(False, f"break is for owners and admins; role {role}: denied")
        if op in PRIVILEGED_OPS:
            if role in PASS_ROLES:
                return Decision(True, f"role {role} may {op}")
            return Decision(False, f"{op} is for owners, admins and services; role {role}: denied")
        rule_name = GATED_OPS.get(op)
        if rule_name is None:
            return Decision(False, f"unknown operation {op!r}: denied")
        if role in PASS_ROLES:
            return _PASSES[role]
        if self._rules is None:
            return Decision(True, "no lock rule set installed: open")
        rule = self._rules.get(rule_name)
        if rule is None:
            return Decision(False, f"rule set {self.name!r} names no {rule_name!r} rule: denied")
        cache_key = (
            rule.name,
            caller.name,
            caller.role,
            caller.uid,
            caller.groups,
            key,
            mode,
            limit,
        )
        verdict = self._verdicts.get(cache_key)
        if verdict is not None:
            self._verdicts.move_to_end(cache_key)
            return verdict
        # CPU time, not wall time: what the evaluation cost the daemon, which
        # the daemon charges to the caller (its verdict does not depend on it).
        started = time.thread_time()
        verdict = self._evaluate(rule, caller, key, mode, limit)
        self._verdicts[cache_key] = verdict
        if len(self._verdicts) > VERDICT_CACHE_SIZE:
            self._verdicts.popitem(last=False)
        return Decision(verdict.allowed, verdict.reason, time.thread_time() - started)

    def _evaluate(
        self, rule: CompiledRule, caller: Caller, key: str, mode: str, limit: int
    ) -> Decision:
        from lockd.rules.celenv import (
            RuleOverBudget,
            describe_eval_error,
            is_cel_bool,
            rule_activation,
            run_rule,
        )

        where = f"rule {rule.name} in {self.file}"
        slow = (rule.name, caller.principal)
        if slow in self._over_budget:
            return Decision(False, f"{where} ran over its budget for this caller: denied")
        activation = rule_activation(caller, key, mode, limit)
        try:
            result = run_rule(rule, activation, caller.groups, self.budget)
        except RuleOverBudget:
            self._over_budget[slow] = None
            if len(self._over_budget) > VERDICT_CACHE_SIZE:
                self._over_budget.popitem(last=False)
            budget_ms = round((self.budget or 0) * 1000)
            log.warning(
                kv(
                    event="rule_over_budget",
                    rule=rule.name,
                    file=self.file,
                    principal=caller.principal,
                    budget_ms=budget_ms,
                    effect="denied until the rule set is reloaded",
                )
            )
            return Decision(False, f"{where} used more than {budget_ms} ms: denied")
        except Exception as exc:  # any evaluation failure denies, never crashes
            return Decision(False, f"rule error: {where}: {describe_eval_error(exc)}: denied")
        if not is_cel_bool(result):
            kind = type(result).__name__
            return Decision(False, f"{where} returned {kind}, not bool: denied")
        if bool(result):
            return Decision(True, f"{where} allowed")
        return Decision(False, f"{where} denied")


def load_rule_set(path: Path, *, wall_ms: Callable[[], int] = timefmt.wall_ms) -> Policy:
    """Load one rule file (``lockd rules check FILE``); raises :class:`RuleSetError`."""
    files = read_files([path])
    if not files:
        raise RuleSetError(str(path), None, None, "cannot read: no such file")
    return _build(files, wall_ms)


def load_policy(
    rule_sets_dir: Path,
    *,
    wall_ms: Callable[[], int] = timefmt.wall_ms,
    trusted_owners: frozenset[int] | None = None,
) -> Policy:
    """The policy of a ``rule-sets/`` folder; raises :class:`RuleSetError`.

    A missing folder or one without ``*.toml`` files gives the open default.
    ``trusted_owners``: the only uids that may own (and write) the folder and
    its files; None skips that check (``lockd rules test``).
    """
    files = rule_files(rule_sets_dir, trusted_owners=trusted_owners)
    return _build(read_files(files, trusted_owners=trusted_owners), wall_ms)


def _build(files: list[tuple[Path, bytes]], wall_ms: Callable[[], int]) -> Policy:
    if not files:
        return Policy.open()
    parsed = [(path, data, _parse_rule_set(str(path), data)) for path, data in files]
    if len(parsed) > 1:
        names = ", ".join(str(p) for p, _, _ in parsed)
        raise RuleSetError(
            str(parsed[0][0]),
            None,
            None,
            f"more than one lock rule set ({names}); at most one may be installed",
        )
    path, data, (name, description, rules) = parsed[0]
    return Policy(
        rules,
        file=str(path),
        name=name,
        description=description,
        sha256=hashlib.sha256(data).hexdigest(),
        loaded_at=timefmt.format_epoch_ms(wall_ms()),
        fingerprint=fingerprint_of(files),
    )


class PolicyManager:
    """The policy in force, its hot reloads, and the last reload error.

    ``reload()`` never raises for a bad rule set: the previous policy stays in
    force (docs/contract.md §5) and the error is kept for ``rules`` / ``lockd rules show``.
    """

    def __init__(
        self,
        rule_sets_dir: Path,
        *,
        wall_ms: Callable[[], int] = timefmt.wall_ms,
        trusted_owners: frozenset[int] | None = None,
        budget: float | None = None,
    ) -> None:
        self.rule_sets_dir = rule_sets_dir
        self._wall_ms = wall_ms
        #: who may own and write the rule sets: root and the daemon's user.
        self.trusted_owners = (
            trusted_owners if trusted_owners is not None else frozenset({0, os.geteuid()})
        )
        #: CPU seconds one rule evaluation may use (``rule_budget_ms``).
        self.budget = budget
        self._policy = Policy.open()
        self._last_error: dict[str, Any] | None = None

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def last_error(self) -> dict[str, Any] | None:
        return dict(self._last_error) if self._last_error is not None else None

    def load_initial(self) -> Policy:
        """Start-up load; raises :class:`RuleSetError` (the daemon must not start)."""
        try:
            policy = load_policy(
                self.rule_sets_dir, wall_ms=self._wall_ms, trusted_owners=self.trusted_owners
            )
        except RuleSetError as err:
            self._last_error = err.as_dict(timefmt.format_epoch_ms(self._wall_ms()))
            raise
        self._install(policy)
        return policy

    def reload(self) -> bool:
        """Re-read the folder. True when the files on disk are in force, False on error.

        Unchanged files (same names and sha256) keep the current policy object
        (and its ``loadedAt``) without recompiling; an earlier error is cleared.
        """
        try:
            trusted = self.trusted_owners
            files = read_files(
                rule_files(self.rule_sets_dir, trusted_owners=trusted), trusted_owners=trusted
            )
            if fingerprint_of(files) == self._policy.fingerprint:
                if self._last_error is not None:
                    log.info(kv(event="rules_error_cleared"))
                self._last_error = None
                return True
            policy = _build(files, self._wall_ms)
        except RuleSetError as err:
            self._last_error = err.as_dict(timefmt.format_epoch_ms(self._wall_ms()))
            log.warning(
                kv(
                    event="rules_rejected",
                    file=err.file,
                    line=err.line,
                    column=err.column,
                    error=err.message,
                    policy="previous stays in force",
                )
            )
            return False
        self._install(policy)
        return True

    def _install(self, policy: Policy) -> None:
        policy.budget = self.budget
        self._policy = policy
        self._last_error = None
        if policy.info is None:
            log.info(kv(event="rules_loaded", policy="open default (no lock rule set)"))
        else:
            log.info(
                kv(
                    event="rules_loaded",
                    name=policy.name,
                    file=policy.file,
                    sha256=policy.sha256,
                    rules=",".join(policy.rule_names) or "none",
                )
            )

    def rules_result(self) -> dict[str, Any]:
        """The result of the ``rules`` op (docs/contract.md §3)."""
        return {"policy": self._policy.info, "lastError": self.last_error}

    def decide(
        self, caller: Caller, op: str, key: str, mode: str = "exclusive", limit: int = 1
    ) -> Decision:
        return self._policy.decide(caller, op, key, mode, limit)
