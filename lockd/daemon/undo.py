"""An undo log: what one request changed in memory, to put back if its commit fails.

The engine mutates its state through these methods while a request runs
(:meth:`UndoLog.begin` .. :meth:`UndoLog.stop`); outside a request (time
passing, clients leaving) they just mutate. :meth:`UndoLog.rollback` applies
the inverse of every entry, newest first, which restores the exact state of
before the request however the changes interleaved.

Objects created during the request need no entries (they vanish with the
references to them), so a grant on a free key logs a handful of entries.
A whole object with ``__slots__`` can be kept once per request
(:meth:`UndoLog.keep`) instead of field by field, which is cheaper for the
per-key state that a hand-off changes in a dozen places.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

_MISSING: Any = object()
_ATTR, _ITEM, _ADDED, _DISCARDED, _APPENDED, _POPPED, _WHOLE = range(7)


class UndoLog:
    __slots__ = ("_entries", "_getters", "_kept")

    def __init__(self) -> None:
        #: None outside a request: nothing is recorded.
        self._entries: list[tuple[int, Any, Any, Any]] | None = None
        self._kept: set[int] = set()
        self._getters: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {}

    @property
    def recording(self) -> bool:
        return self._entries is not None

    def begin(self) -> None:
        self._entries = []
        self._kept.clear()

    def stop(self) -> None:
        """The request is over (committed, or it was a fact): forget the entries."""
        self._entries = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Changes in the block are no part of the request: a rollback leaves them."""
        entries, self._entries = self._entries, None
        try:
            yield
        finally:
            self._entries = entries

    def rollback(self) -> list[Any]:
        """Undo the request; returns the objects whose fields came back (to re-index)."""
        entries, self._entries = self._entries, None
        restored: list[Any] = []
        for kind, target, name, old in reversed(entries or ()):
            if kind == _ATTR:
                setattr(target, name, old)
                restored.append(target)
            elif kind == _ITEM:
                if old is _MISSING:
                    target.pop(name, None)
                else:
                    target[name] = old
                    restored.append(old)
            elif kind == _ADDED:
                target.discard(name)
            elif kind == _DISCARDED:
                target.add(name)
            elif kind == _APPENDED:
                target.pop()
            elif kind == _POPPED:
                target.append(name)
            else:
                for field, value in zip(name, old, strict=True):
                    setattr(target, field, value)
                # A key state restored whole: its holder may be back with no
                # other trace (a sole exclusive holder handed off to a waiter).
                restored.append(target)
        return restored

    def keep(self, obj: Any) -> None:
        """About to change several fields of ``obj``: keep them all, once per request."""
        entries = self._entries
        if entries is None or id(obj) in self._kept:
            return
        self._kept.add(id(obj))
        cls = type(obj)
        fields_getter = self._getters.get(cls)
        if fields_getter is None:
            fields = tuple(cls.__slots__)
            fields_getter = self._getters[cls] = (fields, operator.attrgetter(*fields))
        fields, getter = fields_getter
        entries.append((_WHOLE, obj, fields, getter(obj)))

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        if self._entries is not None:
            self._entries.append((_ATTR, obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def put(self, d: dict[Any, Any], key: Any, value: Any) -> None:
        if self._entries is not None:
            self._entries.append((_ITEM, d, key, d.get(key, _MISSING)))
        d[key] = value

    def delete(self, d: dict[Any, Any], key: Any) -> None:
        if self._entries is not None:
            self._entries.append((_ITEM, d, key, d.get(key, _MISSING)))
        d.pop(key, None)

    def add_to(self, s: set[Any], item: Any) -> None:
        if item in s:
            return
        if self._entries is not None:
            self._entries.append((_ADDED, s, item, None))
        s.add(item)

    def discard_from(self, s: set[Any], item: Any) -> None:
        if item not in s:
            return
        if self._entries is not None:
            self._entries.append((_DISCARDED, s, item, None))
        s.discard(item)

    def append_to(self, items: list[Any], item: Any) -> None:
        if self._entries is not None:
            self._entries.append((_APPENDED, items, None, None))
        items.append(item)

    def pop_from(self, items: list[Any]) -> Any:
        item = items.pop()
        if self._entries is not None:
            self._entries.append((_POPPED, items, item, None))
        return item
