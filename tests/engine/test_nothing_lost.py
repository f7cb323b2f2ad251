"""Nothing lost: a body stopped because its lease was lost runs again, under a fresh
lease, on a real ``celery worker`` and a real ``rq worker`` alike.

The lease store is a Redis server of this module's own, without persistence: stopped
and started again, it forgets every lease, as a production store restarted without
AOF or RDB does. Each holder finds its lease gone at its next renewal, is stopped, and
is sent again (``requeue_lost``, on by default). The ledger of every run, completed or
stopped, shows that each call completed exactly once and that no two runs of a key
overlapped.

Duplicates coalesced into a pending rerun are owed its run: when the pending call dies
(its process killed, its job stopped), a new call runs it in its place.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
from rq import Queue
from rq.command import send_stop_job_command

from celery_exclusive import DuplicateCoalesced, backend_for_url
from celery_exclusive.core import marks
from celery_exclusive.core.lock import ExclusiveLock
from tests.conftest import fresh_redis_db
from tests.support.apps import ledger as ledger_app
from tests.support.apps import rq_jobs
from tests.support.cluster import Stack, wait_until
from tests.support.servers import RedisServer
from tests.support.workers import RQWorker

HOLDERS = 4
#: Long enough that each holder renews several times before and after the restart.
DURATION = 6.0


@pytest.fixture(scope="module")
def store_server():
    server = RedisServer(appendonly=False)
    server.start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, store_server, tmp_path_factory):
    return Stack(redis_server, *client_dbs, store_server.url, tmp_path_factory)


@pytest.fixture
def store(store_server, stack):
    if store_server.process is None:
        store_server.start()
    stack.reset()
    return store_server


def restart_when_all_hold(stack: Stack, store_server: RedisServer, keys: list[str]) -> None:
    """Once every key has its holder, restart the store empty."""
    assert wait_until(lambda: all(stack.holders(key) for key in keys), timeout=30)
    time.sleep(1.0)  # a renewal or two into the runs
    store_server.stop()
    store_server.start()


def runs(stack: Stack) -> list[dict]:
    return [json.loads(raw) for raw in stack.ledger.lrange("ledger", 0, -1)]


def assert_each_call_completed_once(entries: list[dict], calls: list[str], field: str) -> None:
    for call in calls:
        mine = sorted((e for e in entries if e[field] == call), key=lambda e: e["start"])
        assert [e["completed"] for e in mine][-1:] == [True], mine
        assert sum(e["completed"] for e in mine) == 1, mine
        assert not mine[0]["completed"], f"{call} was never stopped: the store kept its lease"
    by_key: dict[str, list[dict]] = {}
    for entry in entries:
        by_key.setdefault(entry["key"], []).append(entry)
    for key, of_key in by_key.items():
        of_key.sort(key=lambda e: e["start"])
        for earlier, later in zip(of_key, of_key[1:]):
            assert later["start"] >= earlier["end"], f"two runs of {key} overlapped"


def test_celery_calls_stopped_by_a_store_that_forgot_their_leases_run_again_once(stack, store):
    with stack.running(stack.worker("celery", concurrency=HOLDERS)):
        keys = [f"celery-{uuid.uuid4().hex[:6]}" for _ in range(HOLDERS)]
        results = [ledger_app.hold_in_steps.delay(key, DURATION) for key in keys]
        restart_when_all_hold(stack, store, keys)
        for result in results:
            result.get(timeout=60)
    assert_each_call_completed_once(runs(stack), [r.id for r in results], "task_id")


def test_rq_jobs_stopped_by_a_store_that_forgot_their_leases_run_again_once(
    redis_server, stack, store
):
    queue_url = fresh_redis_db(redis_server)
    queue = Queue(uuid.uuid4().hex[:8], connection=redis.Redis.from_url(queue_url))
    env = {
        "EXCLUSIVE_BACKEND_URL": stack.store,
        "EXCLUSIVE_TEST_LEDGER": stack.ledger_url,
        "EXCLUSIVE_LEASE_TTL": str(stack.ttl),
        "EXCLUSIVE_REQUEUE_MAX_DELAY": "1",
    }
    workers = [RQWorker(queue_url, queue.name, f"lost-{n}", env=env) for n in range(HOLDERS)]
    for worker in workers:
        worker.start()
    try:
        keys = [f"rq-{uuid.uuid4().hex[:6]}" for _ in range(HOLDERS)]
        jobs = [queue.enqueue(rq_jobs.hold_in_steps, key, DURATION) for key in keys]
        restart_when_all_hold(stack, store, keys)
        finished = lambda: all(j.get_status(refresh=True) == "finished" for j in jobs)  # noqa: E731
        assert wait_until(finished, timeout=60), [j.get_status(refresh=True) for j in jobs]
    finally:
        for worker in workers:
            worker.stop()
    assert_each_call_completed_once(runs(stack), [j.id for j in jobs], "job_id")


def coalesce_then_kill(stack: Stack, host, key: str, kill) -> list[dict]:
    """Hold ``key``; send ``webhook`` v1 (the pending rerun) and v2, v3 (coalesced into
    it); ``kill`` the pending call; release. Return the runs of ``key``."""
    store = backend_for_url(stack.store)
    with ExclusiveLock("exclusive:" + key, stack.store, stack.ttl, name="test holder"):
        first = host.send(key, 1)
        assert wait_until(lambda: marks.pending_rerun(store, "exclusive:" + key) == first.id, 30)
        later = [host.send(key, version) for version in (2, 3)]
        assert wait_until(lambda: all(host.coalesced(call) for call in later), 60)
        kill(first)
        # The pending rerun is handed on to a new call, which waits in the key's line.
        assert wait_until(
            lambda: marks.pending_rerun(store, "exclusive:" + key) not in (None, first.id), 30
        ), marks.pending_rerun(store, "exclusive:" + key)
    assert wait_until(lambda: [run for run in runs(stack) if run["key"] == key], 30)
    time.sleep(1.0)  # a second run, if any, would show by now
    return [run for run in runs(stack) if run["key"] == key]


class CeleryWebhooks:
    def send(self, key: str, version: int):
        return ledger_app.webhook.delay(key, version)

    def coalesced(self, call) -> bool:
        return call.ready() and isinstance(call.result, DuplicateCoalesced)


class RQWebhooks:
    def __init__(self, queue: Queue):
        self.queue = queue

    def send(self, key: str, version: int):
        return self.queue.enqueue(rq_jobs.webhook, key, version)

    def coalesced(self, job) -> bool:
        record = job.get_meta(refresh=True).get(rq_jobs.META_KEY) or {}
        return job.get_status(refresh=True) == "canceled" and record.get("outcome") == "coalesced"


def test_celery_duplicates_coalesced_into_a_pending_rerun_that_is_killed_still_get_their_run(
    stack, store
):
    with stack.running(stack.worker("celery", concurrency=2)):
        key = f"celery-{uuid.uuid4().hex[:6]}"

        def kill(first):
            ledger_app.app.control.revoke(first.id, terminate=True, signal="SIGKILL")

        ran = coalesce_then_kill(stack, CeleryWebhooks(), key, kill)
    versions = [json.loads(raw) for raw in stack.ledger.lrange("versions", 0, -1)]
    assert len(ran) == 1, ran
    assert [v["version"] for v in versions if v["task_id"] == ran[0]["task_id"]] == [3]


def test_rq_duplicates_coalesced_into_a_pending_rerun_whose_job_is_stopped_still_get_their_run(
    redis_server, stack, store
):
    queue_url = fresh_redis_db(redis_server)
    client = redis.Redis.from_url(queue_url)
    queue = Queue(uuid.uuid4().hex[:8], connection=client)
    env = {
        "EXCLUSIVE_BACKEND_URL": stack.store,
        "EXCLUSIVE_TEST_LEDGER": stack.ledger_url,
        "EXCLUSIVE_LEASE_TTL": str(stack.ttl),
        "EXCLUSIVE_WAIT_TIMEOUT": "30",
    }
    workers = [RQWorker(queue_url, queue.name, f"rerun-{n}", env=env) for n in (1, 2)]
    for worker in workers:
        worker.start()
    try:
        key = f"rq-{uuid.uuid4().hex[:6]}"
        ran = coalesce_then_kill(
            stack, RQWebhooks(queue), key, lambda first: send_stop_job_command(client, first.id)
        )
    finally:
        for worker in workers:
            worker.stop()
    assert len(ran) == 1, ran
    [job_id] = [run["job_id"] for run in ran]
    assert queue.fetch_job(job_id).return_value()["version"] == 3
