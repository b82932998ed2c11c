"""What ended a hold, read from watch events (``holdloss.losses_in``): no etcd, no clock.

The events are those each way of ending a hold writes in one revision
(docs/etcd-design.md §6a): a break (holds and bindings deleted, the break
record put), a re-take (the old hold deleted, the same principal and owner
put), a session lease etcd ended (a binding deleted alone), an untie or a
renew (a hold rewritten, its binding deleted: no loss), and a plain
deletion (an expiry, or a release elsewhere: left to the lease look-up).
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from lockd.daemon.backends.etcd.holdloss import (
    BREAK_RECORD,
    Broken,
    SeenLoss,
    break_record,
    losses_in,
)
from lockd.daemon.backends.etcd.records import Layout
from lockd.daemon.backends.etcd.wire import Event, KeyValue
from lockd.daemon.events import BREAK, RETAKE, SESSION

LAYOUT = Layout("/lockd/")
NODE = "host-a"


def _hold_value(principal: str = "user:alice", owner: str | None = None, node: str = NODE) -> bytes:
    return json.dumps({"principal": principal, "owner": owner, "node": node}).encode()


def _kv(etcd_key: bytes, revision: int, value: bytes = b"", lease: int = 0) -> KeyValue:
    return KeyValue(etcd_key, value, 5, revision, 1, lease)


def deleted_hold(key: str, handle: str, revision: int, **hold: object) -> Event:
    prev = _kv(LAYOUT.hold(key, handle), 5, _hold_value(**hold), lease=77)  # type: ignore[arg-type]
    return Event("DELETE", _kv(LAYOUT.hold(key, handle), revision), prev)


def put_hold(key: str, handle: str, revision: int, **hold: object) -> Event:
    value = _hold_value(**hold)  # type: ignore[arg-type]
    return Event("PUT", _kv(LAYOUT.hold(key, handle), revision, value, lease=78), None)


def deleted_binding(key: str, handle: str, revision: int) -> Event:
    return Event("DELETE", _kv(LAYOUT.binding(key, handle), revision), None)


def break_put(key: str, revision: int, value: bytes) -> Event:
    return Event("PUT", _kv(LAYOUT.directory(key) + BREAK_RECORD, revision, value), None)


def test_a_break_names_who_and_why() -> None:
    events = [
        deleted_hold("k", "h1", 9),
        deleted_binding("k", "h1", 9),
        break_put("k", 9, break_record("user:root", "disk swap", "2026-01-01T00:00:00Z")),
    ]
    assert losses_in(LAYOUT, NODE, events) == [
        SeenLoss("k", "h1", BREAK, "user:root", "disk swap", 77, 9)
    ]


def test_a_retake_names_the_principal_and_a_hand_off_is_not_one() -> None:
    retake = [deleted_hold("k", "h1", 9, owner="job"), put_hold("k", "h2", 9, owner="job")]
    assert losses_in(LAYOUT, NODE, retake) == [
        SeenLoss("k", "h1", RETAKE, "user:alice", None, 77, 9)
    ]
    # A release that hands the key to a waiter of another principal: unexplained here.
    hand_off = [deleted_hold("k", "h1", 9, owner="job"), put_hold("k", "h2", 9, principal="bob")]
    assert [loss.cause for loss in losses_in(LAYOUT, NODE, hand_off)] == [None]
    # The same owner name under another principal, or no owner at all: no re-take.
    other = [
        deleted_hold("k", "h1", 9, owner="job"),
        put_hold("k", "h2", 9, principal="bob", owner="job"),
    ]
    assert losses_in(LAYOUT, NODE, other)[0].cause is None
    ownerless = [deleted_hold("k", "h1", 9), put_hold("k", "h2", 9)]
    assert losses_in(LAYOUT, NODE, ownerless)[0].cause is None


def test_a_binding_deleted_alone_is_the_session_and_an_untie_is_nothing() -> None:
    assert losses_in(LAYOUT, NODE, [deleted_binding("k", "h1", 9)]) == [
        SeenLoss("k", "h1", SESSION, None, None, 0, 9)
    ]
    untie = [put_hold("k", "h1", 9), deleted_binding("k", "h1", 9)]
    assert losses_in(LAYOUT, NODE, untie) == []
    release = [deleted_hold("k", "h1", 9), deleted_binding("k", "h1", 9)]
    assert [loss.cause for loss in losses_in(LAYOUT, NODE, release)] == [None]


def test_only_the_revision_that_ended_it_counts() -> None:
    """A break record of a later revision does not explain an earlier deletion."""
    events = [deleted_hold("k", "h1", 9), break_put("k", 10, break_record("a", "r", "t"))]
    assert [loss.cause for loss in losses_in(LAYOUT, NODE, events)] == [None]


def test_other_nodes_holds_and_other_keys_are_not_ours() -> None:
    events = [
        deleted_hold("k", "h1", 9, node="host-b"),
        break_put("k", 9, break_record("a", "r", "t")),
        Event("DELETE", _kv(b"/lockd/n/host-b", 9), None),
        Event("DELETE", _kv(b"/elsewhere/k/6b/h/x", 9), None),
    ]
    assert losses_in(LAYOUT, NODE, events) == []


def test_a_break_record_of_another_version_reads_as_far_as_it_goes() -> None:
    assert Broken.parse(b"not json") == Broken(None, None)
    assert Broken.parse(b"[1]") == Broken(None, None)
    assert Broken.parse(b'{"by": "u", "extra": 1}') == Broken("u", None)
    assert Broken.parse(b'{"by": 3, "reason": "r"}') == Broken(None, "r")


@given(
    by=st.text(max_size=40),
    reason=st.text(max_size=200),
    key=st.text(min_size=1, max_size=30),
)
def test_any_break_record_round_trips(by: str, reason: str, key: str) -> None:
    events = [deleted_hold(key, "h", 4), break_put(key, 4, break_record(by, reason, "t"))]
    (loss,) = losses_in(LAYOUT, NODE, events)
    assert (loss.key, loss.cause, loss.by, loss.reason) == (key, BREAK, by, reason)
