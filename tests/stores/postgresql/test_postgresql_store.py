"""What only the PostgreSQL store has to show: named errors at start, a schema made
once for a locked-down role, tokens that outlive their counters, lost replies read
back. A real PostgreSQL (Debian's) started by the tests; faults are real."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from click.testing import CliRunner

from celery_exclusive.backends import _load
from celery_exclusive.cli.commands import exclusive
from celery_exclusive.errors import BackendUnavailable, ConfigurationError
from tests.support.servers import free_port


@pytest.fixture
def schema() -> str:
    return f"s_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store(postgres_server, schema):
    backend = _load(f"{postgres_server.url}?schema={schema}")
    yield backend
    backend.close()


def admin(postgres_server) -> psycopg.Connection:
    return psycopg.connect(postgres_server.url, autocommit=True)


def test_a_wrong_password_is_a_configuration_error_at_start(postgres_server):
    backend = _load(postgres_server.url_for(password="wrong"))
    with pytest.raises(ConfigurationError, match="password"):
        backend.check("exclusive:~check")


def test_a_missing_database_is_a_configuration_error_at_start(postgres_server):
    backend = _load(postgres_server.url_for(database="no_such_db"))
    with pytest.raises(ConfigurationError, match="database"):
        backend.check("exclusive:~check")


def test_a_server_that_does_not_answer_is_unavailable_not_misconfigured(postgres_server):
    backend = _load(postgres_server.url_for(port=free_port()))
    with pytest.raises(BackendUnavailable):
        backend.check("exclusive:~check")


@pytest.fixture
def limited_role(postgres_server, schema):
    """A role that may log in and use rows, but create nothing."""
    role = f"worker_{uuid.uuid4().hex[:8]}"
    with admin(postgres_server) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    return role


def test_a_role_that_may_not_create_the_tables_is_told_what_to_grant_or_run(
    postgres_server, schema, limited_role
):
    backend = _load(f"{postgres_server.url_for(limited_role, 'pw')}?schema={schema}")
    with pytest.raises(ConfigurationError, match="migrate"):
        backend.check("exclusive:~check")


def test_after_the_migrate_command_a_role_with_only_row_privileges_keeps_leases(
    postgres_server, schema, limited_role
):
    owners_url = f"{postgres_server.url}?schema={schema}"
    result = CliRunner().invoke(exclusive, ["--backend", owners_url, "migrate"])
    assert result.exit_code == 0, result.output
    assert "are in place (schema version 1)\n" in result.output
    assert result.output.rstrip().endswith(
        "layout postgresql version 1 recorded (the store held no version)"
    )
    with admin(postgres_server) as conn:
        conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} "
            f"TO {limited_role}"
        )
    backend = _load(f"{postgres_server.url_for(limited_role, 'pw')}?schema={schema}")
    backend.check("exclusive:~check")  # warnings at most, no error
    assert backend.try_acquire("k", uuid.uuid4().hex, 10) is not None


def test_tokens_keep_rising_when_the_fence_counters_are_lost(store, schema, postgres_server):
    first = store.try_acquire("k", uuid.uuid4().hex, 10)
    store.release(first)
    with admin(postgres_server) as conn:
        conn.execute(f"TRUNCATE {schema}.exclusive_fences")  # a restore that lost them
    second = store.try_acquire("k", uuid.uuid4().hex, 10)
    assert second.fencing_token > first.fencing_token


def test_wait_is_woken_by_the_release_notification_not_by_polling(store, monkeypatch):
    store.try_acquire("free", uuid.uuid4().hex, 10)
    store.wait("free", timeout=0.05)  # starts this process's LISTENing connection
    assert store.connection._listener.listening.wait(5)
    lease = store.try_acquire("k", uuid.uuid4().hex, 10)
    reads = []
    free_for = store._free_for
    monkeypatch.setattr(store, "_free_for", lambda *a: reads.append(1) or free_for(*a))
    threading.Timer(0.6, store.release, [lease]).start()
    started = time.monotonic()
    store.wait("k", timeout=10)
    assert time.monotonic() - started < 5.0
    assert len(reads) == 2, "one read before the release, one after its notification"
