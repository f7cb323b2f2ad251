"""Traces on real Celery workers, prefork and solo, traced by the OpenTelemetry SDK with
opentelemetry-instrumentation-celery: each call's lease steps are spans and events
inside its ``run/<task>`` span, whatever the pool.

The key's other holder is a lock this test process holds (a solo worker runs one call
at a time); the worker's spans reach the test through a file (tests/support/apps/traced.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from celery import Celery

from celery_exclusive import ExclusiveLock
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core import marks
from celery_exclusive.errors import LOSS_ADVICE
from celery_exclusive.telemetry import shown_key
from tests.conftest import fresh_redis_db
from tests.support import trace_picture
from tests.support.cluster import wait_until
from tests.support.spans import acquire_of, call_tree, wait_for_span
from tests.support.workers import Worker


class Traced:
    def __init__(self, client: Celery, store: str, spans: Path, pool: str) -> None:
        self.pool = pool
        self.client = client
        self.store = store
        self.spans = spans

    @contextlib.contextmanager
    def held(self, key: str):
        """``key`` held by a lock of this process for the ``with`` block."""
        with ExclusiveLock(f"exclusive:{key}", self.store, ttl=2) as lease:
            yield lease

    def send(self, task: str, *args):
        return self.client.send_task(task, args)


@pytest.fixture(scope="module", params=["prefork", "solo"])
def traced(request, redis_server, tmp_path_factory):
    pool = request.param
    url = fresh_redis_db(redis_server)
    folder = tmp_path_factory.mktemp(f"traced-{pool}")
    store, spans = f"sqlite:///{folder}/leases.db", folder / "spans.jsonl"
    worker = Worker(
        "tests.support.apps.traced",
        {
            "EXCLUSIVE_TEST_BROKER": url,
            "EXCLUSIVE_TEST_STORE": store,
            "EXCLUSIVE_TEST_SPANS": str(spans),
        },
        pool=pool,
        concurrency=1 if pool == "solo" else 2,
        name=f"traced-{pool}",
    )
    with worker:
        client = Celery("client", broker=url, backend=url, set_as_current=False)
        yield Traced(client, store, spans, pool)


def test_a_skipped_call_shows_its_acquire_span_and_what_it_got(traced):
    with traced.held("skipped"):
        call = traced.send("traced.skip", "skipped", 0)
        call.get(timeout=30, propagate=False)

    run = call_tree(traced.spans, call.id)
    assert run.shape() == ("run/traced.skip", (("exclusive.acquire", ()),))
    acquire = run.child("exclusive.acquire")
    assert acquire.attributes["exclusive.outcome"] == "skipped"
    assert acquire.attributes["exclusive.policy"] == "skip"
    assert acquire.attributes["exclusive.limit"] == 1
    assert acquire.attributes["exclusive.store"] == "sqlite"
    assert acquire.attributes["exclusive.key"] == shown_key("exclusive:skipped", "", "hash")
    assert "exclusive.fencing_token" not in acquire.attributes
    assert [c.name for c in acquire.children] == ["exclusive.store try_acquire"] + [
        c.name for c in acquire.children[1:]
    ]
    assert run.event_names == ["exclusive.skipped"]
    assert run.event("exclusive.skipped") == {}  # held by a lock: no task to name


def test_a_call_that_waited_in_line_shows_its_wait_and_its_time_in_line(traced):
    backend = backend_for_url(traced.store)
    with traced.held("waited"):
        call = traced.send("traced.wait", "waited", 0)
        assert wait_until(lambda: marks.line_of(backend, "exclusive:waited"), timeout=30)
    assert call.get(timeout=30) == "waited"

    run = call_tree(traced.spans, call.id)
    assert run.shape() == (
        "run/traced.wait",
        (("exclusive.acquire", (("exclusive.wait", ()),)),),
    )
    acquire = run.child("exclusive.acquire")
    wait = acquire.child("exclusive.wait")
    assert acquire.attributes["exclusive.outcome"] == "granted"
    assert isinstance(acquire.attributes["exclusive.fencing_token"], int)
    assert wait.attributes["exclusive.granted"] is True
    waited = (wait.end - wait.start) / 1e9
    assert acquire.attributes["exclusive.time_in_line"] == pytest.approx(waited, abs=0.01)
    assert run.event_names == ["exclusive.lease.released"]
    released = run.event("exclusive.lease.released")
    assert released["exclusive.freed"] is True and released["exclusive.late"] is False


def test_a_coalesced_call_names_the_run_it_joined(traced):
    with traced.held("coalesced"):
        pending = traced.send("traced.rerun", "coalesced", 0)
        # Its time in line ran out: it went back to the queue as the pending rerun.
        wait_for_span(traced.spans, acquire_of(pending.id, "requeue"))
        joined = traced.send("traced.rerun", "coalesced", 0)
        joined.get(timeout=30, propagate=False)
    assert pending.get(timeout=60) == "coalesced"

    run = call_tree(traced.spans, joined.id)
    assert run.shape() == ("run/traced.rerun", (("exclusive.acquire", ()),))
    assert run.child("exclusive.acquire").attributes["exclusive.outcome"] == "coalesced"
    assert run.event_names == ["exclusive.coalesced"]
    assert run.event("exclusive.coalesced")["exclusive.rerun_task_id"] == pending.id

    # Its first attempt: in line, then sent again; the attempt that ran is in its trace.
    # Its run span ends after its result is stored: read the trace once it is written.
    ran, _ = wait_for_span(traced.spans, acquire_of(pending.id, "granted"))
    wait_for_span(traced.spans, lambda span: span.span_id == ran.parent_id)
    requeued = call_tree(traced.spans, pending.id)
    first, sent_again = requeued.shape()[1][:2]
    assert first == ("exclusive.acquire", (("exclusive.wait", ()),))
    assert sent_again[0] == "apply_async/traced.rerun"
    assert sent_again[1][0][0] == "run/traced.rerun"
    event = requeued.event("exclusive.requeued")
    assert event["exclusive.cause"] == "held" and event["exclusive.countdown"] > 0
    if os.environ.get("TRACE_PICTURE") and traced.pool == "prefork":
        trace_picture.draw(requeued, Path(os.environ["TRACE_PICTURE"]))


def test_a_lost_lease_is_an_event_with_its_cause_before_the_release(traced):
    backend = backend_for_url(traced.store)
    call = traced.send("traced.lose", "lost", 8)
    assert wait_until(lambda: backend.holders_of("exclusive:lost"), timeout=30)
    backend.force_release("exclusive:lost")
    call.get(timeout=60, propagate=False)
    assert type(call.result).__name__ == "LeaseLost"

    run = call_tree(traced.spans, call.id)
    assert run.shape() == ("run/traced.lose", (("exclusive.acquire", ()),))
    assert run.event_names == ["exclusive.lease.lost", "exclusive.lease.released"]
    lost = run.event("exclusive.lease.lost")
    assert lost["exclusive.cause"] in LOSS_ADVICE and lost["exclusive.reason"]
    assert run.event("exclusive.lease.released")["exclusive.freed"] is False
    assert run.status == "ERROR"  # the task failed with LeaseLost
