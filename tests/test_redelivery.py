"""A message delivered twice: Redis broker, ``acks_late``, a task outliving the
broker's visibility timeout.

kombu restores an unacknowledged message once it is older than the visibility
timeout (here at a worker's start), so a second worker receives the same task id
while the first still runs it. The copy must neither run beside it, nor store a state
over its result, nor run the body again once the first delivery has finished.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.apps import ledger as ledger_app
from tests.cluster import Stack, wait_until
from tests.workers import read_ledger

VISIBILITY_TIMEOUT = 4.0
DURATION = 12.0


@pytest.fixture
def stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    stack.configure_client()
    stack.reset()
    workers = []
    yield stack, workers
    for worker in workers:
        worker.stop(signal.SIGKILL)


@pytest.mark.parametrize(
    "task", [ledger_app.hold_acks_late, ledger_app.hold_acks_late_wait], ids=["skip", "wait"]
)
def test_a_redelivered_copy_of_a_running_task_neither_runs_nor_stores_a_state(stack, task):
    cluster, workers = stack
    env = {"visibility_timeout": VISIBILITY_TIMEOUT}
    first = cluster.worker("first", env=env, concurrency=1).start()
    workers.append(first)
    result = task.delay("redelivered", DURATION)
    started = time.monotonic()
    states, second = [], None
    # Poll through the whole run, and a while after: a copy could store its state late.
    while time.monotonic() - started < DURATION + 3 or "SUCCESS" not in states:
        if second is None and time.monotonic() - started >= 6:
            # Its start restores every message unacknowledged for the visibility timeout.
            second = cluster.worker("second", env=env, concurrency=1).start(wait=False)
            workers.append(second)
        states.append(result.state)
        assert time.monotonic() - started < DURATION + 30, f"no SUCCESS: {states[-5:]}"
        time.sleep(0.1)
    assert "FAILURE" not in states and set(states) <= {"PENDING", "STARTED", "SUCCESS"}
    assert result.state == "SUCCESS"
    entries = read_ledger(cluster.ledger)
    assert [e["task_id"] for e in entries] == [result.id], "the body ran more than once"
    assert wait_until(lambda: not cluster.holders("redelivered"), timeout=5), "a copy runs"
    # The copy was there, set aside while the first delivery ran, and dropped when it
    # came back after that one ended.
    second.wait_for_log("redelivered copy set aside", timeout=10)
    second.wait_for_log("redelivered copy dropped", timeout=10)
    assert len(read_ledger(cluster.ledger)) == 1
    assert result.state == "SUCCESS"
