"""File descriptors: every connection is one, and running out must refuse, never hang.

Three pieces, used by ``serve`` (start-up) and ``server`` (accept):

- :func:`raise_soft_limit` lifts the soft ``RLIMIT_NOFILE`` to the hard one
  at start-up. Outside systemd the soft limit is often 1024 while the hard
  one is far higher. Under the shipped units ``LimitNOFILE=`` already sets
  both, and their seccomp filter (``~@resources``) refuses ``setrlimit``
  anyway, so a refusal is expected and harmless.
- :func:`connection_budget` is how many connections fit under the limit once
  the daemon's own descriptors are set aside; ``serve`` lowers
  ``max_connections`` to it (and says so), so that the ordinary
  ``max_connections`` refusal -- accept, close at once, count -- is what
  clients over the limit meet.
- :class:`SpareFd` is the last line, for when descriptors run out anyway (a
  limit lowered at run time with ``prlimit``, descriptors used elsewhere):
  ``accept()`` then fails with ``EMFILE`` and leaves the connection in the
  backlog, where its client would hang while the listener stays readable and
  the accept loop spins. One descriptor held in reserve is closed, the
  waiting connection is accepted and closed at once, and the reserve is
  taken again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import time

from lockd.logfmt import kv

#: descriptors the daemon keeps for itself besides connections: the listener,
#: SQLite's database and WAL, inotify, epoll and trio's wake-up pipe, the
#: socket-path lock, the sd_notify socket, the log, rule files being read,
#: NSS lookups (passwd, group, sssd sockets), the spare below. About 16 are
#: open at any time; the rest is headroom for the transient ones.
RESERVED_FDS = 64


def raise_soft_limit() -> tuple[int, int]:
    """Lift the soft RLIMIT_NOFILE to the hard limit where allowed; return (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        # Refused under the units' seccomp filter (~@resources): keep what we have.
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def connection_budget(soft_limit: int) -> int:
    """Connections that fit under ``soft_limit`` beside the daemon's own descriptors."""
    if soft_limit == resource.RLIM_INFINITY:
        return 2**31 - 1
    return max(1, soft_limit - RESERVED_FDS)


def _open_reserve() -> int | None:
    try:
        return os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


class SpareFd:
    """One descriptor held back so a connection can still be refused when none is left."""

    def __init__(self) -> None:
        self._fd = _open_reserve()

    def refuse_one(self, listen: socket.socket) -> bool:
        """Accept one waiting connection with the reserve and close it at once.

        Returns False when nothing could be refused (no connection waiting,
        or even the reserve's descriptor was taken meanwhile).
        """
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            conn, _ = listen.accept()
        except OSError:
            return False
        else:
            conn.close()
            return True
        finally:
            self._fd = _open_reserve()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: errno values of accept() that mean "no descriptor for this connection".
OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE})


class ThrottledWarnings:
    """At most one warning line per event and reason per ``interval`` seconds.

    A flood of connections over a limit must not become a flood of log lines
    (thousands a second): the first of a burst is logged at once, the rest
    are counted into the next line (``count`` = occurrences since the
    previous line). ``stats`` counts every refusal anyway.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        #: (event, reason) -> (monotonic time of the last line, occurrences since)
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def warn(self, event: str, reason: str, **fields: object) -> None:
        key = (event, reason)
        now = time.monotonic()
        last, count = self._seen.get(key, (now - self._interval, 0))
        count += 1
        if now - last < self._interval:
            self._seen[key] = (last, count)
            return
        self._seen[key] = (now, 0)
        self._log.warning(kv(event=event, reason=reason, count=count, **fields))
