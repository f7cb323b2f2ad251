from __future__ import annotations

import itertools
import uuid

import pytest

# pytest-celery, when installed, replaces this fixture with a Docker-based one.
from celery.contrib.pytest import celery_worker  # noqa: F401

from tests.support.servers import RedisServer

#: Databases 1 and 2 are the session's broker and ledger (``client_dbs``), in use all
#: session long: a test handed a fresh database never empties them. The rest go round.
SESSION_DATABASES = (1, 2)
_databases = itertools.cycle(range(3, 32))


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


def fresh_redis_db(server) -> str:
    """The URL of a Redis database nobody else is using now, emptied."""
    db = next(_databases)
    server.client(db).flushdb()
    return server.url_for_db(db)


@pytest.fixture(scope="session")
def client_dbs(redis_server):
    """Broker and ledger databases: one pair per session, since the test process's
    Celery client keeps its broker connections for the whole run."""
    for db in SESSION_DATABASES:
        redis_server.client(db).flushdb()
    broker, ledger = SESSION_DATABASES
    return redis_server.url_for_db(broker), redis_server.url_for_db(ledger)


@pytest.fixture
def cluster(stack):
    """The module's ``stack`` (workers already running), its ledger emptied for this test."""
    stack.reset()
    return stack


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


@pytest.fixture(scope="session")
def consul_server():
    """A real agent (CONSUL_HTTP_ADDR, or ``consul agent -dev``) if there is one, else the
    emulator in tests/support/consul_emulator.py."""
    from tests.support.consul_emulator import start_consul

    server = start_consul()
    yield server
    server.stop()


@pytest.fixture
def consul_url(consul_server, monkeypatch):
    """A KV folder of the test's own on the session's Consul."""
    from celery_exclusive.backends.consul import ConsulBackend

    monkeypatch.setattr(ConsulBackend, "min_session_ttl", consul_server.min_session_ttl)
    # lock_delay=0: the contract measures expiry alone (Consul's lock delay would add to it).
    return f"{consul_server.url}/exclusive-tests/{uuid.uuid4().hex}?lock_delay=0"


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL cluster of the session's own (Debian's ``postgresql`` programs)."""
    from tests.support.servers import PostgresServer

    server = PostgresServer()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def postgresql_url(postgres_server):
    """A schema of the test's own in the session's PostgreSQL (created on first use)."""
    return f"{postgres_server.url}?schema=t_{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def etcd_server():
    """A one-member etcd of the session's own (Debian's ``etcd-server``)."""
    from tests.support.servers import EtcdServer

    server = EtcdServer()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def etcd_url(etcd_server):
    """A key prefix of the test's own in the session's etcd."""
    return f"{etcd_server.url}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def mongo_server():
    """The MongoDB at MONGODB_URL if set, else the wire-protocol stand-in in
    tests/support/mongo_standin.py (no MongoDB server can be installed here)."""
    from tests.support.mongo_standin import start_mongo

    server = start_mongo()
    yield server
    server.stop()


@pytest.fixture
def mongodb_url(mongo_server):
    """A database of the test's own."""
    return f"{mongo_server.url}/t_{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-master Redis Cluster, started once for the session."""
    from tests.support.servers import RedisClusterServers

    servers = RedisClusterServers()
    servers.start()
    yield servers
    servers.cleanup()


@pytest.fixture
def redis_cluster_url(redis_cluster):
    """The session's Redis Cluster, every node emptied (a cluster has one database)."""
    for node in redis_cluster.nodes:
        node.client().flushall()
    return redis_cluster.url


#: Contract-suite stores by name; each value builds a BackendCase from the test's fixtures.
BACKEND_CASES = {
    "memory": lambda request: BackendCase(request.getfixturevalue("memory_url")),
    "sqlite": lambda request: BackendCase(request.getfixturevalue("sqlite_url")),
    "redis": lambda request: BackendCase(request.getfixturevalue("redis_url")),
    # etcd leases last whole seconds, one at least.
    "etcd": lambda request: BackendCase(request.getfixturevalue("etcd_url"), short_ttl=1.0),
    "mongodb": lambda request: BackendCase(request.getfixturevalue("mongodb_url")),
    "postgresql": lambda request: BackendCase(request.getfixturevalue("postgresql_url")),
    "redis-cluster": lambda request: BackendCase(request.getfixturevalue("redis_cluster_url")),
    "consul": lambda request: BackendCase(
        request.getfixturevalue("consul_url"),
        short_ttl=request.getfixturevalue("consul_server").short_ttl,
    ),
    # The Consul store speaking HashiCorp's api.Lock / api.Semaphore (?recipe=api).
    "consul-recipe": lambda request: BackendCase(
        request.getfixturevalue("consul_url") + "&recipe=api",
        short_ttl=request.getfixturevalue("consul_server").short_ttl,
    ),
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
