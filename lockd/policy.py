"""Access rules: one CEL rule set from TOML, compiled once, asked per request.

SPEC §5 in code. A rule set lives in ``<config>/rule-sets/*.toml``::

    [ruleSet]
    name = "lock-policy"
    resourceType = "lock"

    [rules.lock]
    acquire = "record.key.startsWith('user:' + user.userId + ':')"
    renew   = "record.key.startsWith('user:' + user.userId + ':')"

Why it is built this way:

- **Pure except reading files.** No sockets, no trio, no clock reads inside
  :meth:`Policy.decide`; the daemon, ``lockd rules check`` and ``lockd rules
  test`` all share this code and see the same verdicts.
- **Strict loading, fail closed.** Anything unexpected in a rule file (unknown
  key or operation, wrong type, TOML or CEL syntax error, an unknown variable,
  field or function) is a :class:`RuleSetError` with file, line and column.
  cel-python 0.5 does not type-check, so a typo such as ``usr.userId`` would
  otherwise compile and then deny every member at run time; we walk the parse
  tree at load time and refuse names the rules cannot see. An unreadable file
  or folder is an error too: the daemon must never fall back to "open" by
  mistake.
- **Compile once, evaluate per request.** Building a ``celpy.Environment``
  costs ~0.2 s (the grammar), so there is one lazily created module-level
  environment. Each rule is parsed and turned into a program at load time.
- **isMemberOf through a context variable.** celpy binds custom functions when
  a program is built, and a function only receives its CEL arguments. Rather
  than building a program per evaluation around a closure, the one program
  calls :func:`_is_member_of`, which reads the caller's groups from a
  :class:`contextvars.ContextVar` set around ``evaluate``. Both were measured at
  the same cost; the context variable keeps "compile once" literal and is safe
  if evaluations ever interleave across tasks or threads.
- **Any doubt denies.** An evaluation error, or a result that is not a CEL
  bool ``true`` (a string, an int, ``null``), denies. Misuse of
  ``isMemberOf`` (no argument, a non-string argument) is an evaluation error,
  not ``false``, so ``!isMemberOf(1)`` denies instead of allowing.

Decision order (:meth:`Policy.decide`), in this order:

1. ``hello``, ``status``, ``release``: allowed for every caller (release is
   never rule-gated; holding the handle is the proof).
2. ``break``: owners and admins only. **Services are denied ``break``.**
   Reading: SPEC §2's table lists ``break: owner, admin`` while it lists
   ``list``/``stats``/``rules`` as ``owner, admin, services`` — the difference
   is deliberate. SPEC §1's "rules never refuse them" is about CEL rules (the
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

import contextvars
import hashlib
import logging
import re
import time
import tomllib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import celpy
import lark
from celpy import celtypes
from celpy.evaluation import base_functions

from lockd.identity import Caller
from lockd.logfmt import kv

log = logging.getLogger("lockd.policy")

RESOURCE_TYPE = "lock"
#: Operation names a ``[rules.lock]`` table may define.
RULE_NAMES: tuple[str, ...] = ("acquire", "renew")
#: Protocol op -> the rule that gates it.
GATED_OPS: Mapping[str, str] = {"acquire": "acquire", "tryAcquire": "acquire", "renew": "renew"}
#: Ops every caller may use.
OPEN_OPS = frozenset({"hello", "status", "release"})
#: Ops for owners, admins and services.
PRIVILEGED_OPS = frozenset({"list", "stats", "rules"})
#: Roles that may ``break`` (services may not; see the module docstring).
BREAK_ROLES = frozenset({"owner", "admin"})
#: Roles that rules never refuse.
PASS_ROLES = frozenset({"owner", "admin", "service"})

#: Variables a rule sees, with their fields.
RULE_FIELDS: Mapping[str, frozenset[str]] = {
    "user": frozenset({"userId", "role", "uid", "groups"}),
    "record": frozenset({"key"}),
}
_RULESET_KEYS = frozenset({"name", "resourceType", "description"})
_OP_HINTS = {
    "tryAcquire": "the 'acquire' rule gates tryAcquire too",
    "release": "release is never rule-gated",
    "status": "status is open to every caller",
    "hello": "hello is open to every caller",
    "list": "list is for owners, admins and services, not rule-gated",
    "stats": "stats is for owners, admins and services, not rule-gated",
    "rules": "rules is for owners, admins and services, not rule-gated",
    "break": "break is for owners and admins, not rule-gated",
}
_CEL_MACRO_METHODS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_CEL_SPECIAL_FUNCTIONS = frozenset({"has", "dyn"})
_CUSTOM_FUNCTIONS = frozenset({"isMemberOf"})
_CEL_FUNCTIONS = frozenset(n for n in base_functions if n.isidentifier()) | _CUSTOM_FUNCTIONS
# Type names (``int``, ``string``, ``timestamp`` ...) and the protobuf
# well-known-type package may appear as bare identifiers.
_CEL_ROOT_NAMES = (
    frozenset(n for n, f in base_functions.items() if n.isidentifier() and isinstance(f, type))
    | frozenset({"google"})
    | frozenset(RULE_FIELDS)
)


# --------------------------------------------------------------------------- errors


class RuleSetError(Exception):
    """A rule set that cannot be used; ``str()`` is ``FILE:LINE:COL: message``."""

    def __init__(self, file: str, line: int | None, column: int | None, message: str) -> None:
        self.file = file
        self.line = line
        self.column = column
        self.message = message
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where}: {self.message}"

    def as_dict(self, at: str) -> dict[str, Any]:
        """The ``lastError`` shape of the ``rules`` op."""
        return {
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "message": self.message,
            "at": at,
        }


# --------------------------------------------------------------------------- time


def rfc3339_ms(epoch_seconds: float) -> str:
    """``2026-11-30T03:31:00.123Z`` (UTC, milliseconds, truncated)."""
    ms = int(epoch_seconds * 1000)
    dt = datetime.fromtimestamp(ms // 1000, UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"


# --------------------------------------------------------------------------- CEL


_ENV: celpy.Environment | None = None


def cel_environment() -> celpy.Environment:
    """The one shared CEL environment, built on first use (~0.2 s)."""
    global _ENV
    if _ENV is None:
        _ENV = celpy.Environment()
    return _ENV


_CALLER_GROUPS: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "lockd_caller_groups"
)


def _is_member_of(*groups: Any) -> celtypes.BoolType:
    """CEL ``isMemberOf(g, ...)``: true when the caller is in any named group.

    A ``TypeError`` here becomes a CEL "no such overload" evaluation error,
    which denies: misuse is never silently ``false`` (``!isMemberOf(1)``).
    """
    if not groups:
        raise TypeError("isMemberOf() needs at least one group name")
    for group in groups:
        if not isinstance(group, str):
            raise TypeError(f"isMemberOf() takes group names, not {type(group).__name__}")
    mine = _CALLER_GROUPS.get(frozenset())
    return celtypes.BoolType(any(str(group) in mine for group in groups))


_FUNCTIONS: dict[str, Any] = {"isMemberOf": _is_member_of}


def _bare_ident(tree: Any) -> str | None:
    """The identifier if ``tree`` is just a (parenthesis-free) name, else None."""
    node = tree
    while isinstance(node, lark.Tree):
        if node.data == "ident":
            return str(node.children[0])
        if len(node.children) != 1:
            return None
        node = node.children[0]
    return None


def _position(token: Any) -> tuple[int | None, int | None]:
    return getattr(token, "line", None), getattr(token, "column", None)


def _check_names(ast: lark.Tree) -> tuple[int | None, int | None, str] | None:
    """Refuse names a rule cannot see; celpy would only fail at run time.

    Returns ``(line, column, message)`` within the expression, or None.
    Macro variables (``user.groups.exists(g, g == 'x')``) are allowed anywhere
    in the expression: lenient about scope, strict about typos.
    """
    bound: set[str] = set()
    under_has: set[int] = set()
    for node in ast.iter_subtrees():
        if node.data == "member_dot_arg" and len(node.children) >= 3:
            method, args = node.children[1], node.children[2]
            if str(method) in _CEL_MACRO_METHODS and isinstance(args, lark.Tree) and args.children:
                var = _bare_ident(args.children[0])
                if var is not None:
                    bound.add(var)
        elif node.data == "ident_arg" and str(node.children[0]) == "has":
            under_has.update(id(sub) for sub in node.iter_subtrees())
    for node in ast.iter_subtrees_topdown():
        data = node.data
        if data in ("ident", "dot_ident"):
            token = node.children[0]
            name = str(token)
            if name not in _CEL_ROOT_NAMES and name not in bound:
                line, col = _position(token)
                return line, col, f"unknown name {name!r}: rules see 'user' and 'record'"
        elif data in ("ident_arg", "dot_ident_arg"):
            token = node.children[0]
            name = str(token)
            if name not in _CEL_FUNCTIONS and name not in _CEL_SPECIAL_FUNCTIONS:
                line, col = _position(token)
                return line, col, f"unknown function {name!r}"
        elif data == "member_dot_arg":
            token = node.children[1]
            name = str(token)
            if name not in _CEL_FUNCTIONS and name not in _CEL_MACRO_METHODS:
                line, col = _position(token)
                return line, col, f"unknown function {name!r}"
        elif data == "member_dot" and id(node) not in under_has:
            root = _bare_ident(node.children[0])
            token = node.children[1]
            if root is not None and root in RULE_FIELDS and root not in bound:
                known = RULE_FIELDS[root]
                if str(token) not in known:
                    line, col = _position(token)
                    fields = ", ".join(sorted(known))
                    return line, col, f"{root} has no field {str(token)!r} (fields: {fields})"
    return None


def _parse_error_message(exc: celpy.CELParseError) -> str:
    cause = exc.__context__
    if isinstance(cause, lark.exceptions.UnexpectedToken):
        if cause.token.type == "$END":
            return "CEL syntax error: unexpected end of expression"
        return f"CEL syntax error: unexpected {str(cause.token)!r}"
    if isinstance(cause, lark.exceptions.UnexpectedCharacters):
        return f"CEL syntax error: unexpected character {cause.char!r}"
    first = str(exc.args[0]).splitlines()[0] if exc.args else ""
    return f"CEL syntax error: {first}".rstrip(": ")


def _describe_eval_error(exc: BaseException) -> str:
    """A short, log-safe description; celpy appends the whole activation."""
    text = str(exc.args[0]) if exc.args else type(exc).__name__
    text = text.split(" (in activation", 1)[0]
    if len(text) > 200:
        text = text[:200] + "..."
    return text


@dataclass(frozen=True)
class CompiledRule:
    name: str
    source: str
    program: celpy.Runner


# --------------------------------------------------------------------------- TOML positions

_BARE_KEY = r"[A-Za-z0-9_-]+"
_QUOTED_KEY = r'"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\''
_KEY = rf"(?:{_BARE_KEY}|{_QUOTED_KEY})"
_DOTTED = rf"{_KEY}(?:[ \t]*\.[ \t]*{_KEY})*"
_KEY_RE = re.compile(_KEY)
_KEYVAL_RE = re.compile(rf"[ \t]*({_DOTTED})[ \t]*=[ \t]*")
_HEADER_RE = re.compile(rf"[ \t]*(\[\[?)[ \t]*({_DOTTED})[ \t]*\]")
_TOML_POS_RE = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_TOML_END_RE = re.compile(r"\s*\(at end of document\)$")


def _split_key(dotted: str) -> tuple[str, ...]:
    parts: list[str] = []
    for raw in _KEY_RE.findall(dotted):
        if raw[0] in "\"'":
            try:
                raw = tomllib.loads(f"k = {raw}")["k"]
            except tomllib.TOMLDecodeError:
                raw = raw[1:-1]
        parts.append(raw)
    return tuple(parts)


@dataclass(frozen=True)
class _Located:
    key_offset: int
    value_offset: int


def _locate(text: str, path: tuple[str, ...]) -> _Located | None:
    """Where the key ``path`` (e.g. ``("rules", "lock", "acquire")``) is written.

    A best-effort scanner (tomllib keeps no positions) for the shapes people
    write: ``[table]`` headers, dotted keys, one level of inline table. It
    skips multi-line strings. A table is found where it is first written,
    also implicitly (``[rules.lock]`` defines ``rules``). None when not found.
    """
    table: tuple[str, ...] = ()
    pos = 0
    n = len(text)
    while pos < n:
        end = text.find("\n", pos)
        end = n if end < 0 else end
        header = _HEADER_RE.match(text, pos, end)
        if header:
            table = _split_key(header.group(2))
            if table[: len(path)] == path:
                return _Located(header.start(1), header.start(1))
            pos = end + 1
            continue
        kv = _KEYVAL_RE.match(text, pos, end)
        if kv:
            keys = table + _split_key(kv.group(1))
            value_at = kv.end()
            if keys[: len(path)] == path:
                return _Located(kv.start(1), value_at)
            rest = path[len(keys) :]
            if path[: len(keys)] == keys and len(rest) == 1 and text.startswith("{", value_at):
                inner = re.compile(rf"[{{,][ \t]*({_KEY})[ \t]*=[ \t]*")
                for m in inner.finditer(text, value_at, end):
                    if _split_key(m.group(1)) == rest:
                        return _Located(m.start(1), m.end())
            for delim in ('"""', "'''"):
                if text.startswith(delim, value_at):
                    close = text.find(delim, value_at + 3)
                    if close >= 0:
                        newline = text.find("\n", close)
                        end = n if newline < 0 else newline
                    break
        pos = end + 1
    return None


def _string_offsets(text: str, start: int, value: str) -> list[int] | None:
    """Raw offsets in ``text`` of each character of the TOML string at ``start``.

    Maps a position inside the decoded string (what CEL parsed) back to the
    file, through escapes and multi-line delimiters. The extra last entry is
    the offset just past the string's content. None if it does not line up.
    """
    for delim in ('"""', "'''", '"', "'"):
        if text.startswith(delim, start):
            break
    else:
        return None
    basic = delim[0] == '"'
    multiline = len(delim) == 3
    pos = start + len(delim)
    if multiline:
        if text.startswith("\r\n", pos):
            pos += 2
        elif text.startswith("\n", pos):
            pos += 1
    offsets: list[int] = []
    i = 0
    while i < len(value):
        if pos >= len(text):
            return None
        c = text[pos]
        if basic and c == "\\":
            nxt = text[pos + 1 : pos + 2]
            if multiline and nxt in (" ", "\t", "\r", "\n"):
                pos += 1
                while pos < len(text) and text[pos] in " \t\r\n":
                    pos += 1
                continue
            width = {"u": 6, "U": 10}.get(nxt, 2)
        elif c == "\r" and text.startswith("\r\n", pos) and value[i] == "\n":
            width = 2
        else:
            if c != value[i]:
                return None
            width = 1
        offsets.append(pos)
        pos += width
        i += 1
    offsets.append(pos)
    return offsets


def _line_col(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return line, column


class _Source:
    """One rule file's text, for turning keys and CEL positions into line:col."""

    def __init__(self, file: str, text: str) -> None:
        self.file = file
        self.text = text

    def error(self, path: tuple[str, ...] | None, message: str) -> RuleSetError:
        """An error at the key ``path`` (its line and column), or with no position."""
        if path is not None:
            while path:
                found = _locate(self.text, path)
                if found is not None:
                    line, col = _line_col(self.text, found.key_offset)
                    return RuleSetError(self.file, line, col, message)
                path = path[:-1]
        return RuleSetError(self.file, None, None, message)

    def cel_error(
        self,
        path: tuple[str, ...],
        expr: str,
        cel_line: int | None,
        cel_column: int | None,
        message: str,
    ) -> RuleSetError:
        """An error inside the CEL string at ``path``, mapped to the file."""
        found = _locate(self.text, path)
        if found is None:
            return self.error(path, message)
        if cel_line is None or cel_column is None:
            line, _ = _line_col(self.text, found.key_offset)
            return RuleSetError(self.file, line, None, message)
        offsets = _string_offsets(self.text, found.value_offset, expr)
        if offsets is None:
            line, _ = _line_col(self.text, found.key_offset)
            return RuleSetError(self.file, line, None, message)
        lines = expr.split("\n")
        index = sum(len(part) + 1 for part in lines[: cel_line - 1]) + cel_column - 1
        index = max(0, min(index, len(expr)))
        line, col = _line_col(self.text, offsets[index])
        return RuleSetError(self.file, line, col, message)


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class Decision:
    """A verdict. ``reason`` is for logs and ``lockd rules test``, never clients."""

    allowed: bool
    reason: str


def _compile_rule(source: _Source, op: str, expr: str) -> CompiledRule:
    path = ("rules", RESOURCE_TYPE, op)
    env = cel_environment()
    try:
        ast = env.compile(expr)
    except celpy.CELParseError as exc:
        raise source.cel_error(path, expr, exc.line, exc.column, _parse_error_message(exc)) from exc
    except Exception as exc:  # lark lexer errors outside CELParseError, recursion ...
        raise source.error(path, f"CEL error: {exc}") from exc
    problem = _check_names(ast)
    if problem is not None:
        line, col, message = problem
        raise source.cel_error(path, expr, line, col, message)
    try:
        program = env.program(ast, functions=_FUNCTIONS)
    except Exception as exc:
        raise source.error(path, f"CEL error: {exc}") from exc
    return CompiledRule(name=op, source=expr, program=program)


def _table(source: _Source, doc: Mapping[str, Any], key: str, path: tuple[str, ...]) -> Any:
    value = doc[key]
    if not isinstance(value, dict):
        raise source.error(path, f"{'.'.join(path)} must be a table")
    return value


def _parse_rule_set(file: str, data: bytes) -> tuple[str, str | None, dict[str, CompiledRule]]:
    """Validate and compile one rule file: ``(name, description, rules)``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        prefix = data[: exc.start].decode("utf-8", "replace")
        line, _ = _line_col(prefix, len(prefix))
        raise RuleSetError(file, line, None, "not valid UTF-8") from exc
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        m = _TOML_POS_RE.search(message)
        if m:
            raise RuleSetError(
                file, int(m.group(1)), int(m.group(2)), "TOML: " + message[: m.start()]
            ) from exc
        m = _TOML_END_RE.search(message)
        if m:
            line, col = _line_col(text, len(text))
            raise RuleSetError(file, line, col, "TOML: " + message[: m.start()]) from exc
        raise RuleSetError(file, None, None, f"TOML: {message}") from exc
    source = _Source(file, text)

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
        compiled[op] = _compile_rule(source, op, expr)
    return name.strip(), description, compiled


def is_rule_file_name(name: str) -> bool:
    """Visible ``*.toml`` names count; editor swap, backup and hidden files do not."""
    return name.endswith(".toml") and not name.startswith(".")


def _rule_files(rule_sets_dir: Path) -> list[Path]:
    """``*.toml`` files, sorted; hidden files and editor leftovers do not count."""
    try:
        entries = list(rule_sets_dir.iterdir())
    except FileNotFoundError:
        return []
    except NotADirectoryError as exc:
        raise RuleSetError(str(rule_sets_dir), None, None, "not a directory") from exc
    except OSError as exc:
        raise RuleSetError(
            str(rule_sets_dir), None, None, f"cannot list: {exc.strerror or exc}"
        ) from exc
    return sorted(p for p in entries if is_rule_file_name(p.name) and not p.is_dir())


def _read(paths: Iterable[Path]) -> list[tuple[Path, bytes]]:
    out: list[tuple[Path, bytes]] = []
    for path in paths:
        try:
            out.append((path, path.read_bytes()))
        except FileNotFoundError:
            continue  # removed between listing and reading: it no longer counts
        except OSError as exc:
            raise RuleSetError(
                str(path), None, None, f"cannot read: {exc.strerror or exc}"
            ) from exc
    return out


Fingerprint = tuple[tuple[str, str], ...]


def _fingerprint(files: Iterable[tuple[Path, bytes]]) -> Fingerprint:
    return tuple((str(p), hashlib.sha256(b).hexdigest()) for p, b in files)


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

    def decide(self, caller: Caller, op: str, key: str) -> Decision:
        """SPEC §5 decision order; see the module docstring."""
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
            return Decision(True, f"role {role} passes")
        if self._rules is None:
            return Decision(True, "no lock rule set installed: open")
        rule = self._rules.get(rule_name)
        if rule is None:
            return Decision(False, f"rule set {self.name!r} names no {rule_name!r} rule: denied")
        cache_key = (rule.name, caller.name, caller.role, caller.uid, caller.groups, key)
        verdict = self._verdicts.get(cache_key)
        if verdict is not None:
            self._verdicts.move_to_end(cache_key)
            return verdict
        verdict = self._evaluate(rule, caller, key)
        self._verdicts[cache_key] = verdict
        if len(self._verdicts) > VERDICT_CACHE_SIZE:
            self._verdicts.popitem(last=False)
        return verdict

    def _evaluate(self, rule: CompiledRule, caller: Caller, key: str) -> Decision:
        where = f"rule {rule.name} in {self.file}"
        activation = {
            "user": celpy.json_to_cel(
                {
                    "userId": caller.name,
                    "role": caller.role,
                    "uid": caller.uid,
                    "groups": sorted(caller.groups),
                }
            ),
            "record": celpy.json_to_cel({"key": key}),
        }
        token = _CALLER_GROUPS.set(caller.groups)
        try:
            result = rule.program.evaluate(activation)
        except Exception as exc:  # any evaluation failure denies, never crashes
            return Decision(False, f"rule error: {where}: {_describe_eval_error(exc)}: denied")
        finally:
            _CALLER_GROUPS.reset(token)
        if not isinstance(result, bool | celtypes.BoolType):
            kind = type(result).__name__
            return Decision(False, f"{where} returned {kind}, not bool: denied")
        if bool(result):
            return Decision(True, f"{where} allowed")
        return Decision(False, f"{where} denied")


def load_rule_set(path: Path, *, wall_clock: Callable[[], float] = time.time) -> Policy:
    """Load one rule file (``lockd rules check FILE``); raises :class:`RuleSetError`."""
    files = _read([path])
    if not files:
        raise RuleSetError(str(path), None, None, "cannot read: no such file")
    return _build(files, wall_clock)


def load_policy(rule_sets_dir: Path, *, wall_clock: Callable[[], float] = time.time) -> Policy:
    """The policy of a ``rule-sets/`` folder; raises :class:`RuleSetError`.

    A missing folder or one without ``*.toml`` files gives the open default.
    """
    return _build(_read(_rule_files(rule_sets_dir)), wall_clock)


def _build(files: list[tuple[Path, bytes]], wall_clock: Callable[[], float]) -> Policy:
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
        loaded_at=rfc3339_ms(wall_clock()),
        fingerprint=_fingerprint(files),
    )


class PolicyManager:
    """The policy in force, its hot reloads, and the last reload error.

    ``reload()`` never raises for a bad rule set: the previous policy stays in
    force (SPEC §5) and the error is kept for ``rules`` / ``lockd rules show``.
    """

    def __init__(self, rule_sets_dir: Path, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.rule_sets_dir = rule_sets_dir
        self._wall_clock = wall_clock
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
            policy = load_policy(self.rule_sets_dir, wall_clock=self._wall_clock)
        except RuleSetError as err:
            self._last_error = err.as_dict(rfc3339_ms(self._wall_clock()))
            raise
        self._install(policy)
        return policy

    def reload(self) -> bool:
        """Re-read the folder. True when the files on disk are in force, False on error.

        Unchanged files (same names and sha256) keep the current policy object
        (and its ``loadedAt``) without recompiling; an earlier error is cleared.
        """
        try:
            files = _read(_rule_files(self.rule_sets_dir))
            if _fingerprint(files) == self._policy.fingerprint:
                if self._last_error is not None:
                    log.info(kv(event="rules_error_cleared"))
                self._last_error = None
                return True
            policy = _build(files, self._wall_clock)
        except RuleSetError as err:
            self._last_error = err.as_dict(rfc3339_ms(self._wall_clock()))
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
        """The result of the ``rules`` op (SPEC §3)."""
        return {"policy": self._policy.info, "lastError": self.last_error}

    def decide(self, caller: Caller, op: str, key: str) -> Decision:
        return self._policy.decide(caller, op, key)
