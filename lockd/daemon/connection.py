"""One client connection as the server keeps it, and the acquires it has waiting.

Plain records shared by the server's parts (:mod:`lockd.daemon.server`,
:mod:`lockd.daemon.outbox`, :mod:`lockd.daemon.waits`): who is on the
other end, its reply writer, and its requests waiting in tasks of their
own. Separate so that those parts can name them without importing each
other.
"""

from __future__ import annotations

import socket as stdsocket
from dataclasses import dataclass, field

import trio

from lockd.daemon import sockio
from lockd.daemon.protocol import RequestId
from lockd.daemon.service import AcquireStep
from lockd.identity import Caller


@dataclass(eq=False)
class Connection:
    id: int
    sock: stdsocket.socket
    caller: Caller
    #: writes the replies in order (set once the connection's nursery is open).
    writer: sockio.ReplyWriter | None = None
    #: requests of this connection waiting in tasks of their own.
    waiting: int = 0
    #: those waits by request id, for ``cancel`` (a client reusing an id gets a list).
    waits: dict[RequestId, list[Wait]] = field(default_factory=dict)
    #: set while a blocking acquire a remote backend decides is not parked yet:
    #: the next line waits for it (see ``LockServer._read_lines``; the other
    #: requests it decides are awaited by the connection's task itself).
    remote_busy: trio.Event | None = None
    #: polls for the next request a moment before parking (``LockServer._read_now``).
    busy: sockio.BusyPoll = field(default_factory=lambda: sockio.BusyPoll(0))
    #: asked for lease-loss events (``hello {"events": true}``, docs/contract.md §12).
    events: bool = False


@dataclass(eq=False)
class Wait:
    """One acquire waiting in a task of its own, as ``cancel`` sees it."""

    #: None for a request a remote backend decides (``Waits.answer_remote``).
    step: AcquireStep | None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: set by ``cancel``: answer CANCELLED, not the step's outcome.
    cancelled: bool = False
    #: the step's reply left its commit to the group commit (see LockService.deferred).
    deferred: bool = False
    #: its grant was sent when the engine handed it over (see Waits.wake).
    answered: bool = False

    def leave(self, conn: Connection, request_id: RequestId) -> None:
        """This wait is over: forget it in ``conn``'s waits and count it out."""
        waits = conn.waits.get(request_id, [])
        if self in waits:
            waits.remove(self)
        if not waits:
            conn.waits.pop(request_id, None)
        conn.waiting -= 1
