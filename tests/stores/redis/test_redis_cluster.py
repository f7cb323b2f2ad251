"""The Redis store on a real 3-master Redis Cluster (the contract suite runs on it too,
as the ``redis-cluster`` case of tests/contract/test_backend_contract.py)."""

from __future__ import annotations

import uuid

import pytest
from redis.crc import key_slot
from redis.exceptions import ResponseError

from celery_exclusive.backends.redis import RedisBackend, layout
from celery_exclusive.backends.redis.connection import RedisConnection
from celery_exclusive.errors import BackendUnavailable, ConfigurationError
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack
from tests.support.workers import overlaps, read_ledger, runs_by_key

KEYS = [f"account-{i}" for i in range(12)]


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, redis_cluster, tmp_path_factory):
    for node in redis_cluster.nodes:
        node.client().flushall()
    stack = Stack(redis_server, *client_dbs, redis_cluster.url, tmp_path_factory)
    with stack.running(stack.worker("w1"), stack.worker("w2")):
        yield stack


@pytest.fixture
def backend(redis_cluster_url):
    backend = RedisBackend(redis_cluster_url)
    yield backend
    backend.close()


def test_two_workers_never_overlap_runs_of_keys_spread_over_three_masters(cluster, redis_cluster):
    results = [ledger_app.hold_requeue.delay(KEYS[i % len(KEYS)], 0.01) for i in range(120)]
    states = [r.get(timeout=120) and r.state for r in results]
    entries = read_ledger(cluster.ledger)
    assert states == ["SUCCESS"] * 120
    assert overlaps(entries) == []
    for runs in runs_by_key(entries):
        tokens = [run["token"] for run in runs]
        assert tokens == sorted(set(tokens))
    assert len({e["pid"] for e in entries}) > 1, "work was not spread across processes"
    assert all(node.client().dbsize() > 0 for node in redis_cluster.nodes), "a master held no key"


def test_everything_of_one_key_shares_its_hash_slot():
    key = "exclusive:{invoice}:7"
    names = [layout.lease(key), layout.fence(key), layout.holders(key), layout.signal(key)]
    names += [layout.signal(key, "task-1"), layout.mark(key, "line"), layout.record(key, "x")]
    assert len({key_slot(name.encode()) for name in names}) == 1


def test_holders_lists_the_leases_of_every_primary(backend, redis_cluster):
    leases = {backend.try_acquire(f"app:{k}", owner(), 30).key for k in KEYS}
    assert {info.key for info in backend.holders("app:")} == leases
    assert all(node.client().dbsize() > 0 for node in redis_cluster.nodes)


def test_renewal_runs_one_script_per_hash_slot_and_reports_exactly_the_lost(backend, redis_cluster):
    leases = [backend.try_acquire(f"app:{k}", owner(), 30) for k in KEYS]
    gone = {leases[0], leases[5]}
    for lease in gone:
        backend.force_release(lease.key)
    for node in redis_cluster.nodes:
        node.client().config_resetstat()
    assert backend.renew(leases) == gone
    calls = sum(
        node.client().info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        for node in redis_cluster.nodes
    )
    assert calls == len({key_slot(layout.lease(lease.key).encode()) for lease in leases})


def test_the_check_passes_on_a_cluster_and_reads_every_primary(backend):
    assert isinstance(backend.check("exclusive:~check"), list)


def test_a_plain_url_to_a_cluster_node_is_refused_at_check(redis_cluster):
    url = f"redis://127.0.0.1:{redis_cluster.nodes[0].port}/0"
    with pytest.raises(ConfigurationError, match="redis\\+cluster://"):
        RedisBackend(url).check("exclusive:~check")


def test_a_plain_url_to_a_cluster_node_fails_an_acquire_with_a_configuration_error(
    redis_cluster,
):
    first = redis_cluster.nodes[0]
    backend = RedisBackend(f"redis://127.0.0.1:{first.port}/0")
    foreign = next(k for k in (f"k{i}" for i in range(100)) if not _served_by(first, k))
    with pytest.raises(ConfigurationError, match="redis\\+cluster://"):
        backend.try_acquire(foreign, owner(), 10)


def test_a_cluster_url_to_a_plain_server_is_refused(redis_server):
    backend = RedisBackend(f"redis+cluster://127.0.0.1:{redis_server.port}")
    with pytest.raises(ConfigurationError, match="not one"):
        backend.check("exclusive:~check")


def _served_by(node, key: str) -> bool:
    slot = key_slot(layout.lease(key).encode())
    return any(
        start <= slot <= end and int(master[1]) == node.port
        for start, end, master, *_ in node.client().execute_command("CLUSTER", "SLOTS")
    )


@pytest.mark.parametrize(
    "reply",
    [
        "Script attempted to execute a command while the cluster is down",
        "Script attempted to execute a write command while the cluster is down and readonly",
    ],
)
def test_a_script_that_finds_the_cluster_down_reports_the_store_unavailable(reply):
    """Redis's own replies (src/script.c) when a script runs on a node that lost its
    cluster's majority: an outage that ends, not a wrong setting."""
    connection = RedisConnection("redis+cluster://h:1")
    error = connection.translate(ResponseError(reply), "acquiring 'k'", "k")
    assert isinstance(error, BackendUnavailable)
