"""The CEL side of access rules: one environment, isMemberOf, compile, evaluate.

:mod:`lockd.rules.policy` decides *whether* a rule is asked; this module compiles a
rule's expression at load time and runs it per request.

Why it is built this way:

- **Strict names at load time.** cel-python 0.5 does not type-check, so a
  typo such as ``usr.userId`` would otherwise compile and then deny every
  member at run time; :func:`_check_names` walks the parse tree at load time
  and refuses names the rules cannot see (variables and fields of
  :data:`RULE_FIELDS`, CEL's functions and macros, ``isMemberOf``). The error
  is a :class:`~lockd.rules.files.RuleSetError` at the name's line and column in
  the rule file.
- **Compile once, evaluate per request.** Building a ``celpy.Environment``
  costs ~0.2 s (the grammar), so there is one lazily created module-level
  environment. Each rule is parsed and turned into a program at load time.
- **isMemberOf through a context variable.** celpy binds custom functions when
  a program is built, and a function only receives its CEL arguments. Rather
  than building a program per evaluation around a closure, the one program
  calls :func:`_is_member_of`, which reads the caller's groups from a
  :class:`contextvars.ContextVar` set around ``evaluate`` (:func:`run_rule`).
  Both were measured at the same cost; the context variable keeps "compile
  once" literal and is safe if evaluations ever interleave across tasks or
  threads.
- **Misuse is an error, not false.** ``isMemberOf`` with no argument or a
  non-string argument is an evaluation error, which the policy turns into a
  denial, so ``!isMemberOf(1)`` denies instead of allowing.
- **Bounded cost.** CEL has no cost limit in cel-python, and evaluation runs
  on the daemon's event loop: a nested comprehension took seconds per
  request. A comprehension inside another is refused at load time (its cost
  is the product of the lists); what remains is linear in the rule's size,
  and :func:`run_rule` bounds it in CPU time (``budget``): the evaluation is
  interrupted by ``SIGVTALRM`` and raises :class:`RuleOverBudget`, which the
  policy turns into a denial.
"""

from __future__ import annotations

import contextvars
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import celpy
import lark
from celpy import celtypes
from celpy.evaluation import base_functions

from lockd.identity import Caller
from lockd.rules.files import RuleSource

# --------------------------------------------------------------------------- names

#: Variables a rule sees, with their fields.
RULE_FIELDS: Mapping[str, frozenset[str]] = {
    "user": frozenset({"userId", "role", "uid", "groups"}),
    # mode and limit: what an acquire asks for, or the hold a renew extends
    # (docs/contract.md §10); "exclusive" and 1 when the request names neither.
    "record": frozenset({"key", "mode", "limit"}),
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


def _nested_comprehension(ast: lark.Tree) -> Any | None:
    """The method token of a comprehension nested in another's arguments, if any."""

    def walk(node: lark.Tree, inside: bool) -> Any | None:
        is_macro = (
            node.data == "member_dot_arg"
            and len(node.children) >= 3
            and str(node.children[1]) in _CEL_MACRO_METHODS
        )
        if is_macro and inside:
            return node.children[1]
        for i, child in enumerate(node.children):
            if isinstance(child, lark.Tree):
                # The receiver (child 0) runs once; the arguments run per element.
                found = walk(child, inside or (is_macro and i >= 2))
                if found is not None:
                    return found
        return None

    return walk(ast, False)


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


def describe_eval_error(exc: BaseException) -> str:
    """A short, log-safe description; celpy appends the whole activation."""
    text = str(exc.args[0]) if exc.args else type(exc).__name__
    text = text.split(" (in activation", 1)[0]
    if len(text) > 200:
        text = text[:200] + "..."
    return text


@dataclass(frozen=True)
class CompiledRule:
    """One rule (``acquire`` or ``renew``), compiled at load time."""

    name: str
    source: str
    program: celpy.Runner


def compile_rule(source: RuleSource, path: tuple[str, ...], expr: str) -> CompiledRule:
    """Parse, name-check and build the rule at key ``path`` (its last part names it)."""
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
    nested = _nested_comprehension(ast)
    if nested is not None:
        line, col = _position(nested)
        message = (
            f"{nested!s}() inside another comprehension: its cost is the product of "
            "the lists' sizes; at most one level of all/exists/exists_one/map/filter"
        )
        raise source.cel_error(path, expr, line, col, message)
    try:
        program = env.program(ast, functions=_FUNCTIONS)
    except Exception as exc:
        raise source.error(path, f"CEL error: {exc}") from exc
    return CompiledRule(name=path[-1], source=expr, program=program)


def rule_activation(
    caller: Caller, key: str, mode: str = "exclusive", limit: int = 1
) -> dict[str, Any]:
    """What a rule sees: ``user`` and ``record`` with the fields of :data:`RULE_FIELDS`."""
    return {
        "user": celpy.json_to_cel(
            {
                "userId": caller.name,
                "role": caller.role,
                "uid": caller.uid,
                "groups": sorted(caller.groups),
            }
        ),
        "record": celpy.json_to_cel({"key": key, "mode": mode, "limit": limit}),
    }


class RuleOverBudget(BaseException):
    """A rule's evaluation used more CPU time than its budget and was stopped.

    A BaseException so that nothing inside celpy catches it as an error.
    """


def _over_budget(signum: int, frame: Any) -> None:
    raise RuleOverBudget()


def run_rule(
    rule: CompiledRule,
    activation: Mapping[str, Any],
    groups: frozenset[str],
    budget: float | None = None,
) -> Any:
    """Evaluate ``rule`` with ``groups`` visible to ``isMemberOf``; errors propagate.

    ``budget``: seconds of CPU time the evaluation may use. ``ITIMER_VIRTUAL``
    stops a runaway evaluation early (only in the main thread, where signals
    are delivered); the verdict rests on the thread's CPU time measured after
    it, so an evaluation over its budget raises :class:`RuleOverBudget`
    whether or not the timer fired.
    """
    token = _CALLER_GROUPS.set(groups)
    timed = budget is not None and threading.current_thread() is threading.main_thread()
    previous: Any = None
    started = time.thread_time()
    try:
        if timed:
            assert budget is not None
            previous = signal.signal(signal.SIGVTALRM, _over_budget)
            signal.setitimer(signal.ITIMER_VIRTUAL, budget)
        result = rule.program.evaluate(activation)
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            signal.signal(signal.SIGVTALRM, previous)
        _CALLER_GROUPS.reset(token)
    # The timer only bounds how long the loop is held; the verdict must not
    # depend on whether its signal arrived in time. It can come late (a
    # process-directed signal taken by another thread is acted on only when
    # the main thread next checks for signals) and never arrives outside the
    # main thread. So an evaluation that used more than its budget is over it,
    # whatever it returned.
    if budget is not None and time.thread_time() - started > budget:
        raise RuleOverBudget()
    return result


def is_cel_bool(value: Any) -> bool:
    """True for a Python or CEL bool; any other result must deny."""
    return isinstance(value, bool | celtypes.BoolType)
