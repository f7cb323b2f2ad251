"""``?recipe=ttl-lease`` under a real ``celery worker``: tasks and pymongo code keeping the
article's lease document exclude each other on one ``_id``, both ways. The ledger app's
key ``k`` is the document ``{_id: "exclusive:k"}`` of ``job_leases``."""

from __future__ import annotations

import threading
import time
import uuid

import pymongo
import pytest

from celery_exclusive import DuplicateSkipped
from tests.stores.mongodb.test_mongodb_recipe import ArticleLease
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding
from tests.support.workers import overlaps, read_ledger


@pytest.fixture(scope="module")
def stack(mongo_server, redis_server, client_dbs, tmp_path_factory):
    database = f"w_{uuid.uuid4().hex[:8]}"
    stack = Stack(
        redis_server,
        *client_dbs,
        f"{mongo_server.url}/{database}?recipe=ttl-lease",
        tmp_path_factory,
    )
    client = pymongo.MongoClient(mongo_server.url, tz_aware=True)
    stack.leases = client[database]["job_leases"]
    with stack.running(stack.worker("m1")):
        yield stack
    client.close()


def node(cluster, key: str) -> ArticleLease:
    return ArticleLease(cluster.leases, "exclusive:" + key, f"node-{uuid.uuid4().hex[:6]}")


def test_a_task_sent_while_an_article_lease_is_held_is_skipped_naming_it(cluster):
    theirs = node(cluster, "m1")
    assert theirs.acquire()
    with pytest.raises(DuplicateSkipped, match=f"owner '{theirs.node}'"):
        ledger_app.hold_skip.delay("m1").get(timeout=30)
    assert read_ledger(cluster.ledger) == []
    assert theirs.release()


def test_a_waiting_task_runs_as_soon_as_the_article_lease_is_released(cluster):
    theirs = node(cluster, "m2")
    assert theirs.acquire()
    result = ledger_app.hold_wait.delay("m2")
    time.sleep(1.0)
    released_at = time.time()
    assert theirs.release()
    entry = result.get(timeout=30)
    assert released_at <= entry["start"] < released_at + 1.0


def test_a_requeued_task_runs_after_the_article_lease_is_released(cluster):
    theirs = node(cluster, "m3")
    assert theirs.acquire()
    result = ledger_app.hold_requeue.delay("m3")
    time.sleep(1.0)
    released_at = time.time()
    assert theirs.release()
    entry = result.get(timeout=30)
    assert entry["start"] >= released_at
    assert entry["requeues"] >= 1


def test_the_article_s_node_gets_the_lease_only_after_the_running_task(cluster):
    result = start_holding(ledger_app.hold_skip, "m4", 1.5, cluster)
    theirs = node(cluster, "m4")
    assert theirs.acquire() is False
    assert theirs.acquire_waiting(30, every=0.02)
    taken_at = time.time()
    entry = result.get(timeout=30)
    assert entry["end"] <= taken_at < entry["end"] + 1.0
    assert theirs.release()


def test_tasks_and_article_nodes_on_one_key_never_overlap(cluster):
    results = [ledger_app.hold_wait.delay("m5", 0.05) for _ in range(6)]
    spans = []

    def theirs() -> None:
        lease = node(cluster, "m5")
        for _ in range(3):
            assert lease.acquire_waiting(90, every=0.02)
            start = time.time()
            time.sleep(0.05)
            spans.append({"key": "m5", "start": start, "end": time.time()})
            lease.release()

    threads = [threading.Thread(target=theirs) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(r.get(timeout=120) for r in results)
    entries = read_ledger(cluster.ledger) + spans
    assert len(entries) == 12
    assert overlaps(entries) == []
