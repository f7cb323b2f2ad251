"""A ``with`` block of any code and a real ``rq worker`` exclude each other on one key.

The block runs in this test process through ``function.exclusive_lock(...)``: outside
any job, its store is ``EXCLUSIVE_BACKEND_URL``, here the queue's own Redis database,
which the workers use by default.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from celery_exclusive import LockHeld
from tests.conftest import fresh_redis_db
from tests.rq.test_rq_workers import TTL, Stack, meta, wait_done
from tests.support.apps import rq_jobs
from tests.support.cluster import wait_until
from tests.support.workers import overlaps


@pytest.fixture(scope="module")
def stack(redis_server):
    stack = Stack(fresh_redis_db(redis_server))
    worker = stack.worker("lock").start()
    worker.wait_ready()
    yield stack
    worker.stop()


@pytest.fixture
def lock_stack(stack, monkeypatch):
    """The stack, its ledger emptied; this process's locks use the workers' store."""
    stack.client.delete("ledger")
    monkeypatch.setenv("EXCLUSIVE_BACKEND_URL", stack.url)
    monkeypatch.setenv("EXCLUSIVE_LEASE_TTL", str(TTL))
    return stack


def note(rq, key: str, lease, start: float) -> None:
    entry = {"key": key, "token": lease.fencing_token, "start": start, "end": time.time()}
    rq.client.rpush("ledger", json.dumps({**entry, "job_id": "block", "pid": os.getpid()}))


def test_a_job_run_while_a_block_holds_the_key_is_skipped_naming_the_block(lock_stack):
    with rq_jobs.hold_skip.exclusive_lock("order:1"):
        job = lock_stack.enqueue(rq_jobs.hold_skip, "order:1")
        assert wait_done([job], timeout=30) == ["canceled"]
    assert meta(job)["holder"].startswith("an exclusive lock of tests.support.apps.rq_jobs")
    assert lock_stack.ledger() == []


def test_a_waiting_job_runs_once_the_block_ends(lock_stack):
    with rq_jobs.hold_wait.exclusive_lock("order:2") as lease:
        start = time.time()
        job = lock_stack.enqueue(rq_jobs.hold_wait, "order:2")
        time.sleep(1.0)
        note(lock_stack, "order:2", lease, start)
    assert wait_done([job], timeout=30) == ["finished"]
    entries = lock_stack.ledger()
    assert [e["token"] > lease.fencing_token for e in entries if e["job_id"] == job.id] == [True]
    assert overlaps(entries) == []


def test_a_block_entered_while_a_job_runs_raises_naming_the_job(lock_stack):
    job = lock_stack.enqueue(rq_jobs.hold_until_told, "order:3")
    assert wait_until(lambda: lock_stack.holders("order:3"), timeout=15)
    with pytest.raises(LockHeld) as raised, rq_jobs.hold_until_told.exclusive_lock("order:3"):
        pytest.fail("the block ran beside the job")
    lock_stack.client.rpush("go:order:3", 1)
    assert wait_done([job], timeout=30) == ["finished"]
    assert raised.value.holder_task_id == job.id


def test_an_async_block_waits_for_the_running_job_then_runs(lock_stack):
    job = lock_stack.enqueue(rq_jobs.hold_until_told, "order:4")
    assert wait_until(lambda: lock_stack.holders("order:4"), timeout=15)

    async def block():
        async with rq_jobs.hold_until_told.exclusive_lock("order:4").waiting(30) as lease:
            note(lock_stack, "order:4", lease, time.time())
            return lease

    async def main():
        waiting = asyncio.create_task(block())
        await asyncio.sleep(0.5)
        assert not waiting.done()
        lock_stack.client.rpush("go:order:4", 1)
        return await waiting

    lease = asyncio.run(main())
    assert wait_done([job], timeout=30) == ["finished"]
    entries = lock_stack.ledger()
    assert len(entries) == 2
    assert overlaps(entries) == []
    assert lease.fencing_token > next(e["token"] for e in entries if e["job_id"] == job.id)
