"""ExclusiveJob on real ``rq worker`` processes: two workers with schedulers, one queue.

Each run appends (key, fencing token, start, end) to a ledger in Redis; overlap is
checked from the ledger, outside the workers. Leases live in the queue's own Redis
database (the default), with the lease settings given as ``EXCLUSIVE_<NAME>``
environment variables of the workers.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import uuid

import pytest
import redis
from rq import Queue
from rq.job import Job

from celery_exclusive import ConfigurationError, ExclusiveKeyError, backend_for_url
from celery_exclusive.rq import exclusive
from tests.apps import rq_jobs
from tests.cluster import wait_until
from tests.conftest import fresh_redis_db
from tests.workers import LoggedProcess, overlaps, read_ledger

TTL = 2.0
DONE = ("finished", "failed")


class RQWorker(LoggedProcess):
    """One ``rq worker`` subprocess using ExclusiveJob, its log in a file."""

    ready_text = "Listening on"

    def __init__(self, url: str, queue: str, name: str, scheduler: bool = True, env=None):
        args = [
            sys.executable,
            "-m",
            "rq.cli",
            "worker",
            "--url",
            url,
            "--job-class",
            "celery_exclusive.rq.ExclusiveJob",
            "--name",
            f"{name}-{uuid.uuid4().hex[:8]}",
            "--logging_level",
            "INFO",
            *(["--with-scheduler"] if scheduler else []),
            queue,
        ]
        super().__init__(args, env or {}, f"rq-{name}")

    def wait_ready(self, timeout: float = 30) -> RQWorker:
        self.wait_for_log(self.ready_text, timeout)
        return self

    def stop(self) -> int:
        # The whole group: a work horse still running a long job goes too.
        return super().stop(signal.SIGTERM, timeout=15, group=True)


class Stack:
    """A queue, its Redis database (which also holds leases and the ledger) and workers."""

    def __init__(self, url: str):
        self.url = url
        self.client = redis.Redis.from_url(url)
        self.queue = Queue(f"exclusive-{uuid.uuid4().hex[:8]}", connection=self.client)
        self.env = {
            "EXCLUSIVE_TEST_LEDGER": url,
            "EXCLUSIVE_LEASE_TTL": str(TTL),
            "EXCLUSIVE_REQUEUE_MAX_DELAY": "1",
        }

    def worker(self, name: str, queue: str | None = None, scheduler: bool = True) -> RQWorker:
        return RQWorker(self.url, queue or self.queue.name, name, scheduler, self.env)

    def enqueue(self, function, *args, queue: Queue | None = None, **options) -> Job:
        return (queue or self.queue).enqueue(function, *args, **options)

    def holders(self, key: str):
        return backend_for_url(self.url).holders_of("exclusive:" + key)

    def ledger(self) -> list[dict]:
        return read_ledger(self.client)

    def scheduler_running(self) -> bool:
        return bool(self.client.exists(f"rq:scheduler-lock:{self.queue.name}"))


@pytest.fixture(scope="module")
def stack(redis_server):
    stack = Stack(fresh_redis_db(redis_server))
    stack.workers = [stack.worker("w1").start(), stack.worker("w2").start()]
    for worker in stack.workers:
        worker.wait_ready()
    assert wait_until(stack.scheduler_running, timeout=15), "no scheduler started"
    yield stack
    for worker in stack.workers:
        worker.stop()


@pytest.fixture
def rq_stack(stack):
    stack.client.delete("ledger")
    return stack


def status(job: Job) -> str:
    return str(getattr(job.get_status(refresh=True), "value", job.get_status()))


def wait_done(jobs: list[Job], timeout: float) -> list[str]:
    """Wait for every job to finish or fail; return their statuses."""
    assert wait_until(lambda: all(status(j) in DONE for j in jobs), timeout), [
        status(j) for j in jobs
    ]
    return [status(j) for j in jobs]


def meta(job: Job) -> dict:
    job.refresh()
    return job.meta.get("exclusive", {})


def error_of(job: Job) -> str:
    result = job.latest_result()
    return result.exc_string if result is not None else ""


def start_holding(stack: Stack, function, key: str, duration: float) -> Job:
    """Enqueue a long job and return once a work horse holds its lease."""
    job = stack.enqueue(function, key, duration)
    assert wait_until(lambda: stack.holders(key), timeout=15), "holder never started"
    return job


# --- exclusion ------------------------------------------------------------------


def test_two_workers_never_overlap_runs_of_one_key(rq_stack):
    keys = [f"key-{i}" for i in range(5)]
    rng = random.Random(7)
    jobs = [rq_stack.enqueue(rq_jobs.hold_requeue, rng.choice(keys), 0.02) for _ in range(100)]
    statuses = wait_done(jobs, timeout=60)
    entries = rq_stack.ledger()
    assert statuses == ["finished"] * 100
    assert len(entries) == 100
    assert overlaps(entries) == []
    assert {meta(job)["outcome"] for job in jobs} == {"ran"}
    assert any(meta(job)["requeues"] for job in jobs), "no contention: the test proved nothing"
    assert len({job.worker_name for job in jobs}) == 2, "work was not spread across workers"


def test_fencing_tokens_increase_with_each_run_of_a_key(rq_stack):
    for _ in range(3):
        wait_done([rq_stack.enqueue(rq_jobs.hold_skip, "fenced", 0)], timeout=10)
    tokens = [e["token"] for e in rq_stack.ledger()]
    assert tokens == sorted(set(tokens)) and len(tokens) == 3


# --- duplicates -------------------------------------------------------------------


def test_a_skipped_duplicate_finishes_with_meta_naming_the_key_and_the_holder(rq_stack):
    holder = start_holding(rq_stack, rq_jobs.hold_skip, "busy-skip", 1.0)
    duplicate = rq_stack.enqueue(rq_jobs.hold_skip, "busy-skip", 0)
    assert wait_done([duplicate], timeout=10) == ["finished"]
    record = {"outcome": "skipped", "key": "exclusive:busy-skip", "holder": holder.id}
    assert record.items() <= meta(duplicate).items()
    assert duplicate.return_value() == meta(duplicate)
    assert wait_done([holder], timeout=10) == ["finished"]
    assert [e["job_id"] for e in rq_stack.ledger()] == [holder.id]


def test_requeued_duplicates_all_run_after_the_holder(rq_stack):
    holder = start_holding(rq_stack, rq_jobs.hold_requeue, "busy-requeue", 1.0)
    duplicates = [rq_stack.enqueue(rq_jobs.hold_requeue, "busy-requeue", 0) for _ in range(4)]
    assert wait_done([holder, *duplicates], timeout=30) == ["finished"] * 5
    entries = {e["job_id"]: e for e in rq_stack.ledger()}
    assert overlaps(list(entries.values())) == []
    for job in duplicates:
        assert entries[job.id]["start"] >= entries[holder.id]["end"]
        assert entries[job.id]["requeues"] >= 1
        assert meta(job)["outcome"] == "ran"


def test_wait_is_woken_by_the_release_not_by_its_timeout(rq_stack):
    holder = start_holding(rq_stack, rq_jobs.hold_wait, "busy-wait", 1.0)
    duplicate = rq_stack.enqueue(rq_jobs.hold_wait, "busy-wait", 0)
    assert wait_done([holder, duplicate], timeout=20) == ["finished"] * 2
    first, second = holder.return_value(), duplicate.return_value()
    assert second["start"] >= first["end"]
    assert second["requeues"] == 0, "the duplicate should have waited, not been requeued"
    # wait_timeout is 30 s: starting this soon means the release woke it.
    assert second["start"] - first["end"] < 1


def test_requeue_without_a_scheduler_fails_saying_how_to_start_one(rq_stack):
    queue = Queue(f"{rq_stack.queue.name}-unscheduled", connection=rq_stack.client)
    worker = rq_stack.worker("bare", queue=queue.name, scheduler=False).start()
    try:
        worker.wait_ready()
        holder = start_holding(rq_stack, rq_jobs.hold_requeue, "busy-bare", 3.0)
        duplicate = rq_stack.enqueue(rq_jobs.hold_requeue, "busy-bare", 0, queue=queue)
        assert wait_done([duplicate], timeout=15) == ["failed"]
    finally:
        worker.stop()
    error = error_of(duplicate)
    assert "ConfigurationError" in error
    assert "--with-scheduler" in error
    assert duplicate.id in error and "exclusive:busy-bare" in error
    wait_done([holder], timeout=10)


# --- lease lifetime ---------------------------------------------------------------


def test_a_job_running_longer_than_the_ttl_keeps_its_lease(rq_stack):
    holder = start_holding(rq_stack, rq_jobs.hold_skip, "long", TTL * 2.5)
    time.sleep(TTL * 2)
    duplicate = rq_stack.enqueue(rq_jobs.hold_skip, "long", 0)
    assert wait_done([duplicate, holder], timeout=15) == ["finished"] * 2
    assert meta(duplicate)["outcome"] == "skipped"
    assert holder.return_value()["lost"] is False


def test_a_sigkilled_work_horse_leaves_a_lease_that_expires_within_the_ttl(rq_stack):
    job = start_holding(rq_stack, rq_jobs.hold_skip, "killed", 30)
    [info] = rq_stack.holders("killed")
    assert info.task_id == job.id
    os.kill(info.holder["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    assert wait_until(lambda: not rq_stack.holders("killed"), timeout=TTL * 2)
    # Renewed at most one heartbeat (ttl / 3) before the kill: gone within the ttl.
    assert time.monotonic() - killed_at <= TTL + 0.3
    assert wait_done([job], timeout=15) == ["failed"]
    assert wait_done([rq_stack.enqueue(rq_jobs.hold_skip, "killed", 0)], 10) == ["finished"]


# --- release on every exit ----------------------------------------------------------


def test_the_lease_is_released_when_the_job_times_out(rq_stack):
    job = rq_stack.enqueue(rq_jobs.hold_skip, "overrun", 10, job_timeout=1)
    assert wait_done([job], timeout=15) == ["failed"]
    assert "JobTimeoutException" in error_of(job)
    assert rq_stack.holders("overrun") == []


def test_the_lease_is_released_when_the_job_raises(rq_stack):
    job = rq_stack.enqueue(rq_jobs.hold_skip, "raising", "not a number")
    assert wait_done([job], timeout=10) == ["failed"]
    assert "TypeError" in error_of(job)
    assert rq_stack.holders("raising") == []


# --- unmarked jobs and mistakes ---------------------------------------------------------


def test_unmarked_jobs_run_untouched_and_may_overlap(rq_stack):
    jobs = [rq_stack.enqueue(rq_jobs.plain, "shared", 1.0) for _ in range(2)]
    assert wait_done(jobs, timeout=15) == ["finished"] * 2
    entries = rq_stack.ledger()
    assert [e["token"] for e in entries] == [None, None]
    assert len(overlaps(entries)) == 1, "two workers should have run them side by side"
    assert all("exclusive" not in meta(job) for job in jobs)
    assert rq_stack.holders("shared") == []


def test_a_key_naming_no_argument_is_refused_when_the_function_is_decorated():
    def settle(invoice_id):
        pass

    with pytest.raises(ExclusiveKeyError) as info:
        exclusive(key="invoice:{invoice}")(settle)
    assert info.value.argument == "invoice"
    assert "settle" in str(info.value)


def test_a_call_whose_key_cannot_be_built_fails_naming_the_job_and_argument(rq_stack):
    job = rq_stack.enqueue(rq_jobs.hold_skip)
    assert wait_done([job], timeout=10) == ["failed"]
    error = error_of(job)
    assert "ExclusiveKeyError" in error
    assert job.id in error and "tests.apps.rq_jobs.hold_skip" in error and "'key'" in error


def test_duplicates_during_one_run_coalesce_into_one_follow_up_with_the_latest_arguments(
    rq_stack,
):
    # A third worker: one runs the holder, one waits as the pending rerun, one takes the
    # other duplicates as they arrive.
    extra = rq_stack.worker("w3").start()
    try:
        holder = rq_stack.enqueue(rq_jobs.webhook, "calendar", 0, 2.0)
        assert wait_until(lambda: holder.get_status(refresh=True) == "started", timeout=10)
        duplicates = [rq_stack.enqueue(rq_jobs.webhook, "calendar", v) for v in range(1, 11)]
        assert wait_done([holder, *duplicates], timeout=40) == ["finished"] * 11
    finally:
        extra.stop()
    outcomes = [d.return_value() for d in duplicates]
    ran = [o for o in outcomes if "version" in o]
    coalesced = [o for o in outcomes if o.get("outcome") == "coalesced"]
    assert len(ran) == 1 and len(coalesced) == 9
    pending = duplicates[outcomes.index(ran[0])]
    assert {c["rerun"] for c in coalesced} == {pending.id}
    assert ran[0]["start"] >= holder.return_value()["end"]
    assert ran[0]["version"] in range(1, 11)  # a duplicate's change, seen by the follow-up


def test_a_bad_setting_is_refused_when_the_function_is_decorated():
    with pytest.raises(ConfigurationError, match="on_duplicate='sometimes'"):
        exclusive(on_duplicate="sometimes")(rq_jobs.plain)


# --- lease store down ---------------------------------------------------------------


def test_store_down_with_on_backend_error_run_runs_without_a_lease(rq_stack):
    job = rq_stack.enqueue(rq_jobs.unlocked_when_store_down, "unlocked")
    assert wait_done([job], timeout=10) == ["finished"]
    assert meta(job)["outcome"] == "ran_without_lease"
    assert [e["token"] for e in rq_stack.ledger()] == [None]


def test_store_down_requeues_by_default_and_never_runs_unlocked(rq_stack):
    job = rq_stack.enqueue(rq_jobs.requeued_when_store_down, "unreachable")
    try:
        assert wait_until(lambda: meta(job).get("outcome") == "requeued", timeout=10)
        assert wait_until(lambda: status(job) == "scheduled", timeout=5)
        assert "did not answer" in meta(job)["reason"]
    finally:
        job.delete()
    assert rq_stack.ledger() == []
