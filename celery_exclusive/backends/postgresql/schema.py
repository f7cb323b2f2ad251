"""The store's tables: created on first use, or once by ``migrate()`` for a
database where the workers' role may not create tables.

The DDL lives in ``schema.sql`` beside this module, the one copy both use.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Optional

import psycopg
from psycopg import sql

#: The version ``schema.sql`` creates (its ``exclusive_schema`` row).
SCHEMA_VERSION = 1
#: Advisory lock taken while creating the tables, so that two processes starting at
#: once do not race to create the same types.
_MIGRATION_LOCK = 0x6365_6C65_7279_6578  # "celeryex"


def schema_sql() -> str:
    """The DDL of the store, unqualified: run it with ``search_path`` set to the schema."""
    return files(__package__).joinpath("schema.sql").read_text()


def installed_version(conn: psycopg.Connection, schema: Optional[str]) -> Optional[int]:
    """The schema version found in the database, or None if there are no tables yet."""
    table = "exclusive_schema" if schema is None else f"{_quote(conn, schema)}.exclusive_schema"
    (regclass,) = conn.execute("SELECT to_regclass(%s)::text", (table,)).fetchone()
    if regclass is None:
        return None
    row = conn.execute(sql.SQL("SELECT max(version) FROM {}").format(_table(schema))).fetchone()
    return row[0]


def create(conn: psycopg.Connection, schema: Optional[str]) -> None:
    """Create the schema (if named) and the tables, in one transaction."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        if schema is not None:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            conn.execute(
                sql.SQL("SELECT set_config('search_path', {}, true)").format(
                    sql.Literal(sql.Identifier(schema).as_string(conn))
                )
            )
        conn.execute(schema_sql())


def _table(schema: Optional[str]) -> sql.Composable:
    name = sql.Identifier("exclusive_schema")
    return name if schema is None else sql.SQL(".").join([sql.Identifier(schema), name])


def _quote(conn: psycopg.Connection, schema: str) -> str:
    return sql.Identifier(schema).as_string(conn)
