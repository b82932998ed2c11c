"""``sockio.BusyPoll``: polling a connection for its next request, and backing off.

The clock is injected: a miss is a jump of the fake clock past the budget,
not a wait.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator

import pytest

from lockd.daemon.sockio import BusyPoll, PollGate

BUDGET_NS = 1_000_000


class FakeClock:
    """Each reading moves time on by ``step_ns``: a poll loop ends after a few turns."""

    def __init__(self, step_ns: int = BUDGET_NS // 4) -> None:
        self.now = 0
        self.step_ns = step_ns
        self.readings = 0

    def __call__(self) -> int:
        self.readings += 1
        self.now += self.step_ns
        return self.now


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    with ours, peer:
        yield ours, peer


def miss(poll: BusyPoll, sock: socket.socket) -> None:
    assert poll.skip == 0
    assert poll.next_bytes(sock, now_ns=FakeClock()) is None


def test_a_request_already_there_is_read_and_clears_the_misses(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = pair
    poll = BusyPoll(BUDGET_NS)
    poll.misses = 3
    peer.send(b'{"id":1,"op":"hello"}\n')
    assert poll.next_bytes(ours, now_ns=FakeClock()) == b'{"id":1,"op":"hello"}\n'
    assert poll.misses == 0 and poll.skip == 0


def test_end_of_file_is_an_answer(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    peer.shutdown(socket.SHUT_WR)
    assert BusyPoll(BUDGET_NS).next_bytes(ours, now_ns=FakeClock()) == b""


def test_a_miss_polls_until_the_budget_is_spent(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair
    clock = FakeClock(step_ns=BUDGET_NS // 10)
    poll = BusyPoll(BUDGET_NS)
    assert poll.next_bytes(ours, now_ns=clock) is None
    # One reading sets the deadline, then one per turn until it is reached.
    assert clock.readings == 1 + 10
    assert poll.misses == 1 and poll.skip == 1


def test_misses_in_a_row_double_the_chances_skipped_up_to_63(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = pair
    poll = BusyPoll(BUDGET_NS)
    skips = []
    for _ in range(8):
        miss(poll, ours)
        skips.append(poll.skip)
        # While skipping, a request that is there is left for the scheduler.
        peer.send(b"x\n")
        clock = FakeClock()
        for _ in range(poll.skip):
            assert poll.next_bytes(ours, now_ns=clock) is None
        assert clock.readings == 0
        assert ours.recv(10) == b"x\n"
    assert skips == [1, 3, 7, 15, 31, 63, 63, 63]
    # A hit starts again from nothing.
    peer.send(b"y\n")
    assert poll.next_bytes(ours, now_ns=FakeClock()) == b"y\n"
    miss(poll, ours)
    assert poll.skip == 1


def test_it_stops_when_another_connection_has_a_request(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, _ = pair
    other, other_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with other, other_peer, select.epoll() as readable:
        readable.register(ours, select.EPOLLIN)
        readable.register(other, select.EPOLLIN)
        poll = BusyPoll(BUDGET_NS)
        other_peer.send(b"waiting")
        clock = FakeClock(step_ns=1)  # the budget alone would take a million turns
        assert poll.next_bytes(ours, readable, now_ns=clock) is None
        assert clock.readings == 1  # the deadline's: gave up at the first turn
        # Not a miss: the connection polls again next time.
        assert poll.misses == 0 and poll.skip == 0
        assert other.recv(10) == b"waiting"


def test_a_zero_budget_never_reads(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, peer = pair
    peer.send(b"x")
    clock = FakeClock()
    assert BusyPoll(0).next_bytes(ours, now_ns=clock) is None
    assert clock.readings == 0 and ours.recv(10) == b"x"


def test_bytes_without_a_whole_request_count_as_a_miss(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A client trickling a byte at a time must not keep the daemon polling for it."""
    ours, peer = pair
    poll = BusyPoll(BUDGET_NS)
    peer.send(b'{"id":1,')
    assert poll.next_bytes(ours, now_ns=FakeClock()) == b'{"id":1,'  # read all the same
    assert poll.misses == 1 and poll.skip == 1
    assert poll.next_bytes(ours, now_ns=FakeClock()) is None  # skipped
    peer.send(b'"op":"hello"}\n')
    assert poll.next_bytes(ours, now_ns=FakeClock()) == b'"op":"hello"}\n'
    assert poll.misses == 0 and poll.skip == 0


def test_blank_lines_count_as_a_miss(pair: tuple[socket.socket, socket.socket]) -> None:
    """Bare newlines end no request: they must not re-arm polling (issue 21, item 7)."""
    ours, peer = pair
    poll = BusyPoll(BUDGET_NS)
    peer.send(b"\n")
    assert poll.next_bytes(ours, now_ns=FakeClock()) == b"\n"
    assert poll.misses == 1 and poll.skip == 1
    assert poll.next_bytes(ours, now_ns=FakeClock()) is None  # skipped
    peer.send(b"\r\n \n")
    assert poll.next_bytes(ours, now_ns=FakeClock()) == b"\r\n \n"
    assert poll.misses == 2 and poll.skip == 3
    peer.send(b'\n{"id":1,"op":"hello"}\n')
    for _ in range(3):
        assert poll.next_bytes(ours, now_ns=FakeClock()) is None
    assert poll.next_bytes(ours, now_ns=FakeClock()) == b'\n{"id":1,"op":"hello"}\n'
    assert poll.misses == 0 and poll.skip == 0


HOLD_OFF_NS = 10 * BUDGET_NS


def test_a_poll_cut_short_by_another_connection_closes_the_gate_for_all(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Several clients busy at once (B3): polls stop for everyone for the hold-off."""
    ours, peer = pair
    other, other_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with other, other_peer, select.epoll() as readable:
        readable.register(ours, select.EPOLLIN)
        readable.register(other, select.EPOLLIN)
        gate = PollGate(HOLD_OFF_NS)
        poll, neighbour = BusyPoll(BUDGET_NS, gate), BusyPoll(BUDGET_NS, gate)
        clock = FakeClock(step_ns=0)
        clock.now = 5 * BUDGET_NS
        other_peer.send(b'{"id":1,"op":"hello"}\n')
        assert poll.next_bytes(ours, readable, now_ns=clock) is None
        assert gate.closed_until == 5 * BUDGET_NS + HOLD_OFF_NS
        assert poll.misses == 0 and poll.skip == 0  # not the connection's own miss
        # Within the hold-off nobody polls, not even with a request there.
        peer.send(b'{"id":2,"op":"hello"}\n')
        clock.now += HOLD_OFF_NS - 1
        assert poll.next_bytes(ours, readable, now_ns=clock) is None
        assert neighbour.next_bytes(other, readable, now_ns=clock) is None
        assert poll.misses == 0 and neighbour.misses == 0
        # After it, polling is back.
        clock.now += 1
        assert neighbour.next_bytes(other, readable, now_ns=clock) == b'{"id":1,"op":"hello"}\n'
        assert poll.next_bytes(ours, readable, now_ns=clock) == b'{"id":2,"op":"hello"}\n'
        assert gate.closed_until == 5 * BUDGET_NS + HOLD_OFF_NS


def test_hits_and_misses_of_a_lone_client_leave_the_gate_open(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """One client streaming (B1) never closes the gate: only another connection does."""
    ours, peer = pair
    with select.epoll() as readable:
        readable.register(ours, select.EPOLLIN)
        gate = PollGate(HOLD_OFF_NS)
        poll = BusyPoll(BUDGET_NS, gate)
        peer.send(b'{"id":1,"op":"hello"}\n')
        assert poll.next_bytes(ours, readable, now_ns=FakeClock()) == b'{"id":1,"op":"hello"}\n'
        assert poll.next_bytes(ours, readable, now_ns=FakeClock()) is None  # a miss by budget
        assert poll.misses == 1
        assert gate.closed_until == 0


def _sockets(count: int) -> list[tuple[socket.socket, socket.socket]]:
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(count)]
    for ours, _ in pairs:
        ours.setblocking(False)
    return pairs


def test_four_connections_asking_in_a_row_close_the_gate() -> None:
    """B3: chances to poll from 4 different connections within the window turn polling off."""
    pairs = _sockets(4)
    try:
        gate = PollGate(HOLD_OFF_NS, window_ns=BUDGET_NS)
        polls = [BusyPoll(BUDGET_NS, gate) for _ in pairs]
        clock = FakeClock(step_ns=0)
        for (ours, peer), poll in zip(pairs[:3], polls[:3], strict=True):
            peer.send(b'{"id":1,"op":"hello"}\n')
            assert poll.next_bytes(ours, now_ns=clock) == b'{"id":1,"op":"hello"}\n'
            clock.now += BUDGET_NS // 4
        last, last_peer = pairs[3]
        last_peer.send(b'{"id":1,"op":"hello"}\n')
        assert polls[3].next_bytes(last, now_ns=clock) is None  # not read: off
        assert gate.closed_until == clock.now + HOLD_OFF_NS
        assert polls[3].misses == 0 and polls[3].skip == 0
        clock.now += HOLD_OFF_NS
        assert polls[3].next_bytes(last, now_ns=clock) == b'{"id":1,"op":"hello"}\n'
    finally:
        for ours, peer in pairs:
            ours.close()
            peer.close()


def test_connections_taking_turns_slowly_or_in_hand_offs_keep_polling() -> None:
    """Four connections spread over more than the window, or B2's releaser/next-holder turns."""
    pairs = _sockets(4)
    try:
        gate = PollGate(HOLD_OFF_NS, window_ns=BUDGET_NS)
        polls = [BusyPoll(BUDGET_NS, gate) for _ in pairs]
        clock = FakeClock(step_ns=0)
        # Spread out: 4 different connections, but over more than the window.
        for (ours, peer), poll in zip(pairs, polls, strict=True):
            peer.send(b"{}\n")
            assert poll.next_bytes(ours, now_ns=clock) == b"{}\n"
            clock.now += BUDGET_NS // 2
        # Hand-offs: A releases, B is granted, B releases, C is granted, ...
        for turn in (0, 1, 1, 2, 2, 3, 3, 0):
            ours, peer = pairs[turn]
            peer.send(b"{}\n")
            assert polls[turn].next_bytes(ours, now_ns=clock) == b"{}\n"
            clock.now += BUDGET_NS // 10
        assert gate.closed_until == 0
    finally:
        for ours, peer in pairs:
            ours.close()
            peer.close()
