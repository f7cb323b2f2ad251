"""ExclusiveJob on real ``rq worker`` processes: two workers with schedulers, one queue.

Each run appends (key, fencing token, start, end) to a ledger in Redis; overlap is
checked from the ledger, outside the workers. Leases live in the queue's own Redis
database (the default), with the lease settings given as ``EXCLUSIVE_<NAME>``
environment variables of the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import rq
from rq import Callback, Queue, Retry, Worker
from rq.command import send_stop_job_command
from rq.job import Job

from celery_exclusive import ExclusiveKeyError, backend_for_url
from celery_exclusive.core import marks
from celery_exclusive.core.lock import ExclusiveLock
from celery_exclusive.rq import exclusive
from tests.conftest import fresh_redis_db
from tests.support.apps import rq_jobs
from tests.support.cluster import wait_until
from tests.support.servers import running
from tests.support.workers import JOB_CLASS, RQWorker, overlaps, read_ledger

TTL = 2.0
#: Where a job's status ends: RQ's terminal statuses (a job that did not run ends canceled).
DONE = ("finished", "failed", "canceled", "stopped")
RQ_MAJOR = int(rq.__version__.split(".")[0])
SPAWN = ("--worker-class", "rq.worker.SpawnWorker")


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
            "EXCLUSIVE_TERMINATE_GRACE": "1",
        }

    def worker(
        self, name: str, queue: str | None = None, scheduler: bool = True, **options
    ) -> RQWorker:
        return RQWorker(self.url, queue or self.queue.name, name, scheduler, self.env, **options)

    def side_queue(self, name: str) -> Queue:
        """A queue of the stack's database that none of its workers listen on."""
        return Queue(f"{self.queue.name}-{name}", connection=self.client)

    @contextlib.contextmanager
    def side_worker(self, name: str, **options) -> Iterator[tuple[Queue, RQWorker]]:
        """A worker of its own on a queue of its own, ready, and stopped after."""
        queue = self.side_queue(name)
        worker = self.worker(name, queue=queue.name, **options).start()
        try:
            yield queue, worker
        finally:
            worker.stop()

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


def unfinished(stack: Stack) -> list[str]:
    """The ids of the stack queue's jobs still waiting, scheduled or running."""
    queue = stack.queue
    registries = (queue.started_job_registry, queue.scheduled_job_registry)
    return [*queue.get_job_ids(), *(i for r in registries for i in r.get_job_ids())]


@pytest.fixture
def rq_stack(stack):
    """The stack with an empty ledger, given back with no job of its queue left running:
    a run a test set going and did not wait for would write into the next test's ledger."""
    stack.client.delete("ledger", "callbacks")
    yield stack
    assert wait_until(lambda: not unfinished(stack), timeout=30), (
        f"jobs left unfinished by the test: {unfinished(stack)}"
    )


def status(job: Job) -> str:
    return str(getattr(job.get_status(refresh=True), "value", job.get_status()))


def wait_done(jobs: list[Job], timeout: float) -> list[str]:
    """Wait for every job to reach a terminal status; return their statuses."""
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


def hold(stack: Stack, key: str, queue: Queue | None = None) -> Job:
    """Enqueue a job that holds ``key`` until ``tell(stack, key)``; return once its
    work horse holds the lease."""
    job = stack.enqueue(rq_jobs.hold_until_told, key, queue=queue)
    assert wait_until(lambda: stack.holders(key), timeout=20), "holder never started"
    return job


def tell(stack: Stack, key: str) -> None:
    """End the run of ``hold_until_told(key)``."""
    stack.client.rpush(f"go:{key}", "go")


# --- exclusion ------------------------------------------------------------------


def test_two_workers_never_overlap_runs_of_one_key(rq_stack):
    # Bodies long enough next to a work horse's start-up that the two workers' runs of
    # one key meet, however loaded the machine.
    keys = [f"key-{i}" for i in range(3)]
    rng = random.Random(7)
    jobs = [rq_stack.enqueue(rq_jobs.hold_requeue, rng.choice(keys), 0.1) for _ in range(60)]
    statuses = wait_done(jobs, timeout=90)
    entries = rq_stack.ledger()
    assert statuses == ["finished"] * 60
    assert len(entries) == 60
    assert overlaps(entries) == []
    assert {meta(job)["outcome"] for job in jobs} == {"ran"}
    assert any(meta(job)["requeues"] for job in jobs), "no contention: the test proved nothing"
    assert len({job.worker_name for job in jobs}) == 2, "work was not spread across workers"


def test_each_run_takes_exactly_one_lease(rq_stack):
    # One grant per run: the function, once ExclusiveJob took its lease, takes no other.
    for _ in range(3):
        wait_done([rq_stack.enqueue(rq_jobs.hold_skip, "fenced", 0)], timeout=10)
    tokens = [e["token"] for e in rq_stack.ledger()]
    assert len(tokens) == 3 and tokens == sorted(set(tokens))  # rising; Redis: by its clock


# --- duplicates -------------------------------------------------------------------


def test_a_skipped_duplicate_ends_canceled_with_meta_naming_the_key_and_the_holder(rq_stack):
    holder = hold(rq_stack, "busy-skip")
    duplicate = rq_stack.enqueue(rq_jobs.hold_skip, "busy-skip", 0)
    assert wait_done([duplicate], timeout=10) == ["canceled"]
    tell(rq_stack, "busy-skip")
    record = {"outcome": "skipped", "key": "exclusive:busy-skip", "holder": holder.id}
    assert record.items() <= meta(duplicate).items()
    # The status is written as the attempt ends, before the worker stores its result.
    assert wait_until(lambda: duplicate.return_value() is not None, timeout=10)
    assert duplicate.return_value() == meta(duplicate)
    queue = rq_stack.queue
    assert duplicate.id in queue.canceled_job_registry.get_job_ids()
    assert duplicate.id not in queue.failed_job_registry.get_job_ids()
    assert duplicate.id not in queue.finished_job_registry.get_job_ids()
    assert wait_done([holder], timeout=10) == ["finished"]
    assert [e["job_id"] for e in rq_stack.ledger()] == [holder.id]


def test_a_skipped_duplicate_is_logged_as_skipped_in_the_workers_own_output(rq_stack):
    # RQ logs every job that returns as "Job OK": the worker's output must say more.
    holder = hold(rq_stack, "logged-skip")
    duplicate = rq_stack.enqueue(rq_jobs.hold_skip, "logged-skip", 0)
    assert wait_done([duplicate], timeout=10) == ["canceled"]
    tell(rq_stack, "logged-skip")
    said = f"duplicate skipped key=exclusive:logged-skip job_id={duplicate.id} holder={holder.id}"
    output = lambda: "".join(worker.output() for worker in rq_stack.workers)  # noqa: E731
    assert wait_until(lambda: said in output(), timeout=10), output()[-2000:]


def test_a_skipped_duplicate_runs_neither_its_dependents_nor_its_success_callback(rq_stack):
    callback = Callback(rq_jobs.record_success)
    holder = rq_stack.enqueue(rq_jobs.hold_until_told, "chain", on_success=callback)
    assert wait_until(lambda: rq_stack.holders("chain"), timeout=15)
    duplicate = rq_stack.enqueue(rq_jobs.hold_skip, "chain", 0, on_success=callback)
    after_duplicate = rq_stack.enqueue(rq_jobs.plain, "receipt", 0, depends_on=duplicate)
    after_holder = rq_stack.enqueue(rq_jobs.plain, "receipt", 0, depends_on=holder)
    assert wait_done([duplicate], timeout=15) == ["canceled"]
    tell(rq_stack, "chain")
    assert wait_done([holder, after_holder], timeout=15) == ["finished", "finished"]
    time.sleep(1)  # time enough for a dependent that was enqueued to run
    assert status(after_duplicate) == "deferred"
    assert [e["job_id"] for e in rq_stack.ledger()] == [holder.id, after_holder.id]
    assert [c.decode() for c in rq_stack.client.lrange("callbacks", 0, -1)] == [holder.id]


def test_a_job_in_the_window_after_a_run_is_canceled_naming_that_run(rq_stack):
    first = rq_stack.enqueue(rq_jobs.windowed_skip, "rq-window", 0)
    assert wait_done([first], timeout=15) == ["finished"]
    duplicate = rq_stack.enqueue(rq_jobs.windowed_skip, "rq-window", 0)
    assert wait_done([duplicate], timeout=15) == ["canceled"]
    assert meta(duplicate)["holder"] == first.id
    assert wait_until(lambda: not rq_stack.holders("rq-window"), timeout=rq_jobs.WINDOW + 10)
    later = rq_stack.enqueue(rq_jobs.windowed_skip, "rq-window", 0)
    assert wait_done([later], timeout=15) == ["finished"]
    runs = {e["job_id"]: e for e in rq_stack.ledger()}
    assert sorted(runs) == sorted([first.id, later.id])
    assert runs[later.id]["start"] >= runs[first.id]["end"] + rq_jobs.WINDOW - 0.05


def test_requeued_jobs_run_once_each_a_window_apart(rq_stack):
    jobs = [rq_stack.enqueue(rq_jobs.windowed_requeue, "rq-windows", 0.1) for _ in range(3)]
    assert wait_done(jobs, timeout=60) == ["finished"] * 3
    runs = sorted(rq_stack.ledger(), key=lambda e: e["start"])
    assert sorted(e["job_id"] for e in runs) == sorted(job.id for job in jobs)
    gaps = [after["start"] - before["end"] for before, after in zip(runs, runs[1:])]
    assert min(gaps) >= rq_jobs.WINDOW - 0.05, gaps


def test_a_throttled_burst_runs_every_job_no_faster_than_the_rate(rq_stack):
    jobs = [rq_stack.enqueue(rq_jobs.rated_requeue, "rq-rate", 0.05) for _ in range(5)]
    assert wait_done(jobs, timeout=60) == ["finished"] * 5
    starts = sorted(e["start"] for e in rq_stack.ledger())
    assert len(starts) == 5
    for first, third in zip(starts, starts[rq_jobs.RATE_RUNS :]):
        assert third - first >= rq_jobs.RATE_PERIOD - 0.1, starts


def test_a_debounced_burst_runs_once_with_its_last_version_and_cancels_the_rest(rq_stack):
    jobs = []
    for version in range(1, 4):
        jobs.append(rq_stack.enqueue(rq_jobs.debounced, "rq-burst", version))
        time.sleep(0.2)
    statuses = wait_done(jobs, timeout=30)
    assert sorted(statuses) == ["canceled", "canceled", "finished"], statuses
    [runner] = [job for job, state in zip(jobs, statuses) if state == "finished"]
    assert [e["job_id"] for e in rq_stack.ledger()] == [runner.id]
    assert runner.return_value()["version"] == 3
    for job in jobs:
        if job is not runner:
            assert (meta(job)["outcome"], meta(job)["rerun"]) == ("coalesced", runner.id)


def test_debounced_jobs_scheduled_for_later_make_one_burst_when_they_come(rq_stack):
    from datetime import timedelta

    jobs = [
        rq_stack.queue.enqueue_in(timedelta(seconds=1), rq_jobs.debounced, "rq-later", version)
        for version in range(1, 4)
    ]
    statuses = wait_done(jobs, timeout=30)
    assert sorted(statuses) == ["canceled", "canceled", "finished"], statuses
    [runner] = [job for job, state in zip(jobs, statuses) if state == "finished"]
    assert [e["job_id"] for e in rq_stack.ledger()] == [runner.id]
    # Due together, the two workers take them at once: the latest is the last stamped,
    # as each job first reached a worker.
    latest = max(jobs, key=lambda job: meta(job)["as_of"])
    assert runner.return_value()["version"] == latest.args[1]


def test_a_newer_job_under_replace_stops_the_running_one_and_runs(rq_stack):
    running = rq_stack.enqueue(rq_jobs.replacing, "rq-replace", 60)
    assert wait_until(lambda: rq_stack.holders("rq-replace"), timeout=15)
    [held] = rq_stack.holders("rq-replace")
    newer = rq_stack.enqueue(rq_jobs.replacing, "rq-replace", 0)
    statuses = wait_done([running, newer], timeout=30)
    assert statuses == ["canceled", "finished"], newer.latest_result().exc_string
    assert (meta(running)["outcome"], meta(running)["by"]) == ("replaced", newer.id)
    assert [e["job_id"] for e in rq_stack.ledger()] == [newer.id]
    assert newer.return_value()["token"] > held.fencing_token


def test_requeued_duplicates_all_run_after_the_holder(rq_stack):
    # The holder runs until every duplicate found it holding: however slowly the workers
    # pick the duplicates up, each one meets it.
    holder = hold(rq_stack, "busy-requeue")
    duplicates = [rq_stack.enqueue(rq_jobs.hold_requeue, "busy-requeue", 0) for _ in range(4)]
    assert wait_until(lambda: all(meta(job).get("requeues") for job in duplicates), 30)
    tell(rq_stack, "busy-requeue")
    assert wait_done([holder, *duplicates], timeout=30) == ["finished"] * 5
    entries = {e["job_id"]: e for e in rq_stack.ledger()}
    assert overlaps(list(entries.values())) == []
    for job in duplicates:
        assert entries[job.id]["start"] >= entries[holder.id]["end"]
        assert entries[job.id]["requeues"] >= 1
        assert meta(job)["outcome"] == "ran"


def test_requeues_are_not_counted_as_failed_jobs_in_the_worker_statistics(rq_stack):
    with rq_stack.side_worker("stats") as (queue, worker):
        holder = hold(rq_stack, "counted")
        duplicates = [
            rq_stack.enqueue(rq_jobs.hold_requeue, "counted", 0, queue=queue) for _ in range(2)
        ]
        assert wait_until(lambda: all(meta(job).get("requeues") for job in duplicates), 20)
        tell(rq_stack, "counted")
        assert wait_done([holder, *duplicates], timeout=30) == ["finished"] * 3
        [stats] = [w for w in Worker.all(queue=queue) if w.name == worker.name]
    assert (stats.successful_job_count, stats.failed_job_count) == (2, 0)


def test_a_burst_worker_requeues_a_duplicate_until_it_runs(rq_stack):
    # `--burst --with-scheduler` holds the scheduler lock for one pass only.
    queue = rq_stack.side_queue("burst")
    holder = hold(rq_stack, "burst")
    duplicate = rq_stack.enqueue(rq_jobs.hold_requeue, "burst", 0, queue=queue)
    worker = rq_stack.worker("burst", queue=queue.name, extra=("--burst",))
    worker.ready_text = None  # a burst worker may be done before the test looks
    worker.start()
    try:
        assert wait_until(lambda: meta(duplicate).get("requeues"), timeout=20)
        tell(rq_stack, "burst")
        assert worker.process.wait(30) == 0, worker.output()
    finally:
        worker.stop()
    assert wait_done([duplicate, holder], timeout=5) == ["finished"] * 2
    entries = {e["job_id"]: e for e in rq_stack.ledger()}
    assert entries[duplicate.id]["start"] >= entries[holder.id]["end"]


def test_wait_is_woken_by_the_release_not_by_its_timeout(rq_stack):
    holder = start_holding(rq_stack, rq_jobs.hold_wait, "busy-wait", 1.0)
    duplicate = rq_stack.enqueue(rq_jobs.hold_wait, "busy-wait", 0)
    assert wait_done([holder, duplicate], timeout=20) == ["finished"] * 2
    first, second = holder.return_value(), duplicate.return_value()
    assert second["start"] >= first["end"]
    assert second["requeues"] == 0, "the duplicate should have waited, not been requeued"
    # wait_timeout is 30 s: starting this soon means the release woke it.
    assert second["start"] - first["end"] < 1


def test_rqs_retry_of_a_failed_run_does_not_meet_its_own_window(rq_stack):
    job = rq_stack.enqueue(
        rq_jobs.windowed_failing_once, "retried-window", retry=Retry(max=1, interval=1)
    )
    # The window is a minute: the retry runs at its interval, not after the window.
    assert wait_done([job], timeout=30) == ["finished"]
    assert meta(job)["outcome"] == "ran" and meta(job)["retry"] is True


def test_a_retry_of_a_failed_attempt_that_meets_another_holder_is_requeued(rq_stack):
    job = rq_stack.enqueue(rq_jobs.fail_first_attempt, "retried", retry=Retry(max=1, interval=2))
    assert wait_until(lambda: status(job) == "scheduled", timeout=10), status(job)
    holder = hold(rq_stack, "retried")
    # Met the holder on its retry, and again on the next try.
    assert wait_until(lambda: meta(job).get("requeues", 0) >= 2, timeout=20), meta(job)
    tell(rq_stack, "retried")
    assert wait_done([job, holder], timeout=30) == ["finished"] * 2
    entries = {e["job_id"]: e for e in rq_stack.ledger()}
    assert entries[job.id]["start"] >= entries[holder.id]["end"]
    assert meta(job)["outcome"] == "ran" and meta(job)["retry"] is True


def test_duplicates_during_one_run_coalesce_into_one_follow_up_with_the_latest_arguments(
    rq_stack,
):
    # A third worker: one runs the holder, one waits as the pending rerun, one takes the
    # other duplicates as they arrive.
    extra = rq_stack.worker("w3").start()
    try:
        holder = hold(rq_stack, "calendar")
        duplicates = [rq_stack.enqueue(rq_jobs.webhook, "calendar", v) for v in range(1, 11)]
        assert wait_until(lambda: sum(status(d) == "canceled" for d in duplicates) == 9, 30)
        tell(rq_stack, "calendar")
        statuses = wait_done([holder, *duplicates], timeout=40)
    finally:
        extra.stop()
    outcomes = [d.return_value() for d in duplicates]
    ran = [o for o in outcomes if "version" in o]
    coalesced = [o for o in outcomes if o.get("outcome") == "coalesced"]
    assert len(ran) == 1 and len(coalesced) == 9
    assert sorted(statuses) == ["canceled"] * 9 + ["finished"] * 2
    pending = duplicates[outcomes.index(ran[0])]
    assert {c["rerun"] for c in coalesced} == {pending.id}
    assert ran[0]["start"] >= holder.return_value()["end"]
    assert ran[0]["version"] in range(1, 11)  # a duplicate's change, seen by the follow-up


def test_the_run_a_pending_rerun_owed_goes_to_a_new_job_when_its_horse_dies(rq_stack):
    holder = hold(rq_stack, "synced")
    pending = rq_stack.enqueue(rq_jobs.webhook, "synced", 1)
    store = backend_for_url(rq_stack.url)
    assert wait_until(lambda: marks.line_of(store, "exclusive:synced") == [pending.id], 10)
    send_stop_job_command(rq_stack.client, pending.id)  # RQ never runs a stopped job again
    assert wait_done([pending], timeout=10) == ["stopped"]
    # The worker that saw its horse die hands the run on: a new job takes its place.
    line = lambda: marks.line_of(store, "exclusive:synced")  # noqa: E731
    assert wait_until(lambda: line() and line() != [pending.id], 10), line()
    owed = Job.fetch(line()[0], connection=rq_stack.client)
    assert owed.func_name == pending.func_name and list(owed.args) == ["synced", 1]
    tell(rq_stack, "synced")
    assert wait_done([holder, owed], timeout=30) == ["finished"] * 2
    assert owed.return_value()["start"] >= holder.return_value()["end"]
    assert [e["job_id"] for e in rq_stack.ledger()] == [holder.id, owed.id]


def test_the_run_a_pending_rerun_owed_goes_to_a_new_job_when_rq_cancels_it(rq_stack):
    holder = rq_stack.enqueue(rq_jobs.webhook_sent_away, "canceled", 0, 2.5)
    assert wait_until(lambda: rq_stack.holders("canceled"), timeout=20), "holder never started"
    pending = rq_stack.enqueue(rq_jobs.webhook_sent_away, "canceled", 1)
    store = backend_for_url(rq_stack.url)
    # Away on its requeue (out of the line for 5 s), and still the pending rerun.
    assert wait_until(lambda: status(pending) == "scheduled", timeout=10), status(pending)
    assert marks.pending_rerun(store, "exclusive:canceled") == pending.id
    joined = rq_stack.enqueue(rq_jobs.webhook_sent_away, "canceled", 2)
    assert wait_done([joined], timeout=10) == ["canceled"]
    assert meta(joined)["rerun"] == pending.id
    rq.cancel_job(pending.id, connection=rq_stack.client)  # a plain Job: RQ's own call
    # As the holder's run ends, the canceled job's place goes to a new job, which runs
    # the change the joined duplicate brought.
    assert wait_until(lambda: len(rq_stack.ledger()) == 2, timeout=20), rq_stack.ledger()
    first, second = rq_stack.ledger()
    owed = Job.fetch(second["job_id"], connection=rq_stack.client)
    assert first["job_id"] == holder.id and owed.id not in (pending.id, joined.id)
    assert wait_done([owed], timeout=10) == ["finished"]
    assert owed.return_value()["version"] == 2
    assert second["start"] >= first["end"]
    assert status(pending) == "canceled"


def test_a_pending_rerun_canceled_while_it_waits_in_line_still_runs_and_only_it(rq_stack):
    # RQ's cancel does not stop a job already running: it waits on, and runs.
    holder = rq_stack.enqueue(rq_jobs.webhook_until_told, "waits-on", 0)
    assert wait_until(lambda: rq_stack.holders("waits-on"), timeout=20), "holder never started"
    pending = rq_stack.enqueue(rq_jobs.webhook, "waits-on", 1)
    store = backend_for_url(rq_stack.url)
    assert wait_until(lambda: marks.line_of(store, "exclusive:waits-on") == [pending.id], 10)
    rq.cancel_job(pending.id, connection=rq_stack.client)
    tell(rq_stack, "waits-on")
    assert wait_until(lambda: len(rq_stack.ledger()) == 2, timeout=20), rq_stack.ledger()
    time.sleep(1.0)  # a run handed on to a new job as well would have started by now
    assert [e["job_id"] for e in rq_stack.ledger()] == [holder.id, pending.id]


def run_as_pending_rerun(rq_stack: Stack, function, key: str) -> tuple[Job, object]:
    """Hold ``key`` here while ``function(key, 1)`` becomes its pending rerun and
    ``function(key, 2|3)`` coalesce into it, then free it: the pending job runs with
    the newest arguments, version 3. Return it and its holder info."""
    store = backend_for_url(rq_stack.url)
    with ExclusiveLock("exclusive:" + key, rq_stack.url, TTL, name="test holder"):
        pending = rq_stack.enqueue(function, key, 1)
        assert wait_until(lambda: marks.pending_rerun(store, "exclusive:" + key) == pending.id, 15)
        later = [rq_stack.enqueue(function, key, version) for version in (2, 3)]
        assert wait_done(later, timeout=30) == ["canceled"] * 2
    assert wait_until(lambda: rq_stack.holders(key), timeout=15), "the pending rerun never ran"
    [holder] = rq_stack.holders(key)
    assert holder.task_id == pending.id
    return pending, holder


def holds_anew(rq_stack: Stack, key: str, stopped) -> bool:
    """Whether ``key`` is held again, under a later grant than ``stopped``'s."""
    return [info.fencing_token > stopped.fencing_token for info in rq_stack.holders(key)] == [True]


def test_a_pending_rerun_stopped_by_its_lost_lease_runs_again_with_the_pending_arguments(
    rq_stack,
):
    key = f"resumed-{uuid.uuid4().hex[:6]}"
    pending, first = run_as_pending_rerun(rq_stack, rq_jobs.webhook_until_told, key)
    backend_for_url(rq_stack.url).force_release("exclusive:" + key)
    # Stopped at its next renewal, requeued, and holding the key under a new grant.
    assert wait_until(lambda: holds_anew(rq_stack, key, first), timeout=TTL + 10)
    tell(rq_stack, key)
    assert wait_done([pending], timeout=15) == ["finished"]
    rerun = pending.return_value()
    assert rerun["version"] == 3, "the coalesced duplicates' change was lost"
    assert rerun["requeues"] == 1 and rerun["token"] > first.fencing_token


# --- lease lifetime ---------------------------------------------------------------


def test_a_job_running_longer_than_the_ttl_keeps_its_lease(rq_stack):
    holder = start_holding(rq_stack, rq_jobs.hold_skip, "long", TTL * 2.5)
    time.sleep(TTL * 2)
    duplicate = rq_stack.enqueue(rq_jobs.hold_skip, "long", 0)
    assert wait_done([duplicate, holder], timeout=15) == ["canceled", "finished"]
    assert meta(duplicate)["outcome"] == "skipped"
    assert holder.return_value()["lost"] is False


def test_the_worker_frees_the_lease_of_a_sigkilled_work_horse_at_once(rq_stack):
    job = hold(rq_stack, "killed")
    [info] = rq_stack.holders("killed")
    assert info.task_id == job.id
    os.kill(info.holder["pid"], signal.SIGKILL)
    # lease_ttl is 30 s: gone this soon means the worker process released it.
    assert wait_until(lambda: not rq_stack.holders("killed"), timeout=5)
    assert wait_done([job], timeout=15) == ["failed"]
    assert wait_done([rq_stack.enqueue(rq_jobs.hold_skip, "killed", 0)], 10) == ["finished"]


def test_the_worker_frees_the_lease_of_a_stopped_job_at_once(rq_stack):
    job = hold(rq_stack, "stopped")
    send_stop_job_command(rq_stack.client, job.id)
    assert wait_until(lambda: not rq_stack.holders("stopped"), timeout=5)
    assert wait_done([job], timeout=10) == ["stopped"]


def test_a_job_whose_killed_horse_is_retried_runs_again_at_once(rq_stack):
    job = rq_stack.enqueue(rq_jobs.hold_until_told, "revived", retry=Retry(max=1))
    assert wait_until(lambda: rq_stack.holders("revived"), timeout=15)
    [first] = rq_stack.holders("revived")
    os.kill(first.holder["pid"], signal.SIGKILL)

    # The retry takes the key anew long before the killed horse's lease (30 s) expires.
    def tokens() -> list:
        return [info.fencing_token for info in rq_stack.holders("revived")]

    def taken_anew() -> bool:
        now = tokens()  # one reading: the holders may change between two
        return len(now) == 1 and now[0] > first.fencing_token

    assert wait_until(taken_anew, timeout=8), tokens()
    tell(rq_stack, "revived")
    assert wait_done([job], timeout=10) == ["finished"]


def test_a_work_horse_whose_lease_is_lost_is_stopped_and_its_worker_goes_on(rq_stack):
    # on_lease_lost="terminate" is the default; requeue_lost=False: the job stays failed.
    job = start_holding(rq_stack, rq_jobs.hold_once, "taken", 30)
    backend_for_url(rq_stack.url).force_release("exclusive:taken")
    # Found lost at the next renewal (every ttl / 3), then interrupted at once.
    assert wait_done([job], timeout=TTL + 2) == ["failed"]
    assert "LeaseLost" in error_of(job)
    assert all(worker.process.poll() is None for worker in rq_stack.workers)
    follow_up = rq_stack.enqueue(rq_jobs.hold_skip, "taken", 0)
    assert wait_done([follow_up], timeout=10) == ["finished"]
    assert [e["job_id"] for e in rq_stack.ledger()] == [follow_up.id]


def test_a_work_horse_that_carries_on_after_losing_its_lease_is_killed(rq_stack):
    job = rq_stack.enqueue(rq_jobs.stubborn, "stubborn", 30)
    assert wait_until(lambda: rq_stack.holders("stubborn"), timeout=15)
    backend_for_url(rq_stack.url).force_release("exclusive:stubborn")
    # EXCLUSIVE_TERMINATE_GRACE is 1 s.
    assert wait_done([job], timeout=TTL + 4) == ["failed"]
    assert "terminated unexpectedly" in error_of(job)
    assert all(worker.process.poll() is None for worker in rq_stack.workers)
    assert rq_stack.ledger() == []
    time.sleep(2.0)  # requeue_lost=False: it stays failed, not sent again
    assert status(job) == "failed" and meta(job).get("outcome") == "ran"


def _started(rq_stack: Stack, key: str) -> list[dict]:
    started = [json.loads(raw) for raw in rq_stack.client.lrange("started", 0, -1)]
    return [s for s in started if s["key"] == key]


def test_a_work_horse_killed_for_its_lost_lease_has_its_job_run_again_once_after_the_kill(
    rq_stack,
):
    job = rq_stack.enqueue(rq_jobs.stubborn_in_steps, "killed", 3.0)
    assert wait_until(lambda: _started(rq_stack, "killed"), timeout=15)
    [info] = rq_stack.holders("killed")
    [first] = _started(rq_stack, "killed")
    backend_for_url(rq_stack.url).force_release("exclusive:killed")
    last_alive = time.time()
    while running(first["pid"]):  # found lost within ttl / 3, then a grace of 1 s
        last_alive = time.time()
        assert last_alive < first["start"] + TTL + 6, "the horse was never killed"
        time.sleep(0.01)
    assert wait_done([job], timeout=30) == ["finished"]
    time.sleep(1.5)  # a second rerun, if any, would have started by now
    [_, second] = _started(rq_stack, "killed")
    [run] = rq_stack.ledger()
    assert second["start"] > last_alive, "the rerun overlapped the killed horse"
    assert run["job_id"] == job.id and run["pid"] == second["pid"] != first["pid"]
    assert run["token"] > info.fencing_token and run["requeues"] == 1


def test_a_pending_rerun_whose_horse_is_killed_for_its_lost_lease_runs_again_with_its_arguments(
    rq_stack,
):
    key = f"revived-{uuid.uuid4().hex[:6]}"
    pending, first = run_as_pending_rerun(rq_stack, rq_jobs.stubborn_webhook, key)
    pid = first.holder["pid"]
    backend_for_url(rq_stack.url).force_release("exclusive:" + key)
    # Found lost within ttl / 3; killed when it has not stopped 1 s (its grace) later.
    assert wait_until(lambda: not running(pid), timeout=TTL + 5), "the horse was never killed"
    assert wait_until(lambda: holds_anew(rq_stack, key, first), timeout=TTL + 10)
    rq_stack.client.set(f"release:{key}", 1)
    assert wait_done([pending], timeout=15) == ["finished"]
    rerun = pending.return_value()
    assert rerun["version"] == 3, "the coalesced duplicates' change was lost"
    assert rerun["pid"] != pid and rerun["token"] > first.fencing_token


def test_a_work_horse_killed_for_another_reason_than_a_lost_lease_is_not_run_again(rq_stack):
    job = rq_stack.enqueue(rq_jobs.stubborn_in_steps, "oom", 30.0)
    assert wait_until(lambda: _started(rq_stack, "oom"), timeout=15)
    [first] = _started(rq_stack, "oom")
    os.kill(first["pid"], signal.SIGKILL)  # as the OOM killer does
    assert wait_done([job], timeout=15) == ["failed"]
    time.sleep(2.0)  # a rerun would have started by now
    assert len(_started(rq_stack, "oom")) == 1 and rq_stack.ledger() == []


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


# --- unmarked jobs, other job classes, mistakes ------------------------------------------


def test_unmarked_jobs_run_untouched_and_may_overlap(rq_stack):
    first = rq_stack.enqueue(rq_jobs.plain, "shared", 5.0)
    assert wait_until(lambda: status(first) == "started", timeout=15)
    # The other worker is free: it runs the second beside the first.
    jobs = [first, rq_stack.enqueue(rq_jobs.plain, "shared", 0.5)]
    assert wait_done(jobs, timeout=30) == ["finished"] * 2
    entries = rq_stack.ledger()
    assert [e["token"] for e in entries] == [None, None]
    assert len(overlaps(entries)) == 1, "two workers should have run them side by side"
    assert all("exclusive" not in meta(job) for job in jobs)
    assert rq_stack.holders("shared") == []


def test_a_worker_without_the_job_class_refuses_marked_jobs(rq_stack):
    with rq_stack.side_worker("plain", job_class=None) as (queue, _):
        job = rq_stack.enqueue(rq_jobs.hold_skip, "unguarded", 0, queue=queue)
        assert wait_done([job], timeout=15) == ["failed"]
    error = error_of(job)
    assert "ConfigurationError" in error and f"--job-class {JOB_CLASS}" in error
    assert rq_stack.ledger() == []


@pytest.mark.skipif(RQ_MAJOR != 2, reason="RQ 3's SpawnWorker passes --job-class on")
def test_rq2_spawn_workers_refuse_marked_jobs(rq_stack):
    with rq_stack.side_worker("spawn", extra=SPAWN) as (queue, _):
        job = rq_stack.enqueue(rq_jobs.hold_skip, "spawned", 0, queue=queue)
        assert wait_done([job], timeout=20) == ["failed"]
    assert "SpawnWorker ignores --job-class" in error_of(job)
    assert rq_stack.ledger() == []


@pytest.mark.skipif(RQ_MAJOR == 2, reason="RQ 2's SpawnWorker ignores --job-class")
def test_spawn_workers_run_marked_jobs_under_their_lease(rq_stack):
    with rq_stack.side_worker("spawn", extra=SPAWN) as (queue, _):
        holder = hold(rq_stack, "spawned", queue=queue)
        duplicate = rq_stack.enqueue(rq_jobs.hold_skip, "spawned", 0)  # on the fork workers
        assert wait_done([duplicate], timeout=20) == ["canceled"]
        tell(rq_stack, "spawned")
        assert wait_done([holder], timeout=20) == ["finished"]
    [entry] = rq_stack.ledger()
    assert entry["job_id"] == holder.id and entry["token"] is not None


def test_a_key_naming_no_argument_is_refused_when_the_function_is_decorated():
    def settle(invoice_id):
        pass

    with pytest.raises(ExclusiveKeyError) as info:
        exclusive(key="invoice:{invoice}")(settle)
    assert info.value.argument == "invoice"
    assert "settle" in str(info.value)


def test_a_call_that_does_not_match_the_signature_fails_as_rq_would_naming_the_argument(
    rq_stack,
):
    job = rq_stack.enqueue(rq_jobs.hold_skip)
    assert wait_done([job], timeout=10) == ["failed"]
    error = error_of(job)
    assert "TypeError: hold_skip() missing a required argument: 'key'" in error
    assert rq_stack.ledger() == []


# --- lease store down ---------------------------------------------------------------


def test_store_down_with_on_backend_error_run_runs_under_an_unlocked_lease(rq_stack):
    job = rq_stack.enqueue(rq_jobs.unlocked_when_store_down, "unlocked")
    assert wait_done([job], timeout=10) == ["finished"]
    assert meta(job)["outcome"] == "ran_without_lease"
    [entry] = rq_stack.ledger()
    assert (entry["lease"], entry["token"]) == ("UnlockedLease", None)


def test_store_down_requeues_by_default_and_never_runs_unlocked(rq_stack):
    job = rq_stack.enqueue(rq_jobs.requeued_when_store_down, "unreachable")
    try:
        assert wait_until(lambda: meta(job).get("outcome") == "requeued", timeout=10)
        assert wait_until(lambda: status(job) == "scheduled", timeout=5)
        assert "did not answer" in meta(job)["reason"]
    finally:
        job.delete()
    assert rq_stack.ledger() == []
