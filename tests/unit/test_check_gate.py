"""Requests and facts wait for the restart's integrity check without stopping the daemon.

After a restart the whole-file check runs in a thread, and no write may
happen before it passed (a damaged page could hide a lease). A commit runs
on the event loop, so waiting for the check there stopped every connection
for the whole scan (seconds at 1 M leases). These pin down the gate that
replaced it: requests other than ``hello`` and ``status`` wait in their
connection's task (``LockServer.integrity_checked``), facts stay pending
(``Commits.commit_fact``), and the loop keeps answering meanwhile.
"""

from __future__ import annotations

import errno
import json
import socket as stdsocket
from pathlib import Path

import pytest
import trio
import trio.testing

from lockd.daemon.server import ANSWERED_BEFORE_CHECK, Limits
from lockd.daemon.store import Store
from lockd.testing.clock import FakeClock
from tests.unit.test_deferred_check import BOOT, _write
from tests.unit.test_server import running, try_acquire, until


def _checked_later(db: Path) -> Store:
    """The store as a restart opens it: the check deferred, not begun."""
    _write(db)
    return Store(db, BOOT, background_check=True, defer_check=True)


def _nothing_to_read(sock: trio.socket.SocketType) -> bool:
    """True when no reply has arrived on ``sock`` (a non-blocking look, no waiting)."""
    try:
        sock._sock.recv(1, stdsocket.MSG_PEEK | stdsocket.MSG_DONTWAIT)
    except OSError as exc:
        return exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
    return False


async def test_hello_status_and_rules_are_answered_during_the_check(tmp_path: Path) -> None:
    store = _checked_later(tmp_path / "state" / "lockd.db")
    async with running(tmp_path, store=store) as h:
        h.server.integrity_checked = trio.Event()
        peer = await h.connect()
        for rid, request in enumerate(
            [{"op": "hello"}, {"op": "status", "key": "k"}, {"op": "rules"}], start=1
        ):
            reply = await peer.call({"id": rid, **request})
            assert reply["ok"], reply
        assert {"hello", "status", "rules"} == ANSWERED_BEFORE_CHECK
        assert store.check_pending  # all three answered while it is


async def test_a_write_waits_for_the_check_while_others_are_answered(tmp_path: Path) -> None:
    store = _checked_later(tmp_path / "state" / "lockd.db")
    async with running(tmp_path, store=store) as h:
        checked = trio.Event()
        h.server.integrity_checked = checked
        writer, reader = await h.connect(), await h.connect()
        await writer.send(try_acquire(1, "fresh"))
        # The loop goes on: another connection is answered, twice over.
        assert (await reader.call({"id": 1, "op": "hello"}))["ok"]
        free = await reader.call({"id": 3, "op": "status", "key": "fresh"})
        assert free["result"]["held"] is False  # the waiting tryAcquire decided nothing
        assert _nothing_to_read(writer.sock)
        assert store.check_pending

        # What serve's _await_integrity does once the check's thread is done.
        await trio.to_thread.run_sync(store.wait_checked)
        h.service.commit_fact("integrity_checked")
        checked.set()
        granted = await writer.recv()
        assert granted is not None and granted["ok"] and granted["id"] == 1
        assert (await reader.call({"id": 4, "op": "status", "key": "fresh"}))["result"]["held"]


async def test_a_connections_later_lines_wait_behind_its_gated_one(tmp_path: Path) -> None:
    store = _checked_later(tmp_path / "state" / "lockd.db")
    async with running(tmp_path, store=store) as h:
        checked = trio.Event()
        h.server.integrity_checked = checked
        peer = await h.connect()
        await peer.send(try_acquire(1, "a"), {"id": 2, "op": "hello"})
        other = await h.connect()
        assert (await other.call({"id": 1, "op": "hello"}))["ok"]
        assert _nothing_to_read(peer.sock)  # its hello is not answered before its tryAcquire
        await trio.to_thread.run_sync(store.wait_checked)
        checked.set()
        first, second = await peer.recv(), await peer.recv()
        assert first is not None and second is not None
        assert (first["id"], second["id"]) == (1, 2)


async def test_facts_stay_pending_until_the_check_then_commit(tmp_path: Path) -> None:
    store = _checked_later(tmp_path / "state" / "lockd.db")
    applied: list[int] = []
    apply = store.apply

    def counting(changes: object) -> None:
        applied.append(1)
        apply(changes)  # type: ignore[arg-type]

    store.apply = counting  # type: ignore[method-assign]
    async with running(tmp_path, store=store) as h:
        holder = await h.connect()
        assert (await holder.call(try_acquire(1, "gone", releaseOnClose=True)))["ok"]
        applied.clear()
        # A check is pending again, as after a restart: the holder leaves.
        store._check = _PendingCheck()  # type: ignore[assignment]
        holder.close()
        assert await until(lambda: bool(h.engine.pending()))  # the close is noticed
        watcher = await h.connect()
        reply = await watcher.call({"id": 1, "op": "status", "key": "gone"})
        assert not reply["result"]["held"]  # decided in memory, answered at once
        assert h.engine.pending()  # ... but not written: the loop did not wait for a check
        assert applied == []
        store._check = None
        assert h.service.commit_fact("integrity_checked")
        assert applied == [1] and not h.engine.pending()


class _PendingCheck:
    """Stands for a check still running: only ``check_pending`` looks at it here."""

    def result(self) -> None:  # pragma: no cover - a write would wait here: the test fails
        pytest.fail("a fact waited for the integrity check on the event loop")


async def test_a_stop_while_a_request_waits_for_the_check_answers_it_shutting_down(
    tmp_path: Path,
) -> None:
    store = _checked_later(tmp_path / "state" / "lockd.db")
    async with running(tmp_path, store=store) as h:
        h.server.integrity_checked = trio.Event()
        peer, other = await h.connect(), await h.connect()
        await peer.send(try_acquire(1, "a"))
        assert (await other.call({"id": 1, "op": "hello"}))["ok"]  # the loop went on
        h.server.shutdown()
        reply = await peer.recv()
        assert reply is not None and reply["error"]["code"] == "SHUTTING_DOWN"
        assert reply["id"] == 1


async def test_the_rest_of_a_line_that_waited_behind_the_check_is_not_timed_out(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """A pipelining client whose next line was cut by a read: the wait is ours, not its.

    trio's clock stands still (``mock_clock``) but for the one jump that
    stands for a check outlasting ``partial_line_timeout``: a loaded machine
    cannot time the line out on its own.
    """
    store = _checked_later(tmp_path / "state" / "lockd.db")
    async with running(tmp_path, store=store, limits=Limits(partial_line_timeout=0.2)) as h:
        checked = trio.Event()
        h.server.integrity_checked = checked
        peer = await h.connect()
        hello = b'{"id":2,"op":"hello"}\n'
        await peer.sock.send(json.dumps(try_acquire(1, "a")).encode() + b"\n" + hello[:5])
        while not h.server._gated:  # read, its rest pending, the tryAcquire at the gate
            await trio.lowlevel.checkpoint()
        mock_clock.jump(0.3)  # the check takes longer than partial_line_timeout
        await trio.to_thread.run_sync(store.wait_checked)
        checked.set()
        first = await peer.recv()
        assert first is not None and first["ok"] and first["id"] == 1
        await peer.sock.send(hello[5:])
        second = await peer.recv()
        assert second is not None and second["ok"] and second["id"] == 2


# ------------------------------------------------- leases held during the check


def _iso_ms(stamp: str) -> int:
    """Milliseconds since the epoch of a ``leaseExpiresAt`` (RFC 3339, UTC)."""
    from datetime import datetime

    return round(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000)


def _renew(rid: int, key: str, handle: str, ttl_ms: int = 2_000) -> dict[str, object]:
    return {"id": rid, "op": "renew", "key": key, "handle": handle, "ttlMs": ttl_ms}


async def test_a_renew_sent_before_its_deadline_keeps_the_lease_however_long_the_check(
    tmp_path: Path,
) -> None:
    """A 2 s lease renewed 1 s into a 5 s check is renewed; one nobody renewed runs out after.

    Without the hold, the timer ran the lease out during the check and the
    renew, judged after it, answered ``lease_lost`` to a holder that had
    asked in time (docs/operations.md, "Restart time").
    """
    clock = FakeClock()
    async with running(tmp_path, clock=clock) as h:
        holder, idle, late = await h.connect(), await h.connect(), await h.connect()
        kept = (await holder.call(try_acquire(1, "kept", ttlMs=2_000)))["result"]
        assert (await idle.call(try_acquire(1, "idle", ttlMs=2_000)))["ok"]
        gone = (await late.call(try_acquire(1, "gone", ttlMs=1_000)))["result"]
        clock.advance(1_500)  # "gone" ran out before the restart answered
        checked = h.server.gate_for_check()  # as serve does at start

        await holder.send(_renew(2, "kept", kept["handle"]))
        await late.send(_renew(2, "gone", gone["handle"]))
        clock.advance(5_000)  # the check takes 5 s; both 2 s deadlines pass
        assert h.service.tick()  # the timer's passes meanwhile run out none of them
        assert h.service.next_deadline() is None  # ... and it does not wake for them
        status = await idle.call({"id": 2, "op": "status", "key": "kept"})
        assert status["result"]["held"], status
        assert _nothing_to_read(holder.sock)

        await h.server.open_gate()  # the check passed
        renewed = await holder.recv()
        assert renewed is not None and renewed["result"]["renewed"] is True, renewed
        # From the time it is judged (after the check), as every renew.
        moved = _iso_ms(renewed["result"]["leaseExpiresAt"]) - _iso_ms(kept["leaseExpiresAt"])
        assert moved == 6_500
        lost = await late.recv()
        assert lost is not None and lost["result"] == {"renewed": False, "reason": "lease_lost"}
        assert checked.is_set() and h.server.integrity_checked is None

        assert h.service.tick()  # leases run out again: "idle" (nobody renewed it) goes
        assert not (await idle.call({"id": 3, "op": "status", "key": "idle"}))["result"]["held"]
        assert (await idle.call({"id": 4, "op": "status", "key": "kept"}))["result"]["held"]
        clock.advance(2_000)
        assert h.service.tick()
        assert not (await idle.call({"id": 5, "op": "status", "key": "kept"}))["result"]["held"]


async def test_a_request_for_a_held_key_after_the_check_waits_for_the_renews_first(
    tmp_path: Path,
) -> None:
    """A tryAcquire that waited for the check does not take a key whose renew waited too."""
    clock = FakeClock()
    async with running(tmp_path, clock=clock) as h:
        holder, rival = await h.connect(), await h.connect()
        kept = (await holder.call(try_acquire(1, "k", ttlMs=2_000)))["result"]
        h.server.gate_for_check()
        await rival.send(try_acquire(1, "k", ttlMs=2_000))
        await holder.send(_renew(2, "k", kept["handle"]))
        clock.advance(5_000)
        await h.server.open_gate()
        busy, renewed = await rival.recv(), await holder.recv()
        assert busy is not None and busy["ok"] and busy["result"] is None, busy
        assert renewed is not None and renewed["result"]["renewed"] is True, renewed


async def test_every_renew_sent_during_the_check_is_judged_before_leases_run_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only the first line of each connection: later renews waited unread in their sockets.

    Four connections, three 2 s leases each, all renewed in time during a
    5 s check, one round of renews every 20 ms. Leases used to run out once
    the first lines were answered, so later renews were ``lease_lost``.
    """
    clock = FakeClock()
    async with running(tmp_path, clock=clock) as h:
        peers = [await h.connect() for _ in range(4)]
        leases: list[list[tuple[str, str]]] = []
        for i, peer in enumerate(peers):
            mine = []
            for j in range(3):
                reply = await peer.call(try_acquire(j + 1, f"k{i}.{j}", ttlMs=2_000))
                mine.append((f"k{i}.{j}", reply["result"]["handle"]))
            leases.append(mine)
        # Every later line waits for its socket to be readable, as on a busy
        # daemon (no inline read); five checks in a row, as five restarts.
        monkeypatch.setattr(h.server, "_read_now", lambda conn: None)
        for check in range(5):
            h.server.gate_for_check()
            for j in range(3):  # each connection's j-th renew, then the next round
                for peer, mine in zip(peers, leases, strict=True):
                    key, handle = mine[j]
                    await peer.send(_renew(10 * check + j, key, handle))
                await trio.sleep(0.02)
            clock.advance(5_000)  # every deadline passes during the check
            await h.server.open_gate()
            answers = [await peer.recv() for peer in peers for _ in range(3)]
            lost = [a for a in answers if a is None or a["result"]["renewed"] is not True]
            assert not lost, (check, answers)


async def test_serve_holds_leases_from_the_gate_until_the_check_and_its_requests_are_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring in serve: gate_for_check, then _await_integrity's open_gate after the check.

    A stored 2 s lease, renewed in time while the (held back) check runs
    for 5 s of the boot clock, is renewed; the timer's passes meanwhile
    run nothing out.
    """
    import threading
    from types import SimpleNamespace

    from lockd.daemon import serve, storecheck
    from lockd.daemon.engine import Changes, Lease, LockEngine

    clock = FakeClock()
    db = tmp_path / "state" / "lockd.db"
    db.parent.mkdir(mode=0o700)
    first = Store(db, BOOT)
    probe = Lease("probe", "h-probe", 1, None, "user:alice", 2_000, clock.now + 2_000)
    first.apply(Changes(rows={("probe", 0): probe}, fence=1))
    first.close()

    opened = threading.Event()  # the check's thread waits for this
    run = storecheck.IntegrityCheck._run

    def held_back(check: storecheck.IntegrityCheck) -> None:
        opened.wait(60)
        run(check)

    monkeypatch.setattr(storecheck.IntegrityCheck, "_run", held_back)
    store = Store(db, BOOT, background_check=True, defer_check=True)
    engine = LockEngine(fence=store.stored_fence())
    engine.restore_lazily(store.deadlines_after, store.leases_of)
    async with running(tmp_path, clock=clock, store=store, engine=engine) as h:
        h.server.gate_for_check()  # as serve._main does before it serves
        daemon = SimpleNamespace(store=store, service=h.service, server=h.server, refusal=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve._await_integrity, daemon, nursery.cancel_scope)
            store.start_check()
            peer = await h.connect()
            await peer.send(_renew(1, "probe", "h-probe"))
            clock.advance(5_000)
            try:
                h.service.tick()  # False: what time did waits for the check
                assert h.engine.status(clock.now, "probe").holder is not None
            finally:
                opened.set()  # the check runs and passes
            renewed = await peer.recv()
            assert renewed is not None and renewed["result"]["renewed"] is True, renewed
            assert h.server.integrity_checked is None and daemon.refusal is None
        clock.advance(2_001)
        assert h.service.tick()  # released: the renewed lease runs out at its new deadline
        assert h.engine.status(clock.now, "probe").holder is None
