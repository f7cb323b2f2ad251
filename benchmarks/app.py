"""The Celery app every benchmark worker runs, configured from the environment.

One app holds the plain task, ExclusiveTask and both peers' base classes, so the
overhead benchmark compares them in one worker, with one broker and one store.

BENCH_BROKER   broker and result backend URL
BENCH_STORE    lock store URL (ours, celery-once's and celery-singleton's)
BENCH_STORE_POSTGRESQL, BENCH_STORE_ETCD, BENCH_STORE_MONGODB
               the other stores ExclusiveTask is measured on (its no-op per store)
BENCH_LEDGER   Redis URL where tasks record timestamps for the latency benchmarks
BENCH_TTL      lease ttl in seconds
BENCH_RECORD_RELEASES  if set, every release of a bench.hold_* lease is timestamped
BENCH_PROFILE  if set, a cProfile of the worker's main thread is written there at shutdown
BENCH_STREAM   if set, every task's start is timestamped in the process (see stream.py)
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery, Task, signals
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_exclusive import ExclusiveTask, lease_released

BROKER = os.environ.get("BENCH_BROKER", "memory://")
STORE = os.environ.get("BENCH_STORE", "memory://")

app = Celery("bench")
app.conf.update(
    broker_url=BROKER,
    result_backend=BROKER if BROKER.startswith("redis") else "cache+memory://",
    exclusive_backend_url=STORE,
    exclusive_lease_ttl=float(os.environ.get("BENCH_TTL", "30")),
    exclusive_wait_timeout=60,
    singleton_backend_url=STORE,
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": STORE}},
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue="b",
    worker_hijack_root_logger=False,
)

_ledger = None


def ledger() -> redis.Redis:
    global _ledger
    if _ledger is None:
        _ledger = redis.Redis.from_url(os.environ.get("BENCH_LEDGER", "redis://"))
    return _ledger


# -- per-task overhead: four no-op tasks that differ only in their base class ----------


@app.task(name="bench.plain")
def plain(i: int) -> None:
    return None


@app.task(name="bench.exclusive", base=ExclusiveTask)
def exclusive(i: int) -> None:
    return None


@app.task(name="bench.plain_acks_late", acks_late=True)
def plain_acks_late(i: int) -> None:
    return None


@app.task(name="bench.exclusive_acks_late", base=ExclusiveTask, acks_late=True)
def exclusive_acks_late(i: int) -> None:
    return None


@app.task(name="bench.once", base=QueueOnce)
def once(i: int) -> None:
    return None


@app.task(name="bench.singleton", base=Singleton)
def singleton(i: int) -> None:
    return None


def _exclusive_on(store: str):
    """The same no-op as ``exclusive``, its leases in another store."""

    @app.task(
        name=f"bench.exclusive_{store}",
        base=ExclusiveTask,
        exclusive_backend_url=os.environ.get(f"BENCH_STORE_{store.upper()}", "memory://"),
    )
    def noop(i: int) -> None:
        return None

    return noop


#: Stores ExclusiveTask is measured on besides BENCH_STORE (Redis).
OTHER_STORES = ("postgresql", "etcd", "mongodb")

NOOPS = {
    "plain": plain,
    "exclusive": exclusive,
    **{f"exclusive ({store})": _exclusive_on(store) for store in OTHER_STORES},
    "plain, acks_late": plain_acks_late,
    "exclusive, acks_late": exclusive_acks_late,
    "celery-once": once,
    "celery-singleton": singleton,
}


@app.task(name="bench.exclusive_both", base=ExclusiveTask, exclusive_scope="both")
def exclusive_both(i: int) -> None:
    return None


@app.task(name="bench.exclusive_replace", base=ExclusiveTask, exclusive_on_duplicate="replace")
def exclusive_replace(i: int) -> None:
    """What ``replace`` adds to a call that meets no running call: a read of the
    key's replaced mark as it claims, and another as its grant finds the key free."""
    return None


def _results_elsewhere():
    """Celery's Redis result backend on the same server reached by another address
    (``localhost``), which the release script does not write for: the fallback path,
    where the release and Celery's own store are round trips of their own."""
    if not BROKER.startswith("redis://127.0.0.1"):
        return None
    from celery.backends.redis import RedisBackend

    return RedisBackend(app=app, url=BROKER.replace("127.0.0.1", "localhost", 1))


@app.task(name="bench.exclusive_elsewhere", base=ExclusiveTask, backend=_results_elsewhere())
def exclusive_results_elsewhere(i: int) -> None:
    return None


# -- floors of the mixed stream: the round trips a lease needs, with no library Python --

_store = None


def store() -> redis.Redis:
    """The lease store's Redis, on a connection of this process's own."""
    global _store
    if _store is None:
        _store = redis.Redis.from_url(STORE)
    return _store


@app.task(name="bench.floor_one_trip")
def floor_one_trip(i: int) -> None:
    """One bare round trip (what a peer's unlock costs the worker)."""
    store().delete(f"floor:{i}")


@app.task(name="bench.floor_two_trips")
def floor_two_trips(i: int) -> None:
    """Two bare round trips: the cheapest lock and unlock around a body."""
    client = store()
    client.set(f"floor:{i}", "1", nx=True, px=30_000)
    client.delete(f"floor:{i}")


@app.task(name="bench.floor_two_scripts")
def floor_two_scripts(i: int) -> None:
    """The store's own acquire and release scripts, sent by EVALSHA on the raw
    connection with their arguments built inline: the lease's round trips and store
    time without the library's Python around them."""
    from celery_exclusive.backends.redis import layout, scripts

    client = store()
    names = layout.entries(f"floor:{i}")
    acquire, release = _floor_shas(client, scripts)
    client.execute_command(
        "EVALSHA",
        acquire,
        4,
        names.lease,
        names.fence,
        names.holders,
        names.line,
        "o",
        30_000,
        1,
        "{}",
        "",
    )
    client.execute_command(
        "EVALSHA",
        release,
        5,
        names.lease,
        names.holders,
        names.line,
        names.signal,
        names.waiting,
        "o",
        1,
        30_000,
    )


_shas: tuple = ()


def _floor_shas(client, scripts) -> tuple:
    global _shas
    if not _shas:
        _shas = (client.script_load(scripts.ACQUIRE), client.script_load(scripts.RELEASE))
    return _shas


STREAM_NOOPS = {
    "plain": plain,
    "celery-once": once,
    "celery-singleton": singleton,
    "exclusive": exclusive,
    'exclusive, scope="both"': exclusive_both,
    'exclusive, on_duplicate="replace"': exclusive_replace,
    "exclusive, result stored by Celery": exclusive_results_elsewhere,
    "plain, acks_late": plain_acks_late,
    "exclusive, acks_late": exclusive_acks_late,
    "floor: one round trip": floor_one_trip,
    "floor: two round trips": floor_two_trips,
    "floor: two scripts, no library Python": floor_two_scripts,
}


# -- the mixed stream: each task's start, kept in the process until flushed -----------

_starts: list = []


def _started(sender=None, args=None, **extra) -> None:
    _starts.append((time.perf_counter(), sender.name, args[0] if args else None))


if os.environ.get("BENCH_STREAM"):
    signals.task_prerun.connect(_started, weak=False)


@app.task(name="bench.stream_flush")
def stream_flush() -> dict:
    """This process's task starts since the last flush, and forget them."""
    taken = list(_starts)
    del _starts[:]
    return {"pid": os.getpid(), "starts": taken}


# -- handoff, failover and scale: runs that leave timestamps in the ledger --------------


def _record(task: Task, key: str, hold: float) -> None:
    """Record when the body started, under which fencing token, then hold the key."""
    lease = task.lease
    start = time.time()
    ledger().rpush(
        "starts",
        json.dumps({"key": key, "start": start, "token": lease.fencing_token, "pid": os.getpid()}),
    )
    time.sleep(hold)
    ledger().rpush("ends", json.dumps({"key": key, "start": start, "end": time.time()}))


def _holding(policy: str):
    @app.task(
        name=f"bench.hold_{policy}",
        base=ExclusiveTask,
        bind=True,
        exclusive_key="{key}",
        exclusive_on_duplicate=policy,
    )
    def hold(self, key: str, hold: float) -> None:
        _record(self, key, hold)

    return hold


hold_wait = _holding("wait")
hold_requeue = _holding("requeue")


def _released(sender, key, task_id, **extra) -> None:
    """The release instant, as the holder saw it (sent right after the store answered)."""
    if sender.startswith("bench.hold_"):
        ledger().rpush("releases", json.dumps({"key": key, "at": time.time()}))


# Connected only where needed: a receiver would add its cost to the overhead benchmark.
if os.environ.get("BENCH_RECORD_RELEASES"):
    lease_released.connect(_released, weak=False)


@app.task(
    name="bench.work", base=ExclusiveTask, exclusive_key="{key}", exclusive_on_duplicate="wait"
)
def work(key: str, seconds: float) -> None:
    time.sleep(seconds)


@app.task(name="bench.plain_work")
def plain_work(key: str, seconds: float) -> None:
    time.sleep(seconds)


# -- optional profile of the worker's main thread (solo pool: where tasks run) ---------

_profile = None


@signals.worker_ready.connect
def _start_profile(**kwargs) -> None:
    global _profile
    if os.environ.get("BENCH_PROFILE"):
        import cProfile

        _profile = cProfile.Profile()
        _profile.enable()


@signals.worker_shutdown.connect
def _dump_profile(**kwargs) -> None:
    if _profile is not None:
        _profile.disable()
        _profile.dump_stats(os.environ["BENCH_PROFILE"])
