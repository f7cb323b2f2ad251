"""The PostgreSQL store through PgBouncer in transaction mode: a real PgBouncer with
ONE server connection that every client shares between transactions, so any state a
client kept on its session (a session-level advisory lock, a prepared statement, a
search_path) would turn up in, or be missing for, the next client."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from celery_exclusive.backends import _load
from celery_exclusive.errors import ConfigurationError
from tests.support.servers import PgBouncer


@pytest.fixture(scope="module")
def pgbouncer(postgres_server):
    bouncer = PgBouncer(postgres_server).start()
    yield bouncer
    bouncer.cleanup()


@pytest.fixture
def stores(pgbouncer):
    """Two store clients (two processes, say) sharing PgBouncer's one server connection."""
    url = f"{pgbouncer.url}?pgbouncer=1&schema=b_{uuid.uuid4().hex[:8]}"
    first, second = _load(url), _load(url)
    yield first, second
    first.close()
    second.close()


def test_leases_marks_and_records_work_with_clients_taking_turns_on_one_connection(stores):
    a, b = stores
    for i in range(10):  # enough statements for psycopg to prepare them, were it allowed
        lease = a.try_acquire(f"k{i}", uuid.uuid4().hex, 10, limit=2)
        assert b.try_acquire(f"k{i}", uuid.uuid4().hex, 10, limit=2) is not None
        assert a.try_acquire(f"k{i}", uuid.uuid4().hex, 10, limit=2) is None
        assert a.renew([lease]) == set()
        assert a.write_record(lease, "r", f"v{i}") is True
        assert b.read_record(f"k{i}", "r") == f"v{i}"
        assert b.swap_mark(f"k{i}", "rerun", None, "x", 10) is True
        assert a.read_mark(f"k{i}", "rerun") == "x"
        assert a.release(lease) is True
    assert len(b.holders("k")) == 10


def test_without_pgbouncer_1_the_pooled_connection_is_named_as_the_problem(pgbouncer):
    store = _load(f"{pgbouncer.url}?listen=0&schema=b_{uuid.uuid4().hex[:8]}")
    other = _load(store.url)
    with pytest.raises(ConfigurationError, match="pgbouncer=1"):
        for _ in range(10):  # psycopg prepares a statement on its 5th use
            for client in (store, other):
                client.swap_mark("k", "x", None, "v", 10)
                client.swap_mark("k", "x", "v", None, 10)


def test_wait_polls_through_pgbouncer_and_returns_after_the_release(stores):
    a, b = stores
    assert a.connection.settings.listen is False  # pgbouncer=1: nobody LISTENs, wait() polls
    lease = a.try_acquire("k", uuid.uuid4().hex, 10)
    threading.Timer(0.3, a.release, [lease]).start()
    started = time.monotonic()
    b.wait("k", timeout=10)
    assert 0.2 < time.monotonic() - started < 5.0
