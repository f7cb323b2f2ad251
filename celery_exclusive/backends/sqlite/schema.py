"""The SQLite store's tables, their upgrade, and the clock origin kept beside them.

Every process prepares the database when it opens its first connection, in one
``BEGIN IMMEDIATE`` transaction: create or upgrade the tables, then settle the clock's
origin for this boot (:mod:`.clock`). A file of an older schema is upgraded in place.
"""

from __future__ import annotations

import sqlite3
from typing import Optional

from .clock import Boot

_TABLES = """
CREATE TABLE IF NOT EXISTS exclusive_leases (
    key TEXT NOT NULL,
    owner TEXT NOT NULL,
    fencing_token INTEGER NOT NULL,
    lease_limit INTEGER NOT NULL,
    expires_at REAL NOT NULL,
    holder TEXT NOT NULL,
    PRIMARY KEY (key, owner)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS exclusive_fences (
    key TEXT PRIMARY KEY,
    counter INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS exclusive_records (
    lease_key TEXT NOT NULL,
    name TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (lease_key, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS exclusive_marks (
    key TEXT NOT NULL,
    kind TEXT NOT NULL,
    value TEXT NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (key, kind)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS exclusive_clock (
    boot_id TEXT NOT NULL,
    origin REAL NOT NULL
);
"""

#: ``PRAGMA user_version`` of the tables above.
#:
#: - Version 1 named marks and records by one string: its marks and records are dropped
#:   (marks are short-lived, records are re-made by the next beat leader's first send).
#: - Version 2 had no ``exclusive_clock``: it is added, and everything else kept. Its
#:   times were wall-clock seconds, which the host clock stays near.
SCHEMA_VERSION = 3
_DROP_VERSION_1 = """
DROP TABLE IF EXISTS exclusive_records;
DROP TABLE IF EXISTS exclusive_marks;
"""


def prepare(conn: sqlite3.Connection, boot: Optional[Boot]) -> Optional[float]:
    """Create or upgrade the tables and settle the clock's origin for ``boot``, in one
    transaction (``executescript`` would commit after each statement). Returns the
    origin; None where the kernel tells no boot (the store then uses the wall clock)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version < SCHEMA_VERSION:
            if version < 2:
                _run(conn, _DROP_VERSION_1)
            _run(conn, _TABLES)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        origin = None if boot is None else _settle_origin(conn, boot)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return origin


def _settle_origin(conn: sqlite3.Connection, boot: Boot) -> float:
    """The clock origin of ``boot`` kept in the database, chosen now if it has none.

    A database last used in another boot held leases of processes that died with it,
    their expiry read from that boot's uptime: they are deleted. Marks and records stay
    (their times are near epoch seconds in every boot).
    """
    row = conn.execute("SELECT boot_id, origin FROM exclusive_clock").fetchone()
    if row is not None and row[0] == boot.id:
        return float(row[1])
    if row is not None:
        conn.execute("DELETE FROM exclusive_leases")
    conn.execute("DELETE FROM exclusive_clock")
    conn.execute("INSERT INTO exclusive_clock VALUES (?, ?)", (boot.id, boot.started))
    return boot.started


def _run(conn: sqlite3.Connection, script: str) -> None:
    for statement in script.strip().split(";"):
        if statement.strip():
            conn.execute(statement)
