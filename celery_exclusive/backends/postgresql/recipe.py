"""``?recipe=advisory``: leases taken as PostgreSQL session advisory locks on a number of
the key that any SQL can compute.

PostgreSQL's own lock for application code is the advisory lock
(src/backend/utils/adt/lockfuncs.c): ``pg_advisory_lock(bigint)`` waits for it,
``pg_try_advisory_lock(bigint)`` takes it or answers false, ``pg_advisory_unlock(bigint)``
gives it back; a session-level lock is held until its session unlocks it or ends,
whatever its transactions do. A lease on ``K`` is the session lock on :func:`lock_id`
(``K``), the common hash: ``('x' || left(md5(K), 16))::bit(64)::bigint`` in SQL.

- **The session is the lease, and the server's clock ends it**: one database session
  per lease (pooled once released), whose ``idle_session_timeout`` is the lease's ttl.
  A holder that dies frees the lock with its socket; one that hangs, ``ttl`` after its
  last renewal, a statement on that very session. A session is never made again: lost,
  it took the lock with it, and the next renewal reports the lease lost.
- **A waiter takes its turn in PostgreSQL's own queue**: the first in our line asks
  ``pg_advisory_lock`` on a session of its own (:class:`_Turn`), so it is served in turn
  with foreign clients that wait the same way, and the lock it is granted becomes its
  lease. A poll with ``pg_try_advisory_lock`` would never be served while foreign
  clients re-lock back to back: each unlock grants the lock to whoever waits in the
  queue, and a newcomer never goes ahead of them (lock.c: LockAcquire, ProcLockWakeup).
- **Who holds it**: each grant also writes a row in ``exclusive_leases`` (owner, token
  from ``exclusive_fences``, holder record, and the session under ``"pg_backend"``), which
  counts only while its session holds the lock. A session holding the lock that no row
  names is a foreign holder, named, and never unlocked or terminated: ``force_release``
  ends only sessions a row of ours names.
- The store's own per-key transaction lock stays another hash of the key (the first 8
  bytes of its SHA-256), so a recipe holder never blocks the store's transactions, and
  workers with and without ``?recipe=`` on one schema see each other's leases.

Refused, by name: ``pgbouncer=1`` (transaction pooling cannot keep a session for a
lease), a limit above 1, PostgreSQL before 14 (no ``idle_session_timeout``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import psycopg
from psycopg import pq

from ...errors import ConfigurationError
from ..base import NO_END, Backend, Capabilities, End, LayoutVersion, Lease, LeaseInfo, MarkRead
from ..line import LINE, admit, first_in_line
from .connection import NOW, PostgreSQLConnection, decoded, encoded, inherited, key_id, key_lock
from .watchdog import CALL_TIMEOUT, WATCH_INTERVAL

#: The value of ``?recipe=`` this module speaks.
RECIPE = "advisory"
#: Seconds a waiter's place in PostgreSQL's queue is kept after its wait() returns, for
#: its next step (its try, its next wait); then it is given up.
KEEP_TURN = 1.0
#: Milliseconds the server keeps a lock granted to a waiter that does not take it (its
#: process stopped): the waiting session's ``idle_session_timeout``.
TURN_IDLE_MS = 2000
#: Milliseconds between the server's checks that a waiting session's client is still
#: there (``client_connection_check_interval``): a waiter that died leaves the queue.
CLIENT_CHECK_MS = 1000
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
    digest = hashlib.md5(encoded(key), usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


# The sessions holding the advisory lock {lock}, each with what pg_stat_activity shows of
# it. pg_locks shows a bigint advisory lock as classid (high 32 bits), objid (low 32 bits)
# and objsubid 1 in the current database (lockfuncs.c, SET_LOCKTAG_INT64). A session is
# its pid and its start: a pid outlives its session, and may be a foreign client's next.
_LOCKS = """
SELECT l.pid, extract(epoch FROM a.backend_start)::float8 AS started, a.usename,
       a.application_name, host(a.client_addr)
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint) = {lock}
"""
# The session a row ``r`` of ours names, if it is the recipe's: its pid and its start.
_SESSION_PID = "(r.holder::jsonb #>> '{pg_backend,pid}')::int"
_SESSION_STARTED = "(r.holder::jsonb #>> '{pg_backend,started}')::float8"
# A row ``r`` of ours is a live lease if it names a session that holds the key's lock (the
# same number in SQL, of the key held as bytes), or, for a lease of the store's own
# layout (no "pg_backend"), while it has not expired.
_HELD_BY_ROW = _LOCKS.format(lock="('x' || left(md5(r.key), 16))::bit(64)::bigint")
_HELD = f"""
(CASE WHEN r.holder::jsonb -> 'pg_backend' IS NULL THEN r.expires_at > clock_timestamp()
      ELSE ({_SESSION_PID}, {_SESSION_STARTED}) IN (SELECT pid, started FROM ({_HELD_BY_ROW}) s)
 END)
"""
# What the statements below name, besides the tables.
_NAMES = {
    "now": NOW,
    "session_pid": _SESSION_PID,
    "session_started": _SESSION_STARTED,
    "held": _HELD,
    "locks": _LOCKS.format(lock="%(lock)s"),
}

# After the key's transaction lock: now, whether a lease of the store's own layout holds
# it, and its line.
_STATE = """
SELECT {now},
       EXISTS (SELECT FROM {leases} WHERE key_id = %(id)s AND expires_at > clock_timestamp()
               AND holder::jsonb -> 'pg_backend' IS NULL),
       (SELECT value FROM {marks} WHERE key_id = %(id)s AND kind = %(line)s
        AND expires_at > clock_timestamp())
"""

# Take the session lock (unless the session holds it already: a waiter's turn came); if
# taken: end the session ``idle`` ms after its last statement, drop the key's rows (stale:
# their sessions no longer hold it), raise the fence, write the row. Returns the fencing
# token, or no row when the lock is held.
_GRANT = """
WITH got AS MATERIALIZED (
    SELECT CASE WHEN %(held)s THEN true ELSE pg_try_advisory_lock(%(lock)s) END AS ok
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

# On the holder's session (or a waiter's, refused its grant): unlock, stop the idle clock
# (the session goes back to the pool), delete the row, wake our waiters. Returns whether
# the session held the lock.
_UNLOCK = """
WITH gone AS (DELETE FROM {leases} WHERE key_id = %(id)s AND owner = %(owner)s)
SELECT pg_advisory_unlock(%(lock)s), set_config('idle_session_timeout', '0', false),
       pg_notify(%(channel)s, %(payload)s)
"""

# From any session: end the session a row of ours names, if it still holds the key's
# lock (its holder died, or an operator frees the key), and delete the row. One row per
# lease freed.
_TERMINATE = """
WITH mine AS (
    DELETE FROM {leases} r WHERE key_id = %(id)s AND owner = %(owner)s
    RETURNING r.expires_at, {session_pid} AS pid, {session_started} AS started
)
SELECT CASE WHEN r.pid IS NULL THEN r.expires_at > clock_timestamp()
            ELSE pg_terminate_backend(r.pid, %(wait)s) END,
       pg_notify(%(channel)s, %(payload)s)
FROM mine r
WHERE r.pid IS NULL OR (r.pid, r.started) IN (SELECT pid, started FROM ({locks}) s)
"""

# The key's rows: with the sessions holding its lock (``_LOCKS``), who holds the key.
_ROWS = """
SELECT r.owner, r.fencing_token, extract(epoch FROM r.expires_at - clock_timestamp())::float8,
       r.holder, r.expires_at > clock_timestamp()
FROM {leases} r WHERE r.key_id = %(id)s
ORDER BY r.fencing_token
"""

_HOLDERS = """
SELECT r.key, r.owner, r.fencing_token,
       extract(epoch FROM r.expires_at - clock_timestamp())::float8, r.holder
FROM {leases} r
WHERE substring(r.key FROM 1 FOR %(length)s) = %(prefix)s AND {held}
ORDER BY r.key, r.fencing_token
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


class _Turn:
    """A waiter's place in PostgreSQL's own queue for a key's lock: a session of its own
    that asks ``pg_advisory_lock``, watched by a thread of its own.

    It is kept from one wait() to the next (a wait lasts a third of the ttl at most,
    a foreign hold may last longer) while the waiter asks for it, until :attr:`until`
    (monotonic); then the request is cancelled. Once granted, the session holds the lock
    for the waiter's next try_acquire (:meth:`take`), which makes it the lease; untaken
    by :attr:`until`, it is closed, and the lock goes to the next in the queue.
    """

    def __init__(self, session: _Session, lock: int, until: float) -> None:
        self.session = session
        self.until = until
        self.granted = False
        #: Set once the request is answered: granted, or not (cancelled, lost).
        self.answered = threading.Event()
        self._taken = threading.Event()
        self._guard = threading.Lock()
        self._closed = False
        thread = threading.Thread(target=self._run, args=(lock,), daemon=True)
        thread.name = "celery-exclusive-pg-turn"
        thread.start()

    def _run(self, lock: int) -> None:
        conn = self.session.conn
        try:
            conn.execute(
                "SELECT set_config('idle_session_timeout', %s, false), "
                "set_config('client_connection_check_interval', %s, false)",
                (str(TURN_IDLE_MS), str(CLIENT_CHECK_MS)),
            )
            self.granted = self._ask(conn.pgconn, lock)
        except (psycopg.Error, OSError):
            pass
        self.answered.set()
        while self.granted and not self._taken.is_set() and time.monotonic() < self.until:
            self._taken.wait(max(0.0, self.until - time.monotonic()))
        self.give_up()

    def _ask(self, pgconn: Any, lock: int) -> bool:
        """``pg_advisory_lock`` sent without blocking: cancelled once :attr:`until`
        passes, the connection dropped if even the cancel goes unanswered."""
        pgconn.send_query_params(b"SELECT pg_advisory_lock($1)", [str(lock).encode()])
        cancelled = False
        while pgconn.is_busy():
            now = time.monotonic()
            if now > self.until + CALL_TIMEOUT:
                return False  # the server answers nothing: the session is closed
            if now > self.until and not cancelled:
                cancelled = True
                self.session.conn.cancel_safe(timeout=CALL_TIMEOUT)
            select.select([pgconn.socket], [], [], WATCH_INTERVAL)
            pgconn.consume_input()
        results = []
        while (result := pgconn.get_result()) is not None:
            results.append(result)
        return bool(results) and results[0].status == pq.ExecStatus.TUPLES_OK

    @property
    def live(self) -> bool:
        """Still asking, or granted and neither taken nor given up."""
        return not self._closed and (self.granted or not self.answered.is_set())

    def take(self) -> Optional[_Session]:
        """The session holding the lock, for the waiter's try_acquire; None if not
        granted (yet), or given up."""
        with self._guard:
            if not self.granted or self._closed:
                return None
            self._taken.set()
            return self.session

    def give_up(self) -> None:
        """Leave the queue, or let the granted lock go, unless it was taken."""
        self.until = 0.0
        with self._guard:
            if not self._taken.is_set() and self.answered.is_set() and not self._closed:
                self._closed = True
                self.session.close()


class AdvisoryBackend(Backend):
    """The PostgreSQL store speaking session advisory locks (see the module docstring)."""

    recipe = RECIPE
    #: One holder per key, as the recipe has.
    capabilities = Capabilities(records=True, marks=True)
    layout_version = LayoutVersion("postgresql+advisory", 1)
    connection_class = PostgreSQLConnection
    connection: PostgreSQLConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._sql = self.connection.statements(
            {
                "state": _STATE,
                "grant": _GRANT,
                "renew": _RENEW,
                "unlock": _UNLOCK,
                "terminate": _TERMINATE,
                "lock holders": "{locks}",
                "rows": _ROWS,
                "holders": _HOLDERS,
            },
            **_NAMES,
        )
        self._sessions_lock = threading.Lock()
        self._sessions_pid = os.getpid()
        #: lease owner -> the session holding its lock
        self._held: dict[str, _Session] = {}
        #: sessions that hold nothing, kept for the next grants (at most POOL_SIZE)
        self._idle: list[_Session] = []
        #: (key, claimant) -> its waiter's place in PostgreSQL's queue for the key's lock
        self._turns: dict[tuple[str, Optional[str]], _Turn] = {}

    # --- sessions ---------------------------------------------------------------------

    def _forked(self) -> None:
        """In a forked child: the parent's sessions are the parent's. Never use or close
        them (closing ends the parent's sessions and frees its locks)."""
        if self._sessions_pid != os.getpid():
            turns = [turn.session for turn in self._turns.values()]
            inherited.extend(s.conn for s in [*self._held.values(), *self._idle, *turns])
            self._held, self._idle, self._turns = {}, [], {}
            self._sessions_pid = os.getpid()

    def _take_session(self) -> tuple[_Session, bool]:
        """An idle session (True: from the pool) or a new one (False)."""
        with self._sessions_lock:
            self._forked()
            if self._idle:
                return self._idle.pop(), True
        return self._open_session(), False

    def _open_session(self) -> _Session:
        self.connection.call("preparing the tables", lambda conn: None, txn=False)  # makes them
        action = "opening a session for a lease"
        try:
            conn = psycopg.connect(
                self.connection.settings.conninfo, autocommit=True, prepare_threshold=None
            )
        except (psycopg.Error, OSError) as exc:
            raise self.connection.translate(exc, action) from None
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
            raise self.connection.translate(exc, action) from None
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
        read: Optional[MarkRead] = None,
    ) -> Optional[Lease]:
        taken = self._take_turn(key, claimant)  # holds the lock: the waiter's turn came
        for attempt in (1, 2):
            held = taken is not None and attempt == 1
            session, pooled = (taken, True) if held and taken else self._take_session()
            try:
                token, value = self._grant(session, key, owner, ttl, holder, claimant, read, held)
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
                raise self.connection.translate(exc, f"acquiring {key!r}") from None
            except BaseException:
                session.close()
                raise
            if read is not None:
                read.value, read.done = value, True
            if token is None:
                if held:  # the line or a lease of the store's own layout goes first
                    self._unlock(session, Lease(key, owner, 0, ttl))
                else:
                    self._keep(session)
                return None
            with self._sessions_lock:
                self._held[owner] = session
                turn = self._turns.pop((key, claimant), None)
            if turn is not None:
                turn.give_up()  # still queued: no longer needed
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
        read: Optional[MarkRead],
        held: bool,
    ) -> tuple[Optional[int], Optional[str]]:
        """The grant on ``session`` (``held``: which holds the lock already): the key's
        transaction lock, its state and line, then the session lock and the row, in one
        transaction. The token (or None), and the mark ``read`` asks for, read after the
        attempt."""
        id_ = key_id(key)
        idle_ms = str(max(1, int(ttl * 1000)))
        record = {
            **dict(holder or {}),
            "pg_backend": {"pid": session.pid, "started": session.started},
        }
        params = {
            "id": id_,
            "key": encoded(key),
            "owner": owner,
            "ttl": ttl,
            "lock": lock_id(key),
            "idle": idle_ms,
            "holder": json.dumps(record),
            "line": LINE,
            "held": held,
        }
        conn, token = session.conn, None
        with session.lock, conn.transaction():
            # A session stopped half-way through this transaction is ended by the server
            # after ttl too, and its lock with it.
            conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, true), "
                "pg_advisory_xact_lock(%s)",
                (idle_ms, key_lock(id_)),
            )
            now, plain_lease, line = conn.execute(self._sql["state"], params).fetchone()
            line = decoded(line)
            admitted, rest = admit(line, claimant, 1, now)
            if admitted and not plain_lease:
                row = conn.execute(self._sql["grant"], params).fetchone()
                if row is not None:  # the lock was free: the claimant leaves the line
                    token = row[0]
                    self.connection.take_from_line(conn, id_, line, rest)
                    if rest is not None:  # the next in line takes its turn in the queue
                        self.connection.wake(conn, id_)
            value = None if read is None else self.connection.mark_in(conn, read.key, read.kind)
        return token, value

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        lost = set()
        for lease in leases:
            session = self._holding(lease.owner)
            if session is None:
                lost.add(lease)
                continue
            params = {"id": key_id(lease.key), "owner": lease.owner, "ttl": lease.ttl}
            try:
                with session.lock:
                    kept = session.conn.execute(self._sql["renew"], params).fetchone()
            except (psycopg.Error, OSError) as exc:
                if not (session.conn.broken or session.conn.closed):
                    raise self.connection.translate(exc, f"renewing {lease.key!r}") from None
                # The session is gone, and its lock with it: nothing can bring it back.
                self._let_go(lease.owner)
                session.close()
                lost.add(lease)
                continue
            if kept is None:
                lost.add(lease)
        return lost

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END:
            return super().release(lease, end)  # the mark swapped first, then this
        session = self._let_go(lease.owner)
        if session is None:
            return self._terminate(lease)
        return self._unlock(session, lease)

    def _unlock(self, session: _Session, lease: Lease) -> bool:
        """Unlock ``lease.key`` on ``session``, which holds it, and keep the session."""
        id_ = key_id(lease.key)
        params = {
            "id": id_,
            "owner": lease.owner,
            "lock": lock_id(lease.key),
            **self.connection.notify_args(id_),
        }
        try:
            with session.lock:
                unlocked = session.conn.execute(self._sql["unlock"], params).fetchone()[0]
        except (psycopg.Error, OSError) as exc:
            session.close()
            if not (session.conn.broken or session.conn.closed):
                raise self.connection.translate(exc, f"releasing {lease.key!r}") from None
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
        id_ = key_id(lease.key)
        params = {
            "id": id_,
            "owner": lease.owner,
            "lock": lock_id(lease.key),
            "wait": TERMINATE_WAIT_MS,
            **self.connection.notify_args(id_),
        }

        def terminate(conn: psycopg.Connection) -> bool:
            return any(row[0] for row in conn.execute(self._sql["terminate"], params))

        try:
            return self.connection.call(f"releasing {lease.key!r}", terminate, txn=False)
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
                freed += bool(self.release(Lease(key, info.owner, info.fencing_token, 1.0)))
        return freed

    # --- waiting ----------------------------------------------------------------------

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        """Wait for ``claimant``'s turn in our line, then in PostgreSQL's own queue for the
        key's lock (:class:`_Turn`), whose grant ``try_acquire`` takes next."""
        deadline = time.monotonic() + timeout
        turn = self._turn(key, claimant)
        if turn is None:
            id_ = key_id(key)
            params = {"id": id_, "line": LINE}

            # First in our line, and no lease of the store's own layout on the key.
            def first(conn: psycopg.Connection) -> bool:
                now, plain_lease, line = conn.execute(self._sql["state"], params).fetchone()
                return not plain_lease and first_in_line(decoded(line), claimant, now)

            def our_turn() -> bool:
                return self.connection.call(f"reading {key!r}", first, txn=False)

            if not self.connection.wait(id_, timeout, our_turn):
                return
            turn = self._queue(key, claimant, deadline + KEEP_TURN)
        turn.until = max(turn.until, deadline + KEEP_TURN)
        turn.answered.wait(max(0.0, deadline - time.monotonic()))

    def _turn(self, key: str, claimant: Optional[str]) -> Optional[_Turn]:
        """``claimant``'s place in the queue for ``key``'s lock, unless it was given up."""
        with self._sessions_lock:
            self._forked()
            turn = self._turns.get((key, claimant))
            if turn is not None and not turn.live:
                del self._turns[(key, claimant)]
                return None
            return turn

    def _take_turn(self, key: str, claimant: Optional[str]) -> Optional[_Session]:
        """The session ``claimant``'s granted turn holds ``key``'s lock on, taken from it."""
        with self._sessions_lock:
            self._forked()
            turn = self._turns.get((key, claimant))
            session = None if turn is None else turn.take()
            if session is not None:
                del self._turns[(key, claimant)]
            return session

    def _queue(self, key: str, claimant: Optional[str], until: float) -> _Turn:
        """Ask for ``key``'s lock on a session of its own, for ``claimant``."""
        session, _ = self._take_session()
        turn = _Turn(session, lock_id(key), until)
        with self._sessions_lock:
            self._turns[(key, claimant)] = turn
        return turn

    # --- who holds what ---------------------------------------------------------------

    def holders_of(self, key: str) -> list[LeaseInfo]:
        id_ = key_id(key)
        params = {"id": id_, "lock": lock_id(key)}

        # Under the key's transaction lock (shared): no grant is half-done meanwhile, so
        # a session that took the lock has its row.
        def read(conn: psycopg.Connection) -> list[LeaseInfo]:
            conn.execute("SELECT pg_advisory_xact_lock_shared(%s)", (key_lock(id_),))
            sessions = conn.execute(self._sql["lock holders"], params).fetchall()
            rows = conn.execute(self._sql["rows"], params).fetchall()
            return _described(key, sessions, rows)

        return self.connection.call(f"reading {key!r}", read)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # Ours only: a foreign session's lock names a number, not a key.
        encoded_prefix = encoded(prefix)
        params = {"length": len(encoded_prefix), "prefix": encoded_prefix}

        def read(conn: psycopg.Connection) -> list[LeaseInfo]:
            return [
                LeaseInfo(decoded(key), owner, token, expires_in, _public(json.loads(holder)))
                for key, owner, token, expires_in, holder in conn.execute(
                    self._sql["holders"], params
                )
            ]

        return self.connection.call(f"listing holders under {prefix!r}", read, txn=False)

    # --- records and marks, the clock, the start-up check -----------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        return self.connection.read_record(lease_key, name)

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        return self.connection.write_record(lease, name, value, _HELD)

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        return self.connection.read_mark(key, kind)

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        return self.connection.swap_mark(key, kind, expected, new, ttl)

    def store_time(self) -> float:
        return self.connection.store_time()

    def check(self, probe_key: str) -> list[str]:
        return super().check(probe_key) + self.connection.warnings()

    def close(self) -> None:
        with self._sessions_lock:
            sessions = [*self._held.values(), *self._idle]
            if self._sessions_pid == os.getpid():
                for turn in self._turns.values():
                    turn.give_up()
                for session in sessions:
                    session.close()
            self._held, self._idle, self._turns = {}, [], {}
        super().close()


def _described(key: str, sessions: list[Any], rows: list[Any]) -> list[LeaseInfo]:
    """The holders of ``key`` from the sessions holding its lock and the key's rows: a
    row of ours counts while the very session it names (pid and start) holds the lock;
    a session no row names is a foreign holder."""
    infos, named = [], set()
    holding = {(pid, started) for pid, started, *_ in sessions}
    for owner, token, expires_in, holder, live in rows:
        record = json.loads(holder)
        backend = record.get("pg_backend")
        if backend is None:
            if live:  # a lease of the store's own layout
                infos.append(LeaseInfo(key, owner, token, expires_in, record))
            continue
        session = (backend.get("pid"), backend.get("started"))
        if session in holding:
            named.add(session)
            infos.append(LeaseInfo(key, owner, token, expires_in, _public(record)))
    for pid, started, user, application, client in sessions:
        if (pid, started) in named:
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


def _public(record: dict[str, Any]) -> dict[str, Any]:
    """The holder record as the store's other layouts keep it (without the session)."""
    return {name: value for name, value in record.items() if name != "pg_backend"}


__all__ = ["AdvisoryBackend", "RECIPE", "lock_id"]
