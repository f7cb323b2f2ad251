"""ExclusiveTask on real Celery workers with the Consul lease store.

The store is the Consul HTTP API emulator (tests/consul_emulator.py), or a real agent
when CONSUL_HTTP_ADDR is set. Workers take Consul's 10 s minimum session TTL.
"""

from __future__ import annotations

import uuid

import pytest

from celery_exclusive import DuplicateSkipped
from tests.apps import ledger as ledger_app
from tests.cluster import Stack, start_holding
from tests.workers import overlaps, read_ledger


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, consul_server, tmp_path_factory):
    store = f"{consul_server.url}/exclusive-workers/{uuid.uuid4().hex}"
    stack = Stack(redis_server, *client_dbs, store, tmp_path_factory)
    with stack.running(stack.worker("c1"), stack.worker("c2")):
        yield stack


def test_two_workers_never_overlap_runs_of_one_key_on_consul(cluster):
    results = [ledger_app.hold_requeue.delay(f"key-{i % 10}", 0.01) for i in range(200)]
    assert [r.get(timeout=180) and r.state for r in results] == ["SUCCESS"] * 200
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 200
    assert overlaps(entries) == []
    for key in {e["key"] for e in entries}:
        tokens = [e["token"] for e in sorted(entries, key=lambda e: e["start"]) if e["key"] == key]
        assert tokens == sorted(set(tokens)), "fencing tokens must increase per key"


def test_a_duplicate_on_consul_is_skipped_naming_the_holder(cluster):
    holder = start_holding(ledger_app.hold_skip, "busy", 1.0, cluster)
    with pytest.raises(DuplicateSkipped) as info:
        ledger_app.hold_skip.delay("busy", 0).get(timeout=15)
    assert info.value.holder_task_id == holder.id
    holder.get(timeout=15)


def test_wait_on_consul_is_woken_by_the_release(cluster):
    holder = start_holding(ledger_app.hold_wait, "busy", 1.0, cluster)
    duplicate = ledger_app.hold_wait.delay("busy", 0)
    first, second = holder.get(timeout=20), duplicate.get(timeout=30)
    assert second["start"] >= first["end"]
    assert second["requeues"] == 0
    assert second["start"] - first["end"] < 5  # wait_timeout is 30 s
