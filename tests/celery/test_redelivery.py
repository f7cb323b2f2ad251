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

from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, wait_until
from tests.support.workers import read_ledger

VISIBILITY_TIMEOUT = 4.0
#: Long enough for the second worker to start on a loaded machine: the body is told to
#: end once the copy was set aside.
DURATION = 120.0
LEASE_TTL = 30.0


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
    # A lease far longer than the run's stalls: a loaded machine that delays a renewal
    # past a 2 s ttl loses the lease, and the call is rightly sent again (RETRY).
    env = {"visibility_timeout": VISIBILITY_TIMEOUT, "ttl": LEASE_TTL}
    first = cluster.worker("first", env=env, concurrency=1).start()
    workers.append(first)
    result = task.delay("redelivered", DURATION)
    assert wait_until(lambda: cluster.holders("redelivered"), timeout=30), "never ran"
    running_since = time.monotonic()
    states: list[str] = []

    def poll(until) -> None:
        while not until():
            states.append(result.state)
            assert time.monotonic() - running_since < DURATION - 10, f"stuck: {states[-5:]}"
            time.sleep(0.1)

    # Its start restores every message unacknowledged for the visibility timeout.
    poll(lambda: time.monotonic() - running_since > VISIBILITY_TIMEOUT + 1)
    second = cluster.worker("second", env=env, concurrency=1).start(wait=False)
    workers.append(second)
    poll(lambda: "redelivered copy set aside" in second.output())
    assert cluster.holders("redelivered"), "the first delivery ended before its copy came"
    cluster.ledger.set("release:redelivered", 1)
    # Poll through the end of the run, and a while after: a copy could store its state late.
    poll(lambda: "SUCCESS" in states)
    settled = time.monotonic()
    poll(lambda: time.monotonic() - settled > 3)
    assert "FAILURE" not in states and set(states) <= {"PENDING", "STARTED", "SUCCESS"}
    assert result.state == "SUCCESS"
    entries = read_ledger(cluster.ledger)
    assert [e["task_id"] for e in entries] == [result.id], "the body ran more than once"
    assert wait_until(lambda: not cluster.holders("redelivered"), timeout=5), "a copy runs"
    # The copy, set aside while the first delivery ran, is dropped when it comes back
    # after that one ended: by whichever worker reserved it (an ETA message goes to any).
    assert wait_until(
        lambda: any("redelivered copy dropped" in w.output() for w in (first, second)),
        timeout=30,
    ), f"the copy never came back:\n{first.output()[-2000:]}\n{second.output()[-2000:]}"
    assert len(read_ledger(cluster.ledger)) == 1
    assert result.state == "SUCCESS"
