"""Per-task overhead: N no-op tasks through one real solo worker, per base class.

Plain ``Task``, ``ExclusiveTask`` (on Redis, and on PostgreSQL, etcd and, with
MONGODB_URL, MongoDB), celery-once's ``QueueOnce`` and celery-singleton's
``Singleton`` run interleaved in the same worker (rounds in rotating order, so drift in
machine load hits all of them alike). A batch is timed from the first ``apply_async``
to the last result being stored: the peers lock in the producer and unlock in the
worker, we lock and unlock in the worker, and both costs land inside that window.
Every call has its own argument, so no lock is ever contended. The ``acks_late`` pair
compares an ``acks_late`` ExclusiveTask with an ``acks_late`` plain task: such a call also
reads and writes its finished mark, so a copy of its message delivered again is dropped.
"""

from __future__ import annotations

import itertools
import time

from benchmarks import app as bench
from benchmarks.common import (
    bench_env,
    configure_client,
    median,
    other_stores,
    redis_server,
    running,
    worker,
)

#: Base classes, and ExclusiveTask on each store ("exclusive" is on Redis).
VARIANTS = ("plain", "exclusive", *(f"exclusive ({s})" for s in bench.OTHER_STORES))
VARIANTS += ("celery-once", "celery-singleton", "plain, acks_late", "exclusive, acks_late")
_calls = itertools.count()


def batch(task, n: int) -> float:
    """Seconds from the first send to the last result (a solo worker runs them in order)."""
    started = time.perf_counter()
    results = [task.apply_async((next(_calls),)) for _ in range(n)]
    results[-1].get(timeout=120)
    elapsed = time.perf_counter() - started
    failed = [r for r in results if r.state != "SUCCESS"]
    if failed:
        raise RuntimeError(f"{task.name}: {len(failed)} of {n} tasks did not succeed")
    return elapsed


def _baseline(name: str) -> str:
    """The plain task a variant is compared with: the one acknowledged the same way."""
    return "plain, acks_late" if name.endswith("acks_late") else "plain"


def run(n: int = 400, rounds: int = 7, profile: str | None = None) -> dict:
    with redis_server() as server, other_stores() as stores:
        env = bench_env(server.url_for_db(0), server.url_for_db(1), server.url_for_db(2))
        env.update({f"BENCH_STORE_{store.upper()}": url for store, url in stores.items()})
        variants = [v for v in VARIANTS if "(" not in v or v[11:-1] in stores]
        if profile:
            env["BENCH_PROFILE"] = profile
        configure_client(bench.app, env)
        with running(worker(env, "overhead")) as (w,):
            for name in variants:  # warm-up: connections, script loading, imports
                batch(bench.NOOPS[name], 50)
            times: dict[str, list[float]] = {name: [] for name in variants}
            ratios: dict[str, list[float]] = {name: [] for name in variants}
            for r in range(rounds):
                shift = r % len(variants)
                order = variants[shift:] + variants[:shift]
                if r % 2:
                    order = order[::-1]
                this_round = {name: batch(bench.NOOPS[name], n) for name in order}
                for name in variants:
                    times[name].append(this_round[name])
                    ratios[name].append(this_round[name] / this_round[_baseline(name)])
            if profile:
                w.stop()  # warm shutdown: the worker writes its profile
    return {
        "n": n,
        "rounds": rounds,
        "per_task_ms": {name: median(t) / n * 1000 for name, t in times.items()},
        "ratio": {name: median(r) for name, r in ratios.items()},
        "ratios": ratios,
    }


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
