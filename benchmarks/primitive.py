"""Lock primitive: acquire+release pairs per second on one Redis, one client, one key.

Our RedisBackend (Lua acquire with a fencing counter and holder record, Lua
owner-checked release that also wakes waiters) against redis-py's ``Lock`` and
python-redis-lock, and the floor: two raw round trips, ``SET NX PX`` then ``DEL``;
then our other stores, each on a server of its own (PostgreSQL and etcd from
Debian's packages; MongoDB only when MONGODB_URL is set).
Variants alternate over several rounds; the median round is reported.
"""

from __future__ import annotations

import time
import uuid

import redis
import redis_lock

from benchmarks.common import median, other_stores, redis_server
from celery_exclusive.backends import _load
from celery_exclusive.backends.redis import RedisBackend


def _ours(client: redis.Redis):
    where = client.connection_pool.connection_kwargs  # the same server, a client of its own
    backend = RedisBackend(f"redis://{where['host']}:{where['port']}/{where.get('db', 0)}")
    holder = {"task": "bench.task", "task_id": str(uuid.uuid4()), "hostname": "h", "pid": 1}

    def pair() -> None:
        lease = backend.try_acquire("exclusive:bench", uuid.uuid4().hex, 30.0, 1, holder)
        backend.release(lease)

    return pair


def _store(url: str):
    backend = _load(url)
    holder = {"task": "bench.task", "task_id": str(uuid.uuid4()), "hostname": "h", "pid": 1}

    def pair() -> None:
        lease = backend.try_acquire("exclusive:bench", uuid.uuid4().hex, 30.0, 1, holder)
        backend.release(lease)

    return pair


#: Our other stores' backend classes, by store.
STORE_NAMES = {
    "postgresql": "PostgreSQLBackend",
    "etcd": "EtcdBackend",
    "mongodb": "MongoDBBackend",
}


def _redis_py(client: redis.Redis):
    def pair() -> None:
        lock = client.lock("redis-py:bench", timeout=30)
        lock.acquire(blocking=False)
        lock.release()

    return pair


def _python_redis_lock(client: redis.Redis):
    def pair() -> None:
        lock = redis_lock.Lock(client, "bench", expire=30)
        lock.acquire(blocking=False)
        lock.release()

    return pair


def _floor(client: redis.Redis):
    def pair() -> None:
        client.set("floor:bench", "x", nx=True, px=30000)
        client.delete("floor:bench")

    return pair


VARIANTS = {
    "celery-exclusive RedisBackend": _ours,
    "redis-py Lock": _redis_py,
    "python-redis-lock": _python_redis_lock,
    "floor: SET NX PX + DEL": _floor,
}


def run(pairs: int = 3000, rounds: int = 5) -> dict:
    with redis_server() as server, other_stores() as stores:
        client = server.client()
        functions = {name: make(client) for name, make in VARIANTS.items()}
        for store, url in stores.items():
            functions[f"celery-exclusive {STORE_NAMES[store]}"] = _store(url)
        for fn in functions.values():
            for _ in range(200):  # warm-up: connection, script loading
                fn()
        rates: dict[str, list[float]] = {name: [] for name in functions}
        names = list(functions)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                fn = functions[name]
                started = time.perf_counter()
                for _ in range(pairs):
                    fn()
                rates[name].append(pairs / (time.perf_counter() - started))
        client.close()
    per_second = {name: median(values) for name, values in rates.items()}
    return {"pairs": pairs, "rounds": rounds, "per_second": per_second}


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
