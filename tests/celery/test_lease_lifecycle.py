"""A lease's life on real prefork workers: it rides out a short store outage, and a
holder that lost it is stopped.

The lease store is a Redis server of this module's own, persisted (appendonly), so
that it can be stopped and started again on the same port and come back with the
leases it had, as a restarted production store does.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from celery_exclusive import LeaseLost, backend_for_url
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.servers import RedisServer, running
from tests.support.workers import overlaps, read_ledger

#: Long enough that restarting the store (a fraction of a second, more on a busy
#: machine) is small beside the half ttl it stays down.
TTL = 6.0


@pytest.fixture(scope="module")
def store_server():
    server = RedisServer(appendonly=True)
    server.start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, store_server, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, store_server.url, tmp_path_factory)
    stack.ttl = TTL
    with stack.running(stack.worker("w1", concurrency=2), stack.worker("w2", concurrency=1)):
        yield stack


@pytest.fixture
def cluster(stack, store_server):
    if store_server.process is None:
        store_server.start()
    stack.reset()
    stack.ledger.delete("started")
    return stack


# --- renewals ride out a store outage --------------------------------------------------


@pytest.mark.parametrize(
    "phase",
    [
        # Starts right after a renewal: the lease has nearly its whole ttl left.
        pytest.param(0.05, id="right-after-a-renewal"),
        # Starts just before a renewal: the lease has only a third of its ttl left past
        # the outage's start... and two regular renewals fall inside the outage.
        pytest.param(TTL / 3 - 0.1, id="just-before-a-renewal"),
    ],
)
def test_a_store_outage_of_half_the_ttl_loses_no_lease_and_runs_no_duplicate(
    cluster, store_server, phase
):
    # The holder runs past the point where its lease would have expired without a
    # renewal after the outage began.
    holder = start_holding(ledger_app.hold_requeue, "outage", TTL * 1.5, cluster)
    [info] = cluster.holders("outage")
    first_renewal = info.holder["acquired_at"] + TTL / 3
    time.sleep(max(0.0, first_renewal + phase - time.time()))
    stopped = time.time()
    store_server.stop()
    duplicate = ledger_app.hold_requeue.delay("outage", 0)
    time.sleep(TTL / 2 - 0.3)  # the restart below takes the rest
    store_server.start()
    outage = time.time() - stopped
    first, second = holder.get(timeout=30), duplicate.get(timeout=30)
    assert TTL / 2 - 0.3 <= outage <= TTL / 2 + 0.6
    assert first["lost"] is False, "the holder's lease was lost to the outage"
    assert second["start"] >= first["end"], "the duplicate ran beside the holder"
    assert second["token"] > first["token"]
    assert overlaps(read_ledger(cluster.ledger)) == []


# --- a holder whose lease is lost is stopped -------------------------------------------


def test_terminate_stops_the_body_at_once_and_another_worker_takes_over(cluster):
    result = start_holding(ledger_app.hold_terminate, "stolen", 20.0, cluster)
    [info] = cluster.holders("stolen")
    released = time.time()
    backend_for_url(cluster.store).force_release("exclusive:stolen")
    assert wait_until(lambda: read_ledger(cluster.ledger), timeout=TTL / 3 + 1.0 + 2.0)
    [stopped] = read_ledger(cluster.ledger)
    assert stopped["ended"] == "LeaseLost"
    assert stopped["end"] - released <= TTL / 3 + 1.0  # a renewal, plus the grace
    with pytest.raises(LeaseLost):
        result.get(timeout=60)
    assert running(info.holder["pid"]), "the pool child should have been interrupted, not killed"

    successor = ledger_app.hold_terminate.delay("stolen", 0.2).get(timeout=20)
    assert successor["ended"] == "returned"
    assert successor["token"] > stopped["token"]
    assert overlaps(read_ledger(cluster.ledger)) == []


def test_terminate_kills_a_body_that_ignores_the_interrupt_and_the_worker_lives_on(cluster):
    result = ledger_app.hold_terminate.delay("stubborn", 20.0, True)
    assert wait_until(lambda: cluster.holders("stubborn"), timeout=15)
    [info] = cluster.holders("stubborn")
    pid = info.holder["pid"]
    released = time.time()
    backend_for_url(cluster.store).force_release("exclusive:stubborn")
    assert wait_until(lambda: not running(pid), timeout=TTL / 3 + 1.0 + 2.0), "never killed"
    killed = time.time()
    assert killed - released <= TTL / 3 + 1.0 + 1.0
    with pytest.raises(Exception, match="WorkerLost|SIGKILL|exited"):
        result.get(timeout=60)
    assert read_ledger(cluster.ledger) == [], "the killed body should not have returned"
    # Both workers still serve: the pool replaced its killed child.
    runs = [ledger_app.hold_terminate.delay(f"after-{i}", 0.5) for i in range(3)]
    assert all(r.get(timeout=20)["ended"] == "returned" for r in runs)
    started = [json.loads(raw) for raw in cluster.ledger.lrange("started", 0, -1)]
    assert pid not in {s["pid"] for s in started[1:]}


def _watch_until_dead(pid: int, timeout: float) -> float:
    """Poll ``pid`` until it is gone; return the last time it was seen alive."""
    seen_alive = time.time()
    deadline = seen_alive + timeout
    while running(pid):
        seen_alive = time.time()
        assert seen_alive < deadline, f"process {pid} never died"
        time.sleep(0.01)
    return seen_alive


def _started(cluster, key: str) -> list[dict]:
    started = [json.loads(raw) for raw in cluster.ledger.lrange("started", 0, -1)]
    return [s for s in started if s["key"] == key]


def test_a_body_killed_for_its_lost_lease_runs_again_once_after_the_kill(cluster):
    result = ledger_app.hold_terminate_again.delay("killed", 4.0, True)
    assert wait_until(lambda: _started(cluster, "killed"), timeout=15)
    [info] = cluster.holders("killed")
    pid = info.holder["pid"]
    backend_for_url(cluster.store).force_release("exclusive:killed")
    last_alive = _watch_until_dead(pid, timeout=TTL / 3 + 1.0 + 2.0)
    rerun = result.get(timeout=60)  # the same task id: the rerun's result is the call's
    time.sleep(1.0)  # a second rerun, if any, would have started by now
    first, second = _started(cluster, "killed")
    assert first["pid"] == pid
    assert rerun["ended"] == "returned" and rerun["pid"] != pid
    assert rerun["start"] == second["start"] > last_alive, "the rerun overlapped the killed body"
    assert rerun["token"] > info.fencing_token
    assert [run["task_id"] for run in read_ledger(cluster.ledger)] == [result.id]


def test_a_body_killed_for_its_lost_lease_is_not_sent_again_when_it_opted_out(cluster):
    result = ledger_app.hold_terminate.delay("opted-out", 20.0, True)
    assert wait_until(lambda: _started(cluster, "opted-out"), timeout=15)
    [info] = cluster.holders("opted-out")
    backend_for_url(cluster.store).force_release("exclusive:opted-out")
    _watch_until_dead(info.holder["pid"], timeout=TTL / 3 + 1.0 + 2.0)
    with pytest.raises(Exception, match="WorkerLost|SIGKILL|exited"):
        result.get(timeout=60)
    time.sleep(2.0)  # a rerun would have started by now
    assert len(_started(cluster, "opted-out")) == 1
    assert [e for e in read_ledger(cluster.ledger) if e["key"] == "opted-out"] == []


def test_a_child_killed_for_another_reason_than_a_lost_lease_is_not_sent_again(cluster):
    result = ledger_app.hold_terminate_again.delay("oom", 20.0, True)
    assert wait_until(lambda: _started(cluster, "oom"), timeout=15)
    [info] = cluster.holders("oom")
    os.kill(info.holder["pid"], signal.SIGKILL)  # as the OOM killer does
    with pytest.raises(Exception, match="WorkerLost|SIGKILL|exited"):
        result.get(timeout=60)
    time.sleep(2.0)  # a rerun would have started by now
    assert len(_started(cluster, "oom")) == 1
    assert read_ledger(cluster.ledger) == []


@pytest.fixture
def solo_worker(cluster):
    worker = cluster.worker("solo", pool="solo", extra=("-Q", "solo")).start()
    yield worker
    worker.stop(signal.SIGKILL)


def test_terminate_under_the_solo_pool_interrupts_the_body_and_the_worker_serves_on(
    cluster, solo_worker
):
    # The body runs in the solo worker's own process, which is never killed for it.
    result = ledger_app.hold_terminate.apply_async(("solo", 20.0), queue="solo")
    assert wait_until(lambda: cluster.holders("solo"), timeout=15)
    assert cluster.holders("solo")[0].holder["pid"] == solo_worker.pid
    backend_for_url(cluster.store).force_release("exclusive:solo")
    with pytest.raises(LeaseLost):
        result.get(timeout=TTL / 3 + 5)
    assert read_ledger(cluster.ledger)[0]["ended"] == "LeaseLost"
    after = ledger_app.hold_terminate.apply_async(("solo-after", 0.1), queue="solo")
    assert after.get(timeout=60)["pid"] == solo_worker.pid
