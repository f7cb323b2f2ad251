"""The lease protocol explored: every schedule of calls, copies, crashes, lost replies
and pauses the CI seeds draw, each run on the real engine (tests/simulation/world.py),
every invariant checked after every step.

``pytest tests/simulation`` runs the CI budget in every world (each version of the
faults, :data:`~.world.FAULTS`) and in the beat leader's; ``SIM_SEEDS=N`` and
``SIM_BEAT_SEEDS=N`` set others (and ``SIM_FIRST=K`` where to start); a failure
prints its world, its seed, the trace of the steps that led to it and the one command
that replays it. A night's run:
``python -m tests.simulation.run --seeds 1000000``.
"""

from __future__ import annotations

import os
import time

import pytest

from .run import run_beat_seed, run_seed
from .world import FAULTS

#: The seeds CI explores in each world: a few thousand schedules, about half a minute on
#: one core, and enough that every seeded bug of mutants.py is caught in its world.
CI_SEEDS = 6000
#: The worlds CI explores: the newest, and every older one a seeded bug is caught in
#: (a world that gains faults moves some schedules away from what an older one reached).
WORLDS = tuple(range(1, FAULTS + 1))
#: The seeds CI explores of the beat leader's worlds (tests/simulation/beat.py), whose
#: schedules are longer: about half a minute on one core.
BEAT_SEEDS = 1500
#: Schedules per test, so that xdist spreads them and a failure names a small range.
CHUNK = 500


def _chunks() -> list[tuple[int, int, int]]:
    first = int(os.environ.get("SIM_FIRST", "0"))
    total = int(os.environ.get("SIM_SEEDS", str(CI_SEEDS)))
    return [
        (faults, start, min(CHUNK, first + total - start))
        for faults in WORLDS
        for start in range(first, first + total, CHUNK)
    ]


@pytest.mark.parametrize(("faults", "first", "count"), _chunks(), ids=lambda v: str(v))
def test_every_invariant_holds_on_every_schedule(faults, first, count):
    started = time.monotonic()
    for seed in range(first, first + count):
        failure = run_seed(seed, faults=faults)
        assert failure is None, f"world {faults}: {failure}"
    took = time.monotonic() - started
    print(f"world {faults}, seeds {first}..{first + count - 1}: {count / took * 60:.0f} a minute")


def _beat_chunks() -> list[tuple[int, int]]:
    first = int(os.environ.get("SIM_FIRST", "0"))
    total = int(os.environ.get("SIM_BEAT_SEEDS", str(BEAT_SEEDS)))
    return [
        (start, min(CHUNK, first + total - start)) for start in range(first, first + total, CHUNK)
    ]


@pytest.mark.parametrize(("first", "count"), _beat_chunks(), ids=lambda v: str(v))
def test_no_tick_is_sent_twice_and_every_due_tick_is_sent(first, count):
    for seed in range(first, first + count):
        failure = run_beat_seed(seed)
        assert failure is None, failure
