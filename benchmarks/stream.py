"""Per-task cost inside one worker: every variant mixed into one stream of tasks.

Batch timings (overhead.py) swing 0.5-3.6x on a shared machine between batches run a
second apart; here the variants share every second of the run. Each round queues the
no-op of every variant, ``per_variant`` times each, shuffled into one stream, on a queue
the worker does not consume yet; then the worker is told to consume it (so the worker
never waits for the producer). Each pool process timestamps every task's start
(``task_prerun``) in memory, and the round ends with flush tasks that return the stamps.
A task's time is from its start to the start of the next task in the same process: its
body, its result, its acknowledgement and the fetch of the next message. Each round's
median per variant is divided by plain ``Task``'s median of the same round
(``acks_late`` variants by the plain ``acks_late`` task's), and the ratios' median over
rounds is reported.

The floors are plain tasks whose bodies make the round trips a lease needs, with no
library Python: one bare round trip (what a peer's unlock costs the worker), two, and
the store's own acquire and release scripts sent by EVALSHA.
"""

from __future__ import annotations

import random
from collections import defaultdict

from benchmarks import app as bench
from benchmarks.common import (
    bench_env,
    configure_client,
    loadavg,
    median,
    redis_server,
    running,
    worker,
)

VARIANTS = tuple(bench.STREAM_NOOPS)
#: Pools the stream runs through: (pool, concurrency).
POOLS = {"solo": ("solo", 1), "prefork -c 2": ("prefork", 2)}
#: Round number times this, plus the task's place, is each task's argument: unique
#: (peers lock on their arguments), and says which round a start belongs to.
ROUND = 1_000_000


def _baseline(name: str) -> str:
    return "plain, acks_late" if name.endswith("acks_late") else "plain"


def _round(queue: str, number: int, per_variant: int, processes: int, seed: int) -> list:
    """Queue one shuffled stream on ``queue``, let the worker drain it, return its
    flushed starts: [{"pid", "starts": [(perf_counter, task name, argument)]}]."""
    stream = [name for name in VARIANTS for _ in range(per_variant)]
    random.Random(seed).shuffle(stream)
    sent = [
        bench.STREAM_NOOPS[name].apply_async((number * ROUND + place,), queue=queue)
        for place, name in enumerate(stream)
    ]
    # Two flushes per pool process: each process that ran tasks is likely to get one;
    # starts a process did not flush come with its next flush (the argument says the round).
    flushes = [bench.stream_flush.apply_async(queue=queue) for _ in range(2 * processes)]
    bench.app.control.add_consumer(queue, reply=True, limit=1, timeout=10)
    try:
        flushed = [f.get(timeout=300) for f in flushes]
    finally:
        bench.app.control.cancel_consumer(queue, reply=True, limit=1, timeout=10)
    failed = [r for r in sent if r.state != "SUCCESS"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(sent)} stream tasks did not succeed")
    return flushed


def _per_task_us(flushed: list) -> dict[int, dict[str, list[float]]]:
    """Round -> variant -> µs from each of its tasks' start to the next start in the
    same process (the next being a task of the same round)."""
    by_pid: dict[int, list] = defaultdict(list)
    for flush in flushed:
        by_pid[flush["pid"]] += flush["starts"]
    names = {task.name: name for name, task in bench.STREAM_NOOPS.items()}
    gaps: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for starts in by_pid.values():
        starts.sort()
        for (at, task, arg), (next_at, next_task, next_arg) in zip(starts, starts[1:]):
            if task not in names or next_task not in names:
                continue
            if arg // ROUND != next_arg // ROUND:
                continue
            gaps[arg // ROUND][names[task]].append((next_at - at) * 1e6)
    return gaps


def run_pool(env: dict, pool: str, concurrency: int, rounds: int, per_variant: int) -> dict:
    w = worker(env, f"stream-{pool}", pool=pool, concurrency=concurrency, queues="b")
    with running(w):
        _round(f"stream-{pool}-warmup", 0, 20, concurrency, seed=0)
        flushed: list = []
        for number in range(1, rounds + 1):
            flushed += _round(f"stream-{pool}-{number}", number, per_variant, concurrency, number)
    per_round = _per_task_us(flushed)
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for number in range(1, rounds + 1):
        gaps = per_round.get(number, {})
        for name in VARIANTS:
            base = gaps.get(_baseline(name))
            if gaps.get(name) and base:
                medians[name].append(median(gaps[name]))
                ratios[name].append(median(gaps[name]) / median(base))
    return {
        "per_task_us": {name: median(v) for name, v in medians.items() if v},
        "ratio": {name: median(v) for name, v in ratios.items() if v},
        "ratios": ratios,
        "samples": {
            name: sum(len(per_round[r].get(name, [])) for r in per_round) for name in VARIANTS
        },
    }


def run(rounds: int = 4, per_variant: int = 150, pools=None) -> dict:
    load = {"start": loadavg()}
    with redis_server() as server:
        env = bench_env(server.url_for_db(0), server.url_for_db(1), server.url_for_db(2))
        env["BENCH_STREAM"] = "1"
        configure_client(bench.app, env)
        results = {
            name: run_pool(env, *POOLS[name], rounds, per_variant) for name in (pools or POOLS)
        }
    load["end"] = loadavg()
    return {"rounds": rounds, "per_variant": per_variant, "pools": results, "load": load}


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
