"""The store's schema: its version and the migrations that bring a database to it.

``PRAGMA user_version`` is the schema version of a database file;
:func:`migrate` runs the missing steps of :data:`MIGRATIONS`, each in a
transaction of its own, when :class:`~lockd.daemon.store.Store` opens it.
"""

from __future__ import annotations

import logging
import sqlite3
import zlib
from collections.abc import Callable
from pathlib import Path

from lockd.daemon.storeerrors import StoreError
from lockd.daemon.verify import ROW_TEXT_SQL
from lockd.logfmt import kv

log = logging.getLogger("lockd.daemon.store")

SCHEMA_VERSION = 4


def _migrate_0_to_1(db: sqlite3.Connection) -> None:
    # WITHOUT ROWID: rows live in the key's own b-tree, so a commit writes one
    # page per table instead of a table page plus a primary-key index page.
    db.execute(
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL) STRICT, WITHOUT ROWID"
    )
    db.execute(
        """
        CREATE TABLE leases (
            key        TEXT PRIMARY KEY,
            handle     TEXT NOT NULL,
            fence      INTEGER NOT NULL,
            owner      TEXT,
            principal  TEXT NOT NULL,
            ttl_ms     INTEGER NOT NULL,
            expires_at INTEGER NOT NULL,  -- CLOCK_BOOTTIME milliseconds
            boot_id    TEXT NOT NULL
        ) STRICT, WITHOUT ROWID
        """
    )
    db.execute("INSERT INTO meta (name, value) VALUES ('fence', 0)")
    # The fence high-water mark follows every inserted lease inside the same
    # statement, so a grant is one statement (one implicit transaction) and
    # the mark can never fall behind a lease that was written.
    db.execute(
        """
        CREATE TRIGGER leases_fence AFTER INSERT ON leases BEGIN
            UPDATE meta SET value = max(value, NEW.fence) WHERE name = 'fence';
        END
        """
    )


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    """Several holders per key (docs/contract.md §10): rows keyed by (key, slot).

    Every version-1 lease becomes the exclusive holder (slot 0, limit 1) of
    its key, with its handle, fence, owner and deadline unchanged; pid and
    process were not recorded then and stay unknown.
    """
    db.execute(
        """
        CREATE TABLE leases_v2 (
            key        TEXT NOT NULL,
            slot       INTEGER NOT NULL,
            handle     TEXT NOT NULL,
            fence      INTEGER NOT NULL,
            owner      TEXT,
            principal  TEXT NOT NULL,
            ttl_ms     INTEGER NOT NULL,
            expires_at INTEGER NOT NULL,  -- CLOCK_BOOTTIME milliseconds
            boot_id    TEXT NOT NULL,
            mode       TEXT NOT NULL CHECK (mode IN ('exclusive', 'shared')),
            hold_limit INTEGER NOT NULL,
            pid        INTEGER,
            process    TEXT,
            PRIMARY KEY (key, slot)
        ) STRICT, WITHOUT ROWID
        """
    )
    db.execute(
        "INSERT INTO leases_v2 (key, slot, handle, fence, owner, principal, ttl_ms, expires_at, "
        "boot_id, mode, hold_limit) SELECT key, 0, handle, fence, owner, principal, ttl_ms, "
        "expires_at, boot_id, 'exclusive', 1 FROM leases"
    )
    db.execute("DROP TABLE leases")  # drops its trigger too
    db.execute("ALTER TABLE leases_v2 RENAME TO leases")
    db.execute(
        """
        CREATE TRIGGER leases_fence AFTER INSERT ON leases BEGIN
            UPDATE meta SET value = max(value, NEW.fence) WHERE name = 'fence';
        END
        """
    )


def _migrate_2_to_3(db: sqlite3.Connection) -> None:
    """Rows checked and writes counted (issue 21, :mod:`lockd.daemon.verify`).

    Every row gets ``chk``, the CRC-32 of its columns; ``meta`` gets
    ``seq`` (a column of its ``fence`` row), the number of lease rows inserted
    or deleted so far, kept by
    triggers inside each write's own transaction (the run record outside
    the state folder counts the same: see :mod:`lockd.daemon.runrecord`).
    An insert (a grant or a renew) already rewrote ``meta`` for the fence,
    so counting it costs no page more; a delete now writes ``meta`` too.
    """
    db.execute("ALTER TABLE leases ADD COLUMN chk INTEGER")
    db.create_function("lockd_chk", 1, lambda text: zlib.crc32(text.encode()), deterministic=True)
    db.execute(f"UPDATE leases SET chk = lockd_chk({ROW_TEXT_SQL})")
    # The count rides in the fence's own meta row: the trigger that raised the
    # fence on every insert still updates one row (a second row cost ~2 us).
    db.execute("ALTER TABLE meta ADD COLUMN seq INTEGER NOT NULL DEFAULT 0")
    db.execute("DROP TRIGGER leases_fence")
    db.execute(
        """
        CREATE TRIGGER leases_insert AFTER INSERT ON leases BEGIN
            UPDATE meta SET value = max(value, NEW.fence), seq = seq + 1 WHERE name = 'fence';
        END
        """
    )
    # An INSERT OR REPLACE does not fire it for the row it replaces
    # (recursive_triggers is off): one write, one count.
    db.execute(
        """
        CREATE TRIGGER leases_delete AFTER DELETE ON leases BEGIN
            UPDATE meta SET seq = seq + 1 WHERE name = 'fence';
        END
        """
    )


def _migrate_3_to_4(db: sqlite3.Connection) -> None:
    """The holder's start time (docs/contract.md §12.2), so ``alive`` survives a restart.

    Rows written before have none (NULL: ``alive`` stays unknown for them).
    Not part of ``chk``: a damaged start time can only make ``alive`` wrong,
    never a lease, and leaving ``chk`` as it is keeps every row valid.
    """
    db.execute("ALTER TABLE leases ADD COLUMN pid_start INTEGER")


#: MIGRATIONS[n] takes a database at user_version n to n + 1.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _migrate_0_to_1,
    _migrate_1_to_2,
    _migrate_2_to_3,
    _migrate_3_to_4,
]


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Bring the database to :data:`SCHEMA_VERSION`; :class:`StoreError` if it is newer."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path}: schema version {version} is newer than this lockd "
            f"understands ({SCHEMA_VERSION}); upgrade lockd"
        )
    while version < SCHEMA_VERSION:
        db.execute("BEGIN IMMEDIATE")
        try:
            MIGRATIONS[version](db)
            version += 1
            db.execute(f"PRAGMA user_version={version}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        log.info(kv(event="migrated", db=path, version=version))
