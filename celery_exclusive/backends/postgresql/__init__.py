"""PostgreSQL lease store (``postgresql://``, psycopg 3).

``postgresql://user:password@host:5432/database?sslmode=verify-full&schema=leases``:
libpq's own URL, so every libpq option works; ``schema=``, ``pgbouncer=1``,
``listen=0`` and ``recipe=advisory`` are this store's (see :mod:`.settings`).

A connection (:mod:`.connection`: the client, its failures, wake-ups, marks and
records) and two layouts over it: the library's own, leases as rows of its tables
(:mod:`.backend`, ``schema.sql``), and ``?recipe=advisory``, leases as session advisory
locks any SQL can take too (:mod:`.recipe`).
"""

from .backend import PostgreSQLBackend
from .connection import PostgreSQLConnection
from .schema import schema_sql

__all__ = ["PostgreSQLBackend", "PostgreSQLConnection", "migrate", "schema_sql"]


def migrate(url: str) -> str:
    """Create the store's tables at ``url`` (as a role allowed to); say what was done.

    For databases where the workers' role may only read and write rows: run this (or
    ``celery exclusive --backend URL migrate``, or ``schema.sql``) once as the owner,
    then grant the workers SELECT, INSERT, UPDATE and DELETE on the ``exclusive_*``
    tables.
    """
    connection = PostgreSQLConnection(url)
    try:
        return connection.migrate()
    finally:
        connection.close()
