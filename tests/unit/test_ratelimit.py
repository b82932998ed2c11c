"""Rate limit (docs/contract.md §6): exact rolling window, exact retry-after, bounded memory."""

from __future__ import annotations

import pytest

from lockd.daemon.ratelimit import HOUR_MS, RateLimiter


def test_limit_reached_gives_exact_retry_after() -> None:
    rl = RateLimiter(3)
    assert rl.try_take("user:a", 1_000) is None
    assert rl.try_take("user:a", 2_000) is None
    assert rl.try_take("user:a", 5_000) is None
    # the oldest counted attempt (t=1000) ages out at 1000 + 1 h
    assert rl.try_take("user:a", 10_000) == 1_000 + HOUR_MS - 10_000
    assert rl.wait_hint("user:a", 10_000) == 1_000 + HOUR_MS - 10_000
    # refusals are not counted: the answer only depends on counted attempts
    assert rl.try_take("user:a", 20_000) == 1_000 + HOUR_MS - 20_000
    assert rl.used("user:a", 20_000) == 3


def test_window_slides() -> None:
    rl = RateLimiter(2, window_ms=1_000)
    assert rl.try_take("p", 0) is None
    assert rl.try_take("p", 400) is None
    assert rl.try_take("p", 999) == 1
    assert rl.wait_hint("p", 999) == 1
    # at t=1000 the attempt at t=0 has left the window (t - window, t]
    assert rl.wait_hint("p", 1_000) == 0
    assert rl.try_take("p", 1_000) is None
    assert rl.try_take("p", 1_001) == 400 + 1_000 - 1_001
    assert rl.try_take("p", 1_400) is None
    assert rl.used("p", 1_400) == 2


def test_never_more_than_limit_in_any_window() -> None:
    rl = RateLimiter(5, window_ms=100)
    granted: list[int] = []
    for t in range(0, 1_000, 3):
        if rl.try_take("p", t) is None:
            granted.append(t)
    for i, t in enumerate(granted):
        in_window = [g for g in granted[: i + 1] if g > t - 100]
        assert len(in_window) <= 5
    # and it is not stingy: 5 per 100 ms over ~1 s
    assert len(granted) >= 45


def test_retry_after_is_when_room_comes() -> None:
    rl = RateLimiter(1, window_ms=1_000)
    assert rl.try_take("p", 100) is None
    wait = rl.try_take("p", 350)
    assert wait == 750
    assert wait is not None
    assert rl.try_take("p", 350 + wait - 1) == 1
    assert rl.try_take("p", 350 + wait) is None


def test_principals_are_independent() -> None:
    rl = RateLimiter(1)
    assert rl.try_take("user:a", 0) is None
    assert rl.try_take("user:b", 0) is None
    assert rl.try_take("user:a", 1) is not None
    assert rl.wait_hint("user:c", 1) == 0


def test_wait_hint_takes_nothing() -> None:
    rl = RateLimiter(1)
    for _ in range(10):
        assert rl.wait_hint("p", 0) == 0
    assert rl.try_take("p", 0) is None


def test_memory_bounded_with_many_principals() -> None:
    rl = RateLimiter(600, window_ms=1_000)
    for i in range(100_000):
        assert rl.try_take(f"user:{i}", i // 100) is None  # 100k principals over 1 s
    assert rl.tracked == 100_000  # all still inside the window
    # a later call evicts every principal whose attempts have all aged out
    assert rl.try_take("user:late", 1_000 + 1_000) is None
    assert rl.tracked == 1
    # also when the only calls are wait_hint
    for i in range(1_000):
        rl.try_take(f"again:{i}", 5_000)
    assert rl.tracked == 1_000
    assert rl.wait_hint("x", 6_000) == 0
    assert rl.tracked == 0


def test_memory_stays_flat_under_a_stream_of_new_principals() -> None:
    rl = RateLimiter(600, window_ms=1_000)
    peak = 0
    for i in range(100_000):
        rl.try_take(f"user:{i}", i)  # one new principal per ms, 1 s window
        peak = max(peak, rl.tracked)
    assert peak <= 1_001


def test_active_principal_is_not_evicted() -> None:
    rl = RateLimiter(2, window_ms=1_000)
    assert rl.try_take("busy", 0) is None
    assert rl.try_take("idle", 100) is None
    assert rl.try_take("busy", 900) is None
    assert rl.try_take("other", 1_500) is None  # evicts idle (100) but not busy (900)
    assert rl.tracked == 2
    assert rl.used("busy", 1_500) == 1
    # busy is at 1 of 2 in the window: one more is allowed, then refused
    assert rl.try_take("busy", 1_500) is None
    assert rl.try_take("busy", 1_500) == 900 + 1_000 - 1_500


def test_saturated_principal_keeps_at_most_limit_stamps() -> None:
    rl = RateLimiter(10, window_ms=10_000)
    for t in range(10_000):
        rl.try_take("p", t)
    assert rl.used("p", 9_999) == 10


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RateLimiter(0)
    with pytest.raises(ValueError):
        RateLimiter(1, window_ms=0)
