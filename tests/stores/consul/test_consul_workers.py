"""ExclusiveTask on real Celery workers with the Consul lease store.

The store is the Consul HTTP API emulator (tests/support/consul_emulator/), or a real agent
when CONSUL_HTTP_ADDR is set. Workers take Consul's 10 s minimum session TTL and the
default lock delay.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from celery_exclusive import DuplicateSkipped
from celery_exclusive.backends.consul import ConsulPermissionDenied
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.consul_emulator import ConsulEmulator
from tests.support.workers import overlaps, read_ledger


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
        ledger_app.hold_skip.delay("busy", 0).get(timeout=60)
    assert info.value.holder_task_id == holder.id
    holder.get(timeout=60)


def test_wait_on_consul_is_woken_by_the_release(cluster):
    holder = start_holding(ledger_app.hold_wait, "busy", 1.0, cluster)
    duplicate = ledger_app.hold_wait.delay("busy", 0)
    first, second = holder.get(timeout=20), duplicate.get(timeout=30)
    assert second["start"] >= first["end"]
    assert second["requeues"] == 0
    assert second["start"] - first["end"] < 5  # wait_timeout is 30 s


def test_a_key_with_double_slashes_and_dots_works_end_to_end_on_consul(cluster):
    key = "https://example.com//a/./b/../c?q=1"
    holder = start_holding(ledger_app.hold_skip, key, 1.0, cluster)
    assert [info.key for info in cluster.holders(key)] == ["exclusive:" + key]
    with pytest.raises(DuplicateSkipped):
        ledger_app.hold_skip.delay(key, 0).get(timeout=60)
    holder.get(timeout=60)
    assert cluster.holders(key) == []
    assert ledger_app.hold_skip.delay(key, 0).get(timeout=60)["key"] == key


def test_a_token_without_key_write_fails_the_task_with_the_named_error(cluster):
    """Not a skip ("held by another task"), not a requeue loop: the permission to grant."""
    acl = ConsulEmulator(acl=True).start()
    acl.add_token("read-only", key_prefix={"leases/": "read"}, session_prefix={"": "write"})
    store = f"{acl.url}/leases?token=read-only"
    worker = cluster.worker("acl", env={"store": store}, concurrency=1, extra=("-Q", "acl"))
    try:
        try:
            worker.start()
        except RuntimeError:  # a start-up check refused it: the same named error
            assert "ConsulPermissionDenied" in worker.output()
            return
        result = ledger_app.hold_skip.apply_async(("denied", 0), queue="acl")
        with pytest.raises(ConsulPermissionDenied, match="key_prefix"):
            result.get(timeout=30)
        assert read_ledger(cluster.ledger) == []
    finally:
        worker.stop()
        acl.stop()


# Last: it kills a pool child, after which Celery may leave a task unrun for a while.
def test_the_main_process_frees_a_sigkilled_childs_consul_lease_at_once(cluster):
    result = start_holding(ledger_app.hold_long_lease, "killed", 60, cluster)
    [info] = cluster.holders("killed")
    os.kill(info.holder["pid"], signal.SIGKILL)
    # Its session lives 30-60 s more (ttl 30): gone long before, the main process freed it.
    assert wait_until(lambda: not cluster.holders("killed"), timeout=5)
    with pytest.raises(Exception, match="WorkerLost|SIGKILL|exited"):
        result.get(timeout=60)
    assert ledger_app.hold_skip.delay("killed", 0).get(timeout=60)["key"] == "killed"
