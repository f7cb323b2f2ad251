"""Real ``celery worker``s on a Consul store speaking Consul's own recipes
(``?recipe=``), beside HashiCorp's client (tests/support/consul_api.py, transcribed from
api/lock.go and api/semaphore.go) on the same agent: each excludes the other on one
key, a duplicate names the Go holder, and neither deletes what the other wrote."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from urllib.parse import urlsplit

import pytest

from celery_exclusive import DuplicateSkipped
from tests.support import consul_api as api
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.consul_emulator import EmulatedConsul
from tests.support.workers import read_ledger

FOLDER = f"recipes-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, consul_server, tmp_path_factory):
    store = f"{consul_server.url}/{FOLDER}?recipe=api"
    stack = Stack(redis_server, *client_dbs, store, tmp_path_factory)
    with stack.running(stack.worker("r1"), stack.worker("r2")):
        yield stack


@pytest.fixture
def go(consul_server) -> api.Client:
    parts = urlsplit(consul_server.url)
    return api.Client(f"http://{parts.hostname}:{parts.port}")


def key() -> str:
    return f"invoice-{uuid.uuid4().hex[:8]}"


def path_of(task_key: str) -> str:
    """The KV path a task's key locks: the store's folder, the key prefix, the key."""
    return f"{FOLDER}/exclusive:{task_key}"


def go_holding(go: api.Client, task_key: str) -> api.Lock:
    lock = api.Lock(go, api.LockOptions(Key=path_of(task_key), Value=b"go billing"))
    assert lock.Lock() is not None
    return lock


def test_a_skipped_duplicate_names_the_go_holder(cluster, go):
    k = key()
    lock = go_holding(go, k)
    with pytest.raises(DuplicateSkipped, match="Consul API Lock") as info:
        ledger_app.hold_skip.delay(k, 0).get(timeout=60)
    assert info.value.holder_task_id is None
    lock.Unlock()
    assert ledger_app.hold_skip.delay(k, 0).get(timeout=60)["key"] == k
    assert len(read_ledger(cluster.ledger)) == 1


@pytest.mark.parametrize(
    "task", [ledger_app.hold_wait, ledger_app.hold_requeue], ids=["wait", "requeue"]
)
def test_a_duplicate_runs_once_the_go_holder_unlocks(cluster, go, task):
    k = key()
    lock = go_holding(go, k)
    result = task.delay(k, 0)
    time.sleep(1.5)
    assert read_ledger(cluster.ledger) == []  # not run beside Go's holder
    unlocked_at = time.time()
    lock.Unlock()
    entry = result.get(timeout=60)
    assert entry["start"] >= unlocked_at
    if task is ledger_app.hold_requeue:
        assert entry["requeues"] >= 1


def test_go_waits_for_a_running_task_and_takes_the_key_after_it(cluster, go):
    k = key()
    result = start_holding(ledger_app.hold_skip, k, 1.5, cluster)
    lock = api.Lock(go, api.LockOptions(Key=path_of(k)))
    assert lock.Lock() is not None
    locked_at = time.time()
    entry = result.get(timeout=60)
    assert locked_at >= entry["end"]
    lock.Unlock()


def test_go_semaphore_holders_and_limit_2_tasks_never_exceed_2_nor_lose_their_record(
    cluster, go, consul_server
):
    if not isinstance(consul_server, EmulatedConsul):
        pytest.skip("looks inside the emulator")
    emulator = consul_server.emulator
    worker = cluster.worker("limit2", env={"limit": 2}, extra=("-Q", "limit2"))
    worker.start()
    k = key()
    record = f"{path_of(k)}/.lock"
    go_spans, lost, record_seen_missing = [], [], []
    stop = threading.Event()

    def go_holder() -> None:
        while not stop.is_set():
            semaphore = api.Semaphore(go, api.SemaphoreOptions(Prefix=path_of(k), Limit=2))
            held = semaphore.Acquire()
            start = time.time()
            time.sleep(0.3)
            end = time.time()
            lost.append(held.is_set())
            semaphore.Release()
            go_spans.append((start, end))

    def watch_record() -> None:
        while not stop.wait(0.02):
            if go_spans and record not in emulator.kv:
                record_seen_missing.append(time.time())

    try:
        threads = [threading.Thread(target=go_holder, daemon=True) for _ in range(2)]
        threads.append(threading.Thread(target=watch_record, daemon=True))
        for thread in threads:
            thread.start()
        results = [ledger_app.hold_requeue.apply_async((k, 0.3), queue="limit2") for _ in range(6)]
        entries = [r.get(timeout=120) for r in results]
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        worker.stop()
    spans = [(e["start"], e["end"]) for e in entries] + go_spans
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    assert len(entries) == 6 and go_spans
    assert peak <= 2
    assert not any(lost), "a Go holder was told it lost its slot"
    assert record_seen_missing == []
    assert json.loads(emulator.kv[record]["Value"])["Limit"] == 2


def test_consul_lock_and_a_task_on_the_consul_lock_recipe_exclude_each_other(
    cluster, go, consul_server
):
    store = f"{consul_server.url}/{FOLDER}?recipe=consul-lock"
    worker = cluster.worker("cli", env={"store": store}, extra=("-Q", "cli"))
    worker.start()
    k = key()
    try:
        result = ledger_app.hold_skip.apply_async((k, 1.5), queue="cli")
        assert wait_until(lambda: read_ledger(cluster.ledger) or _locked(go, k), timeout=15)
        refused = api.consul_lock(go, path_of(k), lambda lost: "ran", timeout=0.3)
        assert refused["acquired"] is False
        entry = result.get(timeout=60)
        done = api.consul_lock(go, path_of(k), lambda lost: time.time())
        assert done["result"] >= entry["end"]

        def inside(lost):
            """While `consul lock` holds the key, a task of it is a duplicate."""
            with pytest.raises(DuplicateSkipped) as info:
                ledger_app.hold_skip.apply_async((k, 0), queue="cli").get(timeout=60)
            return str(info.value)

        skipped = api.consul_lock(go, path_of(k), inside, child_name="./reindex")["result"]
        assert "Consul lock for './reindex'" in skipped
    finally:
        worker.stop()


def _locked(go: api.Client, task_key: str) -> bool:
    pair, _ = go.kv().Get(f"{path_of(task_key)}/.lock")
    return pair is not None and bool(pair.Session)


def test_the_guides_plain_acquire_and_a_task_exclude_each_other(cluster, go, consul_server):
    store = f"{consul_server.url}/{FOLDER}?recipe=acquire"
    worker = cluster.worker("plain", env={"store": store}, extra=("-Q", "plain"))
    worker.start()
    k = key()
    session = go.session().Create(api.SessionEntry(Name="service/leader", TTL="10s"))
    leader = api.KVPair(Key=path_of(k), Value=b"node-a", Session=session)
    try:
        assert go.kv().Acquire(leader)
        with pytest.raises(DuplicateSkipped, match="service/leader"):
            ledger_app.hold_skip.apply_async((k, 0), queue="plain").get(timeout=60)
        assert go.kv().Release(leader)
        result = ledger_app.hold_skip.apply_async((k, 1.5), queue="plain")
        assert wait_until(lambda: read_ledger(cluster.ledger) or _held(go, k), timeout=15)
        assert not go.kv().Acquire(leader)
        result.get(timeout=60)
        assert go.kv().Acquire(leader)
    finally:
        worker.stop()


def _held(go: api.Client, task_key: str) -> bool:
    pair, _ = go.kv().Get(path_of(task_key))
    return pair is not None and bool(pair.Session)


# Last: it kills a pool child, after which Celery may leave a task unrun for a while.
def test_the_main_process_unlocks_a_sigkilled_childs_recipe_lock_and_go_takes_it(cluster, go):
    k = key()
    result = start_holding(ledger_app.hold_long_lease, k, 60, cluster)
    [info] = cluster.holders(k)
    os.kill(info.holder["pid"], signal.SIGKILL)
    lock = api.Lock(go, api.LockOptions(Key=path_of(k), LockTryOnce=True, LockWaitTime=5))
    assert lock.Lock() is not None  # unlocked by the main process, long before its ttl
    with pytest.raises(Exception, match="WorkerLost|SIGKILL|exited"):
        result.get(timeout=60)
    lock.Unlock()
