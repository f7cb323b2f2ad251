"""A run's lease is back in the store before Celery does anything another worker sees.

After the body returns, Celery's tracer sends a chain's next link and the callbacks,
then stores the result (where a chord's callback is sent from), then calls
``on_success``, the ``task_success`` receivers, ``after_return`` and, with
``acks_late``, acknowledges the message. The release happens inside the call, before
all of them, and its reply is awaited: that reply is the only thing that says the
store has the release before the worker's next message to another connection. The
workers here note, at the moment the result is stored and the moment a next link is
published, whether the sender still holds its key (``EXCLUSIVE_TEST_PROBE_ORDER``).
"""

from __future__ import annotations

import json

import pytest
from celery import chain

from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack
from tests.support.workers import read_ledger

LINKS = 6


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    env = {"probe_order": 1}
    workers = [stack.worker(f"order{i}", pool="prefork", concurrency=2, env=env) for i in (1, 2)]
    with stack.running(*workers):
        yield stack


def noted(cluster, moment: str) -> list[dict]:
    entries = [json.loads(raw) for raw in cluster.ledger.lrange("order", 0, -1)]
    return [entry for entry in entries if entry["moment"] == moment]


@pytest.fixture
def cluster(stack):
    stack.reset()
    stack.ledger.delete("order")
    return stack


def test_the_lease_is_released_before_the_result_is_stored(cluster):
    results = [ledger_app.hold_skip.delay(f"result-{i}", 0) for i in range(20)]
    assert all(r.get(timeout=60) for r in results)
    stored = noted(cluster, "result")
    assert len(stored) == 20
    assert [entry for entry in stored if entry["held"]] == []


def test_the_lease_is_released_before_the_next_link_of_a_chain_is_sent(cluster):
    links = chain(ledger_app.hold_skip.si("chained", 0) for _ in range(LINKS))
    links.apply_async().get(timeout=60)
    sent = noted(cluster, "next link")
    assert len(sent) == LINKS - 1
    assert [entry for entry in sent if entry["held"]] == []


def test_a_chain_on_one_key_under_skip_runs_every_link(cluster):
    for _ in range(5):
        chain(ledger_app.hold_skip.si("chain-skip", 0) for _ in range(LINKS)).apply_async().get(
            timeout=60
        )
    runs = read_ledger(cluster.ledger)
    assert len(runs) == 5 * LINKS
    assert all(run["token"] is not None for run in runs)
