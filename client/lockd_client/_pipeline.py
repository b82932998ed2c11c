"""One pipelined connection of the asyncio and trio clients, without I/O.

:class:`Pipeline` keeps the requests in flight by id, files the replies as
bytes come in, and says what to do when a waiting task gives up (see
:mod:`lockd_client._async` for why that never leaves a key held); a backend
(:mod:`lockd_client.aio`, :mod:`lockd_client.trio`) supplies its
:class:`Slot` (where a reply is delivered) and :class:`BlockGuard` (how the
block of ``lock()`` is cancelled).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Generic, TypeVar

from ._connection import ConnectionLost
from ._events import EVENTS_HELLO, Loss, LossBook, loss_from
from ._requests import late_grant
from ._wire import BadLine, ReplyLines, encode

__all__ = ["BlockGuard", "Pipeline", "Slot", "SlotT"]


class Slot(ABC):
    """Where one request's reply (or the connection's death) is delivered."""

    reply: dict[str, Any] | None = None

    @abstractmethod
    def deliver(self, reply: dict[str, Any]) -> None:
        """File the reply and wake the waiting task."""

    @abstractmethod
    def fail(self, lost: ConnectionLost) -> None:
        """The connection died before the reply: wake the task with ``lost``."""


SlotT = TypeVar("SlotT", bound=Slot)


class BlockGuard(ABC):
    """Cancels the block of an ``async with client.lock(...)`` when its hold is lost.

    Entered around the block (in the block's task); :meth:`cancel` may be
    called from any task of the loop (the connection's reader). ``fired``
    says whether it did; :meth:`absorb` takes back the cancellation it
    caused, so the block ends in ``LockLostError`` instead.
    """

    fired = False

    @abstractmethod
    def __enter__(self) -> BlockGuard: ...

    @abstractmethod
    def __exit__(self, *exc: object) -> bool | None: ...

    @abstractmethod
    def cancel(self) -> None:
        """Cancel the block now."""

    @abstractmethod
    async def absorb(self, exc: BaseException | None) -> bool:
        """After the block: True if ``exc`` (None: it ended normally) is only our cancellation."""


class Pipeline(Generic[SlotT]):
    """One pipelined connection's bookkeeping, without I/O.

    ``send`` queues bytes for the connection synchronously (it must not
    block or await); ``make_slot`` makes a backend's :class:`Slot`.
    """

    def __init__(
        self,
        send: Callable[[bytes], None],
        make_slot: Callable[[], SlotT],
        next_id: Callable[[], int],
    ) -> None:
        self._send = send
        self._make_slot = make_slot
        self._next_id = next_id
        self._waiting: dict[int, SlotT] = {}
        self._abandoned: dict[int, str] = {}
        self._lines = ReplyLines()
        self.lost: ConnectionLost | None = None
        #: losses the daemon pushed (docs/contract.md §12), and who waits for each handle's.
        self.losses = LossBook()
        self.loss_listeners: dict[str, Callable[[Loss], None]] = {}
        #: ``hello {"events": true}`` was sent on it.
        self.events_asked = False

    @property
    def dead(self) -> bool:
        return self.lost is not None

    def start(self, message: dict[str, Any]) -> SlotT:
        """Send ``message`` and return the slot its reply will arrive in."""
        if self.lost is not None:
            raise ConnectionLost(self.lost.reason, sent=False)
        slot = self._make_slot()
        self._waiting[message["id"]] = slot
        try:
            self._send(encode(message))
        except BaseException:
            self._waiting.pop(message["id"], None)
            raise
        return slot

    def feed(self, data: bytes) -> None:
        """Bytes from the daemon; ``b""`` is the end of the connection."""
        if not data:
            self.die("the daemon closed the connection")
            return
        try:
            replies = self._lines.feed(data)
        except BadLine as exc:
            self.die(str(exc), protocol=True)
            return
        for reply in replies:
            rid = reply.get("id")
            if not isinstance(rid, int) or isinstance(rid, bool):
                loss = loss_from(reply) if rid is None else None
                if loss is not None:  # pushed (docs/contract.md §12)
                    self._told(loss)
                continue  # id null: the daemon could not read one of our lines
            op = self._abandoned.pop(rid, None)
            if op is not None:
                self._give_back(op, reply)
                continue
            slot = self._waiting.pop(rid, None)
            if slot is not None:
                slot.deliver(reply)

    def _told(self, loss: Loss) -> None:
        self.losses.add(loss)
        listener = self.loss_listeners.pop(loss.handle, None)
        if listener is not None:
            listener(loss)

    def ask_events(self) -> None:
        """Send ``hello {"events": true}`` once, not waited for (an old daemon refuses it)."""
        if not self.events_asked:
            self.events_asked = True
            self._send_quietly({"id": self._next_id(), "op": "hello", **EVENTS_HELLO}, "hello")

    def give_up(self, rid: int, op: str, slot: SlotT) -> None:
        """The task waiting for ``rid`` stopped waiting (cancelled, timed out).

        Synchronous on purpose: it runs inside a cancelled task.
        """
        self._waiting.pop(rid, None)
        if slot.reply is not None:  # it came, but the task never took it
            self._give_back(op, slot.reply)
            return
        if self.lost is not None:
            return  # nothing to withdraw: the daemon dropped it with the connection
        self._abandoned[rid] = op
        if op == "acquire":  # withdraw it from the queue; a crossing grant comes back
            self._send_quietly({"id": self._next_id(), "op": "cancel", "target": rid}, "cancel")

    def die(self, reason: str, *, protocol: bool = False) -> None:
        """The connection is unusable: every waiting task is woken with ConnectionLost."""
        if self.lost is not None:
            return
        self.lost = ConnectionLost(reason, protocol=protocol)
        waiting, self._waiting = self._waiting, {}
        self._abandoned.clear()
        for slot in waiting.values():
            slot.fail(self.lost)

    def _give_back(self, op: str, reply: dict[str, Any]) -> None:
        grant = late_grant(op, reply)
        if grant is not None:
            key, handle = grant
            message = {"id": self._next_id(), "op": "release", "key": key, "handle": handle}
            self._send_quietly(message, "release")

    def _send_quietly(self, message: dict[str, Any], op: str) -> None:
        """Send a request nobody waits for (its reply is dropped)."""
        if self.lost is not None:
            return
        self._abandoned[message["id"]] = op
        with suppress(ConnectionLost):
            self._send(encode(message))
