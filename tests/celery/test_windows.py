"""A uniqueness window (``exclusive_unique_for``): after a run of a key ends, the key
stays taken that long, under every duplicate policy, on every store that keeps a lease
for a set time (Redis, SQLite, PostgreSQL; memory has its own tests).

Real prefork workers (two, two processes each) on one broker; every run noted in a
Redis ledger with its start and end (one host: the workers' and the store's clocks
agree).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_exclusive import DuplicateSkipped
from tests.support.apps import kept
from tests.support.apps.kept import WINDOW
from tests.support.cluster import KEEPING_STORES, Stack, kept_stack, start_holding, wait_until
from tests.support.workers import Worker, read_ledger

#: Clock readings of two processes of one host, a run's end and the next one's start.
SLACK = 0.05


@pytest.fixture(scope="module", params=KEEPING_STORES)
def stack(request, redis_server, client_dbs, tmp_path_factory):
    with kept_stack(request, redis_server, client_dbs, tmp_path_factory, "win", 2) as stack:
        yield stack


def runs_of(cluster, key: str) -> list[dict]:
    return sorted(
        (e for e in read_ledger(cluster.ledger) if e["key"] == key), key=lambda e: e["start"]
    )


def test_a_call_in_the_window_after_a_run_is_skipped_naming_that_run(cluster):
    first = kept.windowed_skip.delay("report", 0.1)
    first.get(timeout=30)
    duplicate = kept.windowed_skip.delay("report", 0)
    with pytest.raises(DuplicateSkipped, match=first.id):
        duplicate.get(timeout=30)
    assert [run["task_id"] for run in runs_of(cluster, "report")] == [first.id]


def test_a_call_after_the_window_runs(cluster):
    first = kept.windowed_skip.delay("digest", 0)
    first.get(timeout=30)
    assert wait_until(lambda: not cluster.holders("digest"), timeout=WINDOW + 10)
    later = kept.windowed_skip.delay("digest", 0).get(timeout=30)
    before = runs_of(cluster, "digest")[0]
    assert later["start"] >= before["end"] + WINDOW - SLACK
    assert later["token"] > before["token"]


def test_requeued_duplicates_each_run_once_a_window_apart(cluster):
    calls = [kept.windowed_requeue.delay("sync", 0.1) for _ in range(4)]
    assert [call.get(timeout=90)["task_id"] for call in calls] == [call.id for call in calls]
    runs = runs_of(cluster, "sync")
    assert sorted(run["task_id"] for run in runs) == sorted(call.id for call in calls)
    gaps = [after["start"] - before["end"] for before, after in zip(runs, runs[1:])]
    assert min(gaps) >= WINDOW - SLACK, gaps


def test_a_waiting_duplicate_runs_once_the_window_lapses_without_a_requeue(cluster):
    first = kept.windowed_wait.delay("export", 0.1)
    first.get(timeout=30)
    second = kept.windowed_wait.delay("export", 0).get(timeout=30)
    assert second["requeues"] == 0
    assert second["start"] >= runs_of(cluster, "export")[0]["end"] + WINDOW - SLACK


def test_a_failed_run_frees_its_key_at_once_by_default(cluster):
    failed = kept.windowed_skip.delay("import", 0, True)
    with pytest.raises(ValueError, match="failed on purpose"):
        failed.get(timeout=30)
    again = kept.windowed_skip.delay("import", 0).get(timeout=30)
    first = runs_of(cluster, "import")[0]
    assert again["start"] < first["end"] + WINDOW


def test_unique_after_end_keeps_the_window_after_a_failed_run_too(cluster):
    failed = kept.windowed_after_end.delay("invoice", 0, True)
    with pytest.raises(ValueError, match="failed on purpose"):
        failed.get(timeout=30)
    duplicate = kept.windowed_after_end.delay("invoice", 0)
    with pytest.raises(DuplicateSkipped, match=failed.id):
        duplicate.get(timeout=30)


def test_a_run_killed_under_unique_after_end_keeps_its_window(cluster):
    holding = start_holding(kept.windowed_after_end, "killed-end", 30, cluster)
    os.kill(cluster.holders("killed-end")[0].holder["pid"], signal.SIGKILL)
    killed_at = time.time()
    # The worker frees what a dead child held, but a run that died ended: its window
    # is kept, and a call meeting it is a duplicate of the killed run.
    time.sleep(0.5)
    duplicate = kept.windowed_after_end.delay("killed-end", 0)
    with pytest.raises(DuplicateSkipped, match=holding.id):
        duplicate.get(timeout=30)
    assert time.time() < killed_at + WINDOW, "the duplicate came too late to tell anything"
    later = wait_until(lambda: run_once(kept.windowed_after_end, "killed-end"), timeout=30)
    assert later["start"] >= killed_at + WINDOW - SLACK


def test_a_run_killed_under_the_default_frees_its_key_at_once(cluster):
    start_holding(kept.windowed_skip, "killed-success", 30, cluster)
    os.kill(cluster.holders("killed-success")[0].holder["pid"], signal.SIGKILL)
    killed_at = time.time()
    later = wait_until(lambda: run_once(kept.windowed_skip, "killed-success"), timeout=30)
    # Freed as the worker saw the death, not a window (nor a lease ttl) later.
    assert later["start"] < killed_at + WINDOW


def run_once(task, key: str):
    """The run of one call of ``key``, or None if it was a duplicate."""
    try:
        return task.delay(key, 0).get(timeout=30)
    except DuplicateSkipped:
        time.sleep(0.1)
        return None


def test_a_retry_sent_from_a_run_that_goes_on_does_not_meet_its_own_window(cluster):
    first = kept.windowed_retry_going_on.delay("going-on")
    # The window is a minute: the retry runs at once, not after it.
    assert wait_until(lambda: len(runs_of(cluster, "going-on")) == 2, timeout=20)
    assert [run["task_id"] for run in runs_of(cluster, "going-on")] == [first.id] * 2


def test_a_worker_on_a_store_without_windows_refuses_to_start_naming_the_task(
    redis_server, client_dbs, tmp_path_factory
):
    # etcd's leases live as long as the etcd lease granted with them: no window there.
    stack = Stack(redis_server, *client_dbs, "etcd://127.0.0.1:9/none", tmp_path_factory)
    worker: Worker = stack.worker("no-windows", app="tests.support.apps.kept", concurrency=1)
    worker.start(wait=False)
    assert worker.process.wait(60) != 0, worker.output()
    last = worker.output().strip().splitlines()[-1]
    # The first by name of the tasks that keep a lease past their run (rated, windowed).
    assert "task kept.rated_" in last and "does not offer windows" in last, last
    assert "exclusive_unique_for" in last and "Traceback" not in worker.output()
