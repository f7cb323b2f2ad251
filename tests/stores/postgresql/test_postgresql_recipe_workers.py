"""``?recipe=advisory`` under a real ``celery worker``: tasks and ``psql`` sessions exclude
each other on one session advisory lock, both ways. The ledger app's key ``k`` locks
``('x' || left(md5('exclusive:k'), 16))::bit(64)::bigint``."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import pytest

from celery_exclusive import DuplicateSkipped
from tests.stores.postgresql.test_postgresql_recipe import Psql, Relockers, lock_sql
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.workers import overlaps, read_ledger


@pytest.fixture(scope="module")
def stack(postgres_server, redis_server, client_dbs, tmp_path_factory):
    url = f"{postgres_server.url}?schema=w_{uuid.uuid4().hex[:8]}&recipe=advisory"
    stack = Stack(redis_server, *client_dbs, url, tmp_path_factory)
    with stack.running(stack.worker("a1")):
        yield stack


@pytest.fixture
def psql(postgres_server):
    sessions = []

    def open_session() -> Psql:
        sessions.append(Psql(postgres_server))
        return sessions[-1]

    yield open_session
    for session in sessions:
        session.close()


def foreign_holds(cluster, key: str) -> bool:
    infos = cluster.holders(key)
    return bool(infos) and infos[0].fencing_token is None


def test_a_task_sent_while_psql_holds_the_lock_is_skipped_naming_it(cluster, psql):
    theirs = psql()
    theirs.lock("exclusive:p1")
    with pytest.raises(DuplicateSkipped, match=f"held by backend {theirs.pid}"):
        ledger_app.hold_skip.delay("p1").get(timeout=30)
    assert read_ledger(cluster.ledger) == []
    assert theirs.unlock("exclusive:p1")


def test_the_worker_logs_the_psql_session_a_duplicate_was_skipped_for(cluster, psql):
    theirs = psql()
    theirs.lock("exclusive:p9")
    skipped = ledger_app.hold_skip.delay("p9")
    with pytest.raises(DuplicateSkipped):
        skipped.get(timeout=30)
    assert theirs.unlock("exclusive:p9")
    [worker] = cluster.workers
    [line] = [line for line in worker.output().splitlines() if f"task_id={skipped.id}" in line]
    holder = f"task_id={skipped.id} holder=a PostgreSQL session advisory lock on "
    assert f"duplicate skipped key=exclusive:p9 {holder}" in line
    assert f" held by backend {theirs.pid} (user postgres" in line
    assert line.endswith(", not taken by celery-exclusive")


def test_a_waiting_task_runs_as_soon_as_psql_unlocks(cluster, psql):
    theirs = psql()
    theirs.lock("exclusive:p2")
    result = ledger_app.hold_wait.delay("p2")
    time.sleep(1.0)
    unlocked_at = time.time()
    assert theirs.unlock("exclusive:p2")
    entry = result.get(timeout=30)
    assert unlocked_at <= entry["start"] < unlocked_at + 1.0


def test_a_waiting_task_takes_its_turn_among_foreign_clients_relocking_back_to_back(
    cluster, postgres_server, psql
):
    """Each foreign hold outlasts the task's waits (a third of its 2 s ttl): it keeps its
    place in PostgreSQL's queue from one to the next."""
    with Relockers(postgres_server, psql, "exclusive:p8", hold=1.0) as relockers:
        sent = time.time()
        entry = ledger_app.hold_wait.delay("p8", 0.2).get(timeout=30)
    relockers.served_in_turn(sent, entry["start"])
    assert all(end <= entry["start"] or start >= entry["end"] for _, start, end in relockers.holds)


def test_a_requeued_task_runs_after_psql_unlocks(cluster, psql):
    theirs = psql()
    theirs.lock("exclusive:p3")
    result = ledger_app.hold_requeue.delay("p3")
    time.sleep(1.0)
    unlocked_at = time.time()
    assert theirs.unlock("exclusive:p3")
    entry = result.get(timeout=30)
    assert entry["start"] >= unlocked_at
    assert entry["requeues"] >= 1


def test_psql_waits_for_the_running_task(cluster, psql):
    result = start_holding(ledger_app.hold_skip, "p4", 1.5, cluster)
    theirs = psql()
    assert theirs.try_lock("exclusive:p4") is False
    theirs.send(f"SELECT pg_advisory_lock({lock_sql('exclusive:p4')})")
    theirs.answer()
    taken_at = time.time()
    entry = result.get(timeout=30)
    assert entry["end"] <= taken_at < entry["end"] + 1.0
    assert theirs.unlock("exclusive:p4")


def test_a_sigkilled_task_frees_the_lock_for_psql_at_once(cluster, psql):
    start_holding(ledger_app.hold_long_lease, "p5", 60, cluster)
    [info] = cluster.holders("p5")
    theirs = psql()
    assert theirs.try_lock("exclusive:p5") is False
    os.kill(info.holder["pid"], signal.SIGKILL)
    killed = time.monotonic()
    assert wait_until(lambda: theirs.try_lock("exclusive:p5"), timeout=10)
    assert time.monotonic() - killed < 5  # its lease lasts 30 s: the session went with it
    assert theirs.unlock("exclusive:p5")


def test_a_stopped_task_loses_the_lock_to_psql_after_its_ttl_and_learns_it(cluster, psql):
    result = start_holding(ledger_app.hold_terminate, "p6", 20, cluster, args=())
    [info] = cluster.holders("p6")
    child = info.holder["pid"]
    theirs = psql()
    time.sleep(cluster.ttl * 1.5)  # renewed past its ttl while it runs
    assert theirs.try_lock("exclusive:p6") is False
    os.kill(child, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert wait_until(lambda: theirs.try_lock("exclusive:p6"), timeout=15)
        waited = time.monotonic() - stopped
    finally:
        os.kill(child, signal.SIGCONT)
        resumed = time.time()
    assert 0.5 < waited < cluster.ttl + 2.0  # the server's idle_session_timeout, not never
    with pytest.raises(Exception, match="LeaseLost|lost"):
        result.get(timeout=30)
    [entry] = [json.loads(e) for e in cluster.ledger.lrange("ledger", 0, -1)]
    assert entry["lost"] is True  # the body was told, not left to run beside psql...
    assert entry["end"] < resumed + 1.0  # ...as soon as it ran again
    assert theirs.unlock("exclusive:p6")


def test_tasks_and_psql_sessions_on_one_key_never_overlap(cluster, psql):
    results = [ledger_app.hold_wait.delay("p7", 0.05) for _ in range(6)]
    spans = []

    def theirs() -> None:
        session = psql()
        for _ in range(3):
            session.lock("exclusive:p7")
            start = time.time()
            time.sleep(0.05)
            spans.append({"key": "p7", "start": start, "end": time.time()})
            session.unlock("exclusive:p7")

    threads = [threading.Thread(target=theirs) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert all(r.get(timeout=90) for r in results)
    entries = read_ledger(cluster.ledger) + spans
    assert len(entries) == 12
    assert overlaps(entries) == []
