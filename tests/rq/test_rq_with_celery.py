"""Celery and RQ share keys on one lease store: a real ``celery worker`` and a real
``rq worker`` running the same keys exclude each other when the RQ worker's
``EXCLUSIVE_BACKEND_URL`` is Celery's ``exclusive_backend_url``.

Their defaults differ (Celery: the broker's Redis; RQ: the queue's Redis), so here the
RQ queue lives in a database of its own, as it would beside another app's broker.
"""

from __future__ import annotations

import uuid

import pytest
import redis
from rq import Queue

from tests.conftest import fresh_redis_db
from tests.support.apps import ledger as ledger_app
from tests.support.apps import rq_jobs
from tests.support.cluster import Stack, wait_until
from tests.support.workers import RQWorker, overlaps, read_ledger


@pytest.fixture
def celery_stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    with stack.running(stack.worker("celery", concurrency=2)):
        yield stack


def test_a_celery_worker_and_an_rq_worker_exclude_each_other_on_one_store(
    celery_stack, redis_server
):
    queue_url = fresh_redis_db(redis_server)
    queue = Queue(uuid.uuid4().hex[:8], connection=redis.Redis.from_url(queue_url))
    env = {
        "EXCLUSIVE_BACKEND_URL": celery_stack.store,  # the one setting that makes them agree
        "EXCLUSIVE_TEST_LEDGER": celery_stack.ledger_url,
        "EXCLUSIVE_LEASE_TTL": str(celery_stack.ttl),
        "EXCLUSIVE_REQUEUE_MAX_DELAY": "1",
    }
    worker = RQWorker(queue_url, queue.name, "beside-celery", env=env).start()
    try:
        keys = ("invoice:1", "invoice:2") * 6
        jobs = [queue.enqueue(rq_jobs.hold_requeue, key, 0.1) for key in keys]
        results = [ledger_app.hold_requeue.delay(key, 0.1) for key in keys]
        assert all(r.get(timeout=60) for r in results)
        done = wait_until(
            lambda: all(j.get_status(refresh=True) == "finished" for j in jobs), timeout=60
        )
        assert done, [j.get_status(refresh=True) for j in jobs]
    finally:
        worker.stop()
    entries = read_ledger(celery_stack.ledger)
    assert len(entries) == 24
    assert sum("job_id" in e for e in entries) == 12  # RQ's runs beside Celery's
    assert overlaps(entries) == []
