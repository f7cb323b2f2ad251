"""Run schedules: ``python -m tests.simulation.run --seed N`` replays one with its whole
trace; ``--seeds N`` (from ``--first``) explores many and stops at the first failure;
``--beat`` runs the beat leader's worlds (tests/simulation/beat.py) instead of the
workers'."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import Any, Optional

from .beat import BeatWorld
from .world import FAULTS, World


def run_seed(seed: int, full_trace: bool = False, faults: int = FAULTS) -> Optional[str]:
    """Run the schedule of ``seed`` (in the world of ``faults``, see
    :data:`~.world.FAULTS`): None if every invariant held, else what failed, with the
    trace of the steps that led to it."""
    replay = f"--seed {seed}" + ("" if faults == FAULTS else f" --faults {faults}")
    return _run(World(seed, faults=faults), f"seed {seed}", full_trace, replay)


def run_beat_seed(seed: int, full_trace: bool = False) -> Optional[str]:
    """Run the beat schedule of ``seed`` (tests/simulation/beat.py), as :func:`run_seed`."""
    return _run(BeatWorld(seed), f"beat seed {seed}", full_trace, f"--beat --seed {seed}")


def _run(world: Any, which: str, full_trace: bool, replay: str) -> Optional[str]:
    if full_trace:
        world.full_trace = []
    try:
        world.run()
    except Exception as exc:  # a violation, or a bug the schedule found
        lines = world.full_trace if full_trace else list(world.trace)
        return (
            f"{which} failed: {type(exc).__name__}: {exc}\n"
            f"config: {world.config}\n"
            + "".join(traceback.format_exception(exc)[-6:])
            + "trace (virtual seconds, who, what):\n"
            + "\n".join(lines)
            + f"\nreplay: python -m tests.simulation.run {replay}"
        )
    return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, help="replay one seed, with its whole trace")
    parser.add_argument("--seeds", type=int, default=1000, help="how many seeds to explore")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--faults", type=int, default=FAULTS, help="the world's faults as of this version"
    )
    parser.add_argument("--beat", action="store_true", help="explore the beat leader's worlds")
    args = parser.parse_args(argv)

    def run(seed: int, full_trace: bool = False) -> Optional[str]:
        if args.beat:
            return run_beat_seed(seed, full_trace=full_trace)
        return run_seed(seed, full_trace=full_trace, faults=args.faults)

    if args.seed is not None:
        failure = run(args.seed, full_trace=True)
        print(failure or f"seed {args.seed}: every invariant held")
        return 1 if failure else 0
    started = time.monotonic()
    for seed in range(args.first, args.first + args.seeds):
        failure = run(seed)
        if failure:
            print(failure)
            return 1
    took = time.monotonic() - started
    print(f"{args.seeds} schedules, every invariant held ({args.seeds / took * 60:.0f}/min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
