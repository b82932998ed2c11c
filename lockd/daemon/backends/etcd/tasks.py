"""Background tasks of the etcd backend that no failure of theirs can end the daemon.

A trio nursery ends when one of its tasks raises, and the backend's tasks
(the session keeper, the clean-up list, the untie list, each key's queue and
its watch) run in the daemon's nursery: one unexpected error in any of them
used to take the whole daemon down, with every client's connection (issue
23: a watch that met etcd's "the client connection is closing" during a
member's graceful stop). Here a task that fails is logged with its traceback
and started again after a back-off; only cancellation (the daemon stopping)
and the errors a caller names as fatal (``NodeTaken``: the daemon must not
serve) end it. The back-off doubles from :data:`FIRST_BACKOFF` to
:data:`MAX_BACKOFF` and starts over once a run lasted :data:`SETTLED_AFTER`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from lockd.logfmt import kv

log = logging.getLogger("lockd.etcd")

FIRST_BACKOFF = 0.25
MAX_BACKOFF = 5.0
SETTLED_AFTER = 30.0


async def keep_running(
    name: str,
    run: Callable[[], Awaitable[object]],
    *,
    fatal: tuple[type[BaseException], ...] = (),
    first_backoff: float = FIRST_BACKOFF,
) -> None:
    """Await ``run()`` until it returns; when it raises, log and run it again after a pause.

    ``fatal`` errors (alone, or as the only errors of a group) propagate.
    """
    backoff = first_backoff
    while True:
        started = trio.current_time()
        try:
            await run()
            return
        except Exception as exc:  # a background task must not end the daemon
            if fatal and _only(exc, fatal):
                raise
            restarts.count(name)
            log.error(
                kv(event="task_failed", task=name, error=exc, restart_in=backoff), exc_info=True
            )
        if trio.current_time() - started >= SETTLED_AFTER:
            backoff = first_backoff
        await trio.sleep(backoff)
        backoff = min(2 * backoff, MAX_BACKOFF)


async def logged(name: str, run: Callable[[], Awaitable[object]]) -> None:
    """Await ``run()`` once; an error is logged, not raised (a one-shot helper task)."""
    try:
        await run()
    except Exception as exc:  # a background task must not end the daemon
        restarts.count(name)
        log.error(kv(event="task_failed", task=name, error=exc), exc_info=True)


def _only(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(inner, kinds) for inner in exc.exceptions)
    return isinstance(exc, kinds)


class _Failures:
    """How often each task failed (tests and ``stats``-style debugging)."""

    def __init__(self) -> None:
        self.by_task: dict[str, int] = {}

    def count(self, name: str) -> None:
        self.by_task[name] = self.by_task.get(name, 0) + 1


restarts = _Failures()
