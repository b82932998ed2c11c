"""The daemon and its supervisor: signals in, systemd notifications out.

SIGTERM and SIGINT stop the daemon cleanly, SIGHUP reloads the access
rules; systemd hears READY=/RELOADING=/STOPPING=, a STATUS= line that
follows the load, and WATCHDOG=1 pings sent from the event loop itself (a
blocked loop stops them, and systemd restarts the daemon). The protocol
is :mod:`lockd.daemon.systemd`'s; this is the server's side of it
(:mod:`lockd.daemon.server`), separate because it concerns the process,
not any connection.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import trio

from lockd.daemon import systemd

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: seconds between STATUS= updates to systemd when the load changed.
STATUS_INTERVAL = 5.0


class Supervision:
    """Signals to the server, the server's state to systemd."""

    def __init__(
        self,
        gauges: Callable[[], dict[str, Any]],
        connection_count: Callable[[], int],
        shutdown: Callable[[], None],
        reload_rules: Callable[[], object] | None,
    ) -> None:
        #: the service's gauges (held, waiters).
        self._gauges = gauges
        self._connection_count = connection_count
        self._shutdown = shutdown
        self._reload_rules = reload_rules

    async def signals(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The task that turns signals into a stop or a reload."""
        with trio.open_signal_receiver(*HANDLED_SIGNALS) as signals:
            # daemon.build() blocked these signals before the socket could
            # answer; one that came early is delivered to us now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS)
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self._reload()
                else:
                    self._shutdown()

    def _reload(self) -> None:
        if self._reload_rules is None:
            return
        systemd.reloading()
        try:
            self._reload_rules()
        finally:
            systemd.ready(self.status_line())

    async def report(self, watchdog: float | None) -> None:
        """WATCHDOG=1 pings (when enabled) and a fresh STATUS= line.

        Pinged from the event loop itself: a blocked loop stops the pings and
        systemd restarts the daemon. Without a watchdog, STATUS= still follows
        the load every few seconds for ``systemctl status``.
        """
        interval = min(watchdog, STATUS_INTERVAL) if watchdog else STATUS_INTERVAL
        last_status = ""
        while True:
            if watchdog:
                systemd.watchdog_ping()
            line = self.status_line()
            if line != last_status:
                systemd.status(line)
                last_status = line
            await trio.sleep(interval)

    def status_line(self) -> str:
        gauges = self._gauges()
        held, waiters = gauges.get("held"), gauges["waiters"]
        connections = self._connection_count()
        return (
            # A remote backend knows no count of every host's holds.
            (f"{held} lock{'s' if held != 1 else ''} held, " if held is not None else "")
            + f"{waiters} waiter{'s' if waiters != 1 else ''}, "
            f"{connections} connection{'s' if connections != 1 else ''}"
        )
