"""Celery tasks and RQ jobs whose worker traces with the OpenTelemetry SDK, as a user's
set-up does, for the tracing tests: every span a worker ends is written to a file as
one JSON line, which the test reads (a worker's in-memory exporter is out of its reach).

A Celery worker traces from ``worker_init`` (a prefork child inherits it) with
opentelemetry-instrumentation-celery, whose ``run/<task>`` spans hold the library's;
an RQ work horse sets the SDK up as it imports this module, and no instrumentation
gives its jobs a span.

EXCLUSIVE_TEST_BROKER   broker and result backend (Redis URL)
EXCLUSIVE_TEST_STORE    the lease store (a SQLite URL)
EXCLUSIVE_TEST_SPANS    the file spans are written to; unset: nothing is traced
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from celery import Celery
from celery.signals import worker_init
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from celery_exclusive import ExclusiveTask
from celery_exclusive.rq import exclusive

STORE = os.environ.get("EXCLUSIVE_TEST_STORE", "memory://")

app = Celery("traced")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("EXCLUSIVE_TEST_BROKER", "cache+memory://"),
    exclusive_backend_url=STORE,
    exclusive_lease_ttl=2,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


def trace_to_file(path: str) -> None:
    """The SDK, its spans exported one by one, as they end, to ``path``."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(path)))
    trace.set_tracer_provider(provider)


class FileExporter(SpanExporter):
    """Appends each span as a JSON line: one write per batch, whole lines only."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence) -> SpanExportResult:
        lines = "".join(json.dumps(as_record(span)) + "\n" for span in spans)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS


def as_record(span) -> dict:
    """What the tests read of a span."""
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_id": None if parent is None else format(parent.span_id, "016x"),
        "attributes": dict(span.attributes or {}),
        "events": [
            {
                "name": event.name,
                "attributes": dict(event.attributes or {}),
                "time": event.timestamp,
            }
            for event in span.events
        ],
        "status": span.status.status_code.name,
        "start": span.start_time,
        "end": span.end_time,
        "pid": os.getpid(),
    }


@worker_init.connect
def traced_worker(sender, **kwargs):
    path = os.environ.get("EXCLUSIVE_TEST_SPANS")
    if path:  # a worker started by the tracing tests
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        trace_to_file(path)
        CeleryInstrumentor().instrument()


# --- Celery tasks ------------------------------------------------------------------------


@app.task(base=ExclusiveTask, exclusive_key="{key}", name="traced.skip")
def skip(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key


@app.task(
    base=ExclusiveTask, exclusive_key="{key}", name="traced.wait", exclusive_on_duplicate="wait"
)
def wait(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key


# A short time in line: the first duplicate goes back to the queue as the pending rerun,
# and the next one joins it.
@app.task(
    base=ExclusiveTask,
    exclusive_key="{key}",
    name="traced.rerun",
    exclusive_on_duplicate="rerun",
    exclusive_wait_timeout=0.5,
    exclusive_requeue_delay=2,
)
def rerun(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key


# Not sent again when its lease is lost: one loss, one attempt, traced.
@app.task(
    base=ExclusiveTask, exclusive_key="{key}", name="traced.lose", exclusive_requeue_lost=False
)
def lose(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key


# --- RQ jobs, as the tasks above ------------------------------------------------------------

if os.environ.get("EXCLUSIVE_TEST_SPANS") and os.environ.get("EXCLUSIVE_TEST_RQ"):
    trace_to_file(os.environ["EXCLUSIVE_TEST_SPANS"])


@exclusive(key="{key}", backend_url=STORE, lease_ttl=2)
def skip_job(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key


@exclusive(key="{key}", backend_url=STORE, lease_ttl=2, on_duplicate="wait")
def wait_job(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key


@exclusive(
    key="{key}",
    backend_url=STORE,
    lease_ttl=2,
    on_duplicate="rerun",
    wait_timeout=0.5,
    requeue_delay=2,
)
def rerun_job(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key


@exclusive(key="{key}", backend_url=STORE, lease_ttl=2, requeue_lost=False)
def lose_job(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key
