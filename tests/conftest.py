from __future__ import annotations

import itertools
import uuid

import pytest

# pytest-celery, when installed, replaces this fixture with a Docker-based one.
from celery.contrib.pytest import celery_worker  # noqa: F401

from tests.servers import RedisServer

_databases = itertools.count(1)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


def fresh_redis_db(server) -> str:
    """The URL of a Redis database nobody else is using now, emptied."""
    db = next(_databases) % 30 + 1
    server.client(db).flushdb()
    return server.url_for_db(db)


@pytest.fixture(scope="session")
def client_dbs(redis_server):
    """Broker and ledger databases: one pair per session, since the test process's
    Celery client keeps its broker connections for the whole run."""
    return fresh_redis_db(redis_server), fresh_redis_db(redis_server)


@pytest.fixture
def redis_url(redis_server):
    """A Redis database of the test's own, empty at start."""
    return fresh_redis_db(redis_server)


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path}/leases.db"


@pytest.fixture
def memory_url():
    return f"memory://{uuid.uuid4().hex}"


class BackendCase:
    """One store for the contract suite: its URL and the shortest lease it supports."""

    def __init__(self, url: str, short_ttl: float = 0.5):
        self.url = url
        self.short_ttl = short_ttl


#: Contract-suite stores by name; each value builds a BackendCase from the test's fixtures.
BACKEND_CASES = {
    "memory": lambda request: BackendCase(request.getfixturevalue("memory_url")),
    "sqlite": lambda request: BackendCase(request.getfixturevalue("sqlite_url")),
    "redis": lambda request: BackendCase(request.getfixturevalue("redis_url")),
}


@pytest.fixture(params=sorted(BACKEND_CASES))
def backend_case(request) -> BackendCase:
    return BACKEND_CASES[request.param](request)


@pytest.fixture
def backend(backend_case):
    from celery_exclusive.backends import _load

    store = _load(backend_case.url)
    yield store
    store.close()
