"""The lease heartbeat: one thread per process renewing every held lease."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from celery_exclusive import LeaseLost, lease_lost
from celery_exclusive.backends.redis import RedisBackend
from celery_exclusive.core.lease import acquire, heartbeat
from tests.support.servers import RedisServer


@pytest.fixture
def store(redis_url):
    backend = RedisBackend(redis_url)
    yield backend
    for lease in heartbeat().held():
        lease.release()
    backend.close()


#: Five leases, two beats, and what the second one cost the store: run in a process of
#: its own, whose heartbeat thread has no beat due yet (ttl 30 s: its first is 10 s away).
#: In the test process, an earlier test's short leases may have left one due any moment.
ONE_BEAT = """
import sys
from celery_exclusive.backends.redis import RedisBackend, layout
from celery_exclusive.core.lease import acquire, heartbeat

store = RedisBackend(sys.argv[1])
client = store.connection.client
evalsha_calls = lambda: client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
leases = [acquire(store, f"k{i}", ttl=30, name="t") for i in range(5)]
heartbeat().beat()  # the first call of a script also loads it (NOSCRIPT, EVALSHA)
before = evalsha_calls()
heartbeat().beat()
print(evalsha_calls() - before, min(client.pttl(layout.lease(l.key)) for l in leases))
for lease in leases:
    lease.release()
"""


def test_one_beat_renews_every_held_lease_in_one_round_trip():
    server = RedisServer()  # its own: no other test's client counts in its commandstats
    server.start()
    try:
        run = subprocess.run(
            [sys.executable, "-c", ONE_BEAT, server.url],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.cleanup()
    assert run.returncode == 0, run.stderr
    calls, shortest_pttl = map(int, run.stdout.split())
    assert calls == 1
    assert shortest_pttl > 29_000


def test_a_lease_outlives_its_ttl_while_the_heartbeat_runs(store):
    lease = acquire(store, "k", ttl=0.6, name="t")
    time.sleep(2.0)
    assert not lease.lost
    assert store.holders_of("k")[0].owner == lease.grant.owner


def test_a_lease_taken_just_after_the_last_was_released_outlives_its_ttl(store):
    acquire(store, "a", ttl=0.6, name="t").release()
    time.sleep(0.1)  # the heartbeat finds the process without a lease
    lease = acquire(store, "b", ttl=0.6, name="t")
    time.sleep(2.0)
    assert not lease.lost
    assert store.holders_of("b")[0].owner == lease.grant.owner


def test_a_lease_taken_just_after_the_last_was_released_does_not_wake_the_heartbeat(store):
    """Short tasks leave a process without a lease between two of them; the next lease
    finds the heartbeat asleep until a beat soon enough for it (no thread switch)."""
    acquire(store, "a", ttl=30, name="t").release()
    beats = heartbeat()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (
        beats._wake.is_set() or (beats._sleeping_until or 0) < time.monotonic() + 5
    ):
        time.sleep(0.01)  # until the thread sleeps towards its next beat
    acquire(store, "b", ttl=30, name="t")
    assert not beats._wake.is_set()


def test_the_heartbeat_thread_starts_with_the_first_lease_not_at_import():
    script = (
        "import threading, celery_exclusive\n"
        "from celery_exclusive.backends import backend_for_url\n"
        "from celery_exclusive.core.lease import acquire\n"
        "names = lambda: sorted(t.name for t in threading.enumerate())\n"
        "print(names())\n"
        "acquire(backend_for_url('memory://'), 'k', 30)\n"
        "print(names())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    after_import, after_acquire = out.stdout.splitlines()
    assert "celery-exclusive-heartbeat" not in after_import
    assert "celery-exclusive-heartbeat" in after_acquire


def test_a_lease_found_gone_is_flagged_logged_and_signalled(store, caplog):
    lease = acquire(store, "k", ttl=30, name="billing.settle", task_id="t-1")
    received = []
    handler = lambda sender, **kw: received.append((sender, kw["key"], kw["task_id"]))  # noqa: E731
    lease_lost.connect(handler, weak=False)
    try:
        store.force_release("k")
        with caplog.at_level(logging.ERROR, logger="celery_exclusive"):
            heartbeat().beat()
    finally:
        lease_lost.disconnect(handler)
    assert lease.lost
    assert received == [("billing.settle", "k", "t-1")]
    assert "lease lost key=k task=billing.settle task_id=t-1" in caplog.text


def test_ensure_held_raises_lease_lost_naming_the_task_and_key(store):
    lease = acquire(store, "k", ttl=30, name="billing.settle", task_id="t-1")
    lease.ensure_held()
    store.force_release("k")
    heartbeat().beat()
    with pytest.raises(LeaseLost) as info:
        lease.ensure_held()
    assert info.value.key == "k"
    assert "billing.settle[t-1]" in str(info.value)


def test_a_lease_taken_by_another_owner_is_lost_not_renewed(store):
    lease = acquire(store, "k", ttl=30, name="t")
    store.force_release("k")
    other = acquire(store, "k", ttl=30, name="t")
    heartbeat().beat()
    assert lease.lost and not other.lost
    assert store.holders_of("k")[0].owner == other.grant.owner


def test_a_released_lease_is_not_renewed(store):
    lease = acquire(store, "k", ttl=30, name="t")
    lease.release()
    heartbeat().beat()
    assert store.holders_of("k") == []
    assert not lease.lost


def test_an_unreachable_store_loses_the_lease_only_once_its_ttl_has_passed(caplog):
    server = RedisServer()
    server.start()
    backend = RedisBackend(server.url)
    try:
        lease = acquire(backend, "k", ttl=1.0, name="t")
        server.stop()
        with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
            heartbeat().beat()
        assert not lease.lost
        assert "lease renewal failed key=k" in caplog.text
        time.sleep(1.1)
        heartbeat().beat()
        assert lease.lost
    finally:
        lease.release()
        server.cleanup()


def test_a_lease_unrenewed_for_a_whole_ttl_is_lost_before_the_heartbeat_looks(store):
    lease = acquire(store, "k", ttl=30, name="t")
    lease.renewed_at -= 31  # as after the process was stopped for 31 s
    assert lease.lost
    with pytest.raises(LeaseLost, match="not renewed within its deadline"):
        lease.ensure_held()


def test_a_lease_found_gone_at_release_is_flagged_lost_and_signalled(store):
    lease = acquire(store, "k", ttl=30, name="t", task_id="t-1")
    store.force_release("k")  # as a failover that lost the grant, or an operator, would
    received = []

    def receiver(sender, **kwargs):
        received.append(kwargs["reason"])

    lease_lost.connect(receiver)
    try:
        assert lease.release() is False
    finally:
        lease_lost.disconnect(receiver)
    assert lease.lost and "no longer had it when its holder released it" in lease.lost_reason
    assert len(received) == 1
    with pytest.raises(LeaseLost):
        lease.ensure_held()


def test_a_lease_released_while_held_is_not_flagged_lost(store):
    lease = acquire(store, "k", ttl=30, name="t")
    assert lease.release() is True
    assert not lease.lost
