"""``?recipe=advisory``: leases taken as PostgreSQL session advisory locks on a number of
the key that any SQL can compute.

PostgreSQL's own lock for application code is the advisory lock
(src/backend/utils/adt/lockfuncs.c): ``pg_advisory_lock(bigint)`` waits for it,
``pg_try_advisory_lock(bigint)`` takes it or answers false, ``pg_advisory_unlock(bigint)``
gives it back. A session-level lock is held until its session unlocks it or ends,
whatever its transactions do (a rollback keeps it). It locks a number in the current
database; code that locks a name locks a hash of it. Ours, :func:`lock_id`, is the
common one: the first 8 bytes of the MD5 of the key's UTF-8, big-endian, signed::

    ('x' || left(md5(key), 16))::bit(64)::bigint        -- key: text in a UTF8 database

With ``postgresql://...?recipe=advisory``, a lease on ``K`` is the session lock on
``lock_id(K)``: a task with the key ``exclusive:invoice:7`` and
``SELECT pg_try_advisory_lock(('x' || left(md5('exclusive:invoice:7'), 16))::bit(64)::bigint)``
exclude each other. So:

- **Our holder** is one database session per lease, opened for it (and kept for the
  next lease once released): ``pg_advisory_lock`` elsewhere waits for it,
  ``pg_try_advisory_lock`` answers false, exactly as against another session. Its
  release is ``pg_advisory_unlock``.
- **The session is the lease, and the server's clock ends it.** A grant sets
  ``idle_session_timeout`` to the lease's ttl on that session: the server ends a session
  that has sent nothing for that long, and the lock with it. A worker that dies frees
  the lock at once (its socket closes); one that hangs or loses the network frees it
  ``ttl`` after its last renewal, by the server's clock. A **renewal** is a statement on
  that very session: it restarts the server's idle clock, and its answer proves the
  session, and so the lock, alive. A session is never made again: when it is lost
  (a server restart or failover, ``pg_terminate_backend``, a broken link) the lock went
  with it, and the next renewal reports the lease lost.
- **A foreign holder** (a session holding the lock with no row of ours naming it) makes
  our duplicates skip, wait or requeue, and is named: its backend pid, user, application
  and client address. Our waiters look every :data:`FOREIGN_POLL` seconds while it
  holds (its unlock notifies nobody); our own releases wake them by ``NOTIFY``.
- **Never touched**: a foreign session is never unlocked or terminated. ``force_release``
  ends only sessions that a row of ours names as holding the key.

Our fencing token stays ours: each grant raises the key's counter in
``exclusive_fences`` as the store always does. A grant also writes a row in
``exclusive_leases`` (owner, token, holder record, and the backend pid of its session
under ``"pg_backend"``), which says who holds the key; a row counts only while its
session holds the lock. Marks, lines and records stay in the store's tables.

The store's own per-key transaction lock stays what it is without the recipe
(``pg_advisory_xact_lock`` on the first 8 bytes of the key's SHA-256, another hash):
a recipe holder never blocks the store's transactions, and workers with and without
``?recipe=`` on one schema serialize on it and see each other's leases.

Refused, with a named error: ``pgbouncer=1`` (transaction pooling cannot keep a session
for a lease), ``exclusive_limit`` above 1 (a lock has one holder), PostgreSQL before 14
(no ``idle_session_timeout``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import psycopg

from ...errors import ConfigurationError
from ..base import Backend, HoldersPage, Lease, LeaseInfo
from ..line import LINE, admit, first_in_line
from .backend import (
    _NOW,
    MAX_SILENCE,
    POLL_MAX,
    POLL_MIN,
    PostgreSQLBackend,
    _bytes,
    _inherited,
    _key_id,
    _lock_id,
    _text,
)
from .errors import translate

#: The value of ``?recipe=`` this module speaks.
RECIPE = "advisory"
#: Seconds between two looks at a key a foreign session holds: its unlock wakes nobody.
FOREIGN_POLL = 0.1
#: Idle lock sessions a process keeps for its next leases.
POOL_SIZE = 2
#: PostgreSQL 14 brought ``idle_session_timeout``, which ends a lost holder's session.
MIN_SERVER_VERSION = 140000
#: Milliseconds ``force_release`` waits for a terminated session to be gone.
TERMINATE_WAIT_MS = 5000
FOREIGN = "a PostgreSQL session advisory lock"


def lock_id(key: str) -> int:
    """The advisory lock number of ``key``: the first 8 bytes of the MD5 of its UTF-8,
    big-endian, signed (what ``('x' || left(md5(key), 16))::bit(64)::bigint`` gives)."""
    digest = hashlib.md5(_bytes(key), usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


#: The same number in SQL, of a key held as bytes (the store keeps keys as ``bytea``).
_LOCK_ID_SQL = "('x' || left(md5({key}), 16))::bit(64)::bigint"

# pg_locks shows a bigint advisory lock as classid (high 32 bits), objid (low 32 bits)
# and objsubid 1 in the current database (lockfuncs.c, SET_LOCKTAG_INT64).
_LOCKS = """
SELECT l.pid FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint) = {lock}
"""
# A row of ours is a live lease if it names a session that holds the key's lock, or, for
# a lease of the store without the recipe (no "pg_backend"), while it has not expired.
_SESSION_PID = "(r.holder::jsonb #>> '{{pg_backend,pid}}')::int"
_HELD = f"""
(CASE WHEN r.holder::jsonb -> 'pg_backend' IS NULL THEN r.expires_at > clock_timestamp()
      ELSE {_SESSION_PID} IN ({_LOCKS.format(lock=_LOCK_ID_SQL.format(key="r.key"))}) END)
"""

# After the key's transaction lock: now, whether a lease of the store's own layout holds
# it, and its line.
_STATE = f"""
SELECT {_NOW},
       EXISTS (SELECT FROM {{leases}} WHERE key_id = %(id)s AND expires_at > clock_timestamp()
               AND holder::jsonb -> 'pg_backend' IS NULL),
       (SELECT value FROM {{marks}} WHERE key_id = %(id)s AND kind = %(line)s
        AND expires_at > clock_timestamp())
"""

# Take the session lock; if taken: end the session ``idle`` ms after its last statement,
# drop the key's rows (stale: their sessions no longer hold it), raise the fence, write
# the row. Returns the fencing token, or no row when the lock is held.
_GRANT = """
WITH got AS MATERIALIZED (
    SELECT pg_try_advisory_lock(%(lock)s) AS ok
), idle AS MATERIALIZED (
    SELECT set_config('idle_session_timeout', %(idle)s, false) FROM got WHERE ok
), stale AS (
    DELETE FROM {leases} WHERE key_id = %(id)s AND (SELECT ok FROM got)
), fence AS (
    INSERT INTO {fences} AS f (key_id, counter)
    SELECT %(id)s, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint FROM got, idle
    WHERE ok
    ON CONFLICT (key_id) DO UPDATE SET counter = GREATEST(f.counter + 1, excluded.counter)
    RETURNING counter
)
INSERT INTO {leases} (key_id, owner, key, fencing_token, lease_limit, expires_at, holder)
SELECT %(id)s, %(owner)s, %(key)s, counter, 1,
       clock_timestamp() + %(ttl)s * interval '1 second', %(holder)s
FROM fence
RETURNING fencing_token
"""

# On the holder's session: the row's expiry moves (what operators see), and the server's
# idle clock starts again. One row if the lease is still ours.
_RENEW = """
UPDATE {leases} SET expires_at = clock_timestamp() + %(ttl)s * interval '1 second'
WHERE key_id = %(id)s AND owner = %(owner)s
RETURNING 1
"""

# On the holder's session: unlock, stop the idle clock (the session goes back to the
# pool), delete the row, wake our waiters. Returns whether the session held the lock.
_UNLOCK = """
WITH gone AS (DELETE FROM {leases} WHERE key_id = %(id)s AND owner = %(owner)s)
SELECT pg_advisory_unlock(%(lock)s), set_config('idle_session_timeout', '0', false),
       pg_notify(%(channel)s, %(payload)s)
"""

# From any session: end the session a row of ours names, if it still holds the key's
# lock (its holder died, or an operator frees the key), and delete the row. One row per
# lease freed.
_TERMINATE = f"""
WITH mine AS (
    DELETE FROM {{leases}} r WHERE key_id = %(id)s AND owner = %(owner)s
    RETURNING r.key, r.holder, r.expires_at, {_SESSION_PID} AS pid
)
SELECT CASE WHEN r.pid IS NULL THEN r.expires_at > clock_timestamp()
            ELSE pg_terminate_backend(r.pid, %(wait)s) END,
       pg_notify(%(channel)s, %(payload)s)
FROM mine r
WHERE r.pid IS NULL OR r.pid IN ({_LOCKS.format(lock="%(lock)s")})
"""

# Who holds the key: every session holding its lock (with what pg_stat_activity shows of
# it), and the key's rows.
_LOCK_HOLDERS = f"""
SELECT l.pid, a.usename, a.application_name, a.client_addr::text
FROM ({_LOCKS.format(lock="%(lock)s")}) l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
"""
_ROWS = """
SELECT r.owner, r.fencing_token, extract(epoch FROM r.expires_at - clock_timestamp())::float8,
       r.holder, r.expires_at > clock_timestamp()
FROM {leases} r WHERE r.key_id = %(id)s
ORDER BY r.fencing_token
"""

_HOLDERS = f"""
SELECT r.key, r.owner, r.fencing_token,
       extract(epoch FROM r.expires_at - clock_timestamp())::float8, r.holder
FROM {{leases}} r
WHERE substring(r.key FROM 1 FOR %(length)s) = %(prefix)s AND {_HELD}
ORDER BY r.key, r.fencing_token
"""

_WRITE_RECORD = f"""
INSERT INTO {{records}} (key_id, name, value)
SELECT %(id)s, %(name)s, %(value)s
WHERE EXISTS (SELECT FROM {{leases}} r WHERE r.key_id = %(id)s AND r.owner = %(owner)s
              AND {_HELD})
ON CONFLICT (key_id, name) DO UPDATE SET value = excluded.value
"""

# wait(): now, the pid of the session holding the lock, the sessions our rows name,
# whether a lease of the store's own layout holds the key, and the line.
_FREE_FOR = f"""
SELECT {_NOW}, ({_LOCKS.format(lock="%(lock)s")} LIMIT 1),
       ARRAY(SELECT {_SESSION_PID} FROM {{leases}} r WHERE r.key_id = %(id)s),
       EXISTS (SELECT FROM {{leases}} WHERE key_id = %(id)s AND expires_at > clock_timestamp()
               AND holder::jsonb -> 'pg_backend' IS NULL),
       (SELECT value FROM {{marks}} WHERE key_id = %(id)s AND kind = %(line)s
        AND expires_at > clock_timestamp())
"""


@dataclass(eq=False)
class _Session:
    """A database session that holds (or held, and may hold again) one lease's lock."""

    conn: psycopg.Connection
    pid: int
    started: float
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self.conn.close()


class AdvisoryBackend(PostgreSQLBackend, recipe=True):
    """The PostgreSQL store speaking session advisory locks (see the module docstring)."""

    #: One holder per key, as the recipe has.
    capabilities = replace(PostgreSQLBackend.capabilities, limits=False)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._sql.update(
            {
                name: text.format(**self.tables)
                for name, text in {
                    "recipe state": _STATE,
                    "recipe grant": _GRANT,
                    "recipe renew": _RENEW,
                    "recipe unlock": _UNLOCK,
                    "recipe terminate": _TERMINATE,
                    "recipe rows": _ROWS,
                    "recipe holders": _HOLDERS,
                    "recipe free for": _FREE_FOR,
                    "write_record": _WRITE_RECORD,
                }.items()
            }
        )
        self._sessions_lock = threading.Lock()
        self._sessions_pid = os.getpid()
        #: lease owner -> the session holding its lock
        self._held: dict[str, _Session] = {}
        #: sessions that hold nothing, kept for the next grants (at most POOL_SIZE)
        self._idle: list[_Session] = []

    # --- sessions ---------------------------------------------------------------------

    def _forked(self) -> None:
        """In a forked child: the parent's sessions are the parent's. Never use or close
        them (closing ends the parent's sessions and frees its locks)."""
        if self._sessions_pid != os.getpid():
            _inherited.extend(s.conn for s in [*self._held.values(), *self._idle])
            self._held, self._idle, self._sessions_pid = {}, [], os.getpid()

    def _take_session(self) -> tuple[_Session, bool]:
        """An idle session (True: from the pool) or a new one (False)."""
        with self._sessions_lock:
            self._forked()
            if self._idle:
                return self._idle.pop(), True
        return self._open_session(), False

    def _open_session(self) -> _Session:
        self._run("preparing the tables", lambda conn: None, txn=False)  # creates them
        action = "opening a session for a lease"
        try:
            conn = psycopg.connect(self.settings.conninfo, autocommit=True, prepare_threshold=None)
        except (psycopg.Error, OSError) as exc:
            raise translate(exc, action, self) from None
        try:
            if conn.info.server_version < MIN_SERVER_VERSION:
                raise ConfigurationError(
                    f"{self.safe_url} speaks PostgreSQL's session advisory locks "
                    f"(?recipe={RECIPE}), which need PostgreSQL 14 or later: "
                    "idle_session_timeout is what ends the session of a holder that stopped "
                    f"renewing. The server is version {conn.info.server_version}; upgrade it, "
                    "or use a store URL without ?recipe=."
                )
            pid, started = conn.execute(
                "SELECT pg_backend_pid(), extract(epoch FROM backend_start)::float8 "
                "FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone()
        except (psycopg.Error, OSError) as exc:
            conn.close()
            raise translate(exc, action, self) from None
        except BaseException:
            conn.close()
            raise
        return _Session(conn, pid, started)

    def _keep(self, session: _Session) -> None:
        """Put a session that holds nothing back in the pool, or close it."""
        with self._sessions_lock:
            if (
                self._sessions_pid == os.getpid()
                and not session.conn.closed
                and len(self._idle) < POOL_SIZE
            ):
                self._idle.append(session)
                return
        session.close()

    def _holding(self, owner: str) -> Optional[_Session]:
        with self._sessions_lock:
            self._forked()
            return self._held.get(owner)

    def _let_go(self, owner: str) -> Optional[_Session]:
        with self._sessions_lock:
            self._forked()
            return self._held.pop(owner, None)

    # --- leases -----------------------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        if limit != 1:
            raise ConfigurationError(
                f"{self.safe_url} speaks PostgreSQL's session advisory locks "
                f"(?recipe={RECIPE}), which have one holder per key, but {key!r} was asked "
                f"for with exclusive_limit={limit}: use a store URL without ?recipe= for "
                "limits."
            )
        for attempt in (1, 2):
            session, pooled = self._take_session()
            try:
                token = self._grant(session, key, owner, ttl, holder, claimant)
            except (psycopg.Error, OSError) as exc:
                # Whatever the statement did, the session may hold the lock now (a
                # rollback keeps a session lock): end it, and the lock goes with it.
                broken = session.conn.broken
                session.close()
                if attempt == 1 and pooled and broken:
                    # A pooled session the server had ended meanwhile (or one lost half-way,
                    # whose lock, if taken, is held by a dying session): try a new one. The
                    # lock itself never grants twice.
                    continue
                raise translate(exc, f"acquiring {key!r}", self) from None
            except BaseException:
                session.close()
                raise
            if token is None:
                self._keep(session)
                return None
            with self._sessions_lock:
                self._held[owner] = session
            return Lease(key, owner, token, ttl, 1)
        raise AssertionError("unreachable")

    def _grant(
        self,
        session: _Session,
        key: str,
        owner: str,
        ttl: float,
        holder: Optional[Mapping[str, Any]],
        claimant: Optional[str],
    ) -> Optional[int]:
        """The grant on ``session``: the key's transaction lock, its state and line, then
        the session lock and the row, in one transaction. The token, or None."""
        key_id = _key_id(key)
        idle_ms = str(max(1, int(ttl * 1000)))
        session_of = {"pid": session.pid, "started": session.started}
        record = {**dict(holder or {}), "pg_backend": session_of}
        params = {
            "id": key_id,
            "key": _bytes(key),
            "owner": owner,
            "ttl": ttl,
            "lock": lock_id(key),
            "idle": idle_ms,
            "holder": json.dumps(record),
            "line": LINE,
        }
        conn, token = session.conn, None
        with session.lock, conn.transaction():
            # A session stopped half-way through this transaction is ended by the server
            # after ttl too, and its lock with it.
            conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, true), "
                "pg_advisory_xact_lock(%s)",
                (idle_ms, _lock_id(key_id)),
            )
            now, plain_lease, line = conn.execute(self._sql["recipe state"], params).fetchone()
            if plain_lease:
                return None
            line = _text(line)
            admitted, rest = admit(line, claimant, 1, now)
            if not admitted:
                return None
            if rest != line:  # the grant takes the claimant out of the line (if it grants)
                if rest is None:
                    conn.execute(self._sql["delete_mark"], {"id": key_id, "kind": LINE})
                else:
                    conn.execute(self._sql["set_line"], {**params, "value": _bytes(rest)})
            row = conn.execute(self._sql["recipe grant"], params).fetchone()
            if row is None:
                raise psycopg.Rollback()  # held: the line stays as it was
            token = row[0]
        return token

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        lost = set()
        for lease in leases:
            session = self._holding(lease.owner)
            if session is None:
                lost.add(lease)
                continue
            params = {"id": _key_id(lease.key), "owner": lease.owner, "ttl": lease.ttl}
            try:
                with session.lock:
                    kept = session.conn.execute(self._sql["recipe renew"], params).fetchone()
            except (psycopg.Error, OSError) as exc:
                if not (session.conn.broken or session.conn.closed):
                    raise translate(exc, f"renewing {lease.key!r}", self) from None
                # The session is gone, and its lock with it: nothing can bring it back.
                self._let_go(lease.owner)
                session.close()
                lost.add(lease)
                continue
            if kept is None:
                lost.add(lease)
        return lost

    def release(self, lease: Lease) -> bool:
        session = self._let_go(lease.owner)
        if session is None:
            return self._terminate(lease)
        key_id = _key_id(lease.key)
        params = {
            "id": key_id,
            "owner": lease.owner,
            "lock": lock_id(lease.key),
            **self._notify_args(key_id),
        }
        try:
            with session.lock:
                unlocked = session.conn.execute(self._sql["recipe unlock"], params).fetchone()[0]
        except (psycopg.Error, OSError) as exc:
            session.close()
            if not (session.conn.broken or session.conn.closed):
                raise translate(exc, f"releasing {lease.key!r}", self) from None
            # The session is gone, or unusable: end it from another one if it lives on.
            return self._terminate(lease)
        if unlocked:
            self._keep(session)
        else:
            session.close()
        return bool(unlocked)

    def _terminate(self, lease: Lease) -> bool:
        """Free ``lease`` from a session other than its own: end the session its row
        names if that still holds the key's lock, and delete the row."""
        key_id = _key_id(lease.key)
        params = {
            "id": key_id,
            "owner": lease.owner,
            "lock": lock_id(lease.key),
            "wait": TERMINATE_WAIT_MS,
            **self._notify_args(key_id),
        }

        def terminate(conn: psycopg.Connection) -> bool:
            return any(row[0] for row in conn.execute(self._sql["recipe terminate"], params))

        try:
            return self._call(f"releasing {lease.key!r}", terminate, txn=False)
        except ConfigurationError as exc:
            if "exclusive_* tables" not in str(exc) and "grant the role" not in str(exc):
                raise
            raise ConfigurationError(
                f"the lease store at {self.safe_url} could not end the session holding "
                f"{lease.key!r} (pg_terminate_backend): run workers as one role, or grant "
                "theirs pg_signal_backend."
            ) from None

    def force_release(self, key: str) -> int:
        """End every session of ours holding ``key``; a foreign session stays (it is not
        ours to end): unlock it from its own session."""
        freed = 0
        for info in self.holders_of(key):
            if info.fencing_token is not None:
                freed += self.release(Lease(key, info.owner, info.fencing_token, 1.0))
        return freed

    # --- waiting ----------------------------------------------------------------------

    def _look(self, key: str, claimant: Optional[str]) -> tuple[bool, bool]:
        """(free for ``claimant``, held by a foreign session)."""
        key_id = _key_id(key)
        params = {"id": key_id, "lock": lock_id(key), "line": LINE}

        def read(conn: psycopg.Connection) -> tuple[bool, bool]:
            now, pid, ours, plain, line = conn.execute(
                self._sql["recipe free for"], params
            ).fetchone()
            if pid is not None or plain:
                return False, pid is not None and pid not in (ours or [])
            return first_in_line(_text(line), claimant, now), False

        return self._call(f"reading {key!r}", read, txn=False)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        listener = self._listener_for_process() if self.settings.listen else None
        delay = POLL_MIN
        if listener is None:
            while True:
                free, foreign = self._look(key, claimant)
                remaining = deadline - time.monotonic()
                if free or remaining <= 0:
                    return
                time.sleep(min(remaining, FOREIGN_POLL if foreign else delay))
                delay = min(delay * 2, POLL_MAX)
        # Subscribed before the first look: a release of ours between the look and the
        # sleep still sets the event. A foreign unlock sets nothing: look again soon.
        with listener.subscribe(_key_id(key)) as released:
            while True:
                free, foreign = self._look(key, claimant)
                remaining = deadline - time.monotonic()
                if free or remaining <= 0:
                    return
                if foreign:
                    pause = FOREIGN_POLL
                elif listener.listening.is_set():
                    pause = MAX_SILENCE
                else:
                    pause, delay = delay, min(delay * 2, POLL_MAX)
                released.wait(min(remaining, pause))
                released.clear()

    # --- who holds what ---------------------------------------------------------------

    def holders_of(self, key: str) -> list[LeaseInfo]:
        key_id = _key_id(key)
        params = {"id": key_id, "lock": lock_id(key)}

        # Under the key's transaction lock (shared): no grant is half-done meanwhile, so
        # a session that took the lock has its row.
        def read(conn: psycopg.Connection) -> list[LeaseInfo]:
            conn.execute("SELECT pg_advisory_xact_lock_shared(%s)", (_lock_id(key_id),))
            sessions = conn.execute(_LOCK_HOLDERS, params).fetchall()
            rows = conn.execute(self._sql["recipe rows"], params).fetchall()
            return _described(key, sessions, rows)

        return self._call(f"reading {key!r}", read)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # Ours only: a foreign session's lock names a number, not a key.
        encoded = _bytes(prefix)
        params = {"length": len(encoded), "prefix": encoded}

        def read(conn: psycopg.Connection) -> list[LeaseInfo]:
            return [
                LeaseInfo(_text(key), owner, token, expires_in, _public(json.loads(holder)))
                for key, owner, token, expires_in, holder in conn.execute(
                    self._sql["recipe holders"], params
                )
            ]

        return self._call(f"listing holders under {prefix!r}", read, txn=False)

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        return Backend.holders_page(self, prefix, cursor, count, kinds)

    def close(self) -> None:
        with self._sessions_lock:
            sessions = [*self._held.values(), *self._idle]
            if self._sessions_pid == os.getpid():
                for session in sessions:
                    session.close()
            self._held, self._idle = {}, []
        super().close()


def _described(key: str, sessions: list, rows: list) -> list[LeaseInfo]:
    """The holders of ``key`` from the sessions holding its lock and the key's rows."""
    infos, named = [], set()
    for owner, token, expires_in, holder, live in rows:
        record = json.loads(holder)
        backend = record.get("pg_backend")
        if backend is None:
            if live:  # a lease of the store's own layout
                infos.append(LeaseInfo(key, owner, token, expires_in, record))
            continue
        if any(pid == backend.get("pid") for pid, *_ in sessions):
            named.add(backend.get("pid"))
            infos.append(LeaseInfo(key, owner, token, expires_in, _public(record)))
    for pid, user, application, client in sessions:
        if pid in named:
            continue
        seen = [
            f"user {user}" if user else "",
            f"application {application!r}" if application else "",
            f"from {client}" if client else "",
        ]
        details = ", ".join(part for part in seen if part)
        described = {
            "foreign": f"{FOREIGN} on {lock_id(key)} held by backend {pid}"
            + (f" ({details})" if details else "")
        }
        infos.append(LeaseInfo(key, f"pg_backend:{pid}", None, None, described))
    return infos


def _public(record: dict) -> dict:
    """The holder record as the store's other layouts keep it (without the session)."""
    return {name: value for name, value in record.items() if name != "pg_backend"}


__all__ = ["AdvisoryBackend", "RECIPE", "lock_id"]
