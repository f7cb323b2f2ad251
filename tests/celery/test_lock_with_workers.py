"""A ``with`` block of any code and a real Celery worker exclude each other on one key.

Real ``celery worker`` processes (prefork, 2 children) run the ledger app's tasks,
whose key is ``exclusive:<key>``; the blocks run in this test process, sync and
``async with``, through ``task.exclusive_lock(...)`` or ``exclusive_lock(key, app=...)``.
Tasks and blocks append their runs to one ledger, read from outside: no two runs of a
key may overlap, on every store the workers run against.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid

import pytest

from celery_exclusive import DuplicateSkipped, LockHeld, exclusive_lock
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.workers import overlaps, read_ledger


def store_url(request, name: str) -> str:
    if name == "postgresql":
        return f"{request.getfixturevalue('postgres_server').url}?schema=l_{uuid.uuid4().hex[:8]}"
    if name == "etcd":
        return f"{request.getfixturevalue('etcd_server').url}/l-{uuid.uuid4().hex[:8]}"
    return name  # redis, sqlite: Stack makes one


@pytest.fixture(scope="module", params=["redis", "sqlite", "postgresql", "etcd"])
def stack(request, redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, store_url(request, request.param), tmp_path_factory)
    with stack.running(stack.worker("l1")):
        yield stack


def note(cluster, key: str, lease, start: float) -> None:
    """Put a block's run in the ledger, as a task's run is."""
    entry = {"key": key, "token": lease.fencing_token, "start": start, "end": time.time()}
    cluster.ledger.rpush("ledger", json.dumps({**entry, "task_id": "block", "pid": os.getpid()}))


def test_a_task_sent_while_a_block_holds_the_key_is_skipped_naming_the_block(cluster):
    with exclusive_lock("invoice:1", app=ledger_app.app):
        result = ledger_app.hold_skip.delay("invoice:1")
        with pytest.raises(DuplicateSkipped) as raised:
            result.get(timeout=30)
    assert f"held by an exclusive lock of invoice:1 in process {os.getpid()}" in str(raised.value)
    assert read_ledger(cluster.ledger) == []


def test_a_waiting_task_runs_once_the_block_ends(cluster):
    with ledger_app.hold_wait.exclusive_lock("invoice:2") as lease:
        start = time.time()
        result = ledger_app.hold_wait.delay("invoice:2")
        time.sleep(1.0)
        note(cluster, "invoice:2", lease, start)
    entry = result.get(timeout=30)
    assert entry["token"] > lease.fencing_token
    assert overlaps(read_ledger(cluster.ledger)) == []


def test_a_block_entered_while_a_task_runs_raises_naming_the_task(cluster):
    result = start_holding(ledger_app.hold_skip, "invoice:3", 1.5, cluster)
    with pytest.raises(LockHeld) as raised, ledger_app.hold_skip.exclusive_lock("invoice:3"):
        pytest.fail("the block ran beside the task")
    assert raised.value.holder_task_id == result.id
    result.get(timeout=30)


def test_a_waiting_block_runs_once_the_task_ends(cluster):
    result = start_holding(ledger_app.hold_skip, "invoice:4", 1.0, cluster)
    with ledger_app.hold_skip.exclusive_lock("invoice:4").waiting(30) as lease:
        note(cluster, "invoice:4", lease, time.time())
    entry = result.get(timeout=30)
    assert lease.fencing_token > entry["token"]
    assert overlaps(read_ledger(cluster.ledger)) == []


def test_async_blocks_and_tasks_on_one_key_never_overlap(cluster):
    """Tasks keep arriving while asyncio tasks and threads of this process take turns
    with them on one key, each waiting for its turn."""
    key = "invoice:5"
    results = [ledger_app.hold_wait.delay(key, 0.05) for _ in range(8)]
    lock = exclusive_lock(key, app=ledger_app.app, wait=60)

    async def block() -> None:
        async with lock as lease:
            start = time.time()
            await asyncio.sleep(0.05)
            note(cluster, key, lease, start)

    def thread_block() -> None:
        with lock as lease:
            start = time.time()
            time.sleep(0.05)
            note(cluster, key, lease, start)

    async def main() -> None:
        await asyncio.gather(*(block() for _ in range(4)))

    threads = [threading.Thread(target=thread_block) for _ in range(4)]
    for thread in threads:
        thread.start()
    asyncio.run(main())
    for thread in threads:
        thread.join(60)
    assert all(r.get(timeout=60) for r in results)
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 16
    assert overlaps(entries) == []
    tokens = [e["token"] for e in sorted(entries, key=lambda e: e["start"])]
    assert tokens == sorted(set(tokens))
    assert wait_until(lambda: not cluster.holders(key), timeout=10)
