"""The systemd edge: socket activation, readiness/status notifications, watchdog.

A dependency-free re-implementation of the parts of libsystemd that lockd uses
(``sd_listen_fds(3)``, ``sd_notify(3)``, ``sd_watchdog_enabled(3)``), so the
daemon runs the same with or without systemd and needs no C bindings:

- Everything is a no-op when the environment does not carry the variables
  systemd sets. ``lockd serve`` started by hand, under pytest or under
  ``systemd-socket-activate`` behaves correctly without checking first.
- Nothing here raises because systemd is missing or misbehaving: a lost
  ``STATUS=`` line must never take a lock service down. Failures are logged at
  debug level and reported as ``False``.
- Nothing here blocks for long: ``notify`` is called from the trio event loop
  (watchdog task, status updates), so a send is bounded by a short timeout.

The daemon uses it like this::

    socks = systemd.listen_fds()          # adopt socks[0] instead of binding
    ...                                   # once the socket accepts:
    systemd.ready(status="0 locks held, 0 waiters")
    interval = systemd.watchdog_interval()  # None: no watchdog task
    ...                                   # every `interval` seconds:
    systemd.watchdog_ping()
    systemd.status(systemd.describe_load(held=3, waiters=1))
    systemd.reloading(); reload_rules(); systemd.ready()   # around SIGHUP
    systemd.stopping()                    # on SIGTERM
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator

__all__ = [
    "SD_LISTEN_FDS_START",
    "describe_load",
    "extend_timeout",
    "listen_fd_names",
    "listen_fds",
    "listen_fds_with_names",
    "notify",
    "ready",
    "reload_cycle",
    "reloading",
    "status",
    "stopping",
    "watchdog_interval",
    "watchdog_ping",
]

log = logging.getLogger(__name__)

#: The first file descriptor systemd passes (after stdin, stdout, stderr).
SD_LISTEN_FDS_START = 3

#: Upper bound on one sd_notify send. PID 1 drains its notify socket all the
#: time; a full queue means the manager is wedged, and waiting longer inside
#: the event loop would only stall every lock client as well.
_SEND_TIMEOUT = 0.5

_ENV_LISTEN = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


# --------------------------------------------------------------------------
# Socket activation


def _listen_count() -> int:
    """How many fds systemd passed to *this* process, 0 when none or invalid.

    ``LISTEN_PID`` guards against a child inheriting the environment of an
    activated parent: only the process the manager started may adopt fds.
    """
    pid_text = os.environ.get("LISTEN_PID")
    fds_text = os.environ.get("LISTEN_FDS")
    if not pid_text or not fds_text:
        return 0
    try:
        pid = int(pid_text)
        count = int(fds_text)
    except ValueError:
        log.debug("ignoring malformed LISTEN_PID=%r LISTEN_FDS=%r", pid_text, fds_text)
        return 0
    if pid != os.getpid():
        return 0
    if count < 1:
        return 0
    return count


def listen_fd_names() -> list[str]:
    """Names of the passed fds (``FileDescriptorName=``, default the socket unit's name).

    Read-only: does not unset anything, so call it *before* :func:`listen_fds`
    (or use :func:`listen_fds_with_names`). Missing names read ``"unknown"``,
    as libsystemd reports them. Empty when nothing was passed to this process.
    """
    count = _listen_count()
    if count == 0:
        return []
    raw = os.environ.get("LISTEN_FDNAMES")
    names = raw.split(":") if raw else []
    names = names[:count]
    names += ["unknown"] * (count - len(names))
    return names


def listen_fds_with_names(*, unset_env: bool = True) -> list[tuple[socket.socket, str]]:
    """Adopt the sockets systemd passed (fds 3, 4, ...), each with its name.

    Follows sd_listen_fds(3): when ``LISTEN_PID`` is our pid and ``LISTEN_FDS``
    >= 1, fds ``3 .. 3+LISTEN_FDS-1`` are ours. Each is marked close-on-exec
    (systemd passes them inheritable, and nothing we spawn should hold the
    listening socket open past our death) and wrapped in a
    :class:`socket.socket`, which reads family and type from the fd itself.
    A passed fd that is not a socket (``ListenFIFO=`` and friends) is skipped
    with a warning: lockd only listens on stream sockets.

    With ``unset_env`` (the default, as libsystemd's ``unset_environment``),
    ``LISTEN_PID``/``LISTEN_FDS``/``LISTEN_FDNAMES`` are removed whatever the
    outcome, so a child process never believes the fds were meant for it and a
    second call returns ``[]``. Call it once: with ``unset_env=False`` a second
    call wraps the same fds in new socket objects, and whichever is garbage
    collected first closes the fd under the other.
    """
    try:
        count = _listen_count()
        names = listen_fd_names()
        adopted: list[tuple[socket.socket, str]] = []
        for index in range(count):
            fd = SD_LISTEN_FDS_START + index
            try:
                mode = os.fstat(fd).st_mode
            except OSError as exc:
                log.warning("LISTEN_FDS names fd %d but it is not open: %s", fd, exc)
                continue
            if not stat.S_ISSOCK(mode):
                log.warning("ignoring inherited fd %d (%s): not a socket", fd, names[index])
                continue
            flags = fcntl.fcntl(fd, fcntl.F_GETFD)
            fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
            adopted.append((socket.socket(fileno=fd), names[index]))
        return adopted
    finally:
        if unset_env:
            for name in _ENV_LISTEN:
                os.environ.pop(name, None)


def listen_fds(*, unset_env: bool = True) -> list[socket.socket]:
    """The sockets systemd passed to this process, in order; ``[]`` when none.

    The daemon adopts ``listen_fds()[0]`` instead of binding its own socket.
    See :func:`listen_fds_with_names` for the rules.
    """
    return [sock for sock, _name in listen_fds_with_names(unset_env=unset_env)]


# --------------------------------------------------------------------------
# sd_notify

_notify_lock = threading.Lock()
_notify_sock: socket.socket | None = None


def _notify_address(value: str) -> bytes | None:
    """``$NOTIFY_SOCKET`` as a socket address: a path, or ``@name`` for abstract.

    Other forms (systemd >= 254 also accepts ``vsock:CID:PORT``) are not
    something a local lock daemon is ever handed; they return None.
    """
    if value.startswith("/"):
        return os.fsencode(value)
    if value.startswith("@") and len(value) > 1:
        # Linux abstract namespace: leading NUL byte instead of '@'.
        return b"\0" + os.fsencode(value[1:])
    return None


def _socket() -> socket.socket:
    """The cached, unconnected datagram socket used for every notification.

    Unconnected (``sendto`` each time) so it keeps working when the manager
    re-executes and re-creates its notify socket, and so tests may point
    ``NOTIFY_SOCKET`` elsewhere between calls.
    """
    global _notify_sock
    if _notify_sock is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # close-on-exec (PEP 446)
        sock.settimeout(_SEND_TIMEOUT)
        _notify_sock = sock
    return _notify_sock


def _drop_socket() -> None:
    global _notify_sock
    if _notify_sock is not None:
        with contextlib.suppress(OSError):
            _notify_sock.close()
        _notify_sock = None


def notify(message: str) -> bool:
    """Send one sd_notify(3) datagram (``"READY=1\\nSTATUS=..."``) to ``$NOTIFY_SOCKET``.

    Returns True when the datagram was handed to the kernel, False when
    ``NOTIFY_SOCKET`` is unset (not started by systemd, or ``NotifyAccess=``
    off) or the send failed. Never raises for a missing or broken socket: the
    failure is logged at debug level, and the cached socket is dropped so the
    next call starts afresh. ``NOTIFY_SOCKET`` stays in the environment: the
    daemon spawns no children that could misuse it, and the watchdog needs it
    for the daemon's whole life.
    """
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    address = _notify_address(target)
    if address is None:
        log.debug("unsupported NOTIFY_SOCKET=%r; not notifying", target)
        return False
    data = message.encode("utf-8")
    with _notify_lock:
        try:
            sent = _socket().sendto(data, address)
        except OSError as exc:  # ENOENT, ECONNREFUSED, EAGAIN/timeout, EMSGSIZE ...
            log.debug("sd_notify to %r failed: %s", target, exc)
            _drop_socket()
            return False
    if sent != len(data):  # datagrams are all-or-nothing; defensive
        log.debug("sd_notify to %r sent %d of %d bytes", target, sent, len(data))
        return False
    return True


def _one_line(text: str) -> str:
    """STATUS= and friends are one line each: newlines would start new fields."""
    return " ".join(text.splitlines()).strip()


def ready(status: str | None = None) -> bool:
    """``READY=1`` (plus ``STATUS=``): the socket accepts; also ends a reload."""
    message = "READY=1"
    if status is not None:
        message += f"\nSTATUS={_one_line(status)}"
    return notify(message)


def status(text: str) -> bool:
    """``STATUS=<text>``, shown by ``systemctl status lockd``."""
    return notify(f"STATUS={_one_line(text)}")


def stopping(status: str | None = None) -> bool:
    """``STOPPING=1``: shutdown started (SIGTERM); systemd stops expecting pings."""
    message = "STOPPING=1"
    if status is not None:
        message += f"\nSTATUS={_one_line(status)}"
    return notify(message)


def _monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def reloading(status: str | None = None) -> bool:
    """``RELOADING=1`` with ``MONOTONIC_USEC=`` (CLOCK_MONOTONIC), as systemd >= 253 wants.

    systemd >= 253 ignores RELOADING=1 without a current MONOTONIC_USEC= (it
    uses the timestamp to pair the reload with ``systemctl reload``); older
    versions ignore the extra field. Send :func:`ready` when the reload is
    over, whether it succeeded or not: a rule set that fails to load leaves the
    previous policy in force, so the daemon is still ready.
    """
    message = f"RELOADING=1\nMONOTONIC_USEC={_monotonic_usec()}"
    if status is not None:
        message += f"\nSTATUS={_one_line(status)}"
    return notify(message)


@contextlib.contextmanager
def reload_cycle(status_after: str | None = None) -> Iterator[None]:
    """``RELOADING=1`` on entry, ``READY=1`` on exit (also when the body raises)."""
    reloading()
    try:
        yield
    finally:
        ready(status_after)


def watchdog_ping() -> bool:
    """``WATCHDOG=1``: the event loop is alive."""
    return notify("WATCHDOG=1")


def extend_timeout(seconds: float) -> bool:
    """``EXTEND_TIMEOUT_USEC=``: ask for more time to start or stop than configured."""
    return notify(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1_000_000))}")


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings, or None when the watchdog is off.

    Half of ``WATCHDOG_USEC``, as sd_watchdog_enabled(3) recommends, so that
    one late ping never trips the watchdog. Honoured only when
    ``WATCHDOG_PID`` is unset (older managers) or names this process, so a
    child that inherits the environment does not ping on the daemon's behalf.
    """
    usec_text = os.environ.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    try:
        usec = int(usec_text)
    except ValueError:
        log.debug("ignoring malformed WATCHDOG_USEC=%r", usec_text)
        return None
    if usec <= 0:
        return None
    pid_text = os.environ.get("WATCHDOG_PID")
    if pid_text:
        try:
            if int(pid_text) != os.getpid():
                return None
        except ValueError:
            log.debug("ignoring malformed WATCHDOG_PID=%r", pid_text)
            return None
    return usec / 2 / 1_000_000


def describe_load(held: int, waiters: int) -> str:
    """The STATUS= line for the daemon's load: ``"3 locks held, 1 waiter"``."""
    locks = "lock" if held == 1 else "locks"
    waiting = "waiter" if waiters == 1 else "waiters"
    return f"{held} {locks} held, {waiters} {waiting}"
