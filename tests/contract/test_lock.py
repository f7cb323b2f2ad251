"""The lock for any code takes the very lease a task call with its key takes, on every store.

Runs once per store in ``conftest.BACKEND_CASES`` against the real store. A task call
is what ``ExclusiveTask`` makes of one: :func:`policies.claim` with the task's settings.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from celery_exclusive import ExclusiveLock, LeaseLost, LockHeld, backend_for_url, signals
from celery_exclusive.backends import _instances
from celery_exclusive.core import outcomes, policies
from celery_exclusive.core.config import Settings
from celery_exclusive.core.heartbeat import heartbeat

KEY = "exclusive:invoice:7"


@pytest.fixture
def store(backend_case):
    """The store's URL; its backend is closed after the test."""
    yield backend_case.url
    for cache_key in [k for k in _instances if k[1] == backend_case.url]:
        _instances.pop(cache_key).close()


def task_call(url: str, task_id: str, ttl: float = 10.0, policy: str = "skip"):
    """What a call of a task with the key ``invoice:{invoice_id}`` gets for invoice 7."""
    settings = Settings(backend_url=url, lease_ttl=ttl, on_duplicate=policy)
    return policies.claim(settings, backend_for_url(url), KEY, "billing.settle", task_id)


def lock(url: str, ttl: float = 10.0, **options) -> ExclusiveLock:
    return ExclusiveLock(KEY, url, ttl, name="billing.settle", **options)


def test_a_lock_held_makes_a_task_call_skip_and_name_the_lock(store):
    with lock(store):
        outcome = task_call(store, "task-1")
    assert isinstance(outcome, outcomes.Skipped)
    assert outcome.holder_task_id is None
    assert outcome.holder == (
        f"an exclusive lock of billing.settle in process {os.getpid()} on {os.uname().nodename}"
    )


def test_a_task_call_running_makes_a_lock_raise_naming_the_task(store):
    run = task_call(store, "task-1")
    with pytest.raises(LockHeld) as raised, lock(store):
        pytest.fail("the block ran while the task held the key")
    run.lease.release()
    assert raised.value.holder_task_id == "task-1"
    assert raised.value.key == KEY
    assert "held by task task-1" in str(raised.value)


def test_the_key_is_free_again_once_the_block_ends(store):
    with lock(store) as lease:
        token = lease.fencing_token
    run = task_call(store, "task-1")
    assert isinstance(run, policies.Granted)
    assert run.lease.fencing_token > token
    run.lease.release()


def test_a_waiting_lock_takes_the_key_as_the_task_releases_it(store):
    run = task_call(store, "task-1")
    threading.Timer(0.3, run.lease.release).start()
    started = time.monotonic()
    with lock(store).waiting(20) as lease:
        waited = time.monotonic() - started
        assert lease.fencing_token > run.lease.fencing_token
    assert 0.25 < waited < 10


def test_a_waiting_lock_gives_up_after_its_wait_and_names_the_holder(store):
    run = task_call(store, "task-1")
    started = time.monotonic()
    refused = pytest.raises(LockHeld, match=r"stayed held for 0\.5s by task task-1")
    with refused, lock(store, wait=0.5):
        pytest.fail("the block ran while the task held the key")
    assert time.monotonic() - started >= 0.5
    run.lease.release()


def test_a_lock_that_waited_for_its_key_is_named_as_a_lock(store):
    run = task_call(store, "task-1")
    threading.Timer(0.3, run.lease.release).start()
    with lock(store).waiting(20):
        outcome = task_call(store, "task-2")
    assert isinstance(outcome, outcomes.Skipped)
    assert outcome.holder == (
        f"an exclusive lock of billing.settle in process {os.getpid()} on {os.uname().nodename}"
    )


def test_async_with_holds_off_a_task_call_and_gives_the_key_back(store):
    async def block() -> tuple:
        async with lock(store) as lease:
            during = task_call(store, "task-1")
        return lease, during

    lease, during = asyncio.run(block())
    assert isinstance(during, outcomes.Skipped)
    after = task_call(store, "task-2")
    assert isinstance(after, policies.Granted)
    assert after.lease.fencing_token > lease.fencing_token
    after.lease.release()


def test_the_heartbeat_keeps_a_block_s_lease_past_its_ttl(store, backend_case):
    ttl = backend_case.short_ttl
    with lock(store, ttl=ttl) as lease:
        time.sleep(ttl * 2.5)
        assert lease.held
        assert isinstance(task_call(store, "task-1"), outcomes.Skipped)


def test_a_lease_lost_inside_a_block_is_signalled_and_raised_as_it_exits(store):
    lost = []

    def record(sender, key, task_id, reason, **extra):
        lost.append((sender, key))

    signals.lease_lost.connect(record)
    try:
        raised_at_exit = pytest.raises(LeaseLost, match="was lost while its block ran")
        with raised_at_exit, lock(store) as lease:
            backend_for_url(store).force_release(KEY)
            heartbeat().beat()
            assert lease.lost
            with pytest.raises(LeaseLost):
                lease.ensure_held()
    finally:
        signals.lease_lost.disconnect(record)
    assert lost == [("billing.settle", KEY)]


def test_a_lease_lost_inside_a_block_is_raised_naming_the_lock_by_its_name_and_process(store):
    with pytest.raises(LeaseLost, match="was lost while its block ran"), lock(store) as lease:
        backend_for_url(store).force_release(KEY)
        heartbeat().beat()
        with pytest.raises(LeaseLost) as raised:
            lease.ensure_held()
    holder = f"billing.settle in process {os.getpid()} on {os.uname().nodename}"
    assert str(raised.value).startswith(f"{holder} lost its lease on {KEY!r} (")
