"""The one place a psycopg exception becomes an ExclusiveError.

Transient (the server did not answer, is starting or shutting down, dropped the
connection): :class:`BackendUnavailable`, and tasks are requeued. Permanent (the
password, the role, the database, TLS, privileges, a read-only standby): a
:class:`ConfigurationError` naming what to fix, raised at worker start by ``check()``
and failing a task at run time instead of requeueing it forever.
"""

from __future__ import annotations

import re

import psycopg
from psycopg import errors as pg_errors

from ...errors import ConfigurationError, ExclusiveError

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


def translate(exc: BaseException, action: str, backend) -> ExclusiveError:
    """The ExclusiveError a psycopg (or socket) exception becomes."""
    for kind, fix in _PERMANENT_SQLSTATES.items():
        if isinstance(exc, kind):
            return _refused(exc, action, backend, fix)
    if isinstance(exc, (psycopg.OperationalError, psycopg.ProgrammingError)) and not getattr(
        exc, "sqlstate", None
    ):
        message = str(exc).lower()
        for pattern, fix in _PERMANENT_CONNECT_ERRORS.items():
            if re.search(pattern, message):
                return _refused(exc, action, backend, fix)
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError, OSError)):
        return backend.unavailable(action, exc)
    # Anything else (a syntax or data error) is a defect or a schema someone changed.
    return ConfigurationError(
        f"the lease store at {backend.safe_url} refused {action}: {type(exc).__name__}: "
        f"{_first_line(exc)}. Check that the exclusive_* tables match "
        "celery_exclusive/backends/postgresql/schema.sql."
    )


def _refused(exc: BaseException, action: str, backend, fix: str) -> ConfigurationError:
    return ConfigurationError(
        f"the lease store at {backend.safe_url} refused {action} "
        f"({type(exc).__name__}: {_first_line(exc)}): {fix}."
    )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]
