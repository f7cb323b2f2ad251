"""Traces on a real ``rq worker``: no instrumentation gives an RQ job a span, so each
call of an ``@exclusive`` job gets the library's own ``exclusive.call``, with its lease
steps beneath it and its events on it, as a Celery task's are in ``run/<task>``.

The key's other holder is a lock this test process holds; the work horse's spans reach
the test through a file (tests/support/apps/traced.py).
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from rq import Queue

from celery_exclusive import ExclusiveLock, backend_for_url
from celery_exclusive.core import marks
from celery_exclusive.errors import LOSS_ADVICE
from celery_exclusive.telemetry import shown_key
from tests.conftest import fresh_redis_db
from tests.support.cluster import wait_until
from tests.support.spans import acquire_of, call_tree, wait_for_span
from tests.support.workers import RQWorker

JOBS = "tests.support.apps.traced"
DONE = ("finished", "failed", "canceled", "stopped")


class Traced:
    def __init__(self, queue: Queue, store: str, spans) -> None:
        self.queue = queue
        self.store = store
        self.spans = spans

    def held(self, key: str) -> ExclusiveLock:
        return ExclusiveLock(f"exclusive:{key}", self.store, ttl=2)

    def enqueue(self, job: str, *args):
        return self.queue.enqueue(f"{JOBS}.{job}", *args)

    def finished(self, job, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while (status := job.get_status(refresh=True)) not in DONE:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        return status


@pytest.fixture(scope="module")
def traced(redis_server, tmp_path_factory):
    url = fresh_redis_db(redis_server)
    folder = tmp_path_factory.mktemp("traced-rq")
    store, spans = f"sqlite:///{folder}/leases.db", folder / "spans.jsonl"
    queue = Queue(f"traced-{uuid.uuid4().hex[:8]}", connection=redis.Redis.from_url(url))
    env = {
        "EXCLUSIVE_TEST_STORE": store,
        "EXCLUSIVE_TEST_SPANS": str(spans),
        "EXCLUSIVE_TEST_RQ": "1",
        "EXCLUSIVE_TERMINATE_GRACE": "1",
    }
    worker = RQWorker(url, queue.name, "traced", env=env)
    with worker:
        yield Traced(queue, store, spans)


def test_a_skipped_job_shows_its_acquire_span_inside_a_span_of_its_own(traced):
    with traced.held("skipped"):
        job = traced.enqueue("skip_job", "skipped", 0)
        assert traced.finished(job) == "canceled"

    call = call_tree(traced.spans, job.id)
    assert call.shape() == ("exclusive.call", (("exclusive.acquire", ()),))
    assert call.parent_id is None
    acquire = call.child("exclusive.acquire")
    assert acquire.attributes["exclusive.outcome"] == "skipped"
    assert acquire.attributes["exclusive.key"] == shown_key("exclusive:skipped", "", "hash")
    assert call.attributes["exclusive.task"] == f"{JOBS}.skip_job"
    assert call.event_names == ["exclusive.skipped"]


def test_a_job_that_waited_in_line_shows_its_wait(traced):
    backend = backend_for_url(traced.store)
    with traced.held("waited"):
        job = traced.enqueue("wait_job", "waited", 0)
        assert wait_until(lambda: marks.line_of(backend, "exclusive:waited"), timeout=30)
    assert traced.finished(job) == "finished"

    call = call_tree(traced.spans, job.id)
    assert call.shape() == (
        "exclusive.call",
        (("exclusive.acquire", (("exclusive.wait", ()),)),),
    )
    acquire = call.child("exclusive.acquire")
    assert acquire.attributes["exclusive.outcome"] == "granted"
    assert acquire.attributes["exclusive.time_in_line"] > 0
    assert call.event_names == ["exclusive.lease.released"]


def test_a_coalesced_job_names_the_run_it_joined(traced):
    with traced.held("coalesced"):
        pending = traced.enqueue("rerun_job", "coalesced", 0)
        wait_for_span(traced.spans, acquire_of(pending.id, "requeue"))
        joined = traced.enqueue("rerun_job", "coalesced", 0)
        assert traced.finished(joined) == "canceled"
    assert traced.finished(pending, timeout=60) == "finished"

    call = call_tree(traced.spans, joined.id)
    assert call.shape() == ("exclusive.call", (("exclusive.acquire", ()),))
    assert call.child("exclusive.acquire").attributes["exclusive.outcome"] == "coalesced"
    assert call.event("exclusive.coalesced")["exclusive.rerun_task_id"] == pending.id


def test_a_lost_lease_of_a_job_is_an_event_and_an_error(traced):
    backend = backend_for_url(traced.store)
    job = traced.enqueue("lose_job", "lost", 8)
    assert wait_until(lambda: backend.holders_of("exclusive:lost"), timeout=30)
    backend.force_release("exclusive:lost")
    assert traced.finished(job, timeout=60) == "failed"

    call = call_tree(traced.spans, job.id)
    assert call.shape() == ("exclusive.call", (("exclusive.acquire", ()),))
    assert call.event_names[:2] == ["exclusive.lease.lost", "exclusive.lease.released"]
    assert call.event("exclusive.lease.lost")["exclusive.cause"] in LOSS_ADVICE
    assert call.status == "ERROR"
    assert any(event["name"] == "exception" for event in call.events)  # LeaseLost, recorded
