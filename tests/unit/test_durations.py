"""The duration parser's int-only route for the usual forms agrees with the general one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockd.cli.durations import _parse_general, parse_duration_ms, seconds_hint
from tests.depth import examples


def _general(text: str) -> int | str:
    try:
        return _parse_general(text, text.strip())
    except ValueError as exc:
        return str(exc)


def _either(text: str) -> int | str:
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        return str(exc)


@settings(max_examples=examples(500), deadline=None)
@given(st.text(alphabet="0123456789.mshx ٣", max_size=8) | st.text(max_size=6))
def test_every_text_reads_the_same_either_way(text: str) -> None:
    assert _either(text) == _general(text)


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("60s", 60_000),
        ("500ms", 500),
        ("5m", 300_000),
        ("2h", 7_200_000),
        ("250", 250),
        ("007s", 7000),
        ("1m30s", 90_000),
        ("1.5s", 1500),
        (" 3s ", 3000),
    ],
)
def test_usual_forms(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "s", "ms", "5 s", "-5s", "5sm", "1s1m", "٣s٣"])
def test_refused_forms(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration_ms(text)


def test_the_bare_number_hint_still_reads_bare_numbers_only() -> None:
    assert seconds_hint("--wait", "5", 5) == "--wait 5 is 5 ms; write 5s for seconds"
    assert seconds_hint("--wait", "5ms", 5) is None
    assert seconds_hint("--wait", "5", 5000) is None
