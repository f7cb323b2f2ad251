"""What the PostgreSQL store's layouts share: one connection per process, its failures
translated in one place, the release notifications ``wait()`` listens for, and the
marks and records, kept in the store's tables whichever layout holds the leases.

The connection is made on first use (creating the tables if they are missing), again
in a forked child (never sharing its parent's socket) and again after a server
restart. Every statement is bounded on the client (:mod:`.watchdog`). Every psycopg
exception leaves through :meth:`PostgreSQLConnection.translate`: transient failures
(the server did not answer, is starting or shutting down, dropped the connection) as
:class:`BackendUnavailable`, so tasks are requeued; permanent ones (the password, the
role, the database, TLS, privileges, a read-only standby) as a
:class:`ConfigurationError` naming what to fix, raised at worker start by ``check()``
and failing a task at run time instead of requeueing it forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from ...errors import BackendUnavailable, ConfigurationError, ExclusiveError
from ..base import Connection, Lease, unavailable
from ..line import LINE
from ..readback import LostAnswer
from . import schema
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
inherited: list[psycopg.Connection] = []

#: The database's clock, in seconds since the epoch.
NOW = "extract(epoch FROM clock_timestamp())::float8"

_READ_MARK = """
SELECT value FROM {marks}
WHERE key_id = %(id)s AND kind = %(kind)s AND expires_at > clock_timestamp()
"""
_SET_MARK = """
INSERT INTO {marks} (key_id, kind, value, expires_at)
VALUES (%(id)s, %(kind)s, %(value)s, clock_timestamp() + %(ttl)s * interval '1 second')
ON CONFLICT (key_id, kind) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
"""
_DELETE_MARK = "DELETE FROM {marks} WHERE key_id = %(id)s AND kind = %(kind)s"
_SET_LINE = "UPDATE {marks} SET value = %(value)s WHERE key_id = %(id)s AND kind = %(kind)s"
_NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"
_READ_RECORD = "SELECT value FROM {records} WHERE key_id = %(id)s AND name = %(name)s"
# The fenced write: inserts (or replaces) the record only if the owner holds the key,
# as the layout that holds it tells (``{held}``, of the lease row ``r``).
_WRITE_RECORD = """
INSERT INTO {records} (key_id, name, value)
SELECT %(id)s, %(name)s, %(value)s
WHERE EXISTS (SELECT FROM {leases} r WHERE r.key_id = %(id)s AND r.owner = %(owner)s AND {held})
ON CONFLICT (key_id, name) DO UPDATE SET value = excluded.value
"""

#: libpq's connection errors carry no SQLSTATE: these patterns of their text (as the
#: server or libpq words them) are the ones retrying cannot fix, with what to do.
_PERMANENT_CONNECT_ERRORS = {
    r"password authentication failed": "check the user and password in exclusive_backend_url",
    r"no pg_hba\.conf entry": "allow this host and user in the server's pg_hba.conf",
    r'role "[^"]*" does not exist': "create the role, or fix the user in exclusive_backend_url",
    r'database "[^"]*" does not exist': "create the database, or fix its name",
    r"certificate|ssl error|does not support ssl|sslmode|ssl connection is required": (
        "check sslmode, sslrootcert, sslcert and sslkey in exclusive_backend_url"
    ),
    r"invalid connection option|invalid uri|missing \"=\"": "fix exclusive_backend_url",
    r"permission denied for database": "grant the role CONNECT on the database",
}
_POOLER = (
    "the connection is shared by a pooler in transaction mode (PgBouncer): add pgbouncer=1 "
    "to exclusive_backend_url"
)
#: SQLSTATEs retrying cannot fix, with what to do about each.
_PERMANENT_SQLSTATES = {
    pg_errors.InsufficientPrivilege: (
        "grant the role SELECT, INSERT, UPDATE, DELETE on the exclusive_* tables (and "
        "CREATE on the schema for the first start, or create them once as the owner "
        "with: celery exclusive --backend <owner's URL> migrate)"
    ),
    pg_errors.ReadOnlySqlTransaction: (
        "the URL points at a read-only server (a standby); point it at the primary, "
        "e.g. with target_session_attrs=read-write"
    ),
    pg_errors.InvalidSchemaName: "create the schema named by ?schema=, or fix the name",
    pg_errors.InvalidPassword: "check the user and password in exclusive_backend_url",
    pg_errors.InvalidAuthorizationSpecification: "check the user in exclusive_backend_url",
    pg_errors.InvalidCatalogName: "create the database, or fix its name",
    # Prepared statements vanishing or colliding: a pooler in transaction mode.
    pg_errors.DuplicatePreparedStatement: _POOLER,
    pg_errors.InvalidSqlStatementName: _POOLER,
}


class PostgreSQLConnection(Connection):
    """This process's connection to the store's database, and what both layouts do
    over it the same way."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.settings = settings_from_url(url)
        prefix = "" if self.settings.schema is None else _quote_ident(self.settings.schema) + "."
        #: The store's tables by short name ("leases", ...), schema-qualified as the URL says.
        self.tables = {
            name: f"{prefix}exclusive_{name}" for name in ("leases", "fences", "marks", "records")
        }
        # A channel name is an identifier: at most 63 bytes, whatever the schema's name.
        self.channel = (
            CHANNEL
            if self.settings.schema is None
            else f"{CHANNEL}_{hashlib.sha256(self.settings.schema.encode()).hexdigest()[:16]}"
        )
        self._sql = self.statements(
            {
                "read_mark": _READ_MARK,
                "set_mark": _SET_MARK,
                "delete_mark": _DELETE_MARK,
                "set_line": _SET_LINE,
                "read_record": _READ_RECORD,
            }
        )
        self._lock = threading.Lock()
        self._conn: Optional[psycopg.Connection] = None
        self._pid = os.getpid()
        self._watch = CallWatch(f"PostgreSQL store {self.safe_url}")
        self._listener: Optional[Listener] = None

    def statements(self, texts: Mapping[str, str], **names: str) -> dict[str, str]:
        """``texts`` with the store's tables (``{leases}``, ...) and ``names`` filled in."""
        return {name: text.format(**self.tables, **names) for name, text in texts.items()}

    # --- the connection -----------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        """This process's connection, (re)made as needed. Call with the lock held."""
        if self._pid != os.getpid():
            if self._conn is not None:
                inherited.append(self._conn)
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

    def run(
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
        with self._lock:
            try:
                conn = self._connection()
            except (psycopg.Error, OSError) as exc:
                raise self.translate(exc, action) from None
            try:
                with self._watch.bounded(conn, bound):
                    if not txn:
                        return work(conn)
                    with conn.transaction():
                        return work(conn)
            except (psycopg.Error, OSError) as exc:
                broken = conn.broken or conn.closed
                if broken or isinstance(exc, pg_errors.UndefinedTable):
                    self._drop_connection()  # dead, or its tables were dropped: remake both
                error = self.translate(exc, action)
                if broken and isinstance(error, BackendUnavailable):
                    raise LostAnswer(error) from None
                raise error from None

    def call(
        self,
        action: str,
        work: Callable[[psycopg.Connection], T],
        txn: bool = True,
        bound: float = CALL_TIMEOUT,
    ) -> T:
        """:meth:`run` for reads and idempotent writes: a lost answer is just
        unavailability, after one retry on a fresh connection (the first statement after
        a server restart finds the old connection dead)."""
        for attempt in (1, 2):
            try:
                return self.run(action, work, txn, bound)
            except LostAnswer as lost:
                if attempt == 2:
                    raise lost.error from None
        raise AssertionError("unreachable")

    def translate(
        self, exc: BaseException, action: str, key: Optional[str] = None
    ) -> ExclusiveError:
        for kind, fix in _PERMANENT_SQLSTATES.items():
            if isinstance(exc, kind):
                return self._refused(exc, action, fix)
        if isinstance(exc, (psycopg.OperationalError, psycopg.ProgrammingError)) and not getattr(
            exc, "sqlstate", None
        ):
            message = str(exc).lower()
            for pattern, fix in _PERMANENT_CONNECT_ERRORS.items():
                if re.search(pattern, message):
                    return self._refused(exc, action, fix)
        if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError, OSError)):
            return unavailable(self.safe_url, action, exc)
        # Anything else (a syntax or data error) is a defect or a schema someone changed.
        return ConfigurationError(
            f"the lease store at {self.safe_url} refused {action}: {type(exc).__name__}: "
            f"{_first_line(exc)}. Check that the exclusive_* tables match "
            "celery_exclusive/backends/postgresql/schema.sql."
        )

    def _refused(self, exc: BaseException, action: str, fix: str) -> ConfigurationError:
        return ConfigurationError(
            f"the lease store at {self.safe_url} refused {action} "
            f"({type(exc).__name__}: {_first_line(exc)}): {fix}."
        )

    # --- waking waiters ---------------------------------------------------------------

    def notify_args(self, key_id: bytes) -> dict[str, Any]:
        """The parameters of a ``pg_notify`` that wakes the waiters of ``key_id``."""
        return {"channel": self.channel, "payload": key_id.hex()}

    def wait(self, key_id: bytes, timeout: float, free: Callable[[], bool]) -> bool:
        """Block until ``free()`` (the key may be free), or ``timeout`` passes; whether
        it did.

        Looks again when a release of the key is notified (``LISTEN``), and at least
        every :data:`MAX_SILENCE`; while nobody listens (``listen=0``, PgBouncer, the
        listening connection being re-made), every :data:`POLL_MIN` to :data:`POLL_MAX`.
        """
        deadline = time.monotonic() + timeout
        listener = self._listener_for_process() if self.settings.listen else None
        # Subscribed before the first look: a release between the look and the pause
        # still sets the event.
        subscribed = listener.subscribe(key_id) if listener else contextlib.nullcontext(None)
        with subscribed as released:
            delay = POLL_MIN
            while not free():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if listener is not None and listener.listening.is_set():
                    pause = MAX_SILENCE
                else:
                    pause, delay = delay, min(delay * 2, POLL_MAX)
                if released is None:
                    time.sleep(min(remaining, pause))
                else:
                    released.wait(min(remaining, pause))
                    released.clear()
            return True

    def wake(self, conn: psycopg.Connection, id_: bytes) -> None:
        """Wake the waiters of the key whose row id is ``id_`` as ``conn``'s transaction
        commits (its line moved: its new first may be free to go)."""
        conn.execute(_NOTIFY, self.notify_args(id_))

    def _listener_for_process(self) -> Listener:
        with self._lock:
            if self._listener is None or self._listener.pid != os.getpid():
                self._listener = Listener(self.settings.conninfo, self.channel)
            return self._listener

    # --- marks and records ------------------------------------------------------------

    def mark_in(self, conn: psycopg.Connection, key: str, kind: str) -> Optional[str]:
        """The live ``kind`` mark of ``key``, read on ``conn`` (in its transaction)."""
        row = conn.execute(self._sql["read_mark"], {"id": key_id(key), "kind": kind}).fetchone()
        return None if row is None else decoded(row[0])

    def take_from_line(
        self, conn: psycopg.Connection, id_: bytes, line: Optional[str], rest: Optional[str]
    ) -> None:
        """After a grant under the key's lock, on ``conn``: its line as it is without the
        claimant the grant took out of it (``rest``), if that changed it."""
        if rest == line:
            return
        if rest is None:
            conn.execute(self._sql["delete_mark"], {"id": id_, "kind": LINE})
        else:
            conn.execute(self._sql["set_line"], {"id": id_, "kind": LINE, "value": encoded(rest)})

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        return self.call(
            f"reading the {kind} mark of {key!r}",
            lambda conn: self.mark_in(conn, key, kind),
            txn=False,
        )

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        id_ = key_id(key)
        params = {"id": id_, "kind": kind, "ttl": ttl, "value": encoded(new or "")}

        # Under the key's lock, which grants take too: they take their claimant out of
        # the line, so a swap of the line and a grant never interleave.
        def swap(conn: psycopg.Connection) -> bool:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (key_lock(id_),))
            if self.mark_in(conn, key, kind) != expected:
                return False
            conn.execute(self._sql["delete_mark" if new is None else "set_mark"], params)
            if kind == LINE:
                self.wake(conn, id_)
            return True

        return self.call(f"changing the {kind} mark of {key!r}", swap)

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        params = {"id": key_id(lease_key), "name": encoded(name)}

        def read(conn: psycopg.Connection) -> Optional[str]:
            row = conn.execute(self._sql["read_record"], params).fetchone()
            return None if row is None else decoded(row[0])

        return self.call(f"reading the record {name!r} of {lease_key!r}", read, txn=False)

    def write_record(self, lease: Lease, name: str, value: str, held: str) -> bool:
        """The fenced write of a record: only if ``lease`` is held, as the condition
        ``held`` on its row ``r`` (the layout's) tells."""
        id_ = key_id(lease.key)
        params = {"id": id_, "name": encoded(name), "value": encoded(value), "owner": lease.owner}
        statement = self.statements({"write": _WRITE_RECORD}, held=held)["write"]

        # Under the key's lock: no new grant can come between the holder check and the
        # write, so a former holder never overwrites what a new one wrote.
        def write(conn: psycopg.Connection) -> bool:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (key_lock(id_),))
            return conn.execute(statement, params).rowcount > 0

        return self.call(f"writing the record {name!r} of {lease.key!r}", write)

    # --- the store's clock, its start-up warnings, its tables -------------------------

    def store_time(self) -> float:
        def now(conn: psycopg.Connection) -> float:
            return conn.execute(f"SELECT {NOW}").fetchone()[0]

        return self.call("reading the time", now, txn=False)

    def warnings(self) -> list[str]:
        """What a worker should be told at start about this server and URL."""

        def settings(conn: psycopg.Connection) -> dict[str, str]:
            rows = conn.execute(
                "SELECT name, setting FROM pg_settings "
                "WHERE name IN ('fsync', 'synchronous_commit')"
            ).fetchall()
            (standby,) = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            return {**dict(rows), "standby": "on" if standby else "off"}

        found = self.call("reading the server settings", settings, txn=False)
        warnings = []
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

        version = self.call("creating the tables", create, txn=False)
        return f"the exclusive_* tables are in place (schema version {version})"

    def close(self) -> None:
        with self._lock:
            if self._listener is not None and self._listener.pid == os.getpid():
                self._listener.stop()
            self._listener = None
            self._drop_connection()


def key_id(key: str) -> bytes:
    """A key's row id: fixed width for any key, equal only for equal keys."""
    return hashlib.sha256(encoded(key)).digest()


def key_lock(id_: bytes) -> int:
    """The transaction-scoped advisory lock (a signed 64-bit number) that serializes the
    writes of the key whose row id is ``id_``."""
    return int.from_bytes(id_[:8], "big", signed=True)


def encoded(text: str) -> bytes:
    """A key, mark or record as the tables keep it: UTF-8, any character (NUL, a lone
    surrogate) exact."""
    return text.encode("utf-8", "surrogatepass")


def decoded(value: Optional[bytes]) -> Optional[str]:
    return None if value is None else bytes(value).decode("utf-8", "surrogatepass")


def _quote_ident(name: str) -> str:
    return sql.Identifier(name).as_string(None)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]
