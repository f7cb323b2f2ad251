from __future__ import annotations

import json
import shutil

import pytest
import redis

from tests.support.apps import host_store
from tests.support.workers import Worker

#: libfaketime, preloaded into a worker to give it a clock of its own.
LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def faked_wall_clock(**settings: str) -> dict:
    """The environment of a worker whose wall clock libfaketime fakes (``settings``: its
    FAKETIME_* variables), its monotonic clock real, as on a host whose wall clock is
    wrong or stepped (CLOCK_MONOTONIC never steps)."""
    return {
        "LD_PRELOAD": LIBFAKETIME,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "EXCLUSIVE_TEST_SLEEP_BY_SELECT": "1",
        **settings,
    }


needs_faketime = pytest.mark.skipif(
    shutil.which("faketime") is None, reason="needs faketime (scripts/test.sh)"
)


class HostStack:
    """Real workers of ``tests.support.apps.host_store`` sharing one SQLite file, with a
    Redis broker and ledger."""

    def __init__(self, client_dbs, tmp_path) -> None:
        # The session's pair: this process's Celery client keeps its broker connections.
        self.broker, self.ledger_url = client_dbs
        for db in client_dbs:
            redis.Redis.from_url(db).flushdb()
        self.path = str(tmp_path / "leases.db")
        self.store = f"sqlite:///{self.path}"
        self.ledger = redis.Redis.from_url(self.ledger_url)
        self.workers: list[Worker] = []
        host_store.app.conf.update(
            broker_url=self.broker, result_backend=self.broker, exclusive_backend_url=self.store
        )

    def worker(self, name: str, ttl: float = 5.0, env=None, extra: tuple = (), **kwargs) -> Worker:
        """A worker named ``name``, consuming the queue of that name."""
        environment = {
            "EXCLUSIVE_TEST_BROKER": self.broker,
            "EXCLUSIVE_TEST_STORE": self.store,
            "EXCLUSIVE_TEST_LEDGER": self.ledger_url,
            "EXCLUSIVE_TEST_TTL": str(ttl),
            "EXCLUSIVE_TEST_NAME": name,
            **(env or {}),
        }
        worker = Worker(
            "tests.support.apps.host_store",
            environment,
            name=name,
            extra=("-Q", name, *extra),
            **kwargs,
        )
        self.workers.append(worker)
        return worker

    def hold(self, worker: str, key: str, duration: float):
        return host_store.hold.apply_async((key, duration), queue=worker)

    def read(self, name: str) -> list[dict]:
        return [json.loads(raw) for raw in self.ledger.lrange(name, 0, -1)]

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


@pytest.fixture
def host(client_dbs, tmp_path):
    stack = HostStack(client_dbs, tmp_path)
    yield stack
    stack.stop()
