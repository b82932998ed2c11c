"""Where lock decisions are committed: the seam the server and the service call.

:class:`LockBackend` is what they ask of the backend behind them, whichever
it is (``serve.py`` picks it from the config and hands it to the service
once, at construction): whether a request's answer must be awaited, that
answer, and what a closed connection, an undeliverable grant and ``stats``
need. Two implement it:

- ``embedded.py``: the default. The engine decides in memory (``engine.py``,
  the rules of ``lockd.core``) and SQLite keeps it (``store.py``); requests
  are answered at once by ``LockService`` and committed by the server's
  group commit, so it awaits nothing;
- ``lockd.daemon.remote.RemoteService`` over a :class:`RemoteBackend` that
  decides where other hosts decide too, so each answer is awaited;
  ``etcd/`` is the one there is (docs/contract.md §11, docs/etcd-design.md).

The service keeps everything per host in front of both: validation,
identity, rules, the rate limit, the reply views. A new remote backend is a
sub-package implementing :class:`RemoteBackend`, plus its config.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from lockd.core import Refused
from lockd.daemon.protocol import Acquire, Request
from lockd.daemon.waiterview import QueuedWaiter
from lockd.identity import Caller

if TYPE_CHECKING:
    from lockd.daemon.leases import Lease
    from lockd.daemon.remote import RemoteReply


class BackendUnavailable(Exception):
    """The backend could not answer in time: ``BACKEND_UNAVAILABLE``, nothing decided."""


class RemoteHold(Protocol):
    """One holder as a remote backend reports it; ``expires_at`` is epoch ms."""

    @property
    def key(self) -> str: ...
    @property
    def handle(self) -> str: ...
    @property
    def principal(self) -> str: ...
    @property
    def owner(self) -> str | None: ...
    @property
    def fence(self) -> int: ...
    @property
    def ttl_ms(self) -> int: ...
    @property
    def expires_at(self) -> int: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def process(self) -> str | None: ...
    @property
    def node(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def limit(self) -> int: ...
    @property
    def retake(self) -> bool: ...


@dataclass(frozen=True)
class RemoteStatus:
    """A key's holders (oldest grant first) and how many wait for it, on every host."""

    key: str
    holds: Sequence[RemoteHold]
    waiters: int
    #: the first waiters in queue order (up to MAX_LISTED_WAITERS), every host's.
    queue: Sequence[QueuedWaiter] = ()


class RemoteBackend(Protocol):
    #: this daemon's node name (``stats`` shows it).
    node: str
    #: seconds a request may take before BACKEND_UNAVAILABLE (``etcd_timeout``).
    timeout: float

    async def acquire(
        self,
        req: Acquire,
        caller: Caller,
        conn: int,
        timeout: float | None,
        parked: trio.Event | None = None,
        *,
        listens: bool = False,
    ) -> RemoteHold | Refused | None:
        """Grant, refuse, or None: busy (tryAcquire) or ``timeout`` seconds passed.

        ``listens``: the connection asking listens for events (docs/contract.md
        §12.1); the hold records it, so a break made elsewhere waits for it.

        A blocking acquire sets ``parked`` once it waits: its place in the
        queue is written (a ``status`` now counts it), or it retries while
        the backend does not answer. The connection's next request waits
        for that, so requests take effect in the order they were sent.
        """

    async def find(self, key: str, handle: str) -> RemoteHold | None:
        """The live hold ``handle`` of ``key``, if it still holds."""

    async def renew(self, hold: RemoteHold, ttl_ms: int) -> RemoteHold | None:
        """The renewed hold, or None when it no longer holds."""

    async def release(self, key: str, handle: str) -> bool: ...

    async def status(self, key: str) -> RemoteStatus: ...

    async def list_held(
        self, prefix: str, limit: int, after: str | None
    ) -> tuple[list[RemoteStatus], str | None]:
        """Held keys in key order from after ``after``; the key to continue after, if more."""

    async def break_lock(
        self,
        key: str,
        *,
        by: str | None = None,
        reason: str | None = None,
        grace_ms: int = 0,
        keep: frozenset[str] = frozenset(),
        stop_local: Callable[[list[str]], Awaitable[None]] | None = None,
    ) -> Sequence[RemoteHold]:
        """End every hold of ``key``; the holds ended, oldest first.

        ``by`` (the principal) and ``reason`` reach holders granted by other
        daemons with their loss event (docs/contract.md §12.1). With
        ``grace_ms``, the holds of ``keep`` (this daemon's listening
        connections) still there after the others ended are handed to
        ``stop_local``, which tells their holders and returns once they
        stopped; a hold another daemon granted to a listening connection
        ends once its holder stopped, within a bounded wait (docs/contract.md
        §11). The call is not bounded by ``timeout`` then.
        """

    def release_undelivered(self, hold: RemoteHold) -> None:
        """A grant whose reply could not be written: release it as soon as the backend answers."""

    def connection_closed(self, conn: int) -> None:
        """Release the ``releaseOnClose`` holds granted on connection ``conn``."""

    def gauges(self) -> dict[str, object]: ...


class LockBackend(Protocol):
    """What the server and the service call, without asking which backend is behind it."""

    def awaits(self, request: Request) -> bool:
        """True when ``request`` is answered by awaiting :meth:`answer`.

        False: the service answers it at once (decided in memory and
        committed by the server's group commit). ``hello``, ``rules`` and
        ``stats`` are never awaited: they answer while a backend is down.
        """

    async def answer(
        self,
        caller: Caller,
        conn: int,
        request: Request,
        *,
        pending: int,
        parked: trio.Event | None = None,
        listens: bool = False,
    ) -> RemoteReply:
        """The answer to a request :meth:`awaits`; raises ProtocolError.

        ``listens``: connection ``conn`` asked for events (docs/contract.md §12.1).
        """

    def release_undelivered(self, grant: Lease | RemoteHold) -> None:
        """A grant whose reply could not be written: release it."""

    def connection_closed(self, conn: int, *, release_bound: bool) -> None:
        """The connection's waiters leave; with ``release_bound`` its bound holds end."""

    def gauges(self) -> dict[str, object]:
        """``stats`` gauges: held, waiters, fence, node."""
