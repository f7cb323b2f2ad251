"""The PostgreSQL store's own layout: every operation is one transaction, timed by the
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

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import psycopg

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
)
from ..limits import check_limit
from ..line import LINE, admit, first_in_line
from ..readback import LostAnswer, budget, settle_acquire, settle_release, token_of
from .connection import NOW, PostgreSQLConnection, decoded, encoded, key_id, key_lock
from .watchdog import CALL_TIMEOUT

_LIVE = "key_id = %(id)s AND expires_at > clock_timestamp()"

# The key's live holders' limits and its live line, read after its lock is taken.
_STATE = f"""
SELECT {NOW},
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
_RELEASE = f"""
WITH gone AS (
    DELETE FROM {{leases}} WHERE {_LIVE} AND owner = %(owner)s RETURNING key_id
)
SELECT pg_notify(%(channel)s, %(payload)s) FROM gone
"""
_FORCE_RELEASE = f"""
WITH gone AS (DELETE FROM {{leases}} WHERE {_LIVE} RETURNING key_id)
SELECT pg_notify(%(channel)s, %(payload)s) FROM gone
"""

# 1 row: now, how many hold the key, the smallest limit they hold it with, the line.
_FREE_FOR = f"""
SELECT {NOW}, count(*), min(lease_limit),
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

_PREFIX = "substring(key FROM 1 FOR %(length)s) = %(prefix)s"


class PostgreSQLBackend(Backend):
    """Leases as rows of the store's tables (see the module docstring)."""

    capabilities = Capabilities(limits=True, records=True, marks=True, windows=True)
    layout_version = LayoutVersion("postgresql", 1)
    connection_class = PostgreSQLConnection
    recipes = {"advisory": "celery_exclusive.backends.postgresql.recipe:AdvisoryBackend"}
    connection: PostgreSQLConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._sql = self.connection.statements(
            {
                "state": _STATE,
                "grant": _GRANT,
                "renew": _RENEW,
                "release": _RELEASE,
                "force_release": _FORCE_RELEASE,
                "free_for": _FREE_FOR,
                "holders": _HOLDERS.replace("{where}", _PREFIX),
                "holders_of": _HOLDERS.replace("{where}", "key_id = %(id)s"),
                "holders_page": _HOLDERS_PAGE,
            }
        )

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
        id_ = key_id(key)
        params = {
            "id": id_,
            "key": encoded(key),
            "owner": owner,
            "ttl": ttl,
            "limit": limit,
            "holder": json.dumps(dict(holder or {})),
            "line": LINE,
        }

        def acquire(conn: psycopg.Connection) -> tuple[Optional[int], Optional[str]]:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (key_lock(id_),))
            now, limits, line = conn.execute(self._sql["state"], params).fetchone()
            check_limit(key, limit, limits)
            line = decoded(line)
            admitted, rest = admit(line, claimant, limit - len(limits), now)
            token = None
            if admitted:  # the grant takes the claimant out of the line
                self.connection.take_from_line(conn, id_, line, rest)
                (token,) = conn.execute(self._sql["grant"], params).fetchone()
            if read is None:
                return token, None
            return token, self.connection.mark_in(conn, read.key, read.kind)  # after it

        try:
            token, value = self.connection.run(f"acquiring {key!r}", acquire)
        except LostAnswer as lost:
            token = settle_acquire(lambda: token_of(self, key, owner), lost.error, budget(ttl))
            return Lease(key, owner, token, ttl, limit)
        if read is not None:
            read.value, read.done = value, True
        return None if token is None else Lease(key, owner, token, ttl, limit)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        ids = [key_id(lease.key) for lease in leases]
        args = (ids, [lease.owner for lease in leases], [lease.ttl for lease in leases])

        def renew(conn: psycopg.Connection) -> set[tuple[bytes, str]]:
            return {(bytes(k), o) for k, o in conn.execute(self._sql["renew"], args).fetchall()}

        # A renewal answered after a whole ttl confirms nothing: its leases are lost.
        bound = min(CALL_TIMEOUT, min(lease.ttl for lease in leases))
        action = f"renewing {len(leases)} lease(s)"
        kept = self.connection.call(action, renew, txn=False, bound=bound)
        return {lease for lease, id_ in zip(leases, ids) if (id_, lease.owner) not in kept}

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END:
            return super().release(lease, end)  # the mark swapped first, then this
        id_ = key_id(lease.key)
        params = {"id": id_, "owner": lease.owner, **self.connection.notify_args(id_)}

        def send() -> bool:
            return self.connection.run(
                f"releasing {lease.key!r}",
                lambda conn: bool(conn.execute(self._sql["release"], params).fetchall()),
                txn=False,
            )

        try:
            return send()
        except LostAnswer as lost:
            return settle_release(
                lambda: token_of(self, lease.key, lease.owner) is not None,
                send,
                lost.error,
                budget(lease.ttl),
            )

    def _free_for(self, key: str, claimant: Optional[str]) -> bool:
        params = {"id": key_id(key), "line": LINE}

        def read(conn: psycopg.Connection) -> bool:
            now, held, smallest, line = conn.execute(self._sql["free_for"], params).fetchone()
            if held and held >= smallest:
                return False
            return first_in_line(decoded(line), claimant, now)

        return self.connection.call(f"reading {key!r}", read, txn=False)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        self.connection.wait(key_id(key), timeout, lambda: self._free_for(key, claimant))

    # --- the operators' view and hand -------------------------------------------------

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        encoded_prefix = encoded(prefix)
        params = {"length": len(encoded_prefix), "prefix": encoded_prefix}
        return self._holders("holders", params, f"listing holders under {prefix!r}")

    def holders_of(self, key: str) -> list[LeaseInfo]:
        return self._holders("holders_of", {"id": key_id(key)}, f"reading {key!r}")

    def _holders(self, statement: str, params: dict[str, Any], action: str) -> list[LeaseInfo]:
        def read(conn: psycopg.Connection) -> list[LeaseInfo]:
            return [
                LeaseInfo(decoded(key), owner, token, expires_in, json.loads(holder))
                for key, owner, token, expires_in, holder in conn.execute(
                    self._sql[statement], params
                )
            ]

        return self.connection.call(action, read, txn=False)

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        encoded_prefix = encoded(prefix)
        params = {
            "length": len(encoded_prefix),
            "prefix": encoded_prefix,
            "after": None if cursor is None else encoded(cursor),
            "count": count + 1,
            "kinds": list(kinds),
        }

        def read(conn: psycopg.Connection) -> HoldersPage:
            rows = []
            for key, owner, token, expires_in, holder, names, values in conn.execute(
                self._sql["holders_page"], params
            ):
                found = dict(zip(names, (decoded(value) for value in values)))
                info = LeaseInfo(decoded(key), owner, token, expires_in, json.loads(holder))
                rows.append((info.key, info, [found.get(kind) for kind in kinds]))
            return page_of(rows, kinds, count)

        return self.connection.call(f"listing holders under {prefix!r}", read, txn=False)

    def force_release(self, key: str) -> int:
        id_ = key_id(key)
        params = {"id": id_, **self.connection.notify_args(id_)}

        def force(conn: psycopg.Connection) -> int:
            return len(conn.execute(self._sql["force_release"], params).fetchall())

        return self.connection.call(f"force-releasing {key!r}", force, txn=False)

    # --- records and marks, the clock, the start-up check -----------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        return self.connection.read_record(lease_key, name)

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        return self.connection.write_record(lease, name, value, "r.expires_at > clock_timestamp()")

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
