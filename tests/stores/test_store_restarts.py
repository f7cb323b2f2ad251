"""The PostgreSQL and etcd stores restarted under running workers: nothing lost, no
overlap, fencing tokens still rising.

A module of its own: its workers must be the only ones consuming the session's broker
(another module's workers on another store would take these tasks).
"""

from __future__ import annotations

import time

import pytest

from tests.stores.test_store_workers import STORES, tokens_rise_per_key
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, wait_until
from tests.support.servers import EtcdServer, PostgresServer
from tests.support.workers import overlaps, read_ledger


@pytest.fixture(params=STORES)
def restartable(request, redis_server, client_dbs, tmp_path_factory):
    """A store server of this test's own, and a stack on it with a lease ttl that
    outlasts the restart."""
    server = PostgresServer() if request.param == "postgresql" else EtcdServer()
    server.start()
    url = f"{server.url}?schema=r" if request.param == "postgresql" else f"{server.url}/r"
    stack = Stack(redis_server, *client_dbs, url, tmp_path_factory)
    stack.ttl = 8.0
    stack.reset()
    with stack.running(stack.worker("r1")):
        yield stack, server
    server.cleanup()


def test_a_store_restarted_mid_run_loses_nothing_and_tokens_keep_rising(restartable):
    stack, server = restartable
    results = [ledger_app.hold_requeue.delay(f"key-{i % 4}", 0.2) for i in range(40)]
    assert wait_until(lambda: len(read_ledger(stack.ledger)) >= 8, timeout=60)
    server.stop()
    restarted_at = time.time()
    time.sleep(1.0)
    server.start()
    assert [r.get(timeout=120) and r.state for r in results] == ["SUCCESS"] * 40
    entries = read_ledger(stack.ledger)
    assert len(entries) == 40
    assert overlaps(entries) == []
    assert tokens_rise_per_key(entries)
    before = [e for e in entries if e["end"] < restarted_at]
    after = [e for e in entries if e["start"] > restarted_at]
    assert before and after
    assert min(e["token"] for e in after) > max(e["token"] for e in before)
    assert not any(e["lost"] for e in entries)
