"""Handoff latency: from the holder's release to the start of the duplicate it held up.

Two real solo workers: the holder runs on queue ``a``, the duplicate on queue ``b``,
so the duplicate is always on another worker, already blocked when the holder lets
go. Inside the workers, the holder's release (the ``lease_released`` signal, sent once
the store answered) and the duplicate's body start are timestamped in a ledger Redis.

``wait`` blocks on the key's wake-up list; ``requeue`` sends the duplicate back with
the default backoff (``requeue_delay=1`` s, halved-plus-jitter), so it comes back
whenever its countdown ends, not when the key frees.
"""

from __future__ import annotations

import json

from benchmarks import app as bench
from benchmarks.common import (
    bench_env,
    configure_client,
    percentile,
    redis_server,
    running,
    wait_until,
    worker,
)

HOLD = 0.25


def one(task, ledger, key: str) -> float:
    """Seconds from the holder's release to the duplicate's start, for a fresh key."""
    task.apply_async((key, HOLD), queue="a")
    assert wait_until(lambda: ledger.llen("starts") >= 1, timeout=30), "holder never started"
    duplicate = task.apply_async((key, 0.0), queue="b")
    duplicate.get(timeout=60)
    starts = [json.loads(x) for x in ledger.lrange("starts", 0, -1)]
    assert wait_until(lambda: ledger.llen("releases") >= 2, timeout=10), "no release recorded"
    released = json.loads(ledger.lindex("releases", 0))["at"]
    ledger.delete("starts", "ends", "releases")
    assert len(starts) == 2 and starts[1]["token"] > starts[0]["token"]
    return starts[1]["start"] - released


def run(samples: dict | None = None) -> dict:
    samples = samples or {"wait": 60, "requeue": 15}
    out = {}
    with redis_server() as server:
        env = bench_env(
            server.url_for_db(0),
            server.url_for_db(1),
            server.url_for_db(2),
            BENCH_RECORD_RELEASES=1,
        )
        configure_client(bench.app, env)
        ledger = server.client(2)
        with running(worker(env, "holder", queues="a"), worker(env, "duplicate", queues="b")):
            for policy, n in samples.items():
                task = bench.hold_wait if policy == "wait" else bench.hold_requeue
                one(task, ledger, f"warm-{policy}")
                latencies = [one(task, ledger, f"{policy}-{i}") for i in range(n)]
                out[policy] = {
                    "samples": n,
                    "p50_ms": percentile(latencies, 50) * 1000,
                    "p99_ms": percentile(latencies, 99) * 1000,
                    "max_ms": max(latencies) * 1000,
                }
    return out


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
