"""Run every benchmark and write benchmarks/results/RESULTS.md and benchmarks.png.

    python -m benchmarks                   # all but beat, about 5 minutes on 2 cores
    python -m benchmarks beat              # beat failover against celery-redbeat, ~9 min
    python -m benchmarks overhead handoff  # some of them
    python -m benchmarks --quick           # smaller samples, to check the harness

Each benchmark starts its own redis-server and real ``celery worker`` processes
(redis-server must be on PATH; ``pip install -e '.[bench]'`` for the peers).
The table is printed too, since benchmarks/results/ is not committed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import report
from benchmarks.common import loadavg, machine

RESULTS = Path(__file__).resolve().parent / "results"

#: Benchmark module -> keyword arguments of its run().
FULL = {
    "stream": {"rounds": 5, "per_variant": 200},
    "overhead": {"n": 400, "rounds": 9},
    "primitive": {"pairs": 3000, "rounds": 5},
    "breakdown": {"cycles": 2000, "rounds": 5},
    "library": {"cycles": 20000, "rounds": 5},
    "handoff": {"samples": {"wait": 100, "requeue": 15}},
    "failover": {"trials": 3},
    "scale": {"n": 400},
    "beat": {"runs": 3},
    "web": {"leases": 10_000},
    "rates": {"processes": 4, "seconds": 8, "rate": "5/1s", "calls": 500, "rounds": 5},
}
#: Run only when named: long, and against other peers than the rest.
ONLY_WHEN_NAMED = {"beat", "web"}
QUICK = {
    "stream": {"rounds": 2, "per_variant": 20},
    "overhead": {"n": 100, "rounds": 2},
    "primitive": {"pairs": 300, "rounds": 2},
    "breakdown": {"cycles": 200, "rounds": 2},
    "library": {"cycles": 2000, "rounds": 2},
    "handoff": {"samples": {"wait": 5, "requeue": 2}},
    "failover": {"trials": 1},
    "scale": {"n": 60, "processes": [1, 2], "key_counts": [1, 100]},
    "beat": {"runs": 1, "signals": ["SIGKILL", "SIGTERM"]},
    "web": {"leases": 500, "rounds": 2},
    "rates": {"processes": 2, "seconds": 3, "rate": "5/1s", "calls": 100, "rounds": 2},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("only", nargs="*", help=f"benchmarks to run: {', '.join(FULL)}")
    parser.add_argument("--quick", action="store_true", help="small samples")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    names = args.only or [name for name in plan if name not in ONLY_WHEN_NAMED]
    load = {"start": loadavg()}
    results = {}
    for name in names:
        started = time.monotonic()
        print(f"running {name}...", file=sys.stderr, flush=True)
        results[name] = run_one(name, plan[name])
        print(f"  {name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    load["end"] = loadavg()
    RESULTS.mkdir(exist_ok=True)
    table = report.markdown(machine(), load, results)
    (RESULTS / "RESULTS.md").write_text(table + "\n")
    (RESULTS / "results.json").write_text(json.dumps(results, indent=1))
    report.chart(results, RESULTS / "benchmarks.png")
    print(table)
    print(f"written: {RESULTS / 'RESULTS.md'}, {RESULTS / 'benchmarks.png'}", file=sys.stderr)


def run_one(name: str, kwargs: dict) -> dict:
    """Run one benchmark in a fresh process (see benchmarks.common.main_json)."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", json.dumps(kwargs)],
        stdout=subprocess.PIPE,
        check=True,
        text=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # JSON turned integer keys (worker processes) into strings.
    if name == "scale":
        result["per_second"] = {int(k): v for k, v in result["per_second"].items()}
    return result
