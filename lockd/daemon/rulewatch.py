"""Hot reload trigger: tell the daemon when ``rule-sets/`` may have changed.

docs/contract.md §5 wants a create, edit, rename or delete in ``rule-sets/`` to take
effect within about a second, and the folder itself may come and go.

Why this shape:

- **inotify on trio's own loop.** ``inotify_simple`` gives a plain fd;
  ``trio.lowlevel.wait_readable`` waits on it without a thread, reacts in well
  under a millisecond and cancels at once (``watchfiles`` needs ~5 s to cancel).
- **What is watched.** The folder, for ``CLOSE_WRITE`` (an edit is complete,
  not every ``write()``), ``MOVED_TO``/``MOVED_FROM`` (atomic renames, editors'
  save-by-rename), ``CREATE``, ``DELETE``, ``ATTRIB`` (a chmod can make a file
  unreadable) and its own ``DELETE_SELF``/``MOVE_SELF``. Also the nearest
  existing ancestor (normally the config folder), for the creation, removal or
  rename of the path toward the folder: deleting and re-creating
  ``rule-sets/`` works, and so does a config folder that does not exist yet.
- **Only rule files count.** Events for names that are not ``*.toml`` or
  that are hidden (editor swap files, ``foo~``) do not call ``on_change``;
  a structural change (the folder appearing or vanishing, a queue overflow)
  always does, after the watches are re-armed, so nothing between the event
  and the re-read is lost.
- **Coalescing.** A burst (an editor's write + rename + chmod) becomes one
  call: after the first event we wait ``settle`` seconds, then drain.
- **No false comfort.** If inotify is unavailable (e.g. ``max_user_watches``
  reached), the watcher falls back to polling the folder every
  ``poll_interval`` seconds rather than silently never reloading.

``on_change`` is synchronous and should be cheap (``PolicyManager.reload``
is). An exception from it is logged and the watch goes on: a bug in a
reload must not stop later reloads or take the daemon down.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import trio
from inotify_simple import INotify, flags

from lockd.logfmt import kv
from lockd.rules.files import is_rule_file_name

log = logging.getLogger("lockd.daemon.rulewatch")

_F = flags
_DIR_MASK = int(
    _F.CLOSE_WRITE
    | _F.MOVED_TO
    | _F.MOVED_FROM
    | _F.CREATE
    | _F.DELETE
    | _F.ATTRIB
    | _F.DELETE_SELF
    | _F.MOVE_SELF
    | _F.ONLYDIR
)
_ANCHOR_MASK = int(
    _F.CREATE | _F.MOVED_TO | _F.MOVED_FROM | _F.DELETE | _F.DELETE_SELF | _F.MOVE_SELF | _F.ONLYDIR
)
_SELF_GONE = int(_F.DELETE_SELF | _F.MOVE_SELF | _F.IGNORED | _F.UNMOUNT)
_OVERFLOW = int(_F.Q_OVERFLOW)
_MISSING = (errno.ENOENT, errno.ENOTDIR)


class _Watches:
    """The folder watch (when it exists) and the anchor watch above it."""

    def __init__(self, inotify: INotify, directory: Path) -> None:
        self.inotify = inotify
        self.directory = directory
        self.dir_wd: int | None = None
        self.anchor_wd: int | None = None
        #: the child of the anchor on the way to ``directory``
        self.next_name = ""

    def arm(self) -> None:
        for wd in (self.dir_wd, self.anchor_wd):
            if wd is not None:
                with contextlib.suppress(OSError):  # already gone (IN_IGNORED)
                    self.inotify.rm_watch(wd)
        self.dir_wd = self.anchor_wd = None
        # Anchor first, then the folder: a folder created in between is
        # reported by the anchor, so there is no blind window.
        anchor = self.directory.parent
        while True:
            try:
                self.anchor_wd = self.inotify.add_watch(anchor, _ANCHOR_MASK)
                break
            except OSError as exc:
                if exc.errno not in _MISSING or anchor == anchor.parent:
                    raise
                anchor = anchor.parent
        self.next_name = self.directory.relative_to(anchor).parts[0]
        try:
            self.dir_wd = self.inotify.add_watch(self.directory, _DIR_MASK)
        except OSError as exc:
            if exc.errno not in _MISSING:
                raise

    def classify(self, events: Iterable[Any]) -> tuple[bool, bool]:
        """``(changed, rearm)`` for a batch of events."""
        changed = rearm = False
        for ev in events:
            if ev.wd == -1 or ev.mask & _OVERFLOW:
                changed = rearm = True
            elif ev.wd == self.dir_wd:
                if ev.mask & _SELF_GONE:
                    changed = rearm = True
                elif is_rule_file_name(ev.name):
                    changed = True
            elif ev.wd == self.anchor_wd and (ev.mask & _SELF_GONE or ev.name == self.next_name):
                rearm = True  # a change on the way to the folder; see _watch
        return changed, rearm


def _call(on_change: Callable[[], None]) -> None:
    try:
        on_change()
    except Exception:
        log.exception(kv(event="rules_reload_failed"))


def _snapshot(directory: Path) -> tuple[Any, ...] | None:
    """What polling compares: visible ``*.toml`` names with stat identity."""
    try:
        names = sorted(n for n in os.listdir(directory) if is_rule_file_name(n))
    except OSError:
        return None
    out: list[tuple[Any, ...]] = []
    for name in names:
        try:
            st = os.stat(directory / name)
        except OSError:
            out.append((name, None))
            continue
        out.append((name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode))
    return tuple(out)


class _Started:
    """Calls ``task_status.started()`` at most once, whichever path gets there."""

    def __init__(self, task_status: trio.TaskStatus[None]) -> None:
        self._task_status = task_status
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self._task_status.started()


class _InotifyFailed(Exception):
    pass


async def _poll(
    directory: Path, on_change: Callable[[], None], interval: float, started: _Started
) -> None:
    last = _snapshot(directory)
    started()
    while True:
        await trio.sleep(interval)
        now = _snapshot(directory)
        if now != last:
            last = now
            _call(on_change)


async def _watch(
    directory: Path, on_change: Callable[[], None], settle: float, started: _Started
) -> None:
    try:
        inotify = INotify(nonblocking=True)
    except OSError as exc:
        raise _InotifyFailed(str(exc)) from exc
    fd = inotify.fileno()
    try:
        watches = _Watches(inotify, directory)
        try:
            watches.arm()
        except OSError as exc:
            raise _InotifyFailed(str(exc)) from exc
        started()
        while True:
            await trio.lowlevel.wait_readable(fd)
            if settle > 0:
                await trio.sleep(settle)
            events: list[Any] = []
            while batch := inotify.read(timeout=0):
                events.extend(batch)
            changed, rearm = watches.classify(events)
            if rearm:
                had_folder = watches.dir_wd is not None
                try:
                    watches.arm()
                except OSError as exc:
                    raise _InotifyFailed(str(exc)) from exc
                # The folder appeared, vanished or was replaced: re-read it.
                # Only intermediate folders changing (``mkdir /etc/lockd``) is no news.
                if had_folder or watches.dir_wd is not None:
                    changed = True
            if changed:
                _call(on_change)
    finally:
        trio.lowlevel.notify_closing(fd)
        inotify.close()


async def watch_rule_sets(
    directory: Path,
    on_change: Callable[[], None],
    *,
    settle: float = 0.05,
    poll_interval: float = 1.0,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call ``on_change()`` after rule files in ``directory`` change; runs until cancelled.

    ``task_status.started()`` is called once the watch is armed: a change made
    after ``nursery.start(watch_rule_sets, ...)`` returns is always seen. The
    folder need not exist. The inotify fd is closed on cancellation.
    """
    directory = Path(os.path.abspath(directory))
    started = _Started(task_status)
    try:
        await _watch(directory, on_change, settle, started)
    except _InotifyFailed as exc:
        log.warning(
            kv(event="rules_watch_polling", dir=directory, error=exc, interval_s=poll_interval)
        )
    if started.done:
        _call(on_change)  # changes may have been missed while switching over
    await _poll(directory, on_change, poll_interval, started)
