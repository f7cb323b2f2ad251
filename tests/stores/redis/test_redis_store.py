"""The Redis store at its edges: hostile keys on real workers, lost counters, eviction
policies, persistence, skewed worker clocks. Every server here is a real redis-server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from celery_exclusive.backends.line import LINE
from celery_exclusive.backends.redis import RedisBackend
from celery_exclusive.errors import BackendUnavailable, ConfigurationError
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, wait_until
from tests.support.servers import RedisServer, free_port
from tests.support.workers import ROOT, overlaps, read_ledger, runs_by_key

#: Keys spelled like another key's internal entries, with Redis's hash-tag and glob
#: characters and a newline: each must be a key like any other.
HOSTILE = [
    "inv7",
    "inv7:~line",
    "inv7:~fence",
    "inv7:~signal",
    "inv7:~holders",
    "inv7:~rerun",
    "{inv7}",
    "inv7}:fence",
    "inv7*",
    "inv7\nsecond line",
]


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    with stack.running(stack.worker("w1"), stack.worker("w2")):
        yield stack


@pytest.fixture
def server():
    """A redis-server of the test's own, which it may restart or reconfigure."""
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


# --- keys are data ----------------------------------------------------------------------


def test_hostile_keys_on_real_workers_never_overlap_and_keep_their_tokens_rising(cluster):
    waits = [ledger_app.hold_wait.delay(HOSTILE[i % len(HOSTILE)], 0.02) for i in range(40)]
    requeues = [ledger_app.hold_requeue.delay(HOSTILE[i % len(HOSTILE)], 0.02) for i in range(40)]
    states = [r.get(timeout=120) and r.state for r in waits + requeues]
    entries = read_ledger(cluster.ledger)
    assert states == ["SUCCESS"] * 80
    assert sorted({e["key"] for e in entries}) == sorted(HOSTILE)
    assert overlaps(entries) == []
    for runs in runs_by_key(entries):
        tokens = [run["token"] for run in runs]
        assert tokens == sorted(set(tokens)), f"tokens of {runs[0]['key']!r}: {tokens}"


def test_ls_lists_every_hostile_key_held_by_real_workers_exactly(cluster):
    keys = ["inv7:~line", "{inv7}", "inv7\nsecond line"]  # three keys on four processes
    results = [ledger_app.hold_skip.delay(key, 6.0) for key in keys]
    held = wait_until(lambda: all(cluster.holders(key) for key in keys), timeout=30)
    assert held, f"not all held at once: {[(r.state, r.result) for r in results]}"
    listed = subprocess.run(
        [sys.executable, "-c", "from celery_exclusive.cli.commands import main; main()"]
        + ["--backend", cluster.store, "ls", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    rows = json.loads(listed.stdout)
    assert sorted(row["key"] for row in rows) == sorted("exclusive:" + key for key in keys)
    assert {row["task_id"] for row in rows} == {r.id for r in results}
    for result in results:
        result.get(timeout=30)


# --- tokens only rise -------------------------------------------------------------------


def test_tokens_keep_rising_across_a_restart_that_forgot_every_counter(server):
    backend = RedisBackend(server.url)
    before = [backend.try_acquire("k", owner(), 30).fencing_token]
    backend.force_release("k")
    before.append(backend.try_acquire("k", owner(), 30).fencing_token)
    server.stop(signal.SIGKILL)  # no AOF, no snapshot: the server forgets everything
    server.start()
    assert server.client().dbsize() == 0
    after = backend.try_acquire("k", owner(), 30)
    assert after is not None, "the restarted store forgot the lease"
    assert after.fencing_token > max(before)
    backend.close()


def test_a_grant_in_the_same_microsecond_still_gets_a_higher_token(server):
    backend = RedisBackend(server.url)
    tokens = [backend.try_acquire("k", owner(), 30, limit=50).fencing_token for _ in range(50)]
    assert tokens == sorted(set(tokens))
    backend.close()


# --- the start-up check: eviction, persistence ------------------------------------------


@pytest.mark.parametrize(
    "policy", ["allkeys-lru", "allkeys-random", "volatile-lru", "volatile-ttl"]
)
def test_the_check_refuses_an_evicting_maxmemory_policy_naming_it(server, policy):
    server.client().config_set("maxmemory", "64mb")
    server.client().config_set("maxmemory-policy", policy)
    with pytest.raises(ConfigurationError, match=f"maxmemory-policy {policy}.*noeviction"):
        RedisBackend(server.url).check("exclusive:~check")


def test_a_server_started_with_allkeys_lru_is_refused_at_check():
    server = RedisServer(extra=("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"))
    server.start()
    try:
        with pytest.raises(ConfigurationError, match="maxmemory-policy allkeys-lru"):
            RedisBackend(server.url).check("exclusive:~check")
    finally:
        server.cleanup()


def test_a_worker_refuses_to_start_on_an_allkeys_lru_store_naming_maxmemory_policy(
    redis_server, client_dbs, tmp_path_factory
):
    server = RedisServer(extra=("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"))
    server.start()
    try:
        stack = Stack(redis_server, *client_dbs, server.url, tmp_path_factory)
        worker = stack.worker("evicting", pool="solo").start(wait=False)
        assert worker.process.wait(60) != 0
        output = worker.output()
        assert "ConfigurationError" in output and "maxmemory-policy allkeys-lru" in output
        assert "noeviction" in output and "Traceback" not in output
    finally:
        server.cleanup()


def test_workers_warn_at_start_that_a_store_without_persistence_forgets_leases(cluster):
    output = cluster.workers[0].output()
    assert "appendonly" in output and "fencing tokens keep rising" in output


def test_allow_eviction_in_the_url_turns_the_refusal_into_a_warning(server):
    server.client().config_set("maxmemory-policy", "allkeys-lru")
    warnings = RedisBackend(server.url + "?allow_eviction=true").check("exclusive:~check")
    assert any("maxmemory-policy allkeys-lru" in w for w in warnings)


def test_the_check_warns_that_a_store_without_persistence_forgets_leases(server):
    warnings = RedisBackend(server.url).check("exclusive:~check")
    assert any("appendonly" in w and "fencing" in w for w in warnings)


def test_a_store_with_append_only_persistence_passes_the_check_without_warnings():
    server = RedisServer(appendonly=True)
    server.start()
    try:
        assert RedisBackend(server.url).check("exclusive:~check") == []
    finally:
        server.cleanup()


def test_the_check_leaves_no_lease_mark_signal_or_record_behind(server):
    RedisBackend(server.url).check("exclusive:~check")
    left = {k.decode() for k in server.client().keys("*")}
    assert left <= {"{exclusive:~check}:fence"}, left


# --- failures: an outage is unavailable, and says so quickly ---------------------------


@pytest.mark.parametrize("scheme", ["redis", "redis+sentinel"])
def test_a_store_that_does_not_answer_is_unavailable_within_a_renewal_interval(scheme):
    path = "/0" if scheme == "redis" else "/leases"
    backend = RedisBackend(f"{scheme}://127.0.0.1:{free_port()}{path}")
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="did not answer"):
        backend.try_acquire("k", owner(), 10)
    assert time.monotonic() - started < 3.0


# --- store time, not worker time --------------------------------------------------------


@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (scripts/test.sh)")
def test_a_dead_waiter_whose_clock_runs_30s_fast_does_not_block_a_freed_key(server):
    backend = RedisBackend(server.url)
    holder = backend.try_acquire("k", owner(), 30)
    # A waiter on a host whose clock is 30 s ahead takes its place for 1 s, prints the
    # line as it left it, then dies.
    taken = subprocess.run(
        ["faketime", "-f", "+30s", sys.executable, "-c"]
        + [
            "import sys; from celery_exclusive.backends.redis import RedisBackend;"
            "from celery_exclusive.core import marks;"
            "backend = RedisBackend(sys.argv[1]);"
            "marks.take_place(backend, 'k', 'fast-waiter', 1.0);"
            f"print(backend.read_mark('k', {LINE!r}))",
            server.url,
        ],
        check=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    line = json.loads(taken.stdout)
    assert [entry["id"] for entry in line] == ["fast-waiter"]
    assert line[0]["until"] < time.time() + 5, "the waiter stamped its own clock"
    # A live waiter behind it, whose place lasts far longer, keeps the line alive (and
    # with it the dead waiter's entry, however long the dead process took to exit).
    line.append({"id": "next", "until": backend.store_time() + 60})
    assert backend.swap_mark("k", LINE, backend.read_mark("k", LINE), json.dumps(line), 60)
    backend.release(holder)
    started = time.monotonic()
    lease = wait_until(lambda: backend.try_acquire("k", owner(), 30, claimant="next"), 10)
    assert lease is not None
    assert time.monotonic() - started < 3, "the dead waiter kept its place"
    backend.close()


# --- wake-ups cost nothing when nobody waits -------------------------------------------


def test_a_release_nobody_waits_for_writes_no_wake_up(server):
    backend = RedisBackend(server.url)
    backend.release(backend.try_acquire("k", owner(), 30))
    assert {k.decode() for k in server.client().keys("*")} == {"{k}:fence"}
    backend.close()
