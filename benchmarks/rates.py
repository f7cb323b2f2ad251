"""Rates per key (``exclusive_rate``): how exact, and what a call costs.

    python -m benchmarks rates
    python -m benchmarks.rates '{"processes": 4, "seconds": 6, "rate": "5/1s"}'

Exactness: ``processes`` processes call one key in a loop for ``seconds``, through the
engine on one Redis, under ``skip``; each run notes when the store granted it (its
fencing token, the store's clock in µs). Reported: the most grants in any period
(sliding, as the store counts: never above N if the rate is exact), and the runs
admitted against the rate's ceiling over the time.

Cost: one process, calls in turn on keys of their own (none meets another), with a rate
and without, interleaved rounds: µs per call, median. A rate keeps a run's lease past
its end (one renewal) instead of releasing it: the same one round trip.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
import uuid

from benchmarks.common import main_json, redis_server
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.config import Settings, parse_rate
from celery_exclusive.engine import attempt

HOST = attempt.Host(can_requeue=True)


def _granted_at() -> float:
    """When the running call's grant was made, by the store's clock: a Redis fencing token
    is the grant's time in µs (see backends/redis/scripts.py), exact where a body's own
    start would add the time its process waited for a core."""
    lease = attempt.current_lease()
    return lease.fencing_token / 1e6 if lease is not None else time.time()


def _calls(url: str, key: str, rate: str | None, until: float, starts) -> int:
    """Call ``key`` until ``until`` (wall clock); note each run's start. Returns the
    calls made."""
    backend = backend_for_url(url)
    limit = parse_rate(rate)[0] if rate else 1
    settings = Settings(backend_url=url, rate=rate, limit=limit, lease_ttl=10.0)
    made = 0
    while time.time() < until:
        call = attempt.Call("bench.rated", uuid.uuid4().hex, key, settings, backend)
        attempt.run(call, HOST, lambda args, kwargs: starts.append(_granted_at()))
        made += 1
    return made


def _worker(url: str, key: str, rate: str, until: float, queue) -> None:
    starts: list[float] = []
    made = _calls(url, key, rate, until, starts)
    queue.put((made, starts))


def exactness(url: str, processes: int, seconds: float, rate: str) -> dict:
    count, period = parse_rate(rate) or (1, 1.0)
    key = f"exclusive:rated:{uuid.uuid4().hex[:8]}"
    until = time.time() + 1.0 + seconds
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [
        context.Process(target=_worker, args=(url, key, rate, until, queue))
        for _ in range(processes)
    ]
    for process in workers:
        process.start()
    results = [queue.get(timeout=seconds + 60) for _ in workers]
    for process in workers:
        process.join(30)
    starts = sorted(start for _, runs in results for start in runs)
    most = max(
        (sum(1 for other in starts if start <= other < start + period) for start in starts),
        default=0,
    )
    span = (starts[-1] - starts[0]) if len(starts) > 1 else 0.0
    ceiling = count * (int(span / period) + 1)
    return {
        "rate": rate,
        "processes": processes,
        "calls": sum(made for made, _ in results),
        "runs": len(starts),
        "most_in_a_period": most,
        "limit": count,
        "admitted_of_ceiling": round(len(starts) / ceiling, 3) if ceiling else 0.0,
    }


def cost(url: str, calls: int, rounds: int) -> dict:
    """µs per call, with a rate and without, each call on a key of its own."""
    per_call: dict[str, list[float]] = {"exclusive": [], "exclusive_rate='1/1s'": []}
    for _ in range(rounds):
        for name, rate in (("exclusive", None), ("exclusive_rate='1/1s'", "1/1s")):
            backend = backend_for_url(url)
            settings = Settings(backend_url=url, rate=rate, lease_ttl=10.0)
            started = time.perf_counter()
            for _ in range(calls):
                key = f"exclusive:cost:{uuid.uuid4().hex}"
                call = attempt.Call("bench.cost", uuid.uuid4().hex, key, settings, backend)
                attempt.run(call, HOST, lambda args, kwargs: None)
            per_call[name].append((time.perf_counter() - started) / calls * 1e6)
    medians = {name: round(statistics.median(values), 1) for name, values in per_call.items()}
    return {
        "calls": calls,
        "rounds": rounds,
        "us_per_call": medians,
        "ratio": round(medians["exclusive_rate='1/1s'"] / medians["exclusive"], 3),
    }


def run(
    processes: int = 4, seconds: float = 6.0, rate: str = "5/1s", calls: int = 500, rounds: int = 5
) -> dict:
    with redis_server() as server:
        url = server.url_for_db(0)
        return {
            "exactness": exactness(url, processes, seconds, rate),
            "cost": cost(url, calls, rounds),
        }


if __name__ == "__main__":
    main_json(run)
