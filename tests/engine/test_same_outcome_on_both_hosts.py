"""One decision, two hosts: the same duplicate scenario ends the same way on a real
``celery worker`` and a real ``rq worker``.

Each scenario holds a key from this process (a lock on the store both workers use),
sends duplicates to each host in turn, and tells its story in the words both share:
which calls ran, were skipped, coalesced or gave up, how often each was requeued, and
whether any ran while the key was held. The two stories must be equal.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
from rq import Queue

from celery_exclusive import DuplicateCoalesced, DuplicateSkipped, backend_for_url
from celery_exclusive.core import marks
from celery_exclusive.core.lock import ExclusiveLock
from tests.conftest import fresh_redis_db
from tests.support.apps import ledger as ledger_app
from tests.support.apps import rq_jobs
from tests.support.cluster import Stack, wait_until
from tests.support.workers import RQWorker

DONE = ("finished", "failed", "canceled", "stopped")


class CeleryHost:
    name = "celery"

    def __init__(self, stack: Stack):
        self.stack = stack

    def send(self, function: str, *args):
        return getattr(ledger_app, function).delay(*args)

    def done(self, call) -> bool:
        return call.ready()

    def outcome(self, call, timeout: float = 60) -> tuple[str, object]:
        """What happened to ``call``, and what it returned if it ran."""
        call.get(timeout=timeout, propagate=False)
        if call.successful():
            return "ran", call.result
        error = call.result
        if isinstance(error, DuplicateCoalesced):
            return "coalesced", None
        if isinstance(error, DuplicateSkipped):
            return ("gave up" if "gave up after" in str(error) else "skipped"), None
        return f"failed: {error!r}", None


class RQHost:
    name = "rq"

    def __init__(self, queue: Queue):
        self.queue = queue

    def send(self, function: str, *args):
        return self.queue.enqueue(getattr(rq_jobs, function), *args)

    def done(self, job) -> bool:
        return job.get_status(refresh=True) in DONE

    def outcome(self, job, timeout: float = 60) -> tuple[str, object]:
        assert wait_until(lambda: self.done(job), timeout), job.get_status(refresh=True)
        status = job.get_status(refresh=True)
        if status == "finished":
            return "ran", job.return_value()
        record = job.get_meta(refresh=True).get(rq_jobs.META_KEY) or {}
        if status == "canceled" and record.get("outcome") == "coalesced":
            return "coalesced", None
        if status == "canceled" and record.get("outcome") == "skipped":
            gave_up = str(record.get("reason", "")).startswith("gave up after")
            return ("gave up" if gave_up else "skipped"), None
        return f"{status}: {record}", None


@pytest.fixture(scope="module")
def hosts(redis_server, client_dbs, tmp_path_factory):
    """A celery worker (-c 2) and two rq workers on one lease store and one ledger."""
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    queue_url = fresh_redis_db(redis_server)
    queue = Queue(uuid.uuid4().hex[:8], connection=redis.Redis.from_url(queue_url))
    env = {
        "EXCLUSIVE_BACKEND_URL": stack.store,
        "EXCLUSIVE_TEST_LEDGER": stack.ledger_url,
        "EXCLUSIVE_LEASE_TTL": str(stack.ttl),
        "EXCLUSIVE_REQUEUE_MAX_DELAY": "1",
        "EXCLUSIVE_WAIT_TIMEOUT": "30",
    }
    rq_workers = [RQWorker(queue_url, queue.name, f"same-{n}", env=env) for n in (1, 2)]
    with stack.running(stack.worker("celery", concurrency=2)):
        for worker in rq_workers:
            worker.start()
        try:
            yield stack, CeleryHost(stack), RQHost(queue)
        finally:
            for worker in rq_workers:
                worker.stop()


def held(stack: Stack, key: str) -> ExclusiveLock:
    """The key, held from this process while the duplicates arrive."""
    return ExclusiveLock("exclusive:" + key, stack.store, stack.ttl, name="test holder")


def runs_of(stack: Stack, key: str) -> list[dict]:
    entries = [json.loads(raw) for raw in stack.ledger.lrange("ledger", 0, -1)]
    return [entry for entry in entries if entry["key"] == key]


def both(hosts, scenario) -> None:
    """Play ``scenario`` on each host with a key of its own; their stories must match."""
    stack, *each = hosts
    stories = {
        host.name: scenario(stack, host, f"{host.name}-{uuid.uuid4().hex[:8]}") for host in each
    }
    assert stories["celery"] == stories["rq"], stories


def test_skip_ends_the_duplicate_unrun_on_both_hosts(hosts):
    def scenario(stack, host, key):
        with held(stack, key):
            call = host.send("hold_skip", key)
            outcome, _ = host.outcome(call)
        return {"outcome": outcome, "runs": len(runs_of(stack, key))}

    both(hosts, scenario)


def test_requeue_runs_the_duplicate_once_after_the_holder_on_both_hosts(hosts):
    def scenario(stack, host, key):
        with held(stack, key):
            call = host.send("hold_requeue", key)
            time.sleep(2.5)  # long enough to be requeued at least once
            done_while_held = host.done(call)
            released = time.time()  # the release starts now: a waiter may start at once
        outcome, _ = host.outcome(call)
        runs = runs_of(stack, key)
        return {
            "done while held": done_while_held,
            "outcome": outcome,
            "runs": len(runs),
            "ran after the release": all(run["start"] >= released for run in runs),
            "requeued": all(run["requeues"] >= 1 for run in runs),
        }

    both(hosts, scenario)


def test_wait_runs_the_duplicate_once_the_key_is_free_without_a_requeue_on_both_hosts(hosts):
    def scenario(stack, host, key):
        with held(stack, key):
            call = host.send("hold_wait", key)
            time.sleep(1.5)
            done_while_held = host.done(call)
            released = time.time()  # the release starts now: a waiter may start at once
        outcome, _ = host.outcome(call)
        runs = runs_of(stack, key)
        return {
            "done while held": done_while_held,
            "outcome": outcome,
            "runs": len(runs),
            "ran after the release": all(run["start"] >= released for run in runs),
            "requeues": [run["requeues"] for run in runs],
        }

    both(hosts, scenario)


def test_rerun_coalesces_duplicates_into_one_run_with_the_latest_arguments_on_both_hosts(hosts):
    def scenario(stack, host, key):
        store = backend_for_url(stack.store)
        with held(stack, key):
            first = host.send("webhook", key, 1)
            assert wait_until(lambda: marks.pending_rerun(store, "exclusive:" + key), 30)
            later = [host.send("webhook", key, version) for version in (2, 3)]
            assert wait_until(lambda: all(host.done(call) for call in later), 60)
        outcomes = [host.outcome(call) for call in (first, *later)]
        return {
            "outcomes": sorted(outcome for outcome, _ in outcomes),
            "ran with version": [value["version"] for outcome, value in outcomes if value],
            "runs": len(runs_of(stack, key)),
        }

    both(hosts, scenario)


def test_a_duplicate_gives_up_after_requeue_max_retries_on_both_hosts(hosts):
    def scenario(stack, host, key):
        with held(stack, key):
            call = host.send("hold_give_up", key)
            outcome, _ = host.outcome(call, timeout=60)
        return {"outcome": outcome, "runs": len(runs_of(stack, key))}

    both(hosts, scenario)
