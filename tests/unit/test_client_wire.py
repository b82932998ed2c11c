"""The client's hot-path short cuts agree with the general code they stand in for.

Each short cut (request lines joined from quoted pieces, a one-line reply
decoded without splitting, results checked in one expression, remembered key
checks) must give exactly what the general path gives, errors included.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lockd_client import Handle, ReleaseResult, _wire
from lockd_client._errors import LockdError
from lockd_client._requests import grant_args

# Field values a request may carry: the fast path takes str, int and bool;
# anything else (None, floats, lists) must fall back to the general encoder.
_values = st.one_of(
    st.text(),
    st.integers(),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=3),
)
_names = st.one_of(st.sampled_from(["key", "ttlMs", "handle", "owner", "id", "op"]), st.text())


def _no_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@given(
    rid=st.integers(min_value=0, max_value=2**63),
    op=st.text().filter(_no_surrogates),
    args=st.dictionaries(_names, _values, max_size=6).filter(
        lambda d: (
            all(_no_surrogates(k) for k in d)
            and all(_no_surrogates(v) for v in d.values() if isinstance(v, str))
        )
    ),
)
def test_request_lines_are_byte_identical_to_the_general_encoder(
    rid: int, op: str, args: dict[str, Any]
) -> None:
    message = {"id": rid, "op": op, **args}
    line = _wire.encode_request(rid, op, args)
    assert line == _wire.encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == message


@given(st.text(), st.text())
def test_any_key_and_owner_string_round_trips(key: str, owner: str) -> None:
    """Escaping of every character (quotes, backslashes, controls, U+2028, astral)."""
    args = {"key": key, "ttlMs": 30000, "owner": owner}
    if not (_no_surrogates(key) and _no_surrogates(owner)):
        with pytest.raises(UnicodeEncodeError):  # as the general encoder does
            _wire.encode_request(7, "tryAcquire", args)
        return
    line = _wire.encode_request(7, "tryAcquire", args)
    expected = json.dumps(
        {"id": 7, "op": "tryAcquire", **args}, ensure_ascii=False, separators=(",", ":")
    )
    assert line == expected.encode() + b"\n"
    assert json.loads(line)["key"] == key and json.loads(line)["owner"] == owner


def test_request_lines_refuse_what_the_general_encoder_refuses() -> None:
    with pytest.raises(ValueError):
        _wire.encode_request(1, "x", {"bad": float("nan")})
    with pytest.raises(TypeError):
        _wire.encode_request(1, "x", {"bad": object()})


class _IntLike(int):
    def __repr__(self) -> str:
        return "not-json"


def test_int_subclasses_and_odd_names_take_the_general_encoder() -> None:
    args: dict[Any, Any] = {"n": _IntLike(5), 3: "three"}
    assert _wire.encode_request(1, "x", args) == _wire.encode({"id": 1, "op": "x", **args})
    assert json.loads(_wire.encode_request(1, "x", args)) == {
        "id": 1,
        "op": "x",
        "n": 5,
        "3": "three",
    }


# -- replies -------------------------------------------------------------------------


def _reference_feed(chunks: list[bytes]) -> list[Any]:
    """What a stream of chunks means: one JSON object per non-blank line."""
    lines = b"".join(chunks).split(b"\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


_reply_objects = st.dictionaries(
    st.text(max_size=5), st.one_of(st.text(max_size=8), st.integers(), st.booleans(), st.none())
)


@given(
    replies=st.lists(_reply_objects, max_size=5),
    blanks=st.lists(st.sampled_from([b"", b" ", b"\t"]), max_size=2),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=4),
)
def test_replies_decode_alike_whole_or_in_pieces(
    replies: list[dict[str, Any]], blanks: list[bytes], cuts: list[int]
) -> None:
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in replies] + blanks
    stream = b"".join(line + b"\n" for line in lines)
    points = sorted({min(c, len(stream)) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    feeder = _wire.ReplyLines()
    got: list[Any] = []
    for chunk in chunks:
        if chunk:
            got.extend(feeder.feed(chunk))
    assert got == _reference_feed(chunks)


@pytest.mark.parametrize("line", [b"[1]\n", b"garbage\n", b'{"id":1}x\n', b"\xff\n", b'"s"\n'])
def test_a_single_bad_line_is_refused_as_before(line: bytes) -> None:
    with pytest.raises(_wire.BadLine):
        _wire.ReplyLines().feed(line)


@given(
    value=_reply_objects,
    before=st.sampled_from(["", " ", "\t"]),
    after=st.sampled_from(["", " ", "\r", "\t "]),
)
def test_a_single_padded_reply_decodes_as_the_general_path_does(
    value: dict[str, Any], before: str, after: str
) -> None:
    # The one-line short cut takes compact lines only; padding goes the general way.
    line = (before + json.dumps(value, ensure_ascii=False) + after + "\n").encode()
    assert _wire.ReplyLines().feed(line) == _reference_feed([line]) == [value]


def test_a_single_blank_line_is_skipped() -> None:
    assert _wire.ReplyLines().feed(b"  \n") == []
    assert _wire.ReplyLines().feed(b"\n") == []


# The client decodes and encodes with json's C pieces, without importing json
# (issue 24): what they give must be what json.loads / json.JSONEncoder give.
_json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.text(),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _loaded(text: str) -> object:
    try:
        return ("ok", json.loads(text))
    except ValueError as exc:
        return ("error", type(exc))


@given(
    value=_json_values,
    separators=st.sampled_from([(",", ":"), (", ", ": ")]),
    padding=st.sampled_from(["", " ", "\t", " \n"]),
    ascii_only=st.booleans(),
)
def test_decode_is_json_loads(
    value: object, separators: tuple[str, str], padding: str, ascii_only: bool
) -> None:
    text = padding + json.dumps(value, separators=separators, ensure_ascii=ascii_only) + padding
    assert repr(_loaded(text)) == repr(("ok", _wire.decode(text)))


@given(st.text(max_size=30))
def test_decode_refuses_what_json_loads_refuses(text: str) -> None:
    expected = _loaded(text)
    try:
        got: object = ("ok", _wire.decode(text))
    except ValueError as exc:
        got = ("error", type(exc))
    assert repr(got) == repr(expected)


def test_the_encoder_sample_is_what_json_writes() -> None:
    sample = {"id": 1, "op": "x", "key": 'é\n"', "b": True, "n": None}
    slow = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    assert slow.encode(sample) == _wire._SAMPLE_TEXT
    assert _wire.encode(sample) == (slow.encode(sample) + "\n").encode()


@given(st.text())
def test_control_characters_are_found_as_the_regex_finds_them(text: str) -> None:
    assert _wire._has_control(text) == (re.search(r"[\x00-\x1f\x7f-\x9f]", text) is not None)


# -- results -------------------------------------------------------------------------


class _Dict(dict[str, Any]):
    """A dict that is not exactly a dict: it always takes the field-by-field checks."""


_field_values = st.one_of(
    st.text(max_size=4), st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False)
)


def _outcome(build: Any, result: dict[str, Any]) -> Any:
    try:
        made = build(result)
    except LockdError as exc:
        return ("error", exc.code, str(exc))
    return ("made", {f.name: getattr(made, f.name) for f in dataclasses.fields(made)})


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "key": _field_values,
            "handle": _field_values,
            "fence": _field_values,
            "owner": _field_values,
            "ttlMs": _field_values,
            "leaseExpiresAt": st.sampled_from(
                [
                    None,
                    5,
                    "2026-11-30T03:31:00.123Z",
                    "2026-11-30T03:31:00Z",
                    "2026-11-30T03:31:00.123z",
                    "2026-11-30T03:31:00.123+01:00",
                    "2026-11-30T03:31:00.123",
                    "2026-11-30T03:31:00+01:00Z",
                    "garbageZ",
                    "Z",
                    "",
                ]
            ),
        },
    )
)
def test_grant_results_decode_alike_on_both_paths(result: dict[str, Any]) -> None:
    assert _outcome(Handle.from_result, result) == _outcome(Handle.from_result, _Dict(result))


@given(st.fixed_dictionaries({}, optional={"released": _field_values, "reason": _field_values}))
def test_release_results_decode_alike_on_both_paths(result: dict[str, Any]) -> None:
    assert _outcome(ReleaseResult.from_result, result) == _outcome(
        ReleaseResult.from_result, _Dict(result)
    )


def test_a_fast_built_handle_is_what_init_builds() -> None:
    raw = {"key": "k", "handle": "h", "fence": 3, "owner": None, "ttlMs": 1000}
    raw["leaseExpiresAt"] = "2026-11-30T03:31:00.123Z"
    made = Handle.from_result(raw)
    built = Handle("k", "h", 3, None, 1000, made.lease_expires_at, raw)
    assert type(made) is Handle
    assert made._values() == built._values()
    assert made.raw is raw and made.lost is False
    assert repr(made) == repr(built)
    made.lost = True  # still a mutable record
    assert made.lost is True


class _MyHandle(Handle):
    __slots__ = ("extra",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra = "set by __init__"


class _MyRelease(ReleaseResult):
    __slots__ = ("extra",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "extra", "set by __init__")


def test_subclasses_built_from_results_run_their_own_init() -> None:
    grant = {"key": "k", "handle": "h", "fence": 3, "owner": None, "ttlMs": 1000}
    handle = _MyHandle.from_result(grant)
    assert type(handle) is _MyHandle and handle.extra == "set by __init__"
    release = _MyRelease.from_result({"released": True})
    assert type(release) is _MyRelease and release.extra == "set by __init__"


def test_a_fast_built_release_result_is_still_frozen_and_comparable() -> None:
    raw = {"released": True}
    made = ReleaseResult.from_result(raw)
    assert made == ReleaseResult(released=True, reason=None, raw=raw)
    assert repr(made) == "ReleaseResult(released=True, reason=None)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.released = False  # type: ignore[misc]


def test_lease_expiry_reads_upper_and_lower_case_z() -> None:
    upper = Handle.from_result(
        {
            "key": "k",
            "handle": "h",
            "fence": 1,
            "ttlMs": 1,
            "leaseExpiresAt": "2026-01-02T03:04:05.006Z",
        }
    )
    lower = Handle.from_result(
        {
            "key": "k",
            "handle": "h",
            "fence": 1,
            "ttlMs": 1,
            "leaseExpiresAt": "2026-01-02T03:04:05.006z",
        }
    )
    assert upper.lease_expires_at == lower.lease_expires_at
    assert upper.lease_expires_at is not None and upper.lease_expires_at.utcoffset() is not None


# -- argument checks ------------------------------------------------------------------


@given(st.text(max_size=20))
def test_a_remembered_key_check_gives_the_first_answer(key: str) -> None:
    def outcome() -> object:
        try:
            return _wire.check_key(key)
        except (TypeError, ValueError) as exc:
            return type(exc)

    first = outcome()
    assert outcome() == first
    if first is key:
        assert key in _wire._checked_keys


def test_refused_keys_and_str_subclasses_are_not_remembered() -> None:
    class Key(str):
        pass

    for bad in ("", "a\nb", "x" * 1025):
        with pytest.raises(ValueError):
            _wire.check_key(bad)
        assert bad not in _wire._checked_keys
    sub = Key("subclass-key")
    assert _wire.check_key(sub) is sub
    assert "subclass-key" not in _wire._checked_keys


def test_remembered_keys_stay_bounded() -> None:
    for n in range(3 * _wire._CHECKED_KEYS_MAX):
        _wire.check_key(f"bounded:{n}")
    assert len(_wire._checked_keys) <= _wire._CHECKED_KEYS_MAX


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"release_on_close": 0}, TypeError),
        ({"release_on_close": None}, TypeError),
        ({"shared": 0}, TypeError),
        ({"limit": True}, TypeError),
        ({"limit": 1.0}, TypeError),
        ({"limit": 0}, ValueError),
        ({"shared": True, "limit": 2}, ValueError),
        ({"owner": ""}, ValueError),
    ],
)
def test_grant_arguments_off_the_defaults_are_still_checked(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    plain = {"owner": None, "release_on_close": False, "shared": False, "limit": 1}
    with pytest.raises(error):
        grant_args("k", 1, **{**plain, **kwargs})


def test_grant_arguments_on_and_off_the_defaults() -> None:
    assert grant_args("k", 30.0, None, False) == {"key": "k", "ttlMs": 30000}
    assert grant_args("k", 1, "o", True, True) == {
        "key": "k",
        "ttlMs": 1000,
        "owner": "o",
        "releaseOnClose": True,
        "mode": "shared",
    }
    assert grant_args("k", 1, None, False, False, 3) == {"key": "k", "ttlMs": 1000, "limit": 3}


# -- request ids ---------------------------------------------------------------------


@pytest.mark.parametrize("free_threaded", [False, True])
def test_request_ids_stay_unique_across_threads(
    free_threaded: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import threading

    from lockd_client import LockClient, _client

    monkeypatch.setattr(_client, "_FREE_THREADED", free_threaded)
    client = LockClient(str(tmp_path / "none.sock"))
    next_id = client._id_source()
    # Under the GIL the count's own __next__, without the lock; else the locked method.
    assert (getattr(next_id, "__self__", None) is client) == free_threaded
    taken: list[list[int]] = [[] for _ in range(8)]

    def take(out: list[int]) -> None:
        for _ in range(2000):
            out.append(next_id())

    threads = [threading.Thread(target=take, args=(out,)) for out in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ids = [rid for out in taken for rid in out]
    assert sorted(ids) == list(range(1, len(ids) + 1))
    client.close()
