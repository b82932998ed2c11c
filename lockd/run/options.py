"""What ``lockd run`` was asked to do, and how it speaks (docs/contract.md §9).

The vocabulary shared by :mod:`lockd.run.lease` (taking the key) and
:mod:`lockd.run.supervisor` (the whole run): kept apart so that neither has
to import the other.
"""

from __future__ import annotations

import sys

from lockd_client._record import Frozen

from lockd.exitcodes import EXIT_BUSY, USAGE, error_document

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import IO, Any, ClassVar

__all__ = ["MIN_TTL_MS", "OnLost", "Reporter", "RunOptions"]

#: The shortest ``lockd run --ttl``: below it, renewing every TTL/3 is hopeless.
MIN_TTL_MS = 100


class _Choices(type):
    """The metaclass of :class:`OnLost`: iterating the class gives its members, as an Enum's."""

    _members: dict[str, OnLost]

    def __iter__(cls) -> Iterator[OnLost]:
        return iter(cls._members.values())


class OnLost(str, metaclass=_Choices):
    """What to do to COMMAND when the lease is lost (``--on-lost``).

    Reads as the ``StrEnum`` it was -- ``OnLost.KILL``, ``OnLost("kill")``
    (the same object; ValueError for anything else), ``.value``, ``.name``,
    ``list(OnLost)``, a ``str`` equal to its value -- without the enum
    module, whose import was a tenth of ``python -c pass`` in every ``lockd
    run`` (issue 24, bench/startup.py).
    """

    __slots__ = ()
    TERM: ClassVar[OnLost]  # SIGTERM to the group, SIGKILL after --grace
    KILL: ClassVar[OnLost]  # SIGKILL to the group at once
    IGNORE: ClassVar[OnLost]  # only report; exit 6 once COMMAND is done

    def __new__(cls, value: str) -> OnLost:
        try:
            return cls._members[value]
        except (KeyError, TypeError):
            raise ValueError(f"{value!r} is not a valid {cls.__name__}") from None

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def name(self) -> str:
        return self.value.upper()

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value!r}>"

    def __reduce__(self) -> tuple[type[OnLost], tuple[str]]:
        return type(self), (self.value,)  # a copy, or a pickle, is the member itself


OnLost._members = {value: str.__new__(OnLost, value) for value in ("term", "kill", "ignore")}
OnLost.TERM, OnLost.KILL, OnLost.IGNORE = OnLost._members.values()


class RunOptions(Frozen):
    """What ``lockd run`` was asked to do. Durations are whole milliseconds.

    A frozen record that reads as a dataclass (``dataclasses.fields()`` with
    the defaults, ``==``, ``repr``; ``_replace`` for a changed copy) without
    importing dataclasses at start-up (lockd_client/_record.py).
    """

    __slots__ = (
        "command",
        "conflict_exit_code",
        "grace_ms",
        "holder_pid",
        "key",
        "kill_descendants",
        "limit",
        "on_lost",
        "owner",
        "quiet",
        "shared",
        "socket_path",
        "ttl_ms",
        "wait_ms",
    )
    __match_args__ = (
        "key",
        "command",
        "ttl_ms",
        "wait_ms",
        "owner",
        "shared",
        "limit",
        "on_lost",
        "grace_ms",
        "conflict_exit_code",
        "socket_path",
        "quiet",
        "kill_descendants",
        "holder_pid",
    )
    _fields = __match_args__

    key: str
    command: tuple[str, ...]
    ttl_ms: int
    wait_ms: int | None  # None: a single tryAcquire
    owner: str | None
    shared: bool  # a shared (reader) hold, like flock -s
    limit: int  # > 1: one of ``limit`` slots of a semaphore, like consul lock -n
    on_lost: OnLost
    grace_ms: int
    conflict_exit_code: int
    socket_path: str | None
    quiet: bool  # no stderr line when the key is busy / the wait timed out
    #: when COMMAND exits, end what it left running (SIGTERM, SIGKILL after
    #: --grace) instead of keeping the key until the last of them exits (flock's way)
    kill_descendants: bool
    #: the process that will use the hold (COMMAND's pid-to-be), named in the
    #: acquire so that status shows it (docs/contract.md §12.2); None: this process
    holder_pid: int | None

    def __init__(
        self,
        key: str,
        command: tuple[str, ...],
        ttl_ms: int = 60_000,
        wait_ms: int | None = None,
        owner: str | None = None,
        shared: bool = False,
        limit: int = 1,
        on_lost: OnLost = OnLost.TERM,
        grace_ms: int = 10_000,
        conflict_exit_code: int = EXIT_BUSY,
        socket_path: str | None = None,
        quiet: bool = False,
        kill_descendants: bool = False,
        holder_pid: int | None = None,
    ) -> None:
        for name, value in (
            ("key", key),
            ("command", command),
            ("ttl_ms", ttl_ms),
            ("wait_ms", wait_ms),
            ("owner", owner),
            ("shared", shared),
            ("limit", limit),
            ("on_lost", on_lost),
            ("grace_ms", grace_ms),
            ("conflict_exit_code", conflict_exit_code),
            ("socket_path", socket_path),
            ("quiet", quiet),
            ("kill_descendants", kill_descendants),
            ("holder_pid", holder_pid),
        ):
            object.__setattr__(self, name, value)


def _init_defaults(cls: type) -> dict[str, object]:
    """The defaults of ``cls.__init__``, by name: one list of them, not two to keep alike."""
    init = vars(cls)["__init__"]
    names = init.__code__.co_varnames[1 : init.__code__.co_argcount]
    values = init.__defaults__ or ()
    return dict(zip(names[len(names) - len(values) :], values, strict=True))


RunOptions._defaults = _init_defaults(RunOptions)


class Reporter:
    """``lockd run``'s own voice: one line per event on stderr.

    stdout belongs to COMMAND, so nothing is ever written there. With
    ``json_lines`` a failure is ONE line ``{"error": {"code", "status",
    "message", "details"}}`` (docs/contract.md §9, :func:`lockd.exitcodes.error_document`),
    and a notice that is not the run's failure (a release that could not be
    sent, a loss ignored while COMMAND runs on) a ``{"warning": {"code",
    "message", "details"}}`` line. run's own names for failures without a wire
    code are mapped to the documented ones: ``INTERRUPTED`` is ``CANCELLED``,
    ``BUG`` is ``INTERNAL``, a COMMAND that cannot be run is ``USAGE``
    (``details.reason``).
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        *,
        json_lines: bool = False,
        prog: str = "lockd run",
    ) -> None:
        self._stream = stream
        self.json_lines = json_lines
        self.prog = prog

    def __call__(self, code: str, message: str, **details: Any) -> None:
        """Report a failure: ``code`` is a stable name such as ``KEY_BUSY`` or ``LEASE_LOST``."""
        if code in _RUN_REASONS:
            code, details = _RUN_REASONS[code], {**details, "reason": code.lower()}
        self._write(error_document(code, message, details) if self.json_lines else None, message)

    def warning(self, code: str, message: str, **details: Any) -> None:
        """Report something that is not (yet) the run's failure."""
        line = None
        if self.json_lines:
            import json  # here: only --json writes it (start-up, issue 24)

            body = {"warning": {"code": code, "message": message, "details": details}}
            line = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        self._write(line, message)

    def _write(self, json_line: str | None, message: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        line = json_line if json_line is not None else f"{self.prog}: {message}"
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed stderr must not hide the exit
            pass


#: run's own failure names -> the documented --json code (the name goes to details.reason).
_RUN_REASONS = {
    "INTERRUPTED": "CANCELLED",
    "BUG": "INTERNAL",
    "COMMAND_NOT_FOUND": USAGE,
    "COMMAND_NOT_EXECUTABLE": USAGE,
}
