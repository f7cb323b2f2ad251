"""A pool child's exit, seen by its worker's main process as it happens, on real prefork
workers and a real Redis store.

Celery may report a killed child's death seconds late (it looks for exited children as
their pipe closes, which can be a moment before they can be waited for, and otherwise
every 5 s); the main process frees the child's leases without waiting for that report.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, wait_until
from tests.support.servers import running

#: Kills in a row of one worker's only child: each but the first is of a child the pool
#: started in place of the one killed before.
KILLS = 5


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    with stack.running(
        stack.worker("killed", concurrency=1, extra=("-Q", "kills")),
        stack.worker(
            "recycled", concurrency=1, extra=("-Q", "recycled", "--max-tasks-per-child", "1")
        ),
        stack.worker("other", concurrency=1, extra=("-Q", "others")),
    ):
        yield stack


def _kill_the_holder(cluster, key: str) -> tuple[int, float]:
    """Kill the child holding ``key``; return its pid and the seconds until the key was
    free."""
    assert wait_until(lambda: cluster.holders(key), timeout=15), "holder never started"
    [info] = cluster.holders(key)
    killed = time.monotonic()
    os.kill(info.holder["pid"], signal.SIGKILL)
    assert wait_until(lambda: not cluster.holders(key), timeout=15, step=0.01)
    return info.holder["pid"], round(time.monotonic() - killed, 3)


def test_each_of_several_pool_children_killed_in_turn_frees_its_key_at_once(cluster):
    pids, freed_after = [], []
    for i in range(KILLS):
        ledger_app.hold_long_lease.apply_async((f"killed-{i}", 60), queue="kills")
        pid, seconds = _kill_the_holder(cluster, f"killed-{i}")
        pids.append(pid)
        freed_after.append(seconds)
    assert len(set(pids)) == KILLS
    # Its lease lasts 30 s: the worker's main process freed each key.
    assert max(freed_after) < 5.0, f"seconds from each kill to its key's release: {freed_after}"


def test_a_child_that_ends_its_call_and_exits_frees_nothing_the_next_holder_took(cluster):
    key = "recycled"
    first = ledger_app.hold_long_lease.apply_async((key, 0.5), queue="recycled")
    assert wait_until(lambda: cluster.holders(key), timeout=15), "holder never started"
    child = cluster.holders(key)[0].holder["pid"]
    # Waits on another worker, and takes the key as the first call releases it.
    second = ledger_app.hold_wait.apply_async((key, 3.0), queue="others")
    first.get(timeout=30)
    assert wait_until(lambda: not running(child), timeout=15), "the child never exited"
    time.sleep(0.5)  # a release on the child's exit would have come by now
    assert [info.task_id for info in cluster.holders(key)] == [second.id]
    entry = second.get(timeout=30)
    assert entry["lost"] is False
    log = cluster.workers[1].output()
    assert "released lease" not in log and "left to expire" not in log
