"""Where a task's lease costs go: one process, one ``redis-server``, no worker.

    python -m benchmarks breakdown
    python -m benchmarks.breakdown '{"cycles": 2000, "rounds": 5}'

Three comparisons, each interleaved over several rounds (median round reported):

* **pairs**: a raw ``SET NX PX`` + ``DEL`` (two round trips, the floor), against the
  backend's ``try_acquire`` + ``release`` and the lease layer's ``acquire`` +
  ``release`` (holder record, heartbeat, signals), in µs per pair;
* **calls**: ``ExclusiveTask.__call__`` against a plain task's, as a solo worker
  calls them (a request on the stack, a new task id and argument each time), so the
  difference is what the lease adds to a task, in µs per call;
* **parts**: the client-side pieces of one cycle timed alone (owner token, holder
  record, signals, settings, key), in µs each;

and **script time**: the store's own microseconds per ``EVALSHA`` of the acquire and
release scripts on the uncontended path, from ``INFO commandstats``, beside an empty
script's and a plain ``SET``'s, which give the floor on the machine at hand; the
**renewal** of 1,250 leases by one process (scripts sent, the longest one's time in
Redis, from the slow log); and what a **burst** of 10,000 distinct keys leaves behind.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid

from celery import Celery, Task
from celery.app.task import Context

from benchmarks.common import median, redis_server
from celery_exclusive import ExclusiveTask, signals
from celery_exclusive.backends import Lease
from celery_exclusive.backends.redis import RedisBackend, layout
from celery_exclusive.core.lease import acquire


def _timed(fn, n: int) -> float:
    """µs per call of ``fn`` over ``n`` calls."""
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def _interleaved(functions: dict, n: int, rounds: int) -> dict[str, float]:
    """µs per call of each function: median over rounds in rotating order."""
    for fn in functions.values():
        _timed(fn, min(n, 200))  # warm-up: connections, script loading
    samples: dict[str, list[float]] = {name: [] for name in functions}
    names = list(functions)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_timed(functions[name], n))
    return {name: round(median(values), 1) for name, values in samples.items()}


def pairs(url: str, client) -> dict:
    backend = RedisBackend(url)  # a client of its own, as a worker has
    holder = {"task": "bench.task", "task_id": str(uuid.uuid4()), "hostname": "h", "pid": 1}

    def floor() -> None:
        client.set("floor:bench", "x", nx=True, px=30000)
        client.delete("floor:bench")

    def backend_pair() -> None:
        grant = backend.try_acquire("exclusive:bench", uuid.uuid4().hex, 30.0, 1, holder)
        backend.release(grant)

    def lease_pair() -> None:
        acquire(backend, "exclusive:bench", 30.0, 1, "bench.task", "id").release()

    return {
        "raw SET NX PX + DEL": floor,
        "RedisBackend try_acquire + release": backend_pair,
        "lease acquire + release": lease_pair,
    }


def _app(url: str) -> Celery:
    app = Celery("breakdown", broker="memory://", set_as_current=False)
    app.conf.update(exclusive_backend_url=url, task_always_eager=False)
    return app


def calls(url: str) -> tuple[dict, Celery]:
    app = _app(url)

    @app.task(name="bench.plain", shared=False)
    def plain(i: int) -> None:
        return None

    @app.task(name="bench.exclusive", base=ExclusiveTask, shared=False)
    def exclusive(i: int) -> None:
        return None

    numbers = itertools.count()

    def as_worker(task: Task):
        task = app.tasks[task.name]

        def call() -> None:
            # What celery.app.trace does around each call in a worker.
            i = next(numbers)
            request = Context(
                id=uuid.uuid4().hex, args=(i,), kwargs={}, called_directly=False, is_eager=False
            )
            task.request_stack.push(request)
            try:
                task(i)
            finally:
                task.request_stack.pop()

        return call

    functions = {
        "plain Task.__call__": as_worker(plain),
        "ExclusiveTask.__call__": as_worker(exclusive),
    }
    return functions, app


def parts(url: str, app: Celery) -> dict:
    task = app.tasks["bench.exclusive"]
    task.exclusive_settings  # noqa: B018 - resolved once, as at worker start
    record = {"task": "bench.exclusive", "task_id": uuid.uuid4().hex, "hostname": "h", "pid": 1}
    numbers = itertools.count()
    return {
        "owner token: uuid4().hex": lambda: uuid.uuid4().hex,
        "owner token: os.urandom(16).hex()": lambda: os.urandom(16).hex(),
        "holder record (json.dumps)": lambda: json.dumps(record),
        "lease_acquired.send, no receiver": lambda: signals.lease_acquired.send(
            sender="t", key="k", task_id="i", fencing_token=1
        ),
        "task.exclusive_settings": lambda: task.exclusive_settings,
        "task.exclusive_backend": lambda: task.exclusive_backend,
        "task.exclusive_key_for": lambda: task.exclusive_key_for((1,), {}),
        "store entry names of a new key": lambda: layout.entries(f"k:{next(numbers)}"),
    }


def script_time(client, url: str, n: int, rounds: int) -> dict[str, float]:
    """µs of store time per call, from ``INFO commandstats``: each script alone on the
    uncontended path (the other half of the cycle done by a raw command, not counted),
    and the raw pair's ``SET`` and ``DEL``; median over rounds."""
    backend = RedisBackend(url)
    names = layout.entries("exclusive:bench")
    holder = {"task": "bench.task", "task_id": str(uuid.uuid4()), "hostname": "h", "pid": 1}
    record = json.dumps(holder)

    def acquire_script() -> None:
        backend.try_acquire("exclusive:bench", uuid.uuid4().hex, 30.0, 1, holder)
        client.delete(names.lease)

    def release_script() -> None:
        owner = uuid.uuid4().hex
        client.set(names.lease, f"{len(owner)}:{owner} 1 {record}", px=30000)
        backend.release(Lease("exclusive:bench", owner, 1, 30.0, 1))

    def raw_pair() -> None:
        client.set("floor:bench", "x", nx=True, px=30000)
        client.delete("floor:bench")

    empty = client.script_load("return 1")

    def empty_script() -> None:
        client.evalsha(empty, 0)

    measured = {
        "empty script (EVALSHA of `return 1`)": (empty_script, "evalsha"),
        "acquire script (EVALSHA)": (acquire_script, "evalsha"),
        "release script (EVALSHA)": (release_script, "evalsha"),
        "raw SET NX PX": (raw_pair, "set"),
        "raw DEL": (raw_pair, "del"),
    }
    samples: dict[str, list[float]] = {name: [] for name in measured}
    for _ in range(rounds):
        for name, (fn, command) in measured.items():
            client.config_resetstat()
            for _ in range(n):
                fn()
            stats = client.info("commandstats")[f"cmdstat_{command}"]
            samples[name].append(stats["usec_per_call"])
    backend.close()
    return {name: round(median(values), 2) for name, values in samples.items()}


def script_time_busy(client, n: int, rounds: int) -> dict[str, float]:
    """µs of store time per call as a busy store spends it: each script sent back to back
    in pipelines of 100 (no idle gap between two, as on a store serving many workers),
    the acquire on a fresh key each time (as every task of the stream has its own) and
    its lease then deleted by a raw ``DEL``, the release on a lease set by a raw
    ``SET``; from ``INFO commandstats``, median over rounds. Sent one at a time, as
    :func:`script_time` sends them, a script finds the server's CPU idle between two
    and costs several times more on a virtual machine whose vCPUs halt when idle."""
    from celery_exclusive.backends.redis import scripts

    holder = json.dumps(
        {"task": "bench.task", "task_id": str(uuid.uuid4()), "hostname": "h", "pid": 1}
    )
    acquire, release = (client.script_load(scripts.ALL[name]) for name in ("acquire", "release"))
    empty = client.script_load("return 1")
    numbers = itertools.count()

    def batch(send) -> float:
        client.config_resetstat()
        pipe = client.pipeline(transaction=False)
        for _ in range(n):
            send(pipe, layout.entries(f"exclusive:busy:{next(numbers)}"), uuid.uuid4().hex)
            if len(pipe) >= 100:
                pipe.execute()
        pipe.execute()
        stats = client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
        client.flushdb()
        return stats

    def acquire_one(pipe, names, owner) -> None:
        keys = [names.lease, names.fence, names.holders, names.line]
        pipe.evalsha(acquire, len(keys), *keys, owner, 30_000, 1, holder, "")
        pipe.delete(names.lease)

    def release_one(pipe, names, owner) -> None:
        pipe.set(names.lease, f"{len(owner)}:{owner} 1 {holder}", px=30_000)
        keys = [names.lease, names.holders, names.line, names.signal, names.waiting]
        pipe.evalsha(release, len(keys), *keys, owner, 1, 30_000, 1_000)

    def empty_one(pipe, names, owner) -> None:
        pipe.evalsha(empty, 0)

    measured = {
        "empty script": empty_one,
        "acquire script, a fresh key": acquire_one,
        "release script": release_one,
    }
    samples: dict[str, list[float]] = {name: [] for name in measured}
    for _ in range(rounds):
        for name, send in measured.items():
            samples[name].append(batch(send))
    return {name: round(median(values), 2) for name, values in samples.items()}


def renewal(url: str, client, leases: int = 1250, rounds: int = 5) -> dict[str, float]:
    """One process renewing ``leases`` leases (one of four holding 5,000): how many
    scripts it sends and the longest any of them blocks Redis, from the slow log (every
    command logged), median over rounds."""
    backend = RedisBackend(url)
    held = [backend.try_acquire(f"renewal:{i}", uuid.uuid4().hex, 60.0) for i in range(leases)]
    backend.renew(held)  # loads the script
    longest, scripts = [], []
    client.config_set("slowlog-max-len", 100_000)  # Redis 7 logs a script's commands too
    for _ in range(rounds):
        client.config_set("slowlog-log-slower-than", 0)
        client.slowlog_reset()
        backend.renew(held)
        entries = [e for e in client.slowlog_get(100_000) if e["command"].startswith(b"EVALSHA")]
        client.config_set("slowlog-log-slower-than", 10_000)
        longest.append(max(e["duration"] for e in entries))
        scripts.append(len(entries))
    for lease in held:
        backend.release(lease)
    backend.close()
    return {
        "leases": leases,
        "scripts": median(scripts),
        "longest script µs": round(median(longest), 1),
    }


def burst(url: str, client, keys: int = 10_000) -> dict[str, float]:
    """What a burst of ``keys`` distinct keys, each taken and released once, leaves in
    the store: how many entries, and how long the longest-lived of them stays."""
    backend = RedisBackend(url)
    client.flushdb()
    for i in range(keys):
        backend.release(backend.try_acquire(f"burst:{i}", uuid.uuid4().hex, 30.0))
    left = list(client.scan_iter(count=1000))
    longest = max((client.pttl(name) for name in left), default=0)
    client.flushdb()
    backend.close()
    return {"keys": keys, "entries left": len(left), "longest kept s": round(longest / 1000)}


def run(cycles: int = 2000, rounds: int = 5) -> dict:
    with redis_server() as server:
        client = server.client()
        url = server.url_for_db(0)
        call_functions, app = calls(url)
        result = {
            "cycles": cycles,
            "rounds": rounds,
            "pairs_us": _interleaved(pairs(url, client), cycles, rounds),
            "calls_us": _interleaved(call_functions, cycles, rounds),
            "parts_us": _interleaved(parts(url, app), cycles * 10, rounds),
            "script_us": script_time(client, url, cycles, rounds),
            "busy_script_us": script_time_busy(client, cycles, rounds),
            "renewal": renewal(url, client, rounds=rounds),
            "burst": burst(url, client),
        }
        client.close()
    pair_us = result["pairs_us"]
    result["pair_ratio"] = round(
        pair_us["RedisBackend try_acquire + release"] / pair_us["raw SET NX PX + DEL"], 3
    )
    call_us = result["calls_us"]
    result["call_added_us"] = round(
        call_us["ExclusiveTask.__call__"] - call_us["plain Task.__call__"], 1
    )
    return result


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
