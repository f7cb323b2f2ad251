"""The Redis store behind real sentinels (1 master, 1 replica, 3 sentinels, all with
passwords): credentials in the URL, a switch of master followed within a second, a
grant withdrawn when no replica has it, and real workers through a failover and a
SIGKILLed master."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid

import pytest

from celery_exclusive.backends.redis import RedisBackend
from celery_exclusive.backends.redis.connection import MASTER_CHECK_INTERVAL
from celery_exclusive.errors import BackendUnavailable, ConfigurationError, LeaseLost
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack
from tests.support.servers import RedisSentinels, RedisServer, TLSFiles
from tests.support.workers import read_ledger, runs_by_key

USER, PASSWORD, SENTINEL_PASSWORD = "leases", "data-secret", "sentinel-secret"


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def sentinels():
    servers = RedisSentinels(user=USER, password=PASSWORD, sentinel_password=SENTINEL_PASSWORD)
    servers.start()
    yield servers
    servers.cleanup()


# --- credentials ------------------------------------------------------------------------


def test_the_data_nodes_user_and_the_sentinels_own_password_both_come_from_the_url(
    sentinels,
):
    backend = RedisBackend(sentinels.url)
    backend.check("exclusive:~check")
    lease = backend.try_acquire("exclusive:k", owner(), 10)
    assert [info.key for info in backend.holders("exclusive:")] == ["exclusive:k"]
    assert backend.release(lease)
    backend.close()


def test_a_wrong_sentinel_password_is_a_named_configuration_error(sentinels):
    url = sentinels.url.replace(SENTINEL_PASSWORD, "wrong")
    with pytest.raises(ConfigurationError, match="sentinel_password"):
        RedisBackend(url).check("exclusive:~check")


def test_a_wrong_data_node_password_is_a_named_configuration_error(sentinels):
    url = sentinels.url.replace(f"{USER}:{PASSWORD}@", f"{USER}:wrong@")
    with pytest.raises(ConfigurationError, match="credentials"):
        RedisBackend(url).check("exclusive:~check")


@pytest.fixture(scope="module")
def tls_sentinels(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("sentinel-tls"))
    servers = RedisSentinels(tls=TLSFiles(directory, "ca"))
    servers.other_ca = TLSFiles(directory, "other").ca
    servers.start()
    yield servers
    servers.cleanup()


def test_tls_to_the_sentinels_and_the_data_nodes_works_with_the_private_ca(tls_sentinels):
    assert tls_sentinels.url.startswith("rediss+sentinel://")
    backend = RedisBackend(tls_sentinels.url)
    backend.check("exclusive:~check")
    assert backend.try_acquire("exclusive:k", owner(), 10) is not None
    backend.close()


def test_a_sentinel_certificate_from_another_ca_is_a_named_configuration_error(tls_sentinels):
    url = tls_sentinels.url.replace(tls_sentinels.tls.ca, tls_sentinels.other_ca)
    with pytest.raises(ConfigurationError, match="TLS.*ssl_ca_certs"):
        RedisBackend(url).check("exclusive:~check")


# --- a switch of master -----------------------------------------------------------------


def test_after_a_switch_no_grant_comes_from_the_demoted_master_past_the_check_interval(
    sentinels,
):
    """Grants keep flowing through ``SENTINEL FAILOVER``; the old master's EVALSHA count
    stops rising within MASTER_CHECK_INTERVAL of the sentinels announcing the new one,
    although the old master itself accepts writes until it is demoted."""
    sentinels.wait_settled()
    backend = RedisBackend(sentinels.url)
    old = sentinels.master_port()
    watcher = sentinels.data_client(old)
    stop = threading.Event()

    def contend() -> None:
        while not stop.is_set():
            try:
                lease = backend.try_acquire("exclusive:switch", owner(), 5)
                if lease is not None:
                    backend.release(lease)
            except BackendUnavailable:
                pass
            time.sleep(0.01)

    def evalsha_calls() -> int:
        return watcher.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    thread = threading.Thread(target=contend)
    thread.start()
    try:
        time.sleep(0.5)
        assert evalsha_calls() > 0
        failover_at = time.monotonic()
        sentinels.failover()
        switched_at = time.monotonic()
        last_calls, last_change, demoted_at = evalsha_calls(), switched_at, None
        while time.monotonic() < switched_at + 4:
            calls = evalsha_calls()
            if calls != last_calls:
                last_calls, last_change = calls, time.monotonic()
            if demoted_at is None and watcher.execute_command("ROLE")[0] == b"slave":
                demoted_at = time.monotonic()
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join()
        backend.close()
    print(
        f"switch {switched_at - failover_at:.2f} s after SENTINEL FAILOVER; old master "
        f"demoted {None if demoted_at is None else round(demoted_at - switched_at, 2)} s "
        f"after the switch; last grant there {last_change - switched_at:.2f} s after it"
    )
    assert last_change - switched_at < MASTER_CHECK_INTERVAL + 0.5


# --- min_replicas -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicated():
    """A master and a replica of its own (no sentinels): the replica can be stopped."""
    master = RedisServer(extra=("--repl-diskless-sync-delay", "0"))
    master.start()
    replica = RedisServer(extra=("--replicaof", "127.0.0.1", str(master.port)))
    replica.start()
    deadline = time.monotonic() + 10
    while replica.client().info("replication")["master_link_status"] != "up":
        assert time.monotonic() < deadline, "the replica never connected"
        time.sleep(0.05)
    yield master, replica
    replica.cleanup()
    master.cleanup()


def test_min_replicas_accepts_a_grant_a_replica_acknowledged(replicated):
    master, replica = replicated
    backend = RedisBackend(master.url + "?min_replicas=1&min_replicas_timeout=5")
    lease = backend.try_acquire("acked", owner(), 10)
    assert lease is not None
    assert replica.client().exists("{acked}") == 1
    backend.close()


def test_min_replicas_withdraws_a_grant_no_replica_acknowledged(replicated):
    master, replica = replicated
    backend = RedisBackend(master.url + "?min_replicas=1&min_replicas_timeout=0.2")
    replica.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable, match="min_replicas"):
            backend.try_acquire("unacked", owner(), 10)
        assert backend.holders_of("unacked") == []
    finally:
        replica.process.send_signal(signal.SIGCONT)
    assert backend.try_acquire("unacked", owner(), 10) is not None
    backend.close()


def test_a_read_only_replica_is_reported_unavailable_not_misconfigured(replicated):
    """READONLY is what a demoted master answers mid-failover: retrying fixes it."""
    _, replica = replicated
    with pytest.raises(BackendUnavailable, match="did not answer"):
        RedisBackend(replica.url).try_acquire("k", owner(), 10)


# --- real workers through a failover and a killed master -----------------------------


def test_through_a_failover_and_a_killed_master_tokens_rise_and_every_overlap_was_lost(
    sentinels, redis_server, client_dbs, tmp_path_factory
):
    """Tokens rise per key in run order, and no overlap goes untold, with the default
    settings (no min_replicas).

    A killed master can lose a fresh grant: its holder finds that at its next renewal
    or, at the latest, when it releases (the store no longer has the lease), so the run
    is flagged lost rather than passing for a clean run, and the call is sent again
    (requeue_lost): every one of the 60 calls runs to its end. (min_replicas=1 closes
    that window: a grant counts only once the replica has it; see the tests above.) The
    killed node rejoins as a replica afterwards, as an operator would bring it back."""
    stack = Stack(redis_server, *client_dbs, sentinels.url, tmp_path_factory)
    stack.ttl = 5.0  # outlives a failover (~2 s here): nobody's lease expires in one
    sentinels.wait_settled()
    keys = [f"ledger-{i}" for i in range(6)]
    workers = [stack.worker(name, concurrency=3) for name in ("w1", "w2")]
    with stack.running(*workers):
        t0 = time.monotonic()
        # Half the tasks run through the switch, half through the kill.
        results = [ledger_app.hold_requeue.delay(keys[i % 6], 1.0) for i in range(30)]
        time.sleep(3)
        first = sentinels.master_port()
        second = sentinels.failover()
        phases = {"first switch": time.monotonic() - t0}
        sentinels.wait_settled()  # the old master follows the new one before we kill it
        phases["old master known as a replica"] = time.monotonic() - t0
        results += [ledger_app.hold_requeue.delay(keys[i % 6], 1.0) for i in range(30)]
        time.sleep(2)
        sentinels.node(second).stop(signal.SIGKILL)
        sentinels.wait_until(lambda: sentinels.master_port() == first, "the second switch", 60)
        phases["second switch"] = time.monotonic() - t0
        sentinels.node(second).start()  # rejoins as a replica of the surviving master
        outcomes = [(r.id, r.get(timeout=180, propagate=False)) for r in results]
        phases["all done"] = time.monotonic() - t0
    entries = read_ledger(stack.ledger)
    flagged = {
        signal_entry["task_id"]
        for signal_entry in map(json.loads, stack.ledger.lrange("signals", 0, -1))
        if signal_entry["signal"] == "lease_lost"
    }
    phases["runs flagged lost"] = len(flagged)
    print(", ".join(f"{phase}: {at:.1f}" for phase, at in phases.items()))
    for task_id, outcome in outcomes:
        if isinstance(outcome, Exception):
            assert isinstance(outcome, LeaseLost) and task_id in flagged, (task_id, outcome)
    assert len({entry["task_id"] for entry in entries}) == 60, "a task never ran"
    for runs in runs_by_key(entries):
        tokens = [run["token"] for run in runs]
        assert tokens == sorted(set(tokens)), f"tokens of {runs[0]['key']} in run order: {tokens}"
        for earlier, later in zip(runs, runs[1:]):
            if later["start"] < earlier["end"]:
                told = earlier["lost"] or earlier["task_id"] in flagged
                assert told, f"an overlap nobody was told of: {earlier}, {later}"
