"""Argument checks and conversions done before a request is sent (docs/contract.md §1, §3),
and the JSON coding of request and reply lines.

These run once per request on the client's hot path, so the common cases take
short cuts (whole seconds, a pre-built encoder, one shared decoder) that give
the same results as the general code.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = [
    "MAX_MS",
    "BadLine",
    "ReplyLines",
    "ceil",
    "check_bool",
    "check_key",
    "check_optional_str",
    "check_owner",
    "check_reason",
    "check_text",
    "decode",
    "encode",
    "encode_request",
    "pack_native",
    "seconds_to_ms",
    "unpack_native",
]

_INF = float("inf")


def ceil(value: float) -> int:
    """``math.ceil`` for finite values: the math module is a C library of its own to
    load, a start-up cost of every command for this one function (issue 24).
    Infinity raises ``ValueError`` here (``math.ceil``: ``OverflowError``); every
    caller passes a finite time."""
    return -int(-value // 1)


#: A C ``long``'s size in bytes: a pointer's on Linux (LP64 and ILP32 alike).
C_LONG = (sys.maxsize.bit_length() + 1) // 8
#: A C ``int``'s size in bytes (4 on every Linux ABI).
C_INT = 4


def pack_native(values: tuple[int, ...] | list[int], size: int) -> bytes:
    """``struct.pack("@" + code * len(values), *values)`` for signed C integers of
    ``size`` bytes (``C_INT``, ``C_LONG``): native order, no padding between equal
    sizes. The struct module is a C library of its own to load, a start-up cost
    of every command for two socket options (issue 24)."""
    order = sys.byteorder
    return b"".join(value.to_bytes(size, order, signed=True) for value in values)


def unpack_native(raw: bytes, size: int) -> tuple[int, ...]:
    """``struct.unpack`` of ``len(raw) // size`` signed C integers of ``size`` bytes."""
    if len(raw) % size:
        raise ValueError(f"{len(raw)} bytes are not a whole number of {size}-byte integers")
    order = sys.byteorder
    return tuple(
        int.from_bytes(raw[i : i + size], order, signed=True) for i in range(0, len(raw), size)
    )


MAX_MS = 86_400_000  # 24 h, the daemon's limit for ttlMs and timeoutMs
MAX_KEY_BYTES = 1024
MAX_OWNER_CHARS = 256
MAX_REASON_CHARS = 1024


#: C0 and C1 control characters (what a ``[\x00-\x1f\x7f-\x9f]`` regex matches),
#: for ``str.translate``: a key is checked on every request, and ``re`` is
#: not imported at start-up (issue 24).
_CONTROL = dict.fromkeys([*range(0x20), *range(0x7F, 0xA0)])


#: ``json.decoder``'s constants (``parse_constant`` of ``json.loads``).
_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


class _ScanContext:
    """What ``json.JSONDecoder()`` hands its C scanner: ``json.loads``' defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


def _c_scanner() -> Callable[[str, int], tuple[Any, int]] | None:
    """The scanner ``json.JSONDecoder`` builds (``_json.make_scanner``), made without
    importing ``json``: its decoder module compiles regular expressions at import,
    which with ``re`` itself cost a ``lockd`` command more than its request
    (issue 24). None when the interpreter has no ``_json``."""
    try:
        from _json import make_scanner
    except ImportError:
        return None
    scanner: Callable[[str, int], tuple[Any, int]] = make_scanner(_ScanContext())  # type: ignore[arg-type]
    return scanner


#: The scanner behind ``raw_decode``, called without its wrapper.
_scan_once = _c_scanner()


def decode(text: str) -> Any:
    """Parse one reply line (a str) as ``json.loads`` would, with less work per call.

    ``json.loads`` re-detects the encoding and goes through the default
    decoder, which matches a whitespace regex on both sides of the value. The
    daemon writes compact lines, so the scanner is run on the whole line
    first; anything else (whitespace around the value, errors: the scanner
    raises StopIteration or ValueError) takes the full decoder, which also
    raises the usual ValueError for garbage.
    """
    if _scan_once is not None:
        try:
            obj, end = _scan_once(text, 0)
        except (StopIteration, ValueError):
            pass
        else:
            if end == len(text):
                return obj
    import json  # here: whitespace, garbage, or no C scanner (the full decoder and its errors)

    return json.loads(text)


class BadLine(ValueError):
    """The daemon sent a line that is not a JSON object (``line``: its first bytes)."""

    def __init__(self, line: bytes) -> None:
        super().__init__(f"the daemon sent a line that is not a JSON object: {line[:200]!r}")
        self.line = line


class ReplyLines:
    """Bytes from the daemon in, reply objects out (one per complete line).

    Keeps an incomplete last line until the rest arrives; blank lines are
    skipped; a line that is not a JSON object raises :class:`BadLine` (the
    stream cannot be trusted after it). Shared by every client.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The replies completed by ``data``."""
        buf = self._buf
        if not buf and data.find(b"\n") == len(data) - 1 and _scan_once is not None:
            # One whole reply, the usual case (its first newline is its last
            # byte; ``find`` stops there, ``count`` would not): no split, no
            # list of lines, the scanner run on the line as :func:`decode`
            # does, newline included. Anything else (a line that is not a
            # compact object, bad UTF-8) is left to the general path below,
            # which skips it if blank and raises otherwise.
            try:
                text = data.decode("utf-8")
                reply, end = _scan_once(text, 0)
            except (StopIteration, ValueError):  # UnicodeDecodeError is a ValueError
                pass
            else:
                if end == len(text) - 1 and type(reply) is dict:
                    return [reply]
        if buf:
            buf += data
            if b"\n" not in data:
                return []
            data = bytes(buf)
            buf.clear()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when data ends with a newline (the usual case)
        if tail:
            buf += tail
        replies = []
        for line in lines:
            try:
                reply = decode(line.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError is one too
                if not line.strip():
                    continue
                reply = None
            if not isinstance(reply, dict):
                raise BadLine(line)
            replies.append(reply)
        return replies


def _refuse(obj: object) -> object:
    raise TypeError(f"cannot encode {type(obj).__name__} in a request")


def _build_encoder() -> Callable[[dict[str, Any]], str]:
    """``dict -> compact JSON text``, built once.

    ``json.dumps`` with options makes a new JSONEncoder, and ``encode`` a new
    C encoder, on every call (about half the cost of a small request). The C
    encoder is made once here when the interpreter has it and it agrees with
    the pure-Python one on a sample; otherwise a pre-built JSONEncoder is used.
    """
    try:
        from _json import encode_basestring, make_encoder
    except ImportError:
        return _slow_encoder()
    try:
        fast = make_encoder(None, _refuse, encode_basestring, None, ":", ",", False, False, False)
        join = "".join

        def encode_fast(message: dict[str, Any]) -> str:
            return join(fast(message, 0))

        sample = {"id": 1, "op": "x", "key": 'é\n"', "b": True, "n": None}
        if encode_fast(sample) != _SAMPLE_TEXT:
            return _slow_encoder()
    except Exception:  # an interpreter whose private encoder differs: use the public one
        return _slow_encoder()
    return encode_fast


#: What ``json.JSONEncoder`` (the options of :func:`_slow_encoder`) makes of the sample
#: above; checked against it in tests/unit/test_client_wire.py.
_SAMPLE_TEXT = '{"id":1,"op":"x","key":"é\\n\\"","b":true,"n":null}'


def _slow_encoder() -> Callable[[dict[str, Any]], str]:
    import json

    return json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


_encode_text = _build_encoder()


def encode(message: dict[str, Any]) -> bytes:
    """One request as a JSON line (UTF-8, ``\\n``-terminated, no NaN)."""
    return (_encode_text(message) + "\n").encode("utf-8")


def _quote_text() -> Callable[[str], str]:
    try:
        from _json import encode_basestring
    except ImportError:
        from json.encoder import encode_basestring
    return encode_basestring


_quote = _quote_text()  # what the encoders above use for every str
_int_text = int.__repr__  # what they use for every int (subclasses included)
#: ``,"name":`` for each field name met so far (a handful: the protocol's own).
_field_heads: dict[str, str] = {}
#: ``,"op":"name"`` for each op met so far (the protocol's own: quoted once, not per request).
_op_parts: dict[str, str] = {}


def encode_request(rid: int, op: str, args: dict[str, Any]) -> bytes:
    """``encode({"id": rid, "op": op, **args})``, byte for byte, with less work.

    Requests are flat objects of strings, ints and bools, so the line is
    joined from pieces (each string quoted by the very function the JSON
    encoder uses) instead of going through the general encoder, which costs
    several times as much for a small object. Anything else (another value
    type, a field named ``id`` or ``op``) takes :func:`encode`.
    """
    line = _joined_request(rid, op, args)
    return line if line is not None else encode({"id": rid, "op": op, **args})


def _joined_request(rid: int, op: str, args: dict[str, Any]) -> bytes | None:
    """The request line joined from pieces, or None when it needs the general encoder."""
    if type(rid) is not int or type(op) is not str or "id" in args or "op" in args:
        return None
    op_part = _op_parts.get(op)
    if op_part is None:
        op_part = _op_parts[op] = f',"op":{_quote(op)}'
    parts = ['{"id":', _int_text(rid), op_part]
    for name, value in args.items():
        kind = type(value)
        if kind is str:
            text = _quote(value)
        elif kind is int:
            text = _int_text(value)
        elif kind is bool:
            text = "true" if value else "false"
        else:
            return None
        head = _field_heads.get(name)
        if head is None:
            if type(name) is not str:
                return None
            head = _field_heads[name] = f",{_quote(name)}:"
        parts.append(head)
        parts.append(text)
    parts.append("}\n")
    return "".join(parts).encode("utf-8")


def seconds_to_ms(value: object, name: str, *, allow_zero: bool) -> int:
    """Seconds (int or float) to whole milliseconds, rounding up (0.0001 s is 1 ms).

    Raises TypeError for non-numbers and ValueError for negatives, NaN,
    infinities, zero (unless ``allow_zero``) and more than 24 hours.
    """
    if type(value) is int and 0 < value <= MAX_MS // 1000:
        return value * 1000  # whole seconds: the common case, exact without Decimal
    if type(value) is float and 0 < value <= MAX_MS / 1000:
        # A whole number of ms (30.0, 0.25, 1.5 s), the other common case:
        # when m / 1000 rounds to this very float, m / 1000 is the only
        # decimal of at most 3 places that does, so it is the float's
        # shortest repr, and the Decimal rule below would give m as well.
        ms = round(value * 1000)
        if ms / 1000 == value:
            return ms
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if isinstance(value, float) and not _INF > value > -_INF:  # inf, -inf or nan
        raise ValueError(f"{name} must be finite, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    # Decimal(str(x)) keeps the literal the caller wrote: 0.007 s is 7 ms, not 8.
    from decimal import ROUND_CEILING, Decimal  # here: the rare case, not at start-up

    ms = int((Decimal(str(value)) * 1000).to_integral_value(rounding=ROUND_CEILING))
    if ms > MAX_MS:
        raise ValueError(f"{name} must be at most 86400 seconds (24 h), got {value!r}")
    return ms


def _has_control(text: str) -> bool:
    return len(text.translate(_CONTROL)) != len(text)


#: Keys that passed :func:`check_key` lately: a program uses a few keys over and
#: over, and the dict lookup costs a fraction of the checks. Bounded; emptied when full.
_checked_keys: dict[str, None] = {}
_CHECKED_KEYS_MAX = 256


def check_key(key: object, name: str = "key") -> str:
    """A key: str of 1-1024 UTF-8 bytes without control characters."""
    if type(key) is str and key in _checked_keys:
        return key
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str, got {type(key).__name__}")
    size = len(key.encode("utf-8"))  # UnicodeEncodeError is a ValueError
    if not 1 <= size <= MAX_KEY_BYTES:
        raise ValueError(f"{name} must be 1-{MAX_KEY_BYTES} bytes of UTF-8, got {size}")
    if _has_control(key):
        raise ValueError(f"{name} must not contain control characters")
    if type(key) is str:  # not a subclass: its __hash__/__eq__ could lie
        if len(_checked_keys) >= _CHECKED_KEYS_MAX:
            _checked_keys.clear()
        _checked_keys[key] = None
    return key


def check_text(value: object, name: str, max_chars: int, *, allow_control: bool = False) -> str:
    """A str of 1..max_chars characters (without control characters unless allowed)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= max_chars:
        raise ValueError(f"{name} must be 1-{max_chars} characters, got {len(value)}")
    if not allow_control and _has_control(value):
        raise ValueError(f"{name} must not contain control characters")
    value.encode("utf-8")
    return value


def check_owner(owner: object) -> str | None:
    """An optional owner: None, or 1-256 characters without control characters."""
    return None if owner is None else check_text(owner, "owner", MAX_OWNER_CHARS)


def check_optional_str(value: object, name: str) -> str | None:
    """None or a str (no further checks)."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    return value


def check_bool(value: object, name: str) -> bool:
    """A real bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_reason(reason: object) -> str:
    """A break reason: 1-1024 characters."""
    return check_text(reason, "reason", MAX_REASON_CHARS, allow_control=True)
