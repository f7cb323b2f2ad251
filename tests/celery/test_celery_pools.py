"""Exclusion holds across pools and the ways Celery sends work.

gevent and eventlet run many tasks on one thread: the heartbeat is a greenlet there,
and every waiting or requeueing greenlet holds a broker connection, so those workers
run with a pool larger than kombu's default of 10 (``max_connections``).
"""

from __future__ import annotations

import time

import pytest
from celery import chain, group

from celery_exclusive import DuplicateSkipped
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding
from tests.support.workers import overlaps, read_ledger

GREENLET_POOLS = ("gevent", "eventlet")


@pytest.fixture(scope="module", params=["threads", "solo", "prefork", *GREENLET_POOLS])
def stack(request, redis_server, client_dbs, tmp_path_factory):
    pool = request.param
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    stack.pool = pool
    concurrency = {"solo": 1, "gevent": 20, "eventlet": 20}.get(pool, 4)
    env = {"max_connections": 100} if pool in GREENLET_POOLS else {}
    workers = [
        stack.worker(f"{pool}{i}", pool=pool, concurrency=concurrency, env=env) for i in range(2)
    ]
    with stack.running(*workers):
        yield stack


def test_runs_of_one_key_never_overlap(cluster):
    results = [ledger_app.hold_requeue.delay(f"k{i % 2}", 0.02) for i in range(40)]
    assert all(r.get(timeout=60) for r in results)
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 40
    assert overlaps(entries) == []


def test_waiting_duplicates_all_run_once_and_never_overlap(cluster):
    results = [ledger_app.hold_wait.delay(f"w{i % 3}", 0.02) for i in range(30)]
    assert all(r.get(timeout=60) for r in results)
    entries = read_ledger(cluster.ledger)
    assert sorted(e["task_id"] for e in entries) == sorted(r.id for r in results)
    assert overlaps(entries) == []


def test_a_body_running_three_ttls_keeps_its_lease(cluster):
    if cluster.pool == "prefork":
        pytest.skip("covered by test_celery_workers")
    holder = start_holding(ledger_app.hold_skip, "long", cluster.ttl * 3, cluster)
    time.sleep(cluster.ttl * 2)
    with pytest.raises(DuplicateSkipped):
        ledger_app.hold_skip.delay("long", 0).get(timeout=60)
    assert holder.get(timeout=30)["lost"] is False
    assert [e["task_id"] for e in read_ledger(cluster.ledger)] == [holder.id]


def test_acks_late_tasks_are_excluded_and_released(cluster):
    results = [ledger_app.hold_acks_late.delay("late", 0.3) for _ in range(3)]
    outcomes = [r.get(timeout=20, propagate=False) for r in results]
    ran = [o for o in outcomes if isinstance(o, dict)]
    assert all(isinstance(o, (dict, DuplicateSkipped)) for o in outcomes)
    assert len(ran) == len(read_ledger(cluster.ledger)) >= 1
    assert overlaps(read_ledger(cluster.ledger)) == []
    assert cluster.holders("late") == []


def test_a_chain_on_one_key_runs_each_link_in_turn(cluster):
    work = chain(ledger_app.hold_skip.si("chained", 0.05) for _ in range(3))
    work.apply_async().get(timeout=30)
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 3
    assert [e["token"] for e in entries] == sorted(e["token"] for e in entries)


def test_a_group_on_one_key_with_requeue_runs_every_member_once(cluster):
    group(ledger_app.hold_requeue.si("grouped", 0.05) for _ in range(5)).apply_async().get(
        timeout=60
    )
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 5
    assert overlaps(entries) == []


def test_a_task_sent_by_name_is_exclusive(cluster):
    result = ledger_app.app.send_task("ledger.hold_skip", args=("by-name", 0))
    assert result.get(timeout=20)["token"] is not None
