"""``?recipe=mutex`` under a real ``celery worker``: tasks and ``etcdctl lock`` exclude
each other on one mutex, both ways. The ledger app's key ``k`` is the mutex
``<root>/exclusive:k``."""

from __future__ import annotations

import uuid

import pytest

from celery_exclusive import DuplicateSkipped, backend_for_url
from tests.stores.etcd.test_etcd_recipe import Etcdctl
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.workers import read_ledger


@pytest.fixture(scope="module")
def stack(request, etcd_server, redis_server, client_dbs, tmp_path_factory):
    root = f"w-{uuid.uuid4().hex[:8]}"
    url = f"{etcd_server.url}/{root}?recipe=mutex"
    stack = Stack(redis_server, *client_dbs, url, tmp_path_factory)
    stack.root = root
    with stack.running(stack.worker("e1")):
        yield stack


@pytest.fixture
def etcdctl(etcd_server):
    tool = Etcdctl(etcd_server.endpoint)
    yield tool
    tool.stop()


def foreign_holds(cluster, key: str) -> bool:
    infos = backend_for_url(cluster.store).holders_of("exclusive:" + key)
    return bool(infos) and infos[0].fencing_token is None


def test_a_task_sent_while_etcdctl_holds_the_mutex_is_skipped_naming_it(cluster, etcdctl):
    etcdctl.lock(f"{cluster.root}/exclusive:m1")
    assert wait_until(lambda: foreign_holds(cluster, "m1"), timeout=10)
    with pytest.raises(DuplicateSkipped, match="etcd concurrency mutex"):
        ledger_app.hold_skip.delay("m1").get(timeout=30)
    assert read_ledger(cluster.ledger) == []


def test_a_waiting_task_runs_as_soon_as_etcdctl_releases(cluster, etcdctl, tmp_path):
    script = tmp_path / "hold.sh"
    script.write_text("sleep 1; date +%s.%N\n")
    holder = etcdctl.lock(f"{cluster.root}/exclusive:m2", "sh", str(script))
    assert wait_until(lambda: foreign_holds(cluster, "m2"), timeout=10)
    entry = ledger_app.hold_wait.delay("m2").get(timeout=30)
    output, _ = holder.communicate(timeout=10)
    ended_at = float(output.split()[-1])
    assert ended_at <= entry["start"] < ended_at + 1.0


def test_etcdctl_lock_waits_for_the_running_task(cluster, etcdctl):
    result = start_holding(ledger_app.hold_skip, "m3", 1.5, cluster)
    waiter = etcdctl.lock(f"{cluster.root}/exclusive:m3", "date", "+%s.%N")
    output, _ = waiter.communicate(timeout=30)
    taken_at = float(output.split()[-1])
    entry = result.get(timeout=30)
    assert entry["end"] <= taken_at < entry["end"] + 1.0
