"""The PostgreSQL and etcd stores under real Celery workers and real faults.

Real servers (Debian's ``postgresql`` and ``etcd-server``) started by the tests on
free ports; real ``celery worker`` processes; every run recorded in a Redis ledger.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.workers import overlaps, read_ledger, runs_by_key

STORES = ["postgresql", "etcd"]


def store_url(request, name: str) -> str:
    """A schema (PostgreSQL) or key prefix (etcd) of the caller's own on the session server."""
    if name == "postgresql":
        return f"{request.getfixturevalue('postgres_server').url}?schema=w_{uuid.uuid4().hex[:8]}"
    return f"{request.getfixturevalue('etcd_server').url}/w-{uuid.uuid4().hex[:8]}"


def tokens_rise_per_key(entries: list[dict]) -> bool:
    return all(
        [e["token"] for e in runs] == sorted({e["token"] for e in runs})
        for runs in runs_by_key(entries)
    )


@pytest.fixture(scope="module", params=STORES)
def stack(request, redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, store_url(request, request.param), tmp_path_factory)
    with stack.running(stack.worker("s1"), stack.worker("s2")):
        yield stack


def test_two_prefork_workers_run_200_tasks_over_10_keys_without_overlap(cluster):
    results = [ledger_app.hold_requeue.delay(f"key-{i % 10}", 0.01) for i in range(200)]
    assert [r.get(timeout=180) and r.state for r in results] == ["SUCCESS"] * 200
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 200
    assert overlaps(entries) == []
    assert tokens_rise_per_key(entries)
    assert len({e["pid"] for e in entries}) > 1, "work was not spread across processes"


def test_wait_is_woken_by_the_release(cluster):
    holder = start_holding(ledger_app.hold_wait, "busy", 1.0, cluster)
    duplicate = ledger_app.hold_wait.delay("busy", 0)
    first, second = holder.get(timeout=20), duplicate.get(timeout=30)
    assert second["start"] >= first["end"]
    assert second["requeues"] == 0
    assert second["start"] - first["end"] < 10.0  # wait_timeout is 30 s: the release woke it


def test_the_main_process_frees_the_lease_of_a_sigkilled_holder(cluster):
    start_holding(ledger_app.hold_long_lease, "killed", 60, cluster)
    [info] = cluster.holders("killed")
    os.kill(info.holder["pid"], signal.SIGKILL)
    # Its lease lasts 30 s: gone long before, the worker's main process released it.
    assert wait_until(lambda: not cluster.holders("killed"), timeout=10)
    entry = ledger_app.hold_skip.delay("killed", 0).get(timeout=60)
    assert entry["token"] > info.fencing_token
