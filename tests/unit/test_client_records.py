"""The client's results are plain slotted classes that still behave as the dataclasses they were.

They stopped being dataclasses so that importing ``lockd_client`` does not
import ``dataclasses`` (issue 24; lockd_client/_record.py). What a user could
rely on stays: constructors, ``repr`` without the hidden fields, equality and
hashing (identity for ``Handle``), immutability with ``FrozenInstanceError``,
``dataclasses.fields()``/``asdict()``/``replace()``/``is_dataclass()``,
``match`` by position, pickling and copying.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from datetime import UTC, datetime

import pytest
from lockd_client import (
    BreakResult,
    Handle,
    Holder,
    LockStatus,
    ReleaseResult,
    RenewResult,
    Waiter,
)
from lockd_client._events import Loss

from lockd.run.options import OnLost, RunOptions

WHEN = datetime(2026, 12, 3, 13, 0, tzinfo=UTC)
HOLDER = Holder("user:a", "o", 3, WHEN, 500, 42, "sh", None, {"fence": 3})
WAITER = Waiter("user:b", 43, "sh", "exclusive", 1, WHEN, 10, 1)
STATUS = LockStatus(
    "k", True, "user:a", "o", 3, WHEN, 500, 1, holders=(HOLDER,), waiter_list=(WAITER,)
)
FROZEN = [
    RenewResult(True, None, WHEN, {"renewed": True}),
    ReleaseResult(False, "not_holder"),
    HOLDER,
    WAITER,
    STATUS,
    BreakResult(True, "user:a", "o", 3, 1),
    Loss("k", "h" * 22, 3, "break", "swap", "user:root", "2026-12-03T13:00:00Z"),
    RunOptions("k", ("true",), on_lost=OnLost.KILL),
]


@pytest.mark.parametrize("record", FROZEN, ids=lambda r: type(r).__name__)
def test_frozen_records_are_equal_by_value_and_refuse_assignment(record: object) -> None:
    twin = copy.copy(record)
    assert twin == record and twin is not record
    assert pickle.loads(pickle.dumps(record)) == record
    assert record != object()
    field = dataclasses.fields(record)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, field, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(record, field)
    with pytest.raises(AttributeError):
        record.not_a_field = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("record", FROZEN, ids=lambda r: type(r).__name__)
def test_dataclass_helpers_still_work(record: object) -> None:
    assert dataclasses.is_dataclass(record)
    names = [f.name for f in dataclasses.fields(record)]  # type: ignore[arg-type]
    assert names == list(type(record).__match_args__)  # type: ignore[attr-defined]
    as_dict = dataclasses.asdict(record)  # type: ignore[call-overload]
    assert list(as_dict) == names
    first = names[0]
    changed = dataclasses.replace(record, **{first: "x"})  # type: ignore[type-var]
    assert getattr(changed, first) == "x" and changed != record
    assert changed == record._replace(**{first: "x"})  # type: ignore[attr-defined]


def test_repr_leaves_out_hidden_fields_like_the_dataclasses_did() -> None:
    assert repr(ReleaseResult(True, None, {"released": True})) == (
        "ReleaseResult(released=True, reason=None)"
    )
    handle = Handle("k", "secret-handle-id", 7, None, 1000, None, {"handle": "secret-handle-id"})
    assert "secret" not in repr(handle)
    assert repr(handle) == (
        "Handle(key='k', fence=7, owner=None, ttl_ms=1000, lease_expires_at=None, lost=False)"
    )
    hidden = {f.name for f in dataclasses.fields(handle) if not f.repr}
    assert hidden == {"handle", "raw"}


def test_a_handle_is_mutable_and_compared_by_identity() -> None:
    one = Handle("k", "h", 1, None, 1000, None)
    other = Handle("k", "h", 1, None, 1000, None)
    assert one != other and one == one
    assert len({one, other}) == 2
    one.lost = True
    one.ttl_ms = 2000
    assert (one.lost, one.ttl_ms, one.raw) == (True, 2000, {})
    assert one.raw is not other.raw  # each gets its own empty raw, as default_factory did
    with pytest.raises(AttributeError):
        one.extra = 1  # type: ignore[attr-defined]


def test_hash_is_over_the_fields() -> None:
    loss = FROZEN[6]
    assert hash(loss) == hash(copy.copy(loss))
    assert len({loss, copy.copy(loss)}) == 1
    with pytest.raises(TypeError):  # raw is a dict: unhashable, as with the dataclass
        hash(ReleaseResult(True))


def test_match_by_position() -> None:
    match ReleaseResult(False, "not_holder"):
        case ReleaseResult(False, reason):
            assert reason == "not_holder"
        case _:
            pytest.fail("no match")


def test_run_options_keep_their_defaults_in_fields() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    assert defaults["ttl_ms"] == 60_000 and defaults["on_lost"] is OnLost.TERM
    assert defaults["key"] is dataclasses.MISSING
    opts = RunOptions("k", ("true",))
    assert opts._replace(holder_pid=5).holder_pid == 5 and opts.holder_pid is None
