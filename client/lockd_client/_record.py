"""Result classes that behave as the dataclasses they were, without importing dataclasses.

``import dataclasses`` pulls in ``inspect``, ``ast``, ``dis`` and
``tokenize``, and building each dataclass runs ``exec``: together more
than half of what importing the client cost, paid by every ``lockd locks
status`` a script runs (issue 24, bench/startup.py). The result classes
are therefore written out by hand with ``__slots__``, and keep what their
users could see of a dataclass:

- the same ``__init__`` signature, ``repr`` (fields marked hidden left
  out), ``==`` between instances of the same class and ``hash`` over the
  fields (:class:`Frozen`), or identity for a mutable one (:class:`Record`);
- a frozen one raises :class:`dataclasses.FrozenInstanceError` on
  assignment (dataclasses is imported then, on that error only);
- ``dataclasses.fields()``, ``asdict()``, ``replace()`` and
  ``is_dataclass()`` keep working: ``__dataclass_fields__`` is built on
  first use, from a dataclass twin made with ``dataclasses.make_dataclass``
  (names, types, ``repr`` flags, and the defaults a class lists in
  ``_defaults``);
- ``_replace(**changes)``, as ``dataclasses.replace`` (and namedtuple's);
- ``match`` by position (``__match_args__``), ``pickle`` and ``copy``.
"""

from __future__ import annotations

#: ``typing`` is imported by the type checker only (it costs ~4 ms at start-up).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, ClassVar, Self

__all__ = ["Frozen", "Record"]

#: the twin dataclasses' fields, per class, made on first use
_twin_fields: dict[type, dict[str, Any]] = {}


class _DataclassFields:
    """``__dataclass_fields__``, made when first read (``dataclasses.fields()`` and friends)."""

    def __get__(self, instance: object, owner: type[Record]) -> dict[str, Any]:
        fields = _twin_fields.get(owner)
        if fields is None:
            import dataclasses

            def field(name: str) -> Any:
                shown = name not in owner._hidden
                if name in owner._defaults:
                    return dataclasses.field(repr=shown, default=owner._defaults[name])
                return dataclasses.field(repr=shown)

            hints: dict[str, object] = {}
            for klass in reversed(owner.__mro__):
                hints.update(getattr(klass, "__annotations__", {}))
            twin = dataclasses.make_dataclass(
                owner.__name__,
                [
                    (
                        name,
                        hints.get(name, "Any"),
                        field(name),
                    )
                    for name in owner._fields
                ],
                eq=issubclass(owner, Frozen),
                frozen=issubclass(owner, Frozen),
            )
            fields = _twin_fields[owner] = {f.name: f for f in dataclasses.fields(twin)}
        return fields


class Record:
    """A mutable record: fields in ``_fields``, compared by identity (``@dataclass(eq=False)``)."""

    __slots__ = ()
    #: every field, in ``__init__`` order
    _fields: ClassVar[tuple[str, ...]] = ()
    #: fields left out of ``repr`` (``field(repr=False)``)
    _hidden: ClassVar[frozenset[str]] = frozenset()
    #: the ``__init__`` defaults, for ``dataclasses.fields()`` (immutable values only)
    _defaults: ClassVar[dict[str, object]] = {}

    __dataclass_fields__: ClassVar[Any] = _DataclassFields()

    def _values(self) -> tuple[object, ...]:
        return tuple([getattr(self, name) for name in self._fields])

    def _replace(self, **changes: object) -> Self:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        values = {name: getattr(self, name) for name in self._fields}
        values.update(changes)
        return self.__class__(**values)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{name}={getattr(self, name)!r}" for name in self._fields if name not in self._hidden
        )
        return f"{self.__class__.__qualname__}({shown})"

    def __reduce__(self) -> tuple[Callable[..., Record], tuple[object, ...]]:
        return self.__class__, self._values()


class Frozen(Record):
    """An immutable record, equal by value (``@dataclass(frozen=True)``)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return self._values() == other._values()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    def __setattr__(self, name: str, value: object) -> None:
        from dataclasses import FrozenInstanceError

        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        from dataclasses import FrozenInstanceError

        raise FrozenInstanceError(f"cannot delete field {name!r}")
