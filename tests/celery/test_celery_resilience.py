"""What happens when parts fail: dead workers, a store that goes away, lost leases."""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_exclusive import LeaseLost, backend_for_url
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.servers import RedisServer
from tests.support.workers import read_ledger


@pytest.fixture(scope="module")
def store_server():
    """The lease store on a Redis of its own, so tests can stop and restart it."""
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def cluster(redis_server, client_dbs, store_server, tmp_path_factory):
    if store_server.process is None:
        store_server.start()
    store_server.client().flushdb()
    stack = Stack(redis_server, *client_dbs, store_server.url, tmp_path_factory)
    stack.configure_client()
    stack.reset()
    stack.workers = []
    yield stack
    for worker in stack.workers:
        worker.stop(signal.SIGKILL)


def start(cluster, name, **kwargs):
    worker = cluster.worker(name, **kwargs).start()
    cluster.workers.append(worker)
    return worker


def test_a_killed_worker_leaves_its_lease_to_expire_within_the_ttl(cluster):
    victim = start(cluster, "victim", pool="solo")
    holder = start_holding(ledger_app.hold_requeue, "crash", 30, cluster)
    start(cluster, "survivor", concurrency=1)
    duplicate = ledger_app.hold_requeue.delay("crash", 0)
    time.sleep(0.5)  # let the duplicate find the key held and start requeueing
    victim.stop(signal.SIGKILL)  # main process and all: nobody left to release
    killed_at = time.time()
    entry = duplicate.get(timeout=30)
    heartbeat, requeue_delay = cluster.ttl / 3, 0.5
    assert entry["start"] - killed_at <= cluster.ttl + heartbeat + requeue_delay + 0.5
    assert entry["start"] - killed_at >= cluster.ttl - heartbeat - 0.2, "freed before expiry?"
    assert holder.state in ("PENDING", "STARTED")


def test_with_the_store_down_a_task_is_requeued_not_run_unlocked(cluster, store_server):
    worker = start(cluster, "w1", concurrency=1)
    store_server.stop()
    result = ledger_app.hold_requeue.delay("outage", 0)
    worker.wait_for_log("requeued (exclusive_on_backend_error='requeue')", timeout=15)
    assert read_ledger(cluster.ledger) == []
    store_server.start()
    entry = result.get(timeout=30)
    assert entry["token"] is not None


def test_the_store_down_error_names_the_task_the_key_and_the_setting(cluster, store_server):
    worker = start(cluster, "w1", concurrency=1)
    store_server.stop()
    ledger_app.hold_requeue.delay("outage", 0)
    # The line itself, not a word of it: the banner's task list may hold any word.
    worker.wait_for_log("cannot take the lease", timeout=15)
    line = next(s for s in worker.output().splitlines() if "cannot take the lease" in s)
    assert "ledger.hold_requeue" in line and "exclusive:outage" in line
    assert "exclusive_on_backend_error" in line
    assert "Traceback" not in worker.output()


def test_with_the_store_down_and_fail_open_the_task_runs_with_a_warning(cluster, store_server):
    worker = start(cluster, "w1", concurrency=1, env={"on_backend_error": "run"})
    store_server.stop()
    entry = ledger_app.hold_requeue.delay("outage", 0).get(timeout=20)
    assert entry["token"] is None
    assert "running WITHOUT a lease" in worker.output()


def test_abort_fails_a_task_whose_lease_was_lost_mid_run(cluster):
    start(cluster, "w1", concurrency=1)
    result = start_holding(ledger_app.hold_abort, "stolen", 2.0, cluster)
    backend_for_url(cluster.store).force_release("exclusive:stolen")
    with pytest.raises(LeaseLost) as info:
        result.get(timeout=20)
    assert info.value.key == "exclusive:stolen"
    assert read_ledger(cluster.ledger)[0]["lost"] is True


def test_warm_shutdown_finishes_the_running_task_and_releases_its_lease(cluster):
    worker = start(cluster, "w1", concurrency=1)
    result = start_holding(ledger_app.hold_skip, "warm", 1.5, cluster)
    assert worker.stop(signal.SIGTERM) == 0
    assert result.state == "SUCCESS"
    assert cluster.holders("warm") == []
    assert len(read_ledger(cluster.ledger)) == 1


def test_a_sigkilled_child_is_replaced_and_its_key_is_usable_again(cluster):
    start(cluster, "w1", concurrency=2)
    start_holding(ledger_app.hold_skip, "child", 30, cluster)
    [info] = cluster.holders("child")
    os.kill(info.holder["pid"], signal.SIGKILL)
    assert wait_until(lambda: not cluster.holders("child"), timeout=cluster.ttl + 1)
    assert ledger_app.hold_skip.delay("child", 0).get(timeout=60)["token"] > info.fencing_token
