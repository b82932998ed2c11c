"""Wait for a condition instead of sleeping for a guessed time.

A test that sleeps "long enough" is slow when the machine is idle and flaky
when it is loaded. These helpers check ``predicate`` at once and then every
``interval`` seconds, return as soon as it holds, and raise
:class:`TimeoutError` naming ``what`` once ``timeout`` seconds have passed.
``timeout`` is a bound for a broken run, not a duration a test expects: make
it generous. The poll interval is the only sleep, and it is here once.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable


def _timed_out(what: str, timeout: float) -> TimeoutError:
    return TimeoutError(f"{what or 'condition'} not met within {timeout} s")


def wait_for(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "", interval: float = 0.01
) -> float:
    """Poll until ``predicate()`` is true; the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout)
        time.sleep(interval)  # the poll interval: the condition has no event to wait on
    return time.monotonic() - started


async def _holds(predicate: Callable[[], object]) -> bool:
    result = predicate()
    if inspect.isawaitable(result):
        result = await result
    return bool(result)


#: a condition for the async helpers: a plain function, or one to await (``status`` calls).
AsyncPredicate = Callable[[], object] | Callable[[], Awaitable[object]]


async def wait_for_trio(
    predicate: AsyncPredicate, timeout: float = 10.0, what: str = "", interval: float = 0.01
) -> float:
    """:func:`wait_for` inside trio: other tasks run while it waits; ``predicate`` may be async."""
    import trio  # only trio tests need it: keep this module importable without trio's cost

    started = trio.current_time()
    deadline = started + timeout
    while not await _holds(predicate):
        if trio.current_time() >= deadline:
            raise _timed_out(what, timeout)
        await trio.sleep(interval)  # the poll interval (under a MockClock it costs no time)
    return trio.current_time() - started


async def wait_for_asyncio(
    predicate: AsyncPredicate, timeout: float = 10.0, what: str = "", interval: float = 0.01
) -> float:
    """:func:`wait_for` inside asyncio (other tasks run meanwhile); ``predicate`` may be async."""
    import asyncio

    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + timeout
    while not await _holds(predicate):
        if loop.time() >= deadline:
            raise _timed_out(what, timeout)
        await asyncio.sleep(interval)  # the poll interval
    return loop.time() - started
