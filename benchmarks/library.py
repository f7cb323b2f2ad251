"""The library's own Python per call: ``ExclusiveTask.__call__`` against a plain task's,
in one process, leases in the in-process memory store (no round trip to hide in).

    python -m benchmarks library
    python -m benchmarks.library '{"cycles": 20000, "rounds": 5}'

Each call is made as a solo worker makes it (a request on the stack, a new task id and
argument each time, and Celery's worker-side stack protection installed, so that
``Task.__call__`` runs the body without pushing a request of its own); the difference
per call is what the lease adds in Python: binding the key, the holder record,
settings, the heartbeat's bookkeeping, signals, the store's own bookkeeping. Median of
interleaved rounds; and, since a median moves with whatever else the machine runs, the
fastest of many short interleaved blocks (``added_fastest_us``), which moves far less.
"""

from __future__ import annotations

import time

from benchmarks.breakdown import _interleaved, calls


def run(cycles: int = 20000, rounds: int = 5, profile: str | None = None) -> dict:
    from celery.app import trace

    trace._install_stack_protection()  # what a worker does at start
    functions, _app = calls("memory://")
    if profile:
        import cProfile

        call = functions["ExclusiveTask.__call__"]
        for _ in range(2000):
            call()
        cProfile.runctx("for _ in range(cycles): call()", globals(), locals(), profile)
    per_call = _interleaved(functions, cycles, rounds)
    added = per_call["ExclusiveTask.__call__"] - per_call["plain Task.__call__"]
    fastest = _fastest(functions, blocks=25, calls=1000)
    return {
        "cycles": cycles,
        "rounds": rounds,
        "calls_us": per_call,
        "added_us": round(added, 1),
        "fastest_us": fastest,
        "added_fastest_us": round(
            fastest["ExclusiveTask.__call__"] - fastest["plain Task.__call__"], 1
        ),
    }


def _fastest(functions: dict, blocks: int, calls: int) -> dict[str, float]:
    """µs per call of each function: the fastest of ``blocks`` interleaved blocks of
    ``calls`` calls (what the code costs when nothing else takes the core)."""
    best = dict.fromkeys(functions, float("inf"))
    for _ in range(blocks):
        for name, function in functions.items():
            started = time.perf_counter_ns()
            for _ in range(calls):
                function()
            best[name] = min(best[name], (time.perf_counter_ns() - started) / calls / 1000)
    return {name: round(value, 1) for name, value in best.items()}


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
