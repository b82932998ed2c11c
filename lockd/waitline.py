"""One live line on a terminal while a command waits for a key (issue 24).

``lockd locks acquire --wait`` and ``lockd run --wait`` park in the
daemon's queue and can sit there for minutes; a person at the terminal
should see why. (No click here: ``lockd run``'s logic uses it too.) While it waits, a
thread of its own asks ``status`` every :data:`INTERVAL` seconds on a
connection of its own and rewrites one line on stderr::

    waiting 14s for 'nightly': held by user:alice (pid 4242 backup.sh),
    lease ends in 41s; 2nd of 3 in the queue

(on one line)

Only when stderr is a terminal (never in scripts, pipes, cron mail or under
``--json``), and the line is erased before the command prints anything else.
The text itself is :func:`wait_text`, a plain function of a status.
"""

from __future__ import annotations

import os
import sys
import time

from lockd_client import LockClient, LockStatus

from lockd.timefmt import format_duration_ms

# threading and lockd.describe are imported when the line is shown: lockd run
# --wait loads this module whenever it may wait, and in a script or under
# cron (no terminal) nothing here runs (issue 24: start-up).
TYPE_CHECKING = False  # typing for the type checker only: it costs start-up time (issue 24)
if TYPE_CHECKING:
    import threading
    from typing import IO

#: seconds between two status reads (and redraws).
INTERVAL = 0.5
#: longest line written: a terminal wraps longer ones, and one line must stay one.
MAX_WIDTH = 200


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def wait_text(status: LockStatus, waited_ms: int, pid: int) -> str:
    """What the line says: who holds the key, for how long, and our place in the queue.

    Our entry in ``waiterList`` is the one with our pid (the daemon saw it
    through SO_PEERCRED); the position is unknown ("in the queue") when the
    list was cut at 100 before us.
    """
    from lockd.describe import who_holds

    parts = [f"waiting {format_duration_ms(waited_ms)} for {status.key!r}"]
    if status.held:
        holder = f"held by {who_holds(status)}"
        if status.expires_in_ms is not None:
            holder += f", lease ends in {format_duration_ms(status.expires_in_ms)}"
        parts.append(holder)
    else:
        parts.append("free now, being handed over")
    ours = next((w for w in status.waiter_list if w.pid == pid), None)
    if ours is not None and ours.position is not None:
        parts.append(f"{_ordinal(ours.position)} of {status.waiters} in the queue")
    else:
        parts.append(f"{status.waiters} in the queue")
    return f"{parts[0]}: {'; '.join(parts[1:])}"


class WaitLine:
    """The live line: ``with WaitLine(key, socket_path): client.acquire(...)``.

    Does nothing unless ``stream`` is a terminal. Errors of its own status
    reads (the daemon restarting, say) only pause the line: the wait itself
    is the caller's and is not disturbed.
    """

    def __init__(self, key: str, socket_path: str | None, stream: IO[str] | None = None) -> None:
        self.key = key
        self.socket_path = socket_path
        self.stream = stream if stream is not None else sys.stderr
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._shown = False
        self._lock: threading.Lock | None = None

    @property
    def enabled(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"

    def __enter__(self) -> WaitLine:
        if self.enabled:
            import threading

            self._stop = threading.Event()
            self._lock = threading.Lock()
            self._thread = threading.Thread(target=self._run, name="lockd-wait-line", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is None or self._lock is None:
            return  # not on a terminal: nothing was started or shown
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            if self._shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._shown = False

    def _run(self) -> None:
        assert self._stop is not None
        started = time.monotonic()
        pid = os.getpid()
        # The first draw waits a moment: a wait that ends at once shows nothing.
        if self._stop.wait(INTERVAL):
            return
        try:
            client = LockClient(self.socket_path, connect_timeout=1.0, request_timeout=2.0)
        except Exception:
            return
        with client:
            while not self._stop.is_set():
                try:
                    status = client.status(self.key)
                except Exception:
                    status = None
                if status is not None:
                    waited = int((time.monotonic() - started) * 1000)
                    self._draw(wait_text(status, waited, pid))
                if self._stop.wait(INTERVAL):
                    return

    def _draw(self, text: str) -> None:
        assert self._lock is not None and self._stop is not None
        with self._lock:
            if self._stop.is_set():
                return
            self.stream.write("\r\x1b[K" + text[:MAX_WIDTH])
            self.stream.flush()
            self._shown = True
