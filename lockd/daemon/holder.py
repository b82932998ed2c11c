"""The process behind a hold, as ``status`` and ``list`` show it (docs/contract.md §12.2).

A hold records the pid of the process that uses it, its name and when it
started. The pid is the peer's own unless the client named another one that
the daemon can vouch for (:func:`lockd.identity.verified_holder_pid`):
``lockd run`` names COMMAND, ``lockd locks acquire`` the shell that called
it. The name is read at the grant (``lockd run``'s COMMAND carries its
name before it is exec'd). The start time tells the recorded process from a later one that reuses
its pid, so ``alive`` is only true for the very process that took the hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lockd.identity import Caller, process_name, process_start, verified_holder_pid

__all__ = ["HolderProcess", "holder_fields", "holder_process"]


@dataclass(frozen=True)
class HolderProcess:
    pid: int | None
    process: str | None
    #: clock ticks since boot (/proc/PID/stat field 22); None when unknown.
    start: int | None


def holder_process(caller: Caller, claimed: int | None) -> HolderProcess:
    """Who will hold: ``claimed`` if verified, else the peer.

    The peer's name and start were read once, when its connection was
    accepted; only a claimed pid costs reads of /proc here.
    """
    if caller.pid <= 0:  # the peer is in a pid namespace the daemon cannot see into
        return HolderProcess(None, caller.process, None)
    if claimed is None or claimed == caller.pid:
        return HolderProcess(caller.pid, caller.process, caller.start)
    pid = verified_holder_pid(caller.pid, caller.uid, claimed)
    if pid == caller.pid:
        return HolderProcess(caller.pid, caller.process, caller.start)
    return HolderProcess(pid, process_name(pid), process_start(pid))


def holder_fields(pid: int | None, process: str | None, start: int | None) -> dict[str, Any]:
    """``pid``, ``process`` and ``alive`` of one holder entry.

    ``alive`` is true while ``pid`` runs with the recorded start time, false
    once it does not, and None when the daemon cannot know (no start time
    recorded: a row of schema 3 or older, a peer in another pid namespace,
    an etcd hold of another node). One read of /proc/PID/stat per holder shown.
    """
    alive = None if pid is None or start is None else process_start(pid) == start
    return {"pid": pid, "process": process, "alive": alive}
