"""Lease-loss events pushed by the daemon (docs/contract.md §12), as every client reads them.

A connection asks for them with ``hello {"events": true}``, sent ahead of
its first request without waiting for the answer: an older daemon refuses
the field (``INVALID_REQUEST``), nothing else changes, and the client keeps
learning of a loss at its next renewal. When a hold taken on the connection
ends other than by its own release, the daemon sends one line without an
``id``: ``{"event": "lost", "key", "handle", "fence", "cause", "reason",
"by", "at"}``. A loss told this way is kept per connection, by handle,
until the code holding that handle takes it.
"""

from __future__ import annotations

from ._record import Frozen

TYPE_CHECKING = False  # ``typing`` only for the type checker (start-up cost, issue 24)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["EVENTS_HELLO", "Loss", "LossBook", "loss_from"]

#: the arguments of the ``hello`` that turns events on.
EVENTS_HELLO: dict[str, Any] = {"events": True}

#: losses kept per connection for handles nobody asked about yet.
_KEPT = 1024


class Loss(Frozen):
    """One hold the daemon says is gone, and why."""

    __slots__ = ("at", "by", "cause", "fence", "handle", "key", "reason")
    __match_args__ = ("key", "handle", "fence", "cause", "reason", "by", "at")
    _fields = __match_args__

    key: str
    handle: str
    fence: int
    #: "break", "retake", "expired" or "session".
    cause: str
    #: the admin's text for a break, else None.
    reason: str | None
    #: the principal who broke or re-took the hold, else None.
    by: str | None
    #: when the daemon decided it (RFC 3339).
    at: str | None

    def __init__(
        self,
        key: str,
        handle: str,
        fence: int,
        cause: str,
        reason: str | None,
        by: str | None,
        at: str | None,
    ) -> None:
        fill = object.__setattr__  # frozen: its own __setattr__ refuses
        fill(self, "key", key)
        fill(self, "handle", handle)
        fill(self, "fence", fence)
        fill(self, "cause", cause)
        fill(self, "reason", reason)
        fill(self, "by", by)
        fill(self, "at", at)

    def describe(self) -> str:
        """One phrase for a message: ``broken by user:root: disk swap``."""
        if self.cause == "break":
            text = f"broken by {self.by or 'an admin'}"
            return f"{text}: {self.reason}" if self.reason else text
        if self.cause == "retake":
            return f"re-taken by {self.by or 'its owner'}"
        if self.cause == "expired":
            return "the lease ran out before it was renewed"
        if self.cause == "session":
            return "the daemon's backend session that kept it was lost"
        return f"lost ({self.cause})"


def loss_from(line: dict[str, Any]) -> Loss | None:
    """The loss a daemon line tells, or None if it is not a well-formed loss event."""
    if line.get("event") != "lost" or "id" in line:
        return None
    key, handle, fence, cause = (line.get(f) for f in ("key", "handle", "fence", "cause"))
    if not (isinstance(key, str) and isinstance(handle, str) and isinstance(cause, str)):
        return None
    if not isinstance(fence, int) or isinstance(fence, bool):
        return None
    reason, by, at = (line.get(f) for f in ("reason", "by", "at"))
    return Loss(
        key,
        handle,
        fence,
        cause,
        reason if isinstance(reason, str) else None,
        by if isinstance(by, str) else None,
        at if isinstance(at, str) else None,
    )


class LossBook:
    """The losses a connection was told, by handle (the oldest dropped past a bound).

    Not locked: the sync client's connection fills and reads it under its
    own lock; the async clients use it from one event loop.
    """

    def __init__(self) -> None:
        # A dict keeps insertion order: the oldest is the first key. Not an
        # OrderedDict: every connection has a book, and collections was
        # a start-up cost of every command (issue 24).
        self._by_handle: dict[str, Loss] = {}

    def add(self, loss: Loss) -> None:
        self._by_handle[loss.handle] = loss
        while len(self._by_handle) > _KEPT:
            del self._by_handle[next(iter(self._by_handle))]

    def get(self, handle: str) -> Loss | None:
        return self._by_handle.get(handle)
