"""How deep the hypothesis tests search: quick by default, as written in the slow lane.

``tests/conftest.py`` loads one of two hypothesis profiles before any test
module is imported:

- ``quick`` (the default: ``scripts/test``, CI, a developer's run) tries a
  quarter of the examples: every property still runs on every run, each
  run with a fresh seed, so repeated runs keep widening the search;
- ``deep`` (``LOCKD_SLOW=1``, the slow lane that also runs the wide
  corruption sweep and the etcd chaos run) tries every example the tests
  ask for, as many as before this profile existed.

A test that asks for a number of examples of its own says it through
:func:`examples`, so the profile scales it too: ``max_examples=examples(200)``
is 200 in the deep lane and 50 in the quick one.
"""

from __future__ import annotations

import os

from hypothesis import settings

#: hypothesis' own default example count: what the deep profile keeps.
FULL_EXAMPLES = 100
#: The share of the examples the quick profile tries.
QUICK_SHARE = 4
#: No property tries fewer than this (or than it asks for, if fewer).
FLOOR = 10


def register_profiles() -> str:
    """Register ``quick`` and ``deep``, load the one this run asks for; its name."""
    settings.register_profile("deep", max_examples=FULL_EXAMPLES)
    settings.register_profile("quick", max_examples=FULL_EXAMPLES // QUICK_SHARE)
    name = "deep" if os.environ.get("LOCKD_SLOW") else "quick"
    settings.load_profile(name)
    return name


def examples(full: int) -> int:
    """``full`` examples in the deep profile, the loaded profile's share of them otherwise."""
    share = settings.default.max_examples / FULL_EXAMPLES
    return max(min(full, FLOOR), round(full * share))
