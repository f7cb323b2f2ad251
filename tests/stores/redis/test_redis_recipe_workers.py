"""``?recipe=set-nx`` under real workers: a real ``celery worker`` and ``rq worker``
exclude redis-py's ``Lock`` and python-redis-lock held in this process, both ways.

The Celery workers run the ledger app with ``exclusive_key_prefix="lock:"``: the task
key ``k`` is the Redis key ``lock:k``, which ``redis.lock("lock:k")`` and
python-redis-lock's ``Lock(r, "k")`` take too.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis
import redis_lock

from celery_exclusive import DuplicateSkipped, backend_for_url
from celery_exclusive.core import marks
from tests.conftest import fresh_redis_db
from tests.rq.test_rq_workers import Stack as RQStack
from tests.rq.test_rq_workers import meta, wait_done
from tests.support.apps import ledger as ledger_app
from tests.support.apps import rq_jobs
from tests.support.cluster import Stack, wait_until
from tests.support.workers import overlaps, read_ledger


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, tmp_path_factory):
    url = fresh_redis_db(redis_server) + "?recipe=set-nx"
    stack = Stack(redis_server, *client_dbs, url, tmp_path_factory)
    stack.redis = redis.Redis.from_url(url.partition("?")[0])
    with stack.running(stack.worker("n1", env={"key_prefix": "lock:"})):
        yield stack


def holders(cluster, key: str):
    return backend_for_url(cluster.store).holders_of("lock:" + key)


def start_holding(cluster, task, key: str, duration: float):
    result = task.delay(key, duration)
    assert wait_until(lambda: holders(cluster, key), timeout=15), "holder never started"
    return result


def test_a_task_sent_while_a_redis_py_lock_holds_its_key_is_skipped_naming_it(cluster):
    theirs = cluster.redis.lock("lock:r1", timeout=30)
    assert theirs.acquire(blocking=False)
    with pytest.raises(DuplicateSkipped) as raised:
        ledger_app.hold_skip.delay("r1").get(timeout=30)
    theirs.release()
    assert "SET NX lock recipe" in str(raised.value)
    assert read_ledger(cluster.ledger) == []


def test_the_worker_logs_the_redis_py_lock_a_duplicate_was_skipped_for(cluster):
    theirs = cluster.redis.lock("lock:r8", timeout=30)
    assert theirs.acquire(blocking=False)
    token = theirs.local.token.decode()
    skipped = ledger_app.hold_skip.delay("r8")
    with pytest.raises(DuplicateSkipped):
        skipped.get(timeout=30)
    theirs.release()
    [worker] = cluster.workers
    [line] = [line for line in worker.output().splitlines() if f"task_id={skipped.id}" in line]
    assert line.endswith(
        f"duplicate skipped key=lock:r8 task_id={skipped.id} holder=a client of Redis's SET NX "
        "lock recipe (redis-py Lock, python-redis-lock, redsync...) with the value "
        f"{token!r}, not taken by celery-exclusive"
    )


def test_a_duplicate_names_the_redis_py_lock_holding_the_key_not_a_task_in_its_line(cluster):
    theirs = cluster.redis.lock("lock:r9", timeout=30, thread_local=False)
    assert theirs.acquire(blocking=False)
    waiting = ledger_app.hold_wait.delay("r9")
    store = backend_for_url(cluster.store)
    assert wait_until(lambda: marks.line_of(store, "lock:r9") == [waiting.id], timeout=15)
    with pytest.raises(DuplicateSkipped) as raised:
        ledger_app.hold_skip.delay("r9").get(timeout=30)
    theirs.release()
    assert "is held by a client of Redis's SET NX lock recipe" in str(raised.value)
    assert raised.value.holder_task_id is None
    assert waiting.get(timeout=30)["key"] == "r9"  # its turn came once the lock was released


def test_a_waiting_task_runs_as_soon_as_the_redis_py_lock_is_released(cluster):
    theirs = cluster.redis.lock("lock:r2", timeout=30, thread_local=False)
    theirs.acquire(blocking=False)
    result = ledger_app.hold_wait.delay("r2")
    time.sleep(1.0)
    released_at = time.time()
    theirs.release()
    entry = result.get(timeout=30)
    assert released_at <= entry["start"] < released_at + 2.0


def test_a_requeued_task_runs_after_the_foreign_release(cluster):
    theirs = cluster.redis.lock("lock:r3", timeout=30, thread_local=False)
    theirs.acquire(blocking=False)
    result = ledger_app.hold_requeue.delay("r3")
    threading.Timer(1.0, theirs.release).start()
    released_after = time.time() + 1.0
    entry = result.get(timeout=30)
    assert entry["start"] >= released_after - 0.05
    assert entry["requeues"] >= 1


def test_a_redis_py_lock_waits_for_the_running_task(cluster):
    result = start_holding(cluster, ledger_app.hold_skip, "r4", 1.0)
    theirs = cluster.redis.lock("lock:r4", timeout=30, blocking_timeout=20)
    assert cluster.redis.lock("lock:r4", timeout=30).acquire(blocking=False) is False
    assert theirs.acquire()
    taken_at = time.time()
    theirs.release()
    entry = result.get(timeout=30)
    assert entry["end"] <= taken_at < entry["end"] + 1.0


def test_a_python_redis_lock_waiter_takes_the_key_as_the_task_releases_it(cluster):
    result = start_holding(cluster, ledger_app.hold_skip, "r5", 1.0)
    theirs = redis_lock.Lock(cluster.redis, "r5")
    assert theirs.acquire(blocking=False) is False
    assert theirs.acquire(timeout=10)  # BLPOP for 10 s, unless a release pushes a wake-up
    taken_at = time.time()
    theirs.release()
    entry = result.get(timeout=30)
    assert entry["end"] <= taken_at < entry["end"] + 0.5


def test_tasks_and_foreign_clients_on_one_key_never_overlap(cluster):
    """Tasks keep arriving while threads with redis-py locks and python-redis-lock take
    the key too: one holder at a time, in the ledger."""
    results = [ledger_app.hold_wait.delay("r6", 0.05) for _ in range(8)]
    spans = []

    def redis_py() -> None:
        lock = cluster.redis.lock("lock:r6", timeout=30, blocking_timeout=60)
        assert lock.acquire()
        start = time.time()
        time.sleep(0.05)
        spans.append({"key": "r6", "start": start, "end": time.time()})
        lock.release()

    def python_redis_lock() -> None:
        with redis_lock.Lock(cluster.redis, "r6", expire=30):
            start = time.time()
            time.sleep(0.05)
            spans.append({"key": "r6", "start": start, "end": time.time()})

    threads = [threading.Thread(target=f) for f in (redis_py, python_redis_lock) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert all(r.get(timeout=90) for r in results)
    entries = read_ledger(cluster.ledger) + spans
    assert len(entries) == 14
    assert overlaps(entries) == []


# --- RQ -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rq(redis_server):
    url = fresh_redis_db(redis_server)
    rq = RQStack(url)
    rq.env["EXCLUSIVE_BACKEND_URL"] = url + "?recipe=set-nx"
    worker = rq.worker("n-rq").start()
    worker.wait_ready()
    yield rq
    worker.stop()


def test_an_rq_job_run_while_a_redis_py_lock_holds_its_key_is_skipped_naming_it(rq):
    theirs = rq.client.lock("exclusive:q1", timeout=30)
    theirs.acquire(blocking=False)
    job = rq.enqueue(rq_jobs.hold_skip, "q1")
    assert wait_done([job], timeout=30) == ["canceled"]
    theirs.release()
    assert "SET NX lock recipe" in meta(job)["holder"]


def test_a_redis_py_lock_waits_for_the_running_rq_job(rq):
    job = rq.enqueue(rq_jobs.hold_skip, "q2", 1.0)
    recipe = backend_for_url(rq.env["EXCLUSIVE_BACKEND_URL"])
    assert wait_until(lambda: recipe.holders_of("exclusive:q2"), timeout=15)
    theirs = rq.client.lock("exclusive:q2", timeout=30, blocking_timeout=20)
    assert theirs.acquire()
    taken_at = time.time()
    theirs.release()
    assert wait_done([job], timeout=30) == ["finished"]
    [entry] = rq.ledger()
    assert entry["end"] <= taken_at < entry["end"] + 1.0
