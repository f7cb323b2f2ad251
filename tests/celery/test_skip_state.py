"""What a skipped duplicate ends as, by ``exclusive_skip_state``, in a real worker: the
state ``.get()`` sees at once, and whether ``task_failure`` handlers count it."""

from __future__ import annotations

import json
import time

import pytest
import redis

from celery_exclusive import DuplicateSkipped
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.lease import acquire
from tests.conftest import fresh_redis_db
from tests.support.apps import outcomes
from tests.support.cluster import wait_until
from tests.support.workers import Worker


@pytest.fixture(scope="module")
def worker(redis_server, client_dbs):
    broker, ledger = client_dbs
    store = fresh_redis_db(redis_server)
    env = {
        "EXCLUSIVE_TEST_BROKER": broker,
        "EXCLUSIVE_TEST_STORE": store,
        "EXCLUSIVE_TEST_LEDGER": ledger,
    }
    outcomes.app.conf.update(broker_url=broker, result_backend=broker, exclusive_backend_url=store)
    with Worker("tests.support.apps.outcomes", env, pool="solo", concurrency=1, name="outcomes"):
        yield store, redis.Redis.from_url(ledger)


@pytest.fixture
def key_held(worker):
    """invoice:7 held by another worker (this process), for the test's duration."""
    store, ledger = worker
    ledger.delete("signals")
    lease = acquire(backend_for_url(store), "exclusive:invoice:7", 30, task_id="holder-7")
    yield
    lease.release()


def signals_of(ledger, task_id: str) -> list[dict]:
    def sent() -> list[dict]:
        entries = map(json.loads, ledger.lrange("signals", 0, -1))
        return [entry for entry in entries if entry["task_id"] == task_id]

    wait_until(sent, timeout=10)
    time.sleep(0.2)  # a second signal for the same task would have been sent by now
    return sent()


def test_by_default_a_skipped_duplicate_fails_with_duplicate_skipped(worker, key_held):
    result = outcomes.settle_failure.delay(7)
    started = time.monotonic()
    with pytest.raises(DuplicateSkipped) as info:
        result.get(timeout=20)
    assert time.monotonic() - started < 10
    assert (info.value.key, info.value.holder_task_id) == ("exclusive:invoice:7", "holder-7")
    assert result.state == "FAILURE"
    assert signals_of(worker[1], result.id) == [
        {"signal": "task_failure", "task_id": result.id, "error": "DuplicateSkipped"}
    ]


def test_skip_state_success_ends_a_duplicate_as_success_without_task_failure(worker, key_held):
    result = outcomes.settle_success.delay(7)
    started = time.monotonic()
    skipped = {"outcome": "skipped", "key": "exclusive:invoice:7", "holder": "holder-7"}
    assert result.get(timeout=20) == skipped
    assert time.monotonic() - started < 10
    assert result.state == "SUCCESS"
    assert signals_of(worker[1], result.id) == [
        {"signal": "task_success", "task_id": result.id, "result": skipped}
    ]


def test_skip_state_success_still_runs_a_call_whose_key_is_free(worker):
    assert outcomes.settle_success.delay(8).get(timeout=20) == "settled 8"
