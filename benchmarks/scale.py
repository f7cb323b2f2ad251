"""Scale: tasks per second with 1, 2 and 4 worker processes over 1, 100 or 10,000 keys.

One real prefork worker with ``-c`` processes runs N tasks whose body sleeps 5 ms,
task ``i`` on key ``i % keys`` with the ``wait`` policy: with one key the runs are
serialised, each waiting duplicate woken by the previous release; with many keys they
run side by side. A plain task with the same body gives the ceiling.
"""

from __future__ import annotations

import signal
import time

from celery.result import ResultSet

from benchmarks import app as bench
from benchmarks.common import bench_env, configure_client, redis_server, worker

BODY = 0.005


def throughput(task, n: int, keys: int) -> float:
    started = time.perf_counter()
    results = ResultSet([task.apply_async((f"k{i % keys}", BODY)) for i in range(n)])
    results.join_native(timeout=300)
    return n / (time.perf_counter() - started)


def run(n: int = 400, processes=(1, 2, 4), key_counts=(1, 100, 10_000)) -> dict:
    table: dict[int, dict[str, float]] = {}
    with redis_server() as server:
        env = bench_env(server.url_for_db(0), server.url_for_db(1), server.url_for_db(2))
        configure_client(bench.app, env)
        for c in processes:
            w = worker(env, f"scale{c}", pool="prefork", concurrency=c).start()
            try:
                throughput(bench.work, 50, 10_000)  # warm-up: every child connects
                row = {"plain": throughput(bench.plain_work, n, 1)}
                for keys in key_counts:
                    row[f"{keys} keys"] = throughput(bench.work, n, keys)
                table[c] = row
            finally:
                w.stop(signal.SIGKILL, timeout=5)
    return {"n": n, "body_ms": BODY * 1000, "per_second": table}


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
