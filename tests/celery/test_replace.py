"""Replace (``exclusive_on_duplicate="replace"``): a newer call of a key stops the
running one, through the path a lost lease takes (its ``LeaseLost``, its grace), and
runs once it stopped, under a higher fencing token; the stopped call ends replaced,
naming its successor, and is not sent again.

Real prefork workers (two, two processes each) on one broker; every run noted in a
Redis ledger, and how each stopped in its "stops" list.
"""

from __future__ import annotations

import json

import pytest

from celery_exclusive import DuplicateReplaced
from tests.support.apps import kept
from tests.support.cluster import KEEPING_STORES, kept_stack, wait_until
from tests.support.workers import read_ledger


@pytest.fixture(scope="module", params=KEEPING_STORES)
def stack(request, redis_server, client_dbs, tmp_path_factory):
    with kept_stack(request, redis_server, client_dbs, tmp_path_factory, "rep", 2) as stack:
        yield stack


def stops_of(cluster) -> dict[str, dict]:
    return {
        stop["task_id"]: stop
        for stop in (json.loads(raw) for raw in cluster.ledger.lrange("stops", 0, -1))
    }


def test_a_newer_call_stops_the_running_one_and_runs_once_it_stopped(cluster):
    running = kept.replacing.delay("search-index", 60)
    assert wait_until(lambda: cluster.holders("search-index"), timeout=30)
    [held] = cluster.holders("search-index")
    newer = kept.replacing.delay("search-index", 0)
    ran = newer.get(timeout=30)
    with pytest.raises(DuplicateReplaced, match=newer.id) as replaced:
        running.get(timeout=30)
    assert replaced.value.holder_task_id == newer.id
    stops = stops_of(cluster)
    assert stops[running.id]["how"] == "LeaseLost"
    assert stops[running.id]["end"] <= ran["start"]
    assert ran["token"] > held.fencing_token
    # Only the newer call ran to its end; the stopped one is not sent again.
    assert [run["task_id"] for run in read_ledger(cluster.ledger)] == [newer.id]


def test_calls_in_turn_each_replace_the_one_before_and_the_last_runs(cluster):
    calls = []
    for _ in range(3):
        calls.append(kept.replacing.delay("preview", 60 if len(calls) < 2 else 0))
        assert wait_until(
            lambda: any(h.task_id == calls[-1].id for h in cluster.holders("preview")), 30
        )
    assert calls[-1].get(timeout=30)["task_id"] == calls[-1].id
    for before, after in zip(calls, calls[1:]):
        with pytest.raises(DuplicateReplaced, match=after.id):
            before.get(timeout=30)


def test_two_calls_replacing_one_run_at_once_run_neither_beside_it_nor_beside_each_other(
    cluster,
):
    running = kept.replacing.delay("catalog", 60)
    assert wait_until(lambda: cluster.holders("catalog"), timeout=30)
    newer = [kept.replacing.delay("catalog", 1.0) for _ in range(2)]
    ran, replaced_by = [], {}
    for call in newer:
        try:
            ran.append(call.get(timeout=60)["task_id"])
        except DuplicateReplaced as exc:
            replaced_by[call.id] = exc.holder_task_id
    with pytest.raises(DuplicateReplaced) as stopped:
        running.get(timeout=30)
    # Each call ended once: the run stopped for a newer call, each newer call ran or was
    # replaced in turn by the other; the last one ran.
    ids = [call.id for call in newer]
    assert stopped.value.holder_task_id in ids
    assert ran and sorted(ran + list(replaced_by)) == sorted(ids)
    assert all(by in ids and by != call for call, by in replaced_by.items())
    # No body ran beside another, the stopped ones included, nor twice.
    bodies = [json.loads(raw) for raw in cluster.ledger.lrange("stops", 0, -1)]
    bodies.sort(key=lambda stop: stop["start"])
    ran_bodies = [body["task_id"] for body in bodies]
    assert len(ran_bodies) == len(set(ran_bodies)) and {running.id, *ran} <= set(ran_bodies)
    for before, after in zip(bodies, bodies[1:]):
        assert after["start"] >= before["end"], (before, after)
