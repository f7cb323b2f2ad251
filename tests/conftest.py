from __future__ import annotations

import itertools
import uuid
import weakref

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
    from celery_exclusive.backends.consul import ConsulConnection

    monkeypatch.setattr(ConsulConnection, "min_session_ttl", consul_server.min_session_ttl)
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
    # A renewal commits to a file (a write lock, a sync): on a loaded disk one may take
    # longer than a 0.5 s lease's renew interval and margin together.
    "sqlite": lambda request: BackendCase(request.getfixturevalue("sqlite_url"), short_ttl=1.0),
    "redis": lambda request: BackendCase(request.getfixturevalue("redis_url")),
    # etcd leases last whole seconds, one at least.
    "etcd": lambda request: BackendCase(request.getfixturevalue("etcd_url"), short_ttl=1.0),
    # The etcd store speaking etcd's concurrency mutex (?recipe=mutex).
    "etcd-mutex": lambda request: BackendCase(
        request.getfixturevalue("etcd_url") + "?recipe=mutex", short_ttl=1.0
    ),
    "mongodb": lambda request: BackendCase(request.getfixturevalue("mongodb_url")),
    # The MongoDB store speaking the TTL-lease document (?recipe=ttl-lease).
    "mongodb-ttl-lease": lambda request: BackendCase(
        request.getfixturevalue("mongodb_url") + "?recipe=ttl-lease"
    ),
    "postgresql": lambda request: BackendCase(request.getfixturevalue("postgresql_url")),
    # The PostgreSQL store speaking session advisory locks (?recipe=advisory).
    "postgresql-advisory": lambda request: BackendCase(
        request.getfixturevalue("postgresql_url") + "&recipe=advisory"
    ),
    "redis-cluster": lambda request: BackendCase(request.getfixturevalue("redis_cluster_url")),
    # The Redis store speaking Redis's SET NX lock recipe (?recipe=set-nx).
    "redis-set-nx": lambda request: BackendCase(
        request.getfixturevalue("redis_url") + "?recipe=set-nx"
    ),
    "consul": lambda request: BackendCase(
        request.getfixturevalue("consul_url"),
        short_ttl=request.getfixturevalue("consul_server").short_ttl,
    ),
    # The Consul store speaking HashiCorp's api.Lock / api.Semaphore, `consul lock` and
    # the plain KV acquire (?recipe=).
    **{
        f"consul-{recipe}": lambda request, recipe=recipe: BackendCase(
            request.getfixturevalue("consul_url") + f"&recipe={recipe}",
            short_ttl=request.getfixturevalue("consul_server").short_ttl,
        )
        for recipe in ("api", "consul-lock", "acquire")
    },
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


def _receivers(signal) -> list:
    """The functions connected to ``signal`` (weak references resolved; dead ones
    left out)."""
    found = []
    for _lookup, receiver in signal.receivers:
        if isinstance(receiver, weakref.ReferenceType):
            receiver = receiver()
        if receiver is not None:
            found.append(receiver)
    return found


def _watched_signals() -> dict:
    from celery import signals as celery_signals

    from celery_exclusive import signals as exclusive_signals

    watched = {
        f"celery_exclusive.{name}": getattr(exclusive_signals, name)
        for name in (
            "lease_acquired",
            "lease_released",
            "lease_lost",
            "lease_waited",
            "duplicate_detected",
        )
    }
    for name in (
        "task_prerun",
        "task_postrun",
        "task_success",
        "task_failure",
        "before_task_publish",
        "after_task_publish",
    ):
        watched[f"celery.{name}"] = getattr(celery_signals, name)
    return watched


def _the_librarys(receiver) -> bool:
    """Whether ``receiver`` is one the library connects for good, once per process: the
    OpenTelemetry metrics', fed by the signals from the first traced call on."""
    return getattr(receiver, "__module__", "") == "celery_exclusive.telemetry"


@pytest.fixture(autouse=True)
def no_signal_handler_left_behind():
    """A test (or a module of test support it imports into this process) leaves no
    receiver connected to the library's or Celery's task signals: one left behind runs
    in every later test of the process, and its failure or its side effect is taken for
    theirs. A worker's app connects its handlers in the worker, never here."""
    watched = _watched_signals()
    before = {name: _receivers(signal) for name, signal in watched.items()}
    yield
    for name, signal in watched.items():
        left = [
            r
            for r in _receivers(signal)
            if not any(r is b for b in before[name]) and not _the_librarys(r)
        ]
        left += [r for r in before[name] if getattr(r, "__module__", "").startswith("tests.")]
        assert not left, (
            f"{name} has receivers left connected by test code: "
            + ", ".join(
                f"{getattr(r, '__module__', '?')}.{getattr(r, '__qualname__', r)}" for r in left
            )
            + "; disconnect them when the test ends, and connect a worker app's handlers "
            "only in its worker"
        )
