"""Exclusion holds across pools and the ways Celery sends work."""

from __future__ import annotations

import pytest
from celery import chain, group

from celery_exclusive import DuplicateSkipped
from tests.apps import ledger as ledger_app
from tests.cluster import Stack
from tests.workers import overlaps, read_ledger


@pytest.fixture(scope="module", params=["threads", "solo", "prefork"])
def stack(request, redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    concurrency = 1 if request.param == "solo" else 4
    workers = [
        stack.worker(f"{request.param}{i}", pool=request.param, concurrency=concurrency)
        for i in range(2)
    ]
    with stack.running(*workers):
        yield stack


def test_runs_of_one_key_never_overlap(cluster):
    results = [ledger_app.hold_requeue.delay(f"k{i % 2}", 0.02) for i in range(40)]
    assert all(r.get(timeout=60) for r in results)
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 40
    assert overlaps(entries) == []


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
