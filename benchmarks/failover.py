"""Failover: from SIGKILL of a lease's holder to the next acquisition of its key.

The holder runs on queue ``a`` and never finishes by itself; a duplicate with the
``wait`` policy is already blocked on another worker (queue ``b``). Two kills:

- the whole holder worker (its process group): nobody is left to release, so the key
  frees when the lease expires, at most ``lease_ttl`` after the last renewal;
- only the prefork child running the task: the worker's main process sees the
  WorkerLostError and releases the lease at once.

Reported: when the store no longer had the lease (polled every 5 ms from outside),
and when the duplicate's body started (recorded inside its worker).
"""

from __future__ import annotations

import json
import os
import signal
import time

from benchmarks import app as bench
from benchmarks.common import bench_env, configure_client, median, redis_server, wait_until, worker
from celery_exclusive import backend_for_url
from tests.support.servers import kill_tree

TTL = 3.0


def trial(holder_worker, ledger, store, key: str, whole: bool) -> dict:
    bench.hold_wait.apply_async((key, 600.0), queue="a")
    info = wait_until(lambda: store.holders_of("exclusive:" + key), timeout=30)
    assert info, "holder never took the lease"
    duplicate = bench.hold_wait.apply_async((key, 0.0), queue="b")
    time.sleep(0.3)  # let the duplicate block on the key
    killed = time.time()
    if whole:
        kill_tree(holder_worker.process, signal.SIGKILL)
    else:
        os.kill(info[0].holder["pid"], signal.SIGKILL)
    wait_until(lambda: not store.holders_of("exclusive:" + key), timeout=TTL * 3)
    freed = time.time()
    duplicate.get(timeout=TTL * 5)
    starts = [json.loads(x) for x in ledger.lrange("starts", 0, -1)]
    ledger.delete("starts", "ends")
    return {"freed": freed - killed, "next_start": starts[-1]["start"] - killed}


def run(trials: int = 3) -> dict:
    out = {"ttl": TTL}
    with redis_server() as server:
        env = bench_env(server.url_for_db(0), server.url_for_db(1), server.url_for_db(2), TTL)
        configure_client(bench.app, env)
        ledger, store = server.client(2), backend_for_url(env["BENCH_STORE"])
        waiter = worker(env, "waiter", queues="b").start()
        try:
            results = []
            for i in range(trials):
                holder = worker(env, f"holder{i}", queues="a").start()
                try:
                    results.append(trial(holder, ledger, store, f"whole-{i}", whole=True))
                finally:
                    holder.stop(signal.SIGKILL, timeout=5)
            out["whole worker"] = _summary(results)
            holder = worker(env, "prefork", pool="prefork", queues="a").start()
            try:
                results = [trial(holder, ledger, store, f"child-{i}", False) for i in range(trials)]
            finally:
                holder.stop(signal.SIGKILL, timeout=5)
            out["pool child only"] = _summary(results)
        finally:
            waiter.stop(signal.SIGKILL, timeout=5)
    return out


def _summary(results: list[dict]) -> dict:
    return {
        "trials": len(results),
        "freed_s": median([r["freed"] for r in results]),
        "next_start_s": median([r["next_start"] for r in results]),
        "next_start_max_s": max(r["next_start"] for r in results),
    }


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
