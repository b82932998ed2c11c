"""What goes wrong with the store: the errors its parts raise.

A module of its own so that every part of the store (:mod:`lockd.daemon.store`
and the modules it is built from) raises the same classes without importing
the door that assembles them.
"""

from __future__ import annotations

import sqlite3


class StoreError(Exception):
    """The database cannot be used (newer schema, unreadable file, ...)."""


class StorageUnavailable(StoreError):
    """A write failed (disk full, I/O error, files gone); nothing of it was kept."""


class DatabaseDamaged(StorageUnavailable):
    """The integrity check, or a row read, found the database damaged: do not use it.

    A :class:`StorageUnavailable` so that a request it stops fails as any
    storage failure does (nothing of it kept); the daemon then stops as a
    start refused on the same damage would (``lockd.daemon.serve``).
    """


class GrantsOnHold(StorageUnavailable):
    """No key is granted yet: leases were lost and accepted at start (issue 21)."""


#: sqlite3 errors that mean "the storage failed", not "lockd has a bug".
BUG_ERRORS = (sqlite3.ProgrammingError, sqlite3.InterfaceError, sqlite3.IntegrityError)
