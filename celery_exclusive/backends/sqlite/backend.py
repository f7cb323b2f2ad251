"""SQLite lease store: the embedded default, coordinating every worker on one host.

Each grant is a row; a transaction opened with ``BEGIN IMMEDIATE`` takes the
database's write lock before reading, so "count the live holders, then insert" is
atomic across processes (a deferred transaction could fail with SQLITE_BUSY at once
instead of waiting). There is no push notification in SQLite, so ``wait()`` polls.

Expiry is told by the host's kernel clock (:mod:`.clock`), which no process can be
shown differently and nobody can step; fencing tokens are ``max(last + 1, now in µs)``
by it, so they keep rising when the database is replaced. The path stays bound to the
file it named when a worker first opened it (:mod:`.file`): a database deleted or
replaced under running workers is refused, never silently started afresh.

Every ``sqlite3`` and OS error leaves this module through :meth:`SQLiteBackend.failure`:
a database that is busy (locked by another process past the busy timeout), an I/O
hiccup or a full disk (said as such) is :class:`BackendUnavailable`, worth a retry; a
file this user cannot write, cannot open, or that is not a database is a
:class:`ConfigurationError`, which no retry fixes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional
from urllib.parse import urlsplit

from ...errors import BackendUnavailable, ConfigurationError
from ...telemetry import round_trip
from ..base import (
    NO_END,
    Backend,
    Capabilities,
    End,
    HoldersPage,
    LayoutVersion,
    Lease,
    LeaseInfo,
    MarkRead,
    page_of,
    unavailable,
)
from ..limits import check_limit
from ..line import LINE, admit, first_in_line
from . import schema
from .clock import HostClock, current_boot
from .file import DatabaseFile, gone
from .forks import GATE, GatedConnection

#: How long a writer waits for the database lock before the store counts as unavailable.
BUSY_TIMEOUT_MS = 10_000


def _into_wal(conn: sqlite3.Connection) -> None:
    """Put the file in WAL mode, as every connection to it asks. Switching a new file
    takes its lock without the busy handler (SQLite answers "database is locked" at
    once while another connection holds it): processes and threads opening a new file
    together try again, within the busy timeout, until one of them switched it (then
    the statement changes nothing)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


#: wait() polls between these bounds, doubling each time.
POLL_MIN, POLL_MAX = 0.005, 0.1

#: The first bytes of every SQLite database file.
SQLITE_HEADER = b"SQLite format 3\x00"

#: Primary result codes (``sqlite3.Error.sqlite_errorcode & 0xff``) that retrying
#: cannot fix: SQLITE_PERM, SQLITE_READONLY, SQLITE_CORRUPT, SQLITE_CANTOPEN,
#: SQLITE_AUTH, SQLITE_NOTADB. Python before 3.11 has no code: the messages below.
_PERMANENT_CODES = {3, 8, 11, 14, 23, 26}
_PERMANENT_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.ENOENT,
}
_PERMANENT_MESSAGES = (
    "readonly database",
    "unable to open",
    "not a database",
    "malformed",
    "access permission denied",
    "authorization denied",
)
#: SQLITE_FULL, and the errnos of a disk (or quota) with no room left.
_FULL_CODE = 13
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def path_from_url(url: str) -> str:
    """``sqlite:///relative.db`` -> ``relative.db``; ``sqlite:////abs/x.db`` -> ``/abs/x.db``."""
    parts = urlsplit(url)
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if not path:
        raise ConfigurationError(
            f"exclusive_backend_url {url!r} names no file; write sqlite:///path/to/leases.db"
        )
    return path


class SQLiteBackend(Backend):
    capabilities = Capabilities(limits=True, records=True, marks=True, windows=True)
    layout_version = LayoutVersion("sqlite", 1)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.path = path_from_url(url)
        self.file = DatabaseFile(self.path, self.safe_url)
        self._local = threading.local()
        self._clock: Optional[HostClock] = None

    # One connection per thread and process: sqlite3 connections must not cross a
    # fork, and the heartbeat thread must not wait on the task thread's connection.
    # Every call passes here, and so checks that the path still names its file.
    def _connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            self.file.ensure_same()
            return conn
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, mode=0o700, exist_ok=True)  # new directories are private
        conn = self.file.connect(self._connect)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _into_wal(conn)
        conn.execute("PRAGMA synchronous = NORMAL")
        self._clock = HostClock(schema.prepare(conn, current_boot()))
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    @staticmethod
    def _connect(target: str, uri: bool) -> sqlite3.Connection:
        return sqlite3.connect(
            target,
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
            uri=uri,
            factory=GatedConnection,
            check_same_thread=False,  # one thread's own, but closed in another as it ends
        )

    def _now(self) -> float:
        """Now by the host's clock (:mod:`.clock`), which every process reads alike."""
        if self._clock is None:
            self._connection()
        assert self._clock is not None
        return self._clock.now()

    def _expiry(self, now: float, ttl: float) -> float:
        """When something granted at ``now`` for ``ttl`` seconds expires: no earlier
        than ``ttl`` after the grant, however far behind ``now`` was read."""
        assert self._clock is not None
        return now + ttl + self._clock.resolution

    def store_time(self) -> float:
        with self._using("reading the clock"):
            return self._now()

    @contextlib.contextmanager
    def _using(self, action: str) -> Iterator[sqlite3.Connection]:
        """This thread's connection, used inside the fork gate (:mod:`.forks`), its
        errors translated (:meth:`failure`) with ``action`` saying what failed."""
        with GATE.passage():
            try:
                yield self._connection()
            except (sqlite3.Error, OSError) as exc:
                raise self.failure(action, exc) from None

    def _write(self, action: str, work):
        """Run ``work(conn)`` inside BEGIN IMMEDIATE ... COMMIT."""
        with self._using(action) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = work(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result

    def failure(self, action: str, exc: BaseException) -> Exception:
        """The one error a ``sqlite3`` or OS error becomes: permanent or transient."""
        code = getattr(exc, "sqlite_errorcode", None)
        message = str(exc).lower()
        if (
            getattr(exc, "errno", None) in _FULL_ERRNOS
            or (code is not None and code & 0xFF == _FULL_CODE)
            or (code is None and "database or disk is full" in message)
        ):
            return self._disk_full(action, exc)
        if isinstance(exc, OSError):
            permanent = exc.errno in _PERMANENT_ERRNOS
        elif code is not None:
            permanent = code & 0xFF in _PERMANENT_CODES
        else:
            permanent = any(text in message for text in _PERMANENT_MESSAGES)
        if not permanent:
            return unavailable(self.safe_url, action, exc)
        return ConfigurationError(
            f"the lease store {self.safe_url} cannot be used ({type(exc).__name__} while "
            f"{action}: {exc}). Check exclusive_backend_url: {os.path.abspath(self.path)} "
            "must be a SQLite database file (or not exist yet) that this user "
            f"(uid {_uid()}) can read and write, in a directory it can write (the journal "
            "lives beside it); fix its permissions, or point exclusive_backend_url at "
            "another file."
        )

    def _disk_full(self, action: str, exc: BaseException) -> BackendUnavailable:
        """SQLITE_FULL or ENOSPC: the disk holding the database (or its journal) has no
        room, which freeing space fixes: an outage, said as what it is."""
        path = os.path.abspath(self.path)
        try:
            room = os.statvfs(os.path.dirname(path))
            free = f"{room.f_bavail * room.f_frsize // 1024} KiB free"
        except OSError:
            free = "free space unknown"
        return BackendUnavailable(
            f"the lease store {self.safe_url} cannot write: the disk holding {path} is full "
            f"({free}; {type(exc).__name__} while {action}: {exc}). Free space on it, or "
            "point exclusive_backend_url at a file on a disk with room.",
            self.safe_url,
        )

    def check(self, probe_key: str) -> list[str]:
        """A real SQLite database file (or none yet), which this user can write."""
        path = os.path.abspath(self.path)
        if os.path.isdir(path):
            raise ConfigurationError(
                f"the lease store {self.safe_url} names a directory, {path}, not a database "
                "file. Set exclusive_backend_url to a file inside it, e.g. "
                f"sqlite:///{os.path.join(path, 'leases.sqlite3')}."
            )
        try:
            with open(path, "rb") as file:
                header = file.read(len(SQLITE_HEADER))
        except FileNotFoundError:
            header = None
        except OSError as exc:
            raise self.failure("opening it", exc) from None
        if header and header != SQLITE_HEADER:
            raise ConfigurationError(
                f"the lease store {self.safe_url} names {path}, which is not a SQLite "
                "database. Point exclusive_backend_url at a new file (it is created), or "
                "move this one away."
            )
        return super().check(probe_key)

    @round_trip("sqlite")
    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
        read: Optional[MarkRead] = None,
    ) -> Optional[Lease]:
        def acquire_and_read(conn: sqlite3.Connection) -> Optional[Lease]:
            grant = acquire(conn)
            if read is not None:
                read.value, read.done = _live_mark(conn, read.key, read.kind, self._now()), True
            return grant

        def acquire(conn: sqlite3.Connection) -> Optional[Lease]:
            now = self._now()
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
            line = _live_mark(conn, key, LINE, now)
            admitted, rest = admit(line, claimant, limit - len(limits), now)
            if not admitted:
                return None
            if rest != line:  # the grant took the claimant out of the line
                if rest is None:
                    conn.execute(
                        "DELETE FROM exclusive_marks WHERE key = ? AND kind = ?", (key, LINE)
                    )
                else:
                    conn.execute(
                        "UPDATE exclusive_marks SET value = ? WHERE key = ? AND kind = ?",
                        (rest, key, LINE),
                    )
            # The next token: above the last, and never below now in µs, so tokens keep
            # rising in a database that lost its fences (replaced, restored).
            (token,) = conn.execute(
                "INSERT INTO exclusive_fences (key, counter) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET counter = max(counter + 1, excluded.counter) "
                "RETURNING counter",
                (key, max(1, int(now * 1_000_000))),
            ).fetchone()
            conn.execute(
                "INSERT INTO exclusive_leases VALUES (?, ?, ?, ?, ?, ?)",
                (key, owner, token, limit, self._expiry(now, ttl), json.dumps(dict(holder or {}))),
            )
            return Lease(key, owner, token, ttl, limit)

        return self._write(f"acquiring {key!r}", acquire_and_read)

    @round_trip("sqlite")
    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)

        def renew(conn: sqlite3.Connection) -> set[Lease]:
            now = self._now()
            lost = set()
            for lease in leases:
                cursor = conn.execute(
                    "UPDATE exclusive_leases SET expires_at = ? "
                    "WHERE key = ? AND owner = ? AND expires_at > ?",
                    (self._expiry(now, lease.ttl), lease.key, lease.owner, now),
                )
                if cursor.rowcount == 0:
                    lost.add(lease)
            return lost

        if not leases:
            return set()
        try:
            return self._write(f"renewing {len(leases)} lease(s)", renew)
        except ConfigurationError as exc:
            if not gone(exc):
                raise
            # The file is gone for everyone else, and so is every lease in it: said at
            # once, so that holders stop before their keys are granted in another file.
            return set(leases)

    @round_trip("sqlite")
    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end.write is not None:
            return super().release(lease, end)  # refused: no final writes here
        mark = end.mark

        def release(conn: sqlite3.Connection) -> Optional[bool]:
            if mark is not None:
                current = _live_mark(conn, mark.key, mark.kind, self._now())
                if current not in (mark.expected, mark.new):
                    return None
                _set_mark(conn, mark.key, mark.kind, mark.new, self._expiry(self._now(), mark.ttl))
            cursor = conn.execute(
                "DELETE FROM exclusive_leases WHERE key = ? AND owner = ? AND expires_at > ?",
                (lease.key, lease.owner, self._now()),
            )
            return cursor.rowcount > 0

        return self._write(f"releasing {lease.key!r}", release)

    def _free_for(self, key: str, claimant: Optional[str]) -> bool:
        """Whether ``claimant`` would find a free slot and be first in line."""
        with self._using(f"reading {key!r}") as conn:
            now = self._now()
            limits = [
                r[0]
                for r in conn.execute(
                    "SELECT lease_limit FROM exclusive_leases WHERE key = ? AND expires_at > ?",
                    (key, now),
                )
            ]
            if limits and len(limits) >= min(limits):
                return False
            return first_in_line(_live_mark(conn, key, LINE, now), claimant, now)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        delay = POLL_MIN
        while not self._free_for(key, claimant) and time.monotonic() < deadline:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, POLL_MAX)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # A range, not substr(): SQLite's string functions stop at a NUL character,
        # while comparisons see the whole key. The prefix test is then made exactly.
        return [
            info
            for info in self._holders("key >= ?", prefix, f"listing holders under {prefix!r}")
            if info.key.startswith(prefix)
        ]

    @round_trip("sqlite")
    def holders_of(self, key: str) -> list[LeaseInfo]:
        return self._holders("key = ?", key, f"reading {key!r}")

    def _holders(self, where: str, value: str, action: str) -> list[LeaseInfo]:
        with self._using(action) as conn:
            now = self._now()
            rows = conn.execute(
                "SELECT key, owner, fencing_token, expires_at, holder FROM exclusive_leases "
                f"WHERE {where} AND expires_at > ? ORDER BY key, fencing_token",
                (value, now),
            ).fetchall()
        assert self._clock is not None
        now += self._clock.resolution  # what a holder was granted, without _expiry's margin
        return [
            LeaseInfo(key, owner, token, max(0.0, expires_at - now), json.loads(holder))
            for key, owner, token, expires_at, holder in rows
        ]

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        # One statement: the page's keys (one more, to know whether a page follows),
        # their live rows and the marks asked for. Keys at or after ``prefix`` that do
        # not start with it sort after every key that does: the page ends there.
        marks = "".join(
            ", (SELECT value FROM exclusive_marks m WHERE m.key = l.key AND m.kind = ? "
            "AND m.expires_at > ?)"
            for _ in kinds
        )
        query = (
            "WITH page AS (SELECT DISTINCT key FROM exclusive_leases WHERE key >= ? "
            "AND (? IS NULL OR key > ?) "
            "AND expires_at > ? ORDER BY key LIMIT ?) "
            f"SELECT l.key, owner, fencing_token, expires_at, holder{marks} "
            "FROM page JOIN exclusive_leases l ON l.key = page.key AND l.expires_at > ? "
            "ORDER BY l.key, fencing_token"
        )
        with self._using(f"listing holders under {prefix!r}") as conn:
            now = self._now()
            args: list[Any] = [prefix, cursor, cursor, now, count + 1]
            args += [arg for kind in kinds for arg in (kind, now)] + [now]
            rows = conn.execute(query, args).fetchall()
        assert self._clock is not None
        live = now + self._clock.resolution  # what a holder was granted, without the margin
        return page_of(
            [
                (
                    key,
                    LeaseInfo(key, owner, token, max(0.0, expires_at - live), json.loads(holder)),
                    values,
                )
                for key, owner, token, expires_at, holder, *values in rows
                if key.startswith(prefix)
            ],
            kinds,
            count,
        )

    @round_trip("sqlite")
    def force_release(self, key: str) -> int:
        def force(conn: sqlite3.Connection) -> int:
            cursor = conn.execute(
                "DELETE FROM exclusive_leases WHERE key = ? AND expires_at > ?", (key, self._now())
            )
            return cursor.rowcount

        return self._write(f"force-releasing {key!r}", force)

    @round_trip("sqlite")
    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        with self._using(f"reading the record {name!r} of {lease_key!r}") as conn:
            row = conn.execute(
                "SELECT value FROM exclusive_records WHERE lease_key = ? AND name = ?",
                (lease_key, name),
            ).fetchone()
        return None if row is None else row[0]

    @round_trip("sqlite")
    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        # One statement inside BEGIN IMMEDIATE: the holder check and the upsert see the
        # same database, and no other process can expire or take the lease in between.
        def write(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "INSERT INTO exclusive_records (lease_key, name, value) SELECT ?, ?, ? "
                "WHERE EXISTS ("
                "  SELECT 1 FROM exclusive_leases"
                "  WHERE key = ? AND owner = ? AND expires_at > ?"
                ") ON CONFLICT (lease_key, name) DO UPDATE SET value = excluded.value",
                (lease.key, name, value, lease.key, lease.owner, self._now()),
            )
            return cursor.rowcount > 0

        return self._write(f"writing the record {name!r} of {lease.key!r}", write)

    @round_trip("sqlite")
    def read_mark(self, key: str, kind: str) -> Optional[str]:
        with self._using(f"reading the {kind} mark of {key!r}") as conn:
            return _live_mark(conn, key, kind, self._now())

    @round_trip("sqlite")
    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        def swap(conn: sqlite3.Connection) -> bool:
            now = self._now()
            if _live_mark(conn, key, kind, now) != expected:
                return False
            _set_mark(conn, key, kind, new, self._expiry(now, ttl))
            return True

        return self._write(f"changing the {kind} mark of {key!r}", swap)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            with GATE.passage():
                conn.close()
        self._local = threading.local()


def _uid() -> int:
    getuid = getattr(os, "getuid", None)
    return getuid() if getuid is not None else 0


def _set_mark(
    conn: sqlite3.Connection, key: str, kind: str, value: Optional[str], expires_at: float
) -> None:
    if value is None:
        conn.execute("DELETE FROM exclusive_marks WHERE key = ? AND kind = ?", (key, kind))
    else:
        conn.execute(
            "INSERT INTO exclusive_marks VALUES (?, ?, ?, ?) ON CONFLICT (key, kind) "
            "DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at",
            (key, kind, value, expires_at),
        )


def _live_mark(conn: sqlite3.Connection, key: str, kind: str, now: float) -> Optional[str]:
    row = conn.execute(
        "SELECT value FROM exclusive_marks WHERE key = ? AND kind = ? AND expires_at > ?",
        (key, kind, now),
    ).fetchone()
    return None if row is None else row[0]
