"""What a ``postgresql://`` URL says: libpq's connection string plus our own options.

Everything libpq understands (host, port, user, password, database, ``sslmode``,
``sslrootcert``, ``sslcert``, ``sslkey``, ``target_session_attrs``, ...) passes
through untouched. Our options are taken out of the query string first:

``schema=<name>``   put the tables in that schema instead of the role's search_path.
``pgbouncer=1``     talking to PgBouncer in transaction mode: no server-side prepared
                    statements, and ``wait()`` polls instead of LISTENing (a LISTEN
                    needs a session of its own, which transaction pooling does not keep).
``listen=0``        poll in ``wait()`` without PgBouncer.
``recipe=advisory`` take leases as PostgreSQL session advisory locks on a documented
                    number of the key, which other SQL can take too (recipe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ...errors import ConfigurationError

OPTIONS = ("schema", "pgbouncer", "listen", "recipe")
#: libpq parameters set unless the URL sets them: a dead server or network must never
#: hang a worker (connect_timeout, tcp_user_timeout) and the server should see who we are.
LIBPQ_DEFAULTS = {
    "connect_timeout": "5",
    "tcp_user_timeout": "10000",
    "keepalives_idle": "10",
    "application_name": "celery-exclusive",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class PostgreSQLSettings:
    conninfo: str
    schema: Optional[str] = None
    pgbouncer: bool = False
    listen: bool = True


def settings_from_url(url: str) -> PostgreSQLSettings:
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {name: value for name, value in query if name in OPTIONS}
    libpq = [(name, value) for name, value in query if name not in OPTIONS]
    present = {name for name, _ in libpq}
    libpq += [(name, value) for name, value in LIBPQ_DEFAULTS.items() if name not in present]
    pgbouncer = _flag(ours, "pgbouncer", False)
    if ours.get("recipe") and pgbouncer:
        raise ConfigurationError(
            "exclusive_backend_url has recipe=advisory and pgbouncer=1: a session advisory "
            "lock lives as long as the server session that took it, and PgBouncer in "
            "transaction mode gives each transaction whichever server session is free, so "
            "the lock would stay behind on a session another client gets next. Point the URL "
            "at PostgreSQL itself, or at a PgBouncer pool in session mode (without "
            "pgbouncer=1)."
        )
    return PostgreSQLSettings(
        conninfo=urlunsplit(parts._replace(scheme="postgresql", query=urlencode(libpq))),
        schema=ours.get("schema") or None,
        pgbouncer=pgbouncer,
        listen=_flag(ours, "listen", not pgbouncer),
    )


def _flag(options: dict, name: str, default: bool) -> bool:
    value = options.get(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigurationError(
        f"exclusive_backend_url has {name}={value!r}; write {name}=1 or {name}=0."
    )
