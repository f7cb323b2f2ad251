"""The PostgreSQL lease store: every operation is one transaction, timed by the
database's clock.

Grants and marks of a key are serialized by a transaction-scoped advisory lock on the
key (``pg_advisory_xact_lock``): it is held until COMMIT and nothing of it outlives
the transaction, so the store works through PgBouncer in transaction mode. A grant
reads the key's live leases and line only after taking that lock, in a statement of
its own (under READ COMMITTED a statement sees what committed before it began), then
decides with :func:`~..line.admit` and writes the lease, the fencing counter and the
line in one more statement.

Every expiry is computed and compared by ``clock_timestamp()``, the database server's
clock: workers' clocks never enter into it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ...errors import BackendUnavailable
from ..base import Backend, Capabilities, HoldersPage, Lease, LeaseInfo, page_of
from ..limits import check_limit
from ..line import LINE, admit, first_in_line
from ..readback import LostAnswer, budget, settle_acquire, settle_release, token_of
from . import schema
from .errors import translate
from .listener import Listener
from .settings import settings_from_url
from .watchdog import CALL_TIMEOUT, CallWatch

T = TypeVar("T")

#: wait() re-reads the key at least this often (seconds), even while LISTENing: a
#: notification sent while the listening connection was being re-made is not lost.
MAX_SILENCE = 2.0
#: wait() polls between these bounds (seconds) while nobody listens, doubling each time.
POLL_MIN, POLL_MAX = 0.01, 0.2
#: The channel of release notifications; a ``?schema=`` gets a channel of its own.
CHANNEL = "celery_exclusive"

#: Connections inherited from a parent process: never used, never closed (closing
#: would end the parent's session), only kept from the garbage collector.
_inherited: list[psycopg.Connection] = []

_NOW = "extract(epoch FROM clock_timestamp())::float8"
_LIVE = "key_id = %(id)s AND expires_at > clock_timestamp()"

# The key's live holders' limits and its live line, read after its lock is taken.
_STATE = f"""
SELECT {_NOW},
       ARRAY(SELECT lease_limit FROM {{leases}} WHERE {_LIVE}),
       (SELECT value FROM {{marks}} WHERE {_LIVE} AND kind = %(line)s)
"""

# Returns the new lease's fencing token: the key's counter + 1, but never below the
# database clock in microseconds, so a counter that was lost still lands above every
# token granted before.
_GRANT = """
WITH expired AS (
    DELETE FROM {leases} WHERE key_id = %(id)s AND expires_at <= clock_timestamp()
), fence AS (
    INSERT INTO {fences} AS f (key_id, counter)
    VALUES (%(id)s, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
    ON CONFLICT (key_id) DO UPDATE SET counter = GREATEST(f.counter + 1, excluded.counter)
    RETURNING counter
)
INSERT INTO {leases} (key_id, owner, key, fencing_token, lease_limit, expires_at, holder)
SELECT %(id)s, %(owner)s, %(key)s, counter, %(limit)s,
       clock_timestamp() + %(ttl)s * interval '1 second', %(holder)s
FROM fence
RETURNING fencing_token
"""

# Returns one row per lease still held, now extended by its own ttl.
_RENEW = """
UPDATE {leases} AS l SET expires_at = clock_timestamp() + v.ttl * interval '1 second'
FROM unnest(%s::bytea[], %s::text[], %s::float8[]) AS v(key_id, owner, ttl)
WHERE l.key_id = v.key_id AND l.owner = v.owner AND l.expires_at > clock_timestamp()
RETURNING l.key_id, l.owner
"""

# One row per lease deleted, each announcing the release to the key's waiters.
_RELEASE = """
WITH gone AS (
    DELETE FROM {leases} WHERE {live} AND owner = %(owner)s RETURNING key_id
)
SELECT pg_notify(%(channel)s, %(payload)s) FROM gone
"""
_FORCE_RELEASE = """
WITH gone AS (DELETE FROM {leases} WHERE {live} RETURNING key_id)
SELECT pg_notify(%(channel)s, %(payload)s) FROM gone
"""

# 1 row: now, how many hold the key, the smallest limit they hold it with, the line.
_FREE_FOR = f"""
SELECT {_NOW}, count(*), min(lease_limit),
       (SELECT value FROM {{marks}} WHERE {_LIVE} AND kind = %(line)s)
FROM {{leases}} WHERE {_LIVE}
"""

_HOLDERS = """
SELECT key, owner, fencing_token, extract(epoch FROM expires_at - clock_timestamp())::float8,
       holder
FROM {leases} WHERE {where} AND expires_at > clock_timestamp()
ORDER BY key, fencing_token
"""

# A page of held keys: one key more than asked for (to know whether a page follows),
# their live leases, and the marks asked for as two arrays (kinds, values).
_HOLDERS_PAGE = """
WITH page AS (
    SELECT DISTINCT key_id, key FROM {leases}
    WHERE substring(key FROM 1 FOR %(length)s) = %(prefix)s
      AND (%(after)s::bytea IS NULL OR key > %(after)s::bytea)
      AND expires_at > clock_timestamp()
    ORDER BY key LIMIT %(count)s
)
SELECT page.key, l.owner, l.fencing_token,
       extract(epoch FROM l.expires_at - clock_timestamp())::float8, l.holder,
       ARRAY(SELECT m.kind FROM {marks} m WHERE m.key_id = page.key_id
             AND m.kind = ANY(%(kinds)s) AND m.expires_at > clock_timestamp() ORDER BY m.kind),
       ARRAY(SELECT m.value FROM {marks} m WHERE m.key_id = page.key_id
             AND m.kind = ANY(%(kinds)s) AND m.expires_at > clock_timestamp() ORDER BY m.kind)
FROM page JOIN {leases} l ON l.key_id = page.key_id AND l.expires_at > clock_timestamp()
ORDER BY page.key, l.fencing_token
"""

# The fenced write: inserts (or replaces) the record only if the owner holds the key.
_WRITE_RECORD = f"""
INSERT INTO {{records}} (key_id, name, value)
SELECT %(id)s, %(name)s, %(value)s
WHERE EXISTS (SELECT FROM {{leases}} WHERE {_LIVE} AND owner = %(owner)s)
ON CONFLICT (key_id, name) DO UPDATE SET value = excluded.value
"""

_READ_MARK = f"SELECT value FROM {{marks}} WHERE {_LIVE} AND kind = %(kind)s"
_SET_MARK = """
INSERT INTO {marks} (key_id, kind, value, expires_at)
VALUES (%(id)s, %(kind)s, %(value)s, clock_timestamp() + %(ttl)s * interval '1 second')
ON CONFLICT (key_id, kind) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
"""
_DELETE_MARK = "DELETE FROM {marks} WHERE key_id = %(id)s AND kind = %(kind)s"
_NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"
_SET_LINE = "UPDATE {marks} SET value = %(value)s WHERE key_id = %(id)s AND kind = %(line)s"


class PostgreSQLBackend(Backend):
    capabilities = Capabilities(limits=True, records=True, marks=True)

    def __new__(cls, url: str) -> PostgreSQLBackend:
        # ?recipe=advisory: session advisory locks on the key's number (recipe.py).
        if cls is PostgreSQLBackend and settings_from_url(url).recipe:
            cls = cls.speaking_recipe()
        return super().__new__(cls)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.settings = settings_from_url(url)
        prefix = "" if self.settings.schema is None else _quote_ident(self.settings.schema) + "."
        tables = {
            name: f"{prefix}exclusive_{name}" for name in ("leases", "fences", "marks", "records")
        }
        #: The store's tables by short name ("leases", ...), schema-qualified as the URL says.
        self.tables = tables
        self._sql = {
            name: text.format(live=_LIVE, where="{where}", **tables)
            for name, text in {
                "state": _STATE,
                "grant": _GRANT,
                "renew": _RENEW,
                "release": _RELEASE,
                "force_release": _FORCE_RELEASE,
                "free_for": _FREE_FOR,
                "holders": _HOLDERS,
                "holders_page": _HOLDERS_PAGE,
                "write_record": _WRITE_RECORD,
                "read_record": "SELECT value FROM {records} WHERE key_id = %(id)s "
                "AND name = %(name)s",
                "read_mark": _READ_MARK,
                "set_mark": _SET_MARK,
                "delete_mark": _DELETE_MARK,
                "set_line": _SET_LINE,
            }.items()
        }
        # A channel name is an identifier: at most 63 bytes, whatever the schema's name.
        self.channel = (
            CHANNEL
            if self.settings.schema is None
            else f"{CHANNEL}_{hashlib.sha256(self.settings.schema.encode()).hexdigest()[:16]}"
        )
        self._connection_lock = threading.Lock()
        self._conn: Optional[psycopg.Connection] = None
        self._watch = CallWatch(f"PostgreSQL store {self.safe_url}")
        self._pid = os.getpid()
        self._listener: Optional[Listener] = None

    # --- connection -------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        """This process's connection, (re)made as needed. Call with the lock held."""
        if self._pid != os.getpid():
            if self._conn is not None:
                _inherited.append(self._conn)
            self._conn, self._pid, self._listener = None, os.getpid(), None
        if self._conn is not None and not self._conn.closed:
            return self._conn
        conn = psycopg.connect(
            self.settings.conninfo,
            autocommit=True,
            prepare_threshold=None if self.settings.pgbouncer else 5,
        )
        try:
            if schema.installed_version(conn, self.settings.schema) is None:
                schema.create(conn, self.settings.schema)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def _run(
        self,
        action: str,
        work: Callable[[psycopg.Connection], T],
        txn: bool = True,
        bound: float = CALL_TIMEOUT,
    ) -> T:
        """Run ``work(conn)`` as one transaction (``txn``) or one autocommit statement,
        cut off after ``bound`` seconds without an answer (:mod:`.watchdog`).

        Every failure leaves as an ExclusiveError; one whose answer was lost after the
        request went out (the outcome of a write is unknown) as :class:`.LostAnswer`.
        """
        with self._connection_lock:
            try:
                conn = self._connection()
            except (psycopg.Error, OSError) as exc:
                raise translate(exc, action, self) from None
            try:
                with self._watch.bounded(conn, bound):
                    if not txn:
                        return work(conn)
                    with conn.transaction():
                        return work(conn)
            except (psycopg.Error, OSError) as exc:
                broken = conn.broken or conn.closed
                if broken:
                    self._drop_connection()
                if isinstance(exc, pg_errors.UndefinedTable):
                    self._drop_connection()  # someone dropped the tables: re-create them
                error = translate(exc, action, self)
                if broken and isinstance(error, BackendUnavailable):
                    raise LostAnswer(error) from None
                raise error from None

    def _call(
        self,
        action: str,
        work: Callable[[psycopg.Connection], T],
        txn: bool = True,
        bound: float = CALL_TIMEOUT,
    ) -> T:
        """``_run`` for reads and idempotent writes: a lost answer is just unavailability,
        after one retry on a fresh connection (the first statement after a server
        restart finds the old connection dead)."""
        for attempt in (1, 2):
            try:
                return self._run(action, work, txn, bound)
            except LostAnswer as lost:
                if attempt == 2:
                    raise lost.error from None
        raise AssertionError("unreachable")

    def _notify_args(self, key_id: bytes) -> dict:
        return {"channel": self.channel, "payload": key_id.hex()}

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
        key_id = _key_id(key)
        params = {
            "id": key_id,
            "key": _bytes(key),
            "owner": owner,
            "ttl": ttl,
            "limit": limit,
            "holder": json.dumps(dict(holder or {})),
            "line": LINE,
        }

        def acquire(conn: psycopg.Connection) -> Optional[Lease]:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_id(key_id),))
            now, limits, line = conn.execute(self._sql["state"], params).fetchone()
            check_limit(key, limit, limits)
            line = _text(line)
            admitted, rest = admit(line, claimant, limit - len(limits), now)
            if not admitted:
                return None
            if rest != line:  # the grant took the claimant out of the line
                if rest is None:
                    conn.execute(self._sql["delete_mark"], {"id": key_id, "kind": LINE})
                else:
                    conn.execute(self._sql["set_line"], {**params, "value": _bytes(rest)})
            (token,) = conn.execute(self._sql["grant"], params).fetchone()
            return Lease(key, owner, token, ttl, limit)

        action = f"acquiring {key!r}"
        try:
            return self._run(action, acquire)
        except LostAnswer as lost:
            token = settle_acquire(lambda: token_of(self, key, owner), lost.error, budget(ttl))
            return Lease(key, owner, token, ttl, limit)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        ids = [_key_id(lease.key) for lease in leases]
        args = (ids, [lease.owner for lease in leases], [lease.ttl for lease in leases])

        def renew(conn: psycopg.Connection) -> set[tuple[bytes, str]]:
            return {(bytes(k), o) for k, o in conn.execute(self._sql["renew"], args).fetchall()}

        # A renewal answered after a whole ttl confirms nothing: its leases are lost.
        bound = min(CALL_TIMEOUT, min(lease.ttl for lease in leases))
        kept = self._call(f"renewing {len(leases)} lease(s)", renew, txn=False, bound=bound)
        return {lease for lease, key_id in zip(leases, ids) if (key_id, lease.owner) not in kept}

    def release(self, lease: Lease) -> bool:
        key_id = _key_id(lease.key)
        params = {"id": key_id, "owner": lease.owner, **self._notify_args(key_id)}

        def release(conn: psycopg.Connection) -> bool:
            return bool(conn.execute(self._sql["release"], params).fetchall())

        def send() -> bool:
            return self._run(f"releasing {lease.key!r}", release, txn=False)

        try:
            return send()
        except LostAnswer as lost:
            return settle_release(
                lambda: token_of(self, lease.key, lease.owner) is not None,
                send,
                lost.error,
                budget(lease.ttl),
            )

    def _free_for(self, key_id: bytes, claimant: Optional[str], key: str) -> bool:
        params = {"id": key_id, "line": LINE}

        def read(conn: psycopg.Connection) -> bool:
            now, held, smallest, line = conn.execute(self._sql["free_for"], params).fetchone()
            if held and held >= smallest:
                return False
            return first_in_line(_text(line), claimant, now)

        return self._call(f"reading {key!r}", read, txn=False)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        key_id = _key_id(key)
        listener = self._listener_for_process() if self.settings.listen else None
        if listener is None:
            delay = POLL_MIN
            while not self._free_for(key_id, claimant, key):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, POLL_MAX)
            return
        # Subscribed before the first read: a release between the read and the sleep
        # still sets the event.
        with listener.subscribe(key_id) as released:
            delay = POLL_MIN
            while not self._free_for(key_id, claimant, key):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                if listener.listening.is_set():
                    released.wait(min(remaining, MAX_SILENCE))
                else:
                    released.wait(min(remaining, delay))
                    delay = min(delay * 2, POLL_MAX)
                released.clear()

    def _listener_for_process(self) -> Listener:
        with self._connection_lock:
            if self._listener is None or self._listener.pid != os.getpid():
                self._listener = Listener(self.settings.conninfo, self.channel)
            return self._listener

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        encoded = _bytes(prefix)
        where = "substring(key FROM 1 FOR %(length)s) = %(prefix)s"
        params = {"length": len(encoded), "prefix": encoded}
        return self._holders(where, params, f"listing holders under {prefix!r}")

    def holders_of(self, key: str) -> list[LeaseInfo]:
        return self._holders("key_id = %(id)s", {"id": _key_id(key)}, f"reading {key!r}")

    def _holders(self, where: str, params: dict, action: str) -> list[LeaseInfo]:
        query = self._sql["holders"].replace("{where}", where)

        def read(conn: psycopg.Connection) -> list[LeaseInfo]:
            return [
                LeaseInfo(_text(key), owner, token, expires_in, json.loads(holder))
                for key, owner, token, expires_in, holder in conn.execute(query, params)
            ]

        return self._call(action, read, txn=False)

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        encoded = _bytes(prefix)
        params = {
            "length": len(encoded),
            "prefix": encoded,
            "after": None if cursor is None else _bytes(cursor),
            "count": count + 1,
            "kinds": list(kinds),
        }

        def read(conn: psycopg.Connection) -> HoldersPage:
            rows = []
            for key, owner, token, expires_in, holder, names, values in conn.execute(
                self._sql["holders_page"], params
            ):
                found = dict(zip(names, (_text(value) for value in values)))
                info = LeaseInfo(_text(key), owner, token, expires_in, json.loads(holder))
                rows.append((info.key, info, [found.get(kind) for kind in kinds]))
            return page_of(rows, kinds, count)

        return self._call(f"listing holders under {prefix!r}", read, txn=False)

    def force_release(self, key: str) -> int:
        key_id = _key_id(key)
        params = {"id": key_id, **self._notify_args(key_id)}

        def force(conn: psycopg.Connection) -> int:
            return len(conn.execute(self._sql["force_release"], params).fetchall())

        return self._call(f"force-releasing {key!r}", force, txn=False)

    # --- records and marks ------------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        params = {"id": _key_id(lease_key), "name": _bytes(name)}

        def read(conn: psycopg.Connection) -> Optional[str]:
            row = conn.execute(self._sql["read_record"], params).fetchone()
            return None if row is None else _text(row[0])

        return self._call(f"reading the record {name!r} of {lease_key!r}", read, txn=False)

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        key_id = _key_id(lease.key)
        params = {"id": key_id, "name": _bytes(name), "value": _bytes(value), "owner": lease.owner}

        # Under the key's lock: no new grant can come between the holder check and the
        # write, so a former holder never overwrites what a new one wrote.
        def write(conn: psycopg.Connection) -> bool:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_id(key_id),))
            return conn.execute(self._sql["write_record"], params).rowcount > 0

        return self._call(f"writing the record {name!r} of {lease.key!r}", write)

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        params = {"id": _key_id(key), "kind": kind}

        def read(conn: psycopg.Connection) -> Optional[str]:
            row = conn.execute(self._sql["read_mark"], params).fetchone()
            return None if row is None else _text(row[0])

        return self._call(f"reading the {kind} mark of {key!r}", read, txn=False)

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        key_id = _key_id(key)
        params = {"id": key_id, "kind": kind, "ttl": ttl, "value": _bytes(new or "")}

        # Under the key's lock, which grants take too: they take their claimant out of
        # the line, so a swap of the line and a grant never interleave.
        def swap(conn: psycopg.Connection) -> bool:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_id(key_id),))
            row = conn.execute(self._sql["read_mark"], params).fetchone()
            if (None if row is None else _text(row[0])) != expected:
                return False
            conn.execute(self._sql["delete_mark" if new is None else "set_mark"], params)
            if kind == LINE:  # the line moved: its new first may be free to go
                conn.execute(_NOTIFY, self._notify_args(key_id))
            return True

        return self._call(f"changing the {kind} mark of {key!r}", swap)

    # --- the store's clock, the start-up check ---------------------------------------

    def store_time(self) -> float:
        def now(conn: psycopg.Connection) -> float:
            return conn.execute(f"SELECT {_NOW}").fetchone()[0]

        return self._call("reading the time", now, txn=False)

    def check(self, probe_key: str) -> list[str]:
        warnings = super().check(probe_key)

        def settings(conn: psycopg.Connection) -> dict[str, str]:
            rows = conn.execute(
                "SELECT name, setting FROM pg_settings "
                "WHERE name IN ('fsync', 'synchronous_commit')"
            ).fetchall()
            (standby,) = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            return {**dict(rows), "standby": "on" if standby else "off"}

        found = self._call("reading the server settings", settings, txn=False)
        if found.get("fsync") == "off" or found.get("synchronous_commit") == "off":
            warnings.append(
                f"the PostgreSQL server at {self.safe_url} runs with fsync or "
                "synchronous_commit off: a crash can forget grants it acknowledged, so a key "
                "may be granted twice across one (fencing tokens still rise, floored by the "
                "database clock)."
            )
        if not self.settings.listen:
            warnings.append(
                f"{self.safe_url}: wait() polls the store (pgbouncer=1 or listen=0), "
                f"{POLL_MIN * 1000:.0f}-{POLL_MAX * 1000:.0f} ms, instead of LISTEN/NOTIFY."
            )
        return warnings

    def migrate(self) -> str:
        """Create the store's tables (and ``?schema=``) now, as this URL's role. What
        ``celery exclusive migrate`` runs for a locked-down database, with an owner's URL."""

        def create(conn: psycopg.Connection) -> int:
            schema.create(conn, self.settings.schema)
            return schema.installed_version(conn, self.settings.schema) or schema.SCHEMA_VERSION

        version = self._call("creating the tables", create, txn=False)
        return f"the exclusive_* tables are in place (schema version {version})"

    def close(self) -> None:
        with self._connection_lock:
            if self._listener is not None and self._listener.pid == os.getpid():
                self._listener.stop()
            self._listener = None
            self._drop_connection()


def _key_id(key: str) -> bytes:
    """A key's row id: fixed width for any key, equal only for equal keys."""
    return hashlib.sha256(_bytes(key)).digest()


def _lock_id(key_id: bytes) -> int:
    """The advisory lock (a signed 64-bit number) that serializes one key's writes."""
    return int.from_bytes(key_id[:8], "big", signed=True)


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _text(value: Optional[bytes]) -> Optional[str]:
    return None if value is None else bytes(value).decode("utf-8", "surrogatepass")


def _quote_ident(name: str) -> str:
    return sql.Identifier(name).as_string(None)
