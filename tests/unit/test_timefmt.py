"""Wire times (lockd.timefmt): RFC 3339, UTC, whole milliseconds."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from lockd.timefmt import format_duration_ms, format_epoch_ms, wall_ms


def test_format_epoch_ms() -> None:
    assert format_epoch_ms(0) == "1970-01-01T00:00:00.000Z"
    assert format_epoch_ms(1_796_009_460_123) == "2026-11-30T03:31:00.123Z"
    assert format_epoch_ms(1_796_009_460_005) == "2026-11-30T03:31:00.005Z"


@given(st.integers(min_value=0, max_value=253_402_300_799_999))  # up to 9999-12-31
def test_format_epoch_ms_round_trips_through_fromisoformat(epoch_ms: int) -> None:
    text = format_epoch_ms(epoch_ms)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", text)
    parsed = datetime.fromisoformat(text)
    assert parsed.tzinfo == UTC
    assert round(parsed.timestamp() * 1000) == epoch_ms


def test_wall_ms_is_the_wall_clock_in_ms() -> None:
    before = time.time_ns() // 1_000_000
    now = wall_ms()
    assert before <= now <= time.time_ns() // 1_000_000


def test_format_duration_ms_counts_down() -> None:
    samples = (0, 999, 1000, 1500, 59_999, 60_000, 3_725_000, 90_000_000)
    assert [format_duration_ms(v) for v in samples] == [
        "0ms",
        "999ms",
        "1s",
        "1s",
        "59s",
        "1m",
        "1h 2m",
        "1d 1h",
    ]
