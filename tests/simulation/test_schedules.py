"""The lease protocol explored: every schedule of calls, copies, crashes, lost replies
and pauses the CI seeds draw, each run on the real engine (tests/simulation/world.py),
every invariant checked after every step.

``pytest tests/simulation`` runs the CI budget; ``SIM_SEEDS=N`` sets another (and
``SIM_FIRST=K`` where to start); a failure prints its seed, the trace of the steps
that led to it and the one command that replays it. A night's run:
``python -m tests.simulation.run --seeds 1000000``.
"""

from __future__ import annotations

import os
import time

import pytest

from .run import run_seed

#: The seeds CI explores: a few thousand schedules, about a minute on one core, and
#: enough that every seeded bug of mutants.py is caught.
CI_SEEDS = 6000
#: Schedules per test, so that xdist spreads them and a failure names a small range.
CHUNK = 250


def _chunks() -> list[tuple[int, int]]:
    first = int(os.environ.get("SIM_FIRST", "0"))
    total = int(os.environ.get("SIM_SEEDS", str(CI_SEEDS)))
    return [
        (start, min(CHUNK, first + total - start)) for start in range(first, first + total, CHUNK)
    ]


@pytest.mark.parametrize(("first", "count"), _chunks(), ids=lambda v: str(v))
def test_every_invariant_holds_on_every_schedule(first, count):
    started = time.monotonic()
    for seed in range(first, first + count):
        failure = run_seed(seed)
        assert failure is None, failure
    took = time.monotonic() - started
    print(f"seeds {first}..{first + count - 1}: {count / took * 60:.0f} schedules a minute")
