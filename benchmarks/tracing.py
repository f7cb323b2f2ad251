"""What OpenTelemetry tracing costs a call, next to what the library costs it.

    python -m benchmarks.tracing [--quick]

One process per variant, each calling an ExclusiveTask directly (the engine's whole
path: claim, body, release; no broker) in rounds the parent interleaves, so that load
that comes and goes hits each variant alike. The variants:

- ``body``: the task's body alone (the floor);
- ``no api``: the library, OpenTelemetry not installed (``opentelemetry`` unimportable);
- ``api``: the API installed, no SDK (its no-op tracer answers);
- ``sdk``: the SDK with a batch span processor and an exporter that drops every span.

Each on the memory store (the library's own cost) and on a SQLite file (a real store:
round trips, and their spans). Reported: the median round, in microseconds per call,
and each variant's cost over ``no api``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import loadavg, machine, median

VARIANTS = ("body", "no api", "api", "sdk")
STORES = ("memory", "sqlite")

#: The variant's process: told a call count on each line, it answers the ns per call.
CHILD = r"""
import json, sys, time
variant, url = sys.argv[1], sys.argv[2]
if variant == "no api":
    sys.modules["opentelemetry"] = None  # as if the extra were not installed
if variant == "sdk":
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropped(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
from celery import Celery
from celery_exclusive import ExclusiveTask

app = Celery("bench", broker="memory://", set_as_current=False)
app.conf.update(exclusive_backend_url=url, exclusive_lease_ttl=30)

@app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}")
def settle(invoice_id):
    return invoice_id

task = app.tasks[settle.name]
call = task.run if variant == "body" else task
call(1)  # settings resolved, store opened, heartbeat started
for line in sys.stdin:
    n = int(line)
    started = time.perf_counter_ns()
    for i in range(n):
        call(i % 64)
    print(json.dumps((time.perf_counter_ns() - started) / n), flush=True)
"""


def run(rounds: int = 9, calls: int = 2000) -> dict:
    folder = tempfile.mkdtemp(prefix="bench-tracing-")
    urls = {"memory": "memory://bench", "sqlite": f"sqlite:///{folder}/leases.db"}
    children = {
        (store, variant): subprocess.Popen(
            [sys.executable, "-c", CHILD, variant, urls[store]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        for store in STORES
        for variant in VARIANTS
    }
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in children}
    try:
        for _ in range(rounds):
            for key, child in children.items():
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(f"{calls}\n")
                child.stdin.flush()
                samples[key].append(json.loads(child.stdout.readline()) / 1000)
    finally:
        for child in children.values():
            if child.stdin is not None:
                child.stdin.close()
            child.wait(10)
    return {f"{store}/{variant}": median(samples[(store, variant)]) for store, variant in samples}


def table(results: dict) -> str:
    lines = [
        "| store | variant | µs per call | over `no api` | share of the library's cost |",
        "|---|---|---|---|---|",
    ]
    for store in STORES:
        floor = results[f"{store}/body"]
        plain = results[f"{store}/no api"]
        for variant in VARIANTS:
            value = results[f"{store}/{variant}"]
            over = "" if variant in ("body", "no api") else f"+{value - plain:.1f} µs"
            share = (
                "" if variant in ("body", "no api") else f"{(value - plain) / (plain - floor):.0%}"
            )
            lines.append(f"| {store} | {variant} | {value:.1f} | {over} | {share} |")
    return "\n".join(lines)


def main() -> None:
    quick = "--quick" in sys.argv
    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg()
    results = run(rounds=3, calls=200) if quick else run()
    print(f"measured {started} on {machine()}; load {load_before} -> {loadavg()}")
    print(table(results))


if __name__ == "__main__":
    main()
