"""The clients' side of lease-loss events (docs/contract.md §12), without a daemon.

A socket pair stands in for the daemon: what a pushed line does to the
sync connection (filed by handle, read while nobody else reads, a waiting
renewer woken at once) and to the async clients' pipeline.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from lockd_client._async import Pipeline, Slot
from lockd_client._connection import Connection, ConnectionLost
from lockd_client._events import Loss, LossBook, loss_from

from lockd.testing.polling import wait_for

EVENT: dict[str, Any] = {
    "event": "lost",
    "key": "k",
    "handle": "h" * 22,
    "fence": 7,
    "cause": "break",
    "reason": "disk swap",
    "by": "user:root",
    "at": "2026-11-30T03:31:00.123Z",
}


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def test_a_loss_event_parses_and_describes_itself() -> None:
    loss = loss_from(EVENT)
    assert loss == Loss("k", "h" * 22, 7, "break", "disk swap", "user:root", EVENT["at"])
    assert loss.describe() == "broken by user:root: disk swap"
    assert loss_from({**EVENT, "cause": "retake", "reason": None, "by": "user:a"}).describe() == (  # type: ignore[union-attr]
        "re-taken by user:a"
    )
    assert "ran out" in loss_from({**EVENT, "cause": "expired"}).describe()  # type: ignore[union-attr]
    assert "session" in loss_from({**EVENT, "cause": "session"}).describe()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad",
    [
        {**EVENT, "id": 3},  # a reply, not an event
        {**EVENT, "event": "other"},
        {**EVENT, "fence": "7"},
        {**EVENT, "fence": True},
        {k: v for k, v in EVENT.items() if k != "handle"},
    ],
)
def test_anything_else_is_not_a_loss(bad: dict[str, Any]) -> None:
    assert loss_from(bad) is None


def test_the_book_keeps_the_newest_losses() -> None:
    book = LossBook()
    for n in range(1100):
        book.add(Loss("k", f"h{n}", n, "expired", None, None, None))
    assert book.get("h0") is None and book.get("h1099") is not None


@pytest.fixture
def pair() -> Iterator[tuple[Connection, socket.socket]]:
    ours, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ids = itertools.count(1)
    conn = Connection(ours, lambda: next(ids))
    try:
        yield conn, daemon
    finally:
        conn.close()
        daemon.close()


def test_a_pushed_loss_wakes_the_waiting_renewer(pair: tuple[Connection, socket.socket]) -> None:
    conn, daemon = pair
    stop = threading.Event()
    got: list[Loss | None] = []
    waiter = threading.Thread(target=lambda: got.append(conn.wait_for_loss("h" * 22, 10, stop)))
    waiter.start()
    # The renewer is waiting, as the connection's reader, when the loss comes (a loss
    # sent before would be found by another path, already in the book).
    wait_for(lambda: conn._reading, 5, "the renewer reading")
    sent = time.monotonic()
    daemon.sendall(line({**EVENT, "handle": "other" * 5}) + line(EVENT))
    waiter.join(5)
    assert got and got[0] is not None and got[0].reason == "disk swap"
    assert time.monotonic() - sent < 2
    assert conn.losses.get("other" * 5) is not None  # kept for whoever holds it


def test_wake_ends_the_wait_at_once(pair: tuple[Connection, socket.socket]) -> None:
    conn, _daemon = pair
    stop = threading.Event()
    got: list[Loss | None] = []
    waiter = threading.Thread(target=lambda: got.append(conn.wait_for_loss("h" * 22, 30, stop)))
    waiter.start()
    wait_for(lambda: conn._reading, 5, "the renewer reading")  # waiting (as above)
    started = time.monotonic()
    stop.set()
    conn.wake()
    waiter.join(5)
    assert got == [None] and time.monotonic() - started < 2
    assert not conn.dead


def test_replies_and_events_interleave(pair: tuple[Connection, socket.socket]) -> None:
    """A request's reply is found while a loss for another handle is filed on the way."""
    conn, daemon = pair

    def answer() -> None:
        request = json.loads(daemon.recv(65536))
        daemon.sendall(line(EVENT) + line({"id": request["id"], "ok": True, "result": {"x": 1}}))

    threading.Thread(target=answer).start()
    reply = conn.request("status", {"key": "k"}, 5)
    assert reply["result"] == {"x": 1}
    assert conn.losses.get("h" * 22) is not None


def test_the_wait_ends_when_the_connection_dies(pair: tuple[Connection, socket.socket]) -> None:
    conn, daemon = pair
    stop = threading.Event()
    daemon.close()
    assert conn.wait_for_loss("h" * 22, 10, stop) is None
    assert conn.dead
    with pytest.raises(ConnectionLost):
        conn.request("hello", {}, 1)


class _Slot(Slot):
    def deliver(self, reply: dict[str, Any]) -> None:
        self.reply = reply

    def fail(self, lost: ConnectionLost) -> None:
        pass


def test_the_async_pipeline_calls_the_handle_listener_once() -> None:
    sent: list[bytes] = []
    ids = itertools.count(100)
    pipe: Pipeline[_Slot] = Pipeline(sent.append, _Slot, lambda: next(ids))
    pipe.ask_events()
    pipe.ask_events()  # once per connection
    assert [json.loads(b)["op"] for b in sent] == ["hello"]
    assert json.loads(sent[0])["events"] is True
    told: list[Loss] = []
    pipe.loss_listeners["h" * 22] = told.append
    slot = pipe.start({"id": 1, "op": "status", "key": "k"})
    pipe.feed(line(EVENT) + line({"id": 1, "ok": True, "result": None}) + line(EVENT))
    assert [loss.cause for loss in told] == ["break"]  # the listener is taken off once told
    assert slot.reply is not None and pipe.losses.get("h" * 22) is not None
    # An old daemon refuses the hello's field: the reply nobody waits for is dropped.
    pipe.feed(line({"id": 100, "ok": False, "error": {"code": "INVALID_REQUEST"}}))
    assert not pipe.dead
