"""A short run of ``scripts/crash_loop.py``: kill -9 at random moments under load (issue 21).

The script itself runs 200 rounds or more (its module docstring says how);
this keeps a few in the suite: after every restart, each lease whose grant
was acknowledged is back with its fence, and fences only go up.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "crash_loop.py"


def test_random_kill9_keeps_every_acknowledged_lease(short_tmp: Path) -> None:
    spec = importlib.util.spec_from_file_location("crash_loop", SCRIPT)
    assert spec is not None and spec.loader is not None
    crash_loop = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = crash_loop  # its dataclasses look their module up
    spec.loader.exec_module(crash_loop)
    ledger = crash_loop.run(rounds=8, seconds=120, root=short_tmp, seed=8)
    assert ledger.failures == []
    assert ledger.grants > 50  # the kills did land under load
