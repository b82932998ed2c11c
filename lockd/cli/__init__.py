"""The ``lockd`` command line.

The click group is :data:`lockd.cli.root.main` (``lockd.cli.main`` here, for
callers and tests); the console script starts in :mod:`lockd.cli.fast`, which
runs ``lockd locks status`` and ``lockd run`` without importing click and
hands every other command line to that group. This package's own import
loads nothing (no click): the fast path lives in it.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    from lockd.cli.root import EXIT_CODES_HELP, main, render_metrics, render_stats_text

__all__ = ["EXIT_CODES_HELP", "main", "render_metrics", "render_stats_text"]


def __getattr__(name: str) -> object:
    # The click group and its helpers are imported when asked for: the fast
    # path (lockd.cli.fast) imports this package without paying for click.
    import importlib

    root = importlib.import_module("lockd.cli.root")  # not "from lockd.cli import": recursion
    try:
        return getattr(root, name)
    except AttributeError:
        raise AttributeError(f"module 'lockd.cli' has no attribute {name!r}") from None
