"""Durations on the command line (``500ms``, ``60s``, ``1m30s``, ``forever``), without click.

The one place they are parsed and checked: the click type
(:class:`lockd.cli.common.Duration`) and the fast path (:mod:`lockd.cli.fast`)
both call :func:`check_duration`, so a value means the same, and is refused
for the same reason, whichever path reads it.
"""

from __future__ import annotations

from lockd.contract import WAIT_FOREVER

# re and decimal are imported by the general parser only: the usual forms
# (``60s``, ``500ms``, ``5m``, a bare count of ms) are read with int(), so
# ``lockd run --wait 5s`` does not pay for them at start (issue 24).
TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    import re

#: ``--wait forever``: a blocking acquire without limit (docs/contract.md §12). The wire
#: needs ``timeoutMs``: the client sends the largest and parks again.
FOREVER = "forever"

_NUMBER = r"\d+(?:\.\d*)?|\.\d+"
#: each unit's milliseconds, from the largest down: a compound duration
#: names them in this order.
_UNIT_MS = {"h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}
_UNIT_ORDER = tuple(_UNIT_MS)
_compiled: tuple[re.Pattern[str], re.Pattern[str]] | None = None


def _patterns() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(one part of a compound duration, ``ms`` before ``m``; a bare number), compiled once."""
    global _compiled
    if _compiled is None:
        import re

        _compiled = (re.compile(rf"(?P<num>{_NUMBER})(?P<unit>ms|h|m|s)"), re.compile(_NUMBER))
    return _compiled


def _whole(raw: str) -> int | None:
    """``60s``, ``500ms``, ``5m``, ``2h``, ``250``: ASCII digits and at most one unit, in ms.

    None for anything else (fractions, compound or malformed durations),
    which the general parser reads or refuses: the same value either way
    (a hypothesis test holds the two equal) up to Decimal's 28 digits, far
    past any duration ``check_duration`` accepts.
    """
    unit = "ms" if raw.endswith("ms") else raw[-1:]
    if unit not in _UNIT_MS:
        unit = ""
    digits = raw[: len(raw) - len(unit)]
    if digits and digits.isascii() and digits.isdigit():
        return int(digits) * (_UNIT_MS[unit] if unit else 1)
    return None


DURATION_FORMS = "500ms, 60s, 1.5s, 5m, 1m30s, 1h5m; a bare number is milliseconds"


def parse_duration_ms(text: str) -> int:
    """``"1.5s"`` -> 1500, ``"1m30s"`` -> 90000. Whole ms, rounded up; ValueError says why.

    A compound duration names its units from the largest down, each at most
    once (``1h5m``, ``1m30s``, ``2s250ms``), as Go's and systemd's do; a bare
    number is milliseconds (docs/contract.md §9). Decimal arithmetic keeps what was
    written: ``1.1s`` is 1100 ms, not 1101.
    """
    raw = text.strip()
    whole = _whole(raw)
    if whole is not None:
        return whole
    return _parse_general(text, raw)


def _parse_general(text: str, raw: str) -> int:
    """:func:`parse_duration_ms` for every form: regular expressions and Decimal."""
    from decimal import ROUND_CEILING, Decimal

    part_re, bare_re = _patterns()
    bad = ValueError(f"{text!r} is not a duration (use {DURATION_FORMS})")
    if bare_re.fullmatch(raw):
        value = Decimal(raw)
    else:
        value, pos, last = Decimal(0), 0, -1
        for m in part_re.finditer(raw):
            rank = _UNIT_ORDER.index(m.group("unit"))
            if m.start() != pos or rank <= last:
                raise bad
            value += Decimal(m.group("num")) * _UNIT_MS[m.group("unit")]
            pos, last = m.end(), rank
        if pos == 0 or pos != len(raw):
            raise bad
    return int(value.to_integral_value(rounding=ROUND_CEILING))


class DurationError(ValueError):
    """Why a duration is refused (the text click shows after ``Invalid value for '--ttl':``)."""


def check_duration(value: str | int, *, min_ms: int, max_ms: int, forever: bool = False) -> int:
    """``value`` (text, or whole ms as an option default) as whole ms within the bounds.

    With ``forever``, the word ``forever`` (any case) is :data:`WAIT_FOREVER`.
    Raises :class:`DurationError` saying why.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        ms = value
        if ms == WAIT_FOREVER and forever:
            return ms
    elif forever and str(value).strip().lower() == FOREVER:
        return WAIT_FOREVER
    else:
        try:
            ms = parse_duration_ms(str(value))
        except ValueError as exc:
            raise DurationError(str(exc)) from None
    if ms < min_ms:
        raise DurationError(f"{value!r} is too short: at least {_exact(min_ms)}")
    if ms > max_ms:
        raise DurationError(f"{value!r} is too long: at most {_exact(max_ms)}")
    return ms


def seconds_hint(name: str, value: object, ms: int) -> str | None:
    """The warning for a bare number under a second (``--wait 5`` is 5 ms), else None.

    flock's -w and timeout(1) count seconds: say what we read it as.
    """
    if not (isinstance(value, str) and 0 < ms < 1000):
        return None
    if _patterns()[1].fullmatch(value.strip()):
        text = value.strip()
        return f"{name} {text} is {text} ms; write {text}s for seconds"
    return None


def _exact(ms: int) -> str:
    """A limit written as a duration that parses back to exactly ``ms``."""
    if ms and ms % 3_600_000 == 0:
        return f"{ms // 3_600_000}h"
    if ms and ms % 1000 == 0:
        return f"{ms // 1000}s"
    return f"{ms}ms"
