"""ReplyWriter: replies in order, the slow path in one task, undelivered grants reported.

On a socket pair with small buffers, so a reply that does not fit is
queued for real (not simulated): what the group commit relies on when it
writes a batch's replies without yielding.
"""

from __future__ import annotations

import socket

import trio

from lockd.daemon.sockio import ReplyWriter


def small_pair() -> tuple[socket.socket, socket.socket]:
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sock in (ours, peer):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ours.setblocking(False)
    return ours, peer


async def read_exactly(peer: socket.socket, size: int) -> bytes:
    data = bytearray()
    peer.setblocking(False)
    while len(data) < size:
        await trio.lowlevel.wait_readable(peer)
        data += peer.recv(65536)
    return bytes(data)


async def test_replies_that_do_not_fit_are_written_in_order_by_one_task() -> None:
    ours, peer = small_pair()
    lost: list[object] = []
    replies = [bytes([65 + i]) * 50_000 + b"\n" for i in range(3)]
    async with trio.open_nursery() as nursery:
        writer = ReplyWriter(ours, nursery.start_soon, lost.append)
        for i, reply in enumerate(replies):
            assert writer.write(reply, token=i)  # none blocks
        assert writer.backlogged
        received = await read_exactly(peer, sum(map(len, replies)))
        await writer.wait_drained()
    assert received == b"".join(replies) and not writer.backlogged and lost == []
    ours.close()
    peer.close()


async def test_queued_grants_are_reported_when_the_peer_is_gone() -> None:
    ours, peer = small_pair()
    lost: list[object] = []
    async with trio.open_nursery() as nursery:
        writer = ReplyWriter(ours, nursery.start_soon, lost.append)
        assert writer.write(b"x" * 100_000, token="first")
        assert writer.write(b"small\n", token="second")
        assert writer.write(b"no grant\n")
        peer.close()  # the client died with its replies unread
        await writer.wait_drained()
    assert lost == ["first", "second"] and writer.closed
    assert not writer.write(b"late\n", token="third")  # refused: the caller releases it
    ours.close()


async def test_a_reply_that_fits_is_written_at_once() -> None:
    ours, peer = small_pair()
    spawned: list[object] = []
    writer = ReplyWriter(ours, spawned.append, lambda token: None)
    assert writer.write(b'{"id":1}\n', token="grant")
    assert not writer.backlogged and spawned == []
    assert peer.recv(100) == b'{"id":1}\n'
    ours.close()
    peer.close()


async def test_a_reply_that_does_not_fit_once_the_connection_ends_is_refused() -> None:
    ours, peer = small_pair()
    async with trio.open_nursery() as nursery:
        writer = ReplyWriter(ours, nursery.start_soon, lambda token: None)
    # The nursery is closed: no task can write the rest, so the caller is told.
    assert not writer.write(b"x" * 100_000, token="grant")
    assert writer.closed and not writer.backlogged
    ours.close()
    peer.close()
