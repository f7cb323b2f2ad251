"""A broker, a lease store and a ledger shared by one test module's real workers."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import redis

from celery_exclusive import backend_for_url
from tests.conftest import fresh_redis_db
from tests.support.apps import ledger as ledger_app
from tests.support.workers import Worker


class Stack:
    """Broker, lease store and ledger shared by one module's workers."""

    def __init__(self, server, broker: str, ledger_url: str, store: str, tmp_path_factory):
        self.server = server
        self.broker, self.ledger_url = broker, ledger_url
        for url in (broker, ledger_url):
            redis.Redis.from_url(url).flushdb()
        if store == "redis":
            self.store = fresh_redis_db(server)
        elif store == "sqlite":
            self.store = f"sqlite:///{tmp_path_factory.mktemp('leases')}/leases.db"
        else:
            self.store = store
        self.ledger = redis.Redis.from_url(self.ledger_url)
        self.ttl = 2.0

    def env(self, **overrides) -> dict:
        env = {
            "EXCLUSIVE_TEST_BROKER": self.broker,
            "EXCLUSIVE_TEST_STORE": self.store,
            "EXCLUSIVE_TEST_LEDGER": self.ledger_url,
            "EXCLUSIVE_TEST_TTL": str(self.ttl),
        }
        env.update({f"EXCLUSIVE_TEST_{k.upper()}": str(v) for k, v in overrides.items()})
        return env

    def worker(
        self, name: str, env: dict | None = None, app: str = "tests.support.apps.ledger", **kwargs
    ) -> Worker:
        """A worker of the ledger's app, or of ``app`` (a module of tests/support/apps
        configured from the same variables)."""
        return Worker(app, self.env(**(env or {})), name=name, **kwargs)

    def configure_client(self, app=None) -> None:
        """Point this (test) process's copy of the app (the ledger's, or ``app``) at the
        same broker and store."""
        (app or ledger_app.app).conf.update(
            broker_url=self.broker, result_backend=self.broker, exclusive_backend_url=self.store
        )
        for task in ledger_app.app.tasks.values():
            task._exclusive_settings = None

    def holders(self, key: str):
        return backend_for_url(self.store).holders_of("exclusive:" + key)

    @contextlib.contextmanager
    def running(self, *workers: Worker):
        """Point this process's client at the stack, run ``workers``, stop them after."""
        self.configure_client()
        self.workers = [worker.start() for worker in workers]
        try:
            yield self
        finally:
            for worker in self.workers:
                worker.stop()

    def reset(self) -> None:
        self.ledger.delete("ledger", "entered", "signals", "versions", "stops")
        for told in self.ledger.scan_iter("release:*"):
            self.ledger.delete(told)


#: The stores the kept tasks run on (tests/support/apps/kept.py): those with ``windows``.
KEEPING_STORES = ["redis", "sqlite", "postgresql"]


@contextlib.contextmanager
def kept_stack(
    request, redis_server, client_dbs, tmp_path_factory, name: str, concurrency: int
) -> Iterator[Stack]:
    """A stack on the store ``request.param`` names (of KEEPING_STORES; PostgreSQL in a
    schema of its own), two workers of the kept tasks' app running on it, and this
    process's copy of that app pointed at it."""
    from tests.support.apps import kept

    store = request.param
    if store == "postgresql":
        server = request.getfixturevalue("postgres_server")
        store = f"{server.url}?schema={name}_{uuid.uuid4().hex[:8]}"
    stack = Stack(redis_server, *client_dbs, store, tmp_path_factory)
    app = "tests.support.apps.kept"
    workers = (stack.worker(f"{name}{i}", app=app, concurrency=concurrency) for i in range(2))
    with stack.running(*workers):
        stack.configure_client(kept.app)
        yield stack


def wait_until(predicate, timeout: float, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


def start_holding(task, key: str, duration: float, cluster, args: tuple = ()) -> object:
    """Send a long task and return once a worker holds its lease."""
    result = task.delay(key, *args, duration) if args else task.delay(key, duration)
    assert wait_until(lambda: cluster.holders(key), timeout=15), "holder never started"
    return result
