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

Two harnesses (``harnesses``): ``queued``, as above, and ``live``, where the worker
consumes the queue while the stream is sent: producer, worker and Redis then share the
cores, as on a small host, and a task's time includes what that sharing costs it. And
with or without hiredis (``hiredis``: ``"installed"``, the environment as it is;
``"both"``, or true/false): without, every process of the run (the producer, the workers)
finds hiredis hidden (``benchmarks/no_hiredis`` first on their path), as the default
``pip install 'celery-exclusive[redis]'`` has none; each setting runs in a process of its own.

    python -m benchmarks.stream '{"harnesses": ["live"], "hiredis": "both"}'
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

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
from tests.support.workers import ROOT

VARIANTS = tuple(bench.STREAM_NOOPS)
#: Pools the stream runs through: (pool, concurrency).
POOLS = {"solo": ("solo", 1), "prefork -c 2": ("prefork", 2)}
#: Round number times this, plus the task's place, is each task's argument: unique
#: (peers lock on their arguments), and says which round a start belongs to.
ROUND = 1_000_000
#: How the stream reaches the worker: filled first, then drained; or sent while drained.
HARNESSES = ("queued", "live")
#: The directory whose ``hiredis`` module hides the real one.
NO_HIREDIS = Path(__file__).resolve().parent / "no_hiredis"


def _baseline(name: str) -> str:
    return "plain, acks_late" if name.endswith("acks_late") else "plain"


def _round(
    queue: str, number: int, per_variant: int, processes: int, seed: int, live: bool = False
) -> list:
    """Queue one shuffled stream on ``queue``, let the worker drain it (``live``: while it
    is sent), return its flushed starts: [{"pid", "starts": [(perf_counter, task name,
    argument)]}]."""
    stream = [name for name in VARIANTS for _ in range(per_variant)]
    random.Random(seed).shuffle(stream)
    if live:
        bench.app.control.add_consumer(queue, reply=True, limit=1, timeout=10)
    sent = [
        bench.STREAM_NOOPS[name].apply_async((number * ROUND + place,), queue=queue)
        for place, name in enumerate(stream)
    ]
    # Two flushes per pool process: each process that ran tasks is likely to get one;
    # starts a process did not flush come with its next flush (the argument says the round).
    flushes = [bench.stream_flush.apply_async(queue=queue) for _ in range(2 * processes)]
    if not live:
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


def run_pool(
    env: dict, pool: str, concurrency: int, rounds: int, per_variant: int, live: bool = False
) -> dict:
    harness = "live" if live else "queued"
    w = worker(env, f"stream-{harness}-{pool}", pool=pool, concurrency=concurrency, queues="b")
    with running(w):
        _round(f"stream-{harness}-{pool}-warmup", 0, 20, concurrency, seed=0, live=live)
        flushed: list = []
        for number in range(1, rounds + 1):
            queue = f"stream-{harness}-{pool}-{number}"
            flushed += _round(queue, number, per_variant, concurrency, number, live=live)
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


def run(
    rounds: int = 4,
    per_variant: int = 150,
    pools=None,
    harnesses=HARNESSES,
    hiredis="installed",
) -> dict:
    """``{"runs": [one run per hiredis setting: {"hiredis", "columns": {"<harness>,
    <pool>": the pool's result}, "load"}], "rounds", "per_variant"}``."""
    settings = [True, False] if hiredis == "both" else [hiredis]
    runs = [_run_with(setting, rounds, per_variant, pools, harnesses) for setting in settings]
    return {"rounds": rounds, "per_variant": per_variant, "runs": runs}


def _run_with(hiredis, rounds: int, per_variant: int, pools, harnesses) -> dict:
    """One run of every harness and pool, hiredis shown or hidden as ``hiredis`` says
    ("installed": as it is here), in a process of its own where it must be hidden or was."""
    if hiredis == "installed" or bool(hiredis) == _hiredis_here():
        return _run_here(rounds, per_variant, pools, harnesses)
    env = dict(os.environ)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(NO_HIREDIS)]
    env["PYTHONPATH"] = os.pathsep.join(path if hiredis else [str(NO_HIREDIS), *path])
    arguments = {
        "rounds": rounds,
        "per_variant": per_variant,
        "pools": pools,
        "harnesses": list(harnesses),
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.stream", json.dumps(arguments)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["runs"][0]


def _hiredis_here() -> bool:
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


def _run_here(rounds: int, per_variant: int, pools, harnesses) -> dict:
    load = {"start": loadavg()}
    columns = {}
    with redis_server() as server:
        env = bench_env(server.url_for_db(0), server.url_for_db(1), server.url_for_db(2))
        env["BENCH_STREAM"] = "1"
        if str(NO_HIREDIS) in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            env["PYTHONPATH"] = os.pathsep.join([str(NO_HIREDIS), str(ROOT)])
        configure_client(bench.app, env)
        for harness in harnesses:
            for name in pools or POOLS:
                columns[f"{harness}, {name}"] = run_pool(
                    env, *POOLS[name], rounds, per_variant, live=harness == "live"
                )
    load["end"] = loadavg()
    return {"hiredis": _hiredis_here(), "columns": columns, "load": load}


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
