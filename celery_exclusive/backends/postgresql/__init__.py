"""PostgreSQL lease store (``postgresql://``, psycopg 3).

``postgresql://user:password@host:5432/database?sslmode=verify-full&schema=leases``:
libpq's own URL, so every libpq option works; ``schema=``, ``pgbouncer=1`` and
``listen=0`` are this store's (see :mod:`.settings`).

Tables (``schema.sql``; created on first use, or once by :func:`migrate`):
``exclusive_leases`` (one row per grant), ``exclusive_fences`` (each key's last
fencing token, never deleted), ``exclusive_marks`` (lines, pending reruns),
``exclusive_records`` (the beat leader's records). Rows are found by the SHA-256 of
the key, and keys are kept as bytes, so any key, NUL included, is exact.

Guarantees: each operation is one transaction; a grant and the line check are one
step under the key's transaction-scoped advisory lock; expiry is the database's clock
(``clock_timestamp()``); fencing tokens are ``GREATEST(counter + 1, database clock
in µs)`` and so rise across deletes, restarts and restores; ``wait()`` is woken by
``LISTEN/NOTIFY`` on release. One connection per process (plus one LISTENing
connection while a ``wait()`` runs); a connection lost to a server restart is made
again on the next call. An acquire or release whose answer was lost is read back
until its outcome is known.
"""

from .backend import PostgreSQLBackend
from .recipe import AdvisoryBackend
from .schema import schema_sql

__all__ = ["AdvisoryBackend", "PostgreSQLBackend", "migrate", "schema_sql"]


def migrate(url: str) -> str:
    """Create the store's tables at ``url`` (as a role allowed to); say what was done.

    For databases where the workers' role may only read and write rows: run this (or
    ``celery exclusive --backend URL migrate``, or ``schema.sql``) once as the owner,
    then grant the workers SELECT, INSERT, UPDATE and DELETE on the ``exclusive_*``
    tables.
    """
    backend = PostgreSQLBackend(url)
    try:
        return backend.migrate()
    finally:
        backend.close()
