"""SQLite lease store: the embedded default, coordinating every worker on one host.

Each grant is a row; a transaction opened with ``BEGIN IMMEDIATE`` takes the
database's write lock before reading, so "count the live holders, then insert" is
atomic across processes (a deferred transaction could fail with SQLITE_BUSY at once
instead of waiting). Expiry compares wall-clock seconds, which all processes of one
host share. There is no push notification in SQLite, so ``wait()`` polls.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Optional
from urllib.parse import urlsplit

from .base import Backend, Lease, LeaseInfo
from .limits import check_limit
from .line import admit, first_in_line, line_mark

_SCHEMA = """
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
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS exclusive_marks (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    expires_at REAL NOT NULL
) WITHOUT ROWID;
"""

#: How long a writer waits for the database lock before the store counts as unavailable.
BUSY_TIMEOUT_MS = 10_000
#: wait() polls between these bounds, doubling each time.
POLL_MIN, POLL_MAX = 0.005, 0.1


def path_from_url(url: str) -> str:
    """``sqlite:///relative.db`` -> ``relative.db``; ``sqlite:////abs/x.db`` -> ``/abs/x.db``."""
    parts = urlsplit(url)
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if not path:
        raise ValueError(f"{url!r} names no file; write sqlite:///path/to/leases.db")
    return path


class SQLiteBackend(Backend):
    stores_records = True
    stores_marks = True

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.path = path_from_url(url)
        self._local = threading.local()

    # One connection per thread and process: sqlite3 connections must not cross a
    # fork, and the heartbeat thread must not wait on the task thread's connection.
    def _connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            return conn
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.executescript(_SCHEMA)
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def _write(self, action: str, work):
        """Run ``work(conn)`` inside BEGIN IMMEDIATE ... COMMIT."""
        try:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = work(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result
        except (sqlite3.Error, OSError) as exc:
            raise self.unavailable(action, exc) from None

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        def acquire(conn: sqlite3.Connection) -> Optional[Lease]:
            now = time.time()
            conn.execute(
                "DELETE FROM exclusive_leases WHERE key = ? AND expires_at <= ?", (key, now)
            )
            limits = [
                r[0]
                for r in conn.execute(
                    "SELECT lease_limit FROM exclusive_leases WHERE key = ?", (key,)
                )
            ]
            check_limit(key, limit, limits)
            line = _live_mark(conn, line_mark(key), now)
            admitted, rest = admit(line, claimant, limit - len(limits))
            if not admitted:
                return None
            if rest != line:  # the grant took the claimant out of the line
                if rest is None:
                    conn.execute("DELETE FROM exclusive_marks WHERE name = ?", (line_mark(key),))
                else:
                    conn.execute(
                        "UPDATE exclusive_marks SET value = ? WHERE name = ?",
                        (rest, line_mark(key)),
                    )
            (token,) = conn.execute(
                "INSERT INTO exclusive_fences (key, counter) VALUES (?, 1) "
                "ON CONFLICT (key) DO UPDATE SET counter = counter + 1 RETURNING counter",
                (key,),
            ).fetchone()
            conn.execute(
                "INSERT INTO exclusive_leases VALUES (?, ?, ?, ?, ?, ?)",
                (key, owner, token, limit, now + ttl, json.dumps(dict(holder or {}))),
            )
            return Lease(key, owner, token, ttl, limit)

        return self._write(f"acquiring {key!r}", acquire)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)

        def renew(conn: sqlite3.Connection) -> set[Lease]:
            now = time.time()
            lost = set()
            for lease in leases:
                cursor = conn.execute(
                    "UPDATE exclusive_leases SET expires_at = ? "
                    "WHERE key = ? AND owner = ? AND expires_at > ?",
                    (now + lease.ttl, lease.key, lease.owner, now),
                )
                if cursor.rowcount == 0:
                    lost.add(lease)
            return lost

        return self._write(f"renewing {len(leases)} lease(s)", renew) if leases else set()

    def release(self, lease: Lease) -> bool:
        def release(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "DELETE FROM exclusive_leases WHERE key = ? AND owner = ? AND expires_at > ?",
                (lease.key, lease.owner, time.time()),
            )
            return cursor.rowcount > 0

        return self._write(f"releasing {lease.key!r}", release)

    def _free_for(self, key: str, claimant: Optional[str]) -> bool:
        """Whether ``claimant`` would find a free slot and be first in line."""
        now = time.time()
        try:
            conn = self._connection()
            limits = [
                r[0]
                for r in conn.execute(
                    "SELECT lease_limit FROM exclusive_leases WHERE key = ? AND expires_at > ?",
                    (key, now),
                )
            ]
            if limits and len(limits) >= min(limits):
                return False
            return first_in_line(_live_mark(conn, line_mark(key), now), claimant)
        except (sqlite3.Error, OSError) as exc:
            raise self.unavailable(f"reading {key!r}", exc) from None

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        delay = POLL_MIN
        while not self._free_for(key, claimant) and time.monotonic() < deadline:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, POLL_MAX)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        now = time.time()
        try:
            rows = (
                self._connection()
                .execute(
                    "SELECT key, owner, fencing_token, expires_at, holder FROM exclusive_leases "
                    "WHERE substr(key, 1, ?) = ? AND expires_at > ? ORDER BY key, fencing_token",
                    (len(prefix), prefix, now),
                )
                .fetchall()
            )
        except (sqlite3.Error, OSError) as exc:
            raise self.unavailable("listing holders", exc) from None
        return [
            LeaseInfo(key, owner, token, expires_at - now, json.loads(holder))
            for key, owner, token, expires_at, holder in rows
        ]

    def force_release(self, key: str) -> int:
        def force(conn: sqlite3.Connection) -> int:
            cursor = conn.execute(
                "DELETE FROM exclusive_leases WHERE key = ? AND expires_at > ?", (key, time.time())
            )
            return cursor.rowcount

        return self._write(f"force-releasing {key!r}", force)

    def read_record(self, key: str) -> Optional[str]:
        try:
            row = (
                self._connection()
                .execute("SELECT value FROM exclusive_records WHERE key = ?", (key,))
                .fetchone()
            )
        except (sqlite3.Error, OSError) as exc:
            raise self.unavailable(f"reading the record {key!r}", exc) from None
        return None if row is None else row[0]

    def write_record(self, lease: Lease, key: str, value: str) -> bool:
        # One statement inside BEGIN IMMEDIATE: the holder check and the upsert see the
        # same database, and no other process can expire or take the lease in between.
        def write(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "INSERT INTO exclusive_records (key, value) SELECT ?, ? WHERE EXISTS ("
                "  SELECT 1 FROM exclusive_leases"
                "  WHERE key = ? AND owner = ? AND expires_at > ?"
                ") ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value, lease.key, lease.owner, time.time()),
            )
            return cursor.rowcount > 0

        return self._write(f"writing the record {key!r}", write)

    def read_mark(self, name: str) -> Optional[str]:
        try:
            return _live_mark(self._connection(), name, time.time())
        except (sqlite3.Error, OSError) as exc:
            raise self.unavailable(f"reading the mark {name!r}", exc) from None

    def swap_mark(self, name: str, expected: Optional[str], new: Optional[str], ttl: float) -> bool:
        def swap(conn: sqlite3.Connection) -> bool:
            now = time.time()
            if _live_mark(conn, name, now) != expected:
                return False
            if new is None:
                conn.execute("DELETE FROM exclusive_marks WHERE name = ?", (name,))
            else:
                conn.execute(
                    "INSERT INTO exclusive_marks VALUES (?, ?, ?) ON CONFLICT (name) "
                    "DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at",
                    (name, new, now + ttl),
                )
            return True

        return self._write(f"changing the mark {name!r}", swap)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local = threading.local()


def _live_mark(conn: sqlite3.Connection, name: str, now: float) -> Optional[str]:
    row = conn.execute(
        "SELECT value FROM exclusive_marks WHERE name = ? AND expires_at > ?", (name, now)
    ).fetchone()
    return None if row is None else row[0]
