"""The feed: duplicates and lost leases reported by worker processes reach the store,
in batches, bounded, whatever the store does meanwhile."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from celery_exclusive import ExclusiveLock
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core import feed as feed_module
from celery_exclusive.core.feed import Feed, append_events, read_events
from celery_exclusive.core.lease import acquire
from celery_exclusive.errors import BackendUnavailable
from tests.support.workers import Worker


def kinds(backend, prefix="exclusive:") -> list[str]:
    return [json.loads(event)["kind"] for event in read_events(backend, prefix)]


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s")


def test_noted_events_reach_the_store_in_one_batch(sqlite_url, monkeypatch):
    backend = backend_for_url(sqlite_url)
    calls = []
    monkeypatch.setattr(
        feed_module, "append_events", lambda *args: (calls.append(args), append_events(*args))[1]
    )
    feed = Feed()
    for i in range(5):
        feed.note(backend, "exclusive:", "skipped", f"exclusive:k{i}", task="t", task_id=str(i))
    wait_for(lambda: len(read_events(backend, "exclusive:")) == 5)
    assert len(calls) == 1
    events = [json.loads(e) for e in read_events(backend, "exclusive:")]
    assert [e["key"] for e in events] == [f"exclusive:k{i}" for i in range(5)]
    assert {e["kind"] for e in events} == {"skipped"}


class DownStore:
    """A store that does not answer its feed until told to."""

    def __init__(self, url: str, monkeypatch) -> None:
        self.inner = backend_for_url(url)
        self.up = False
        monkeypatch.setattr(feed_module, "append_events", self.append_events)

    def append_events(self, store, *args) -> None:
        if not self.up:
            raise BackendUnavailable("down for the test", "test://")
        append_events(self.inner, *args)


def test_events_wait_for_a_store_that_does_not_answer_and_what_overflowed_is_said(
    sqlite_url, monkeypatch
):
    monkeypatch.setattr(feed_module, "BUFFER", 10)
    monkeypatch.setattr(feed_module, "RETRY_FIRST", 0.1)
    store = DownStore(sqlite_url, monkeypatch)
    feed = Feed()
    for i in range(15):
        feed.note(store, "exclusive:", "skipped", f"exclusive:k{i}")
    time.sleep(0.5)
    assert read_events(store.inner, "exclusive:") == []
    store.up = True
    events = wait_for(lambda: [json.loads(e) for e in read_events(store.inner, "exclusive:")])
    assert events[0]["kind"] == "missed"
    assert events[0]["count"] == 5
    assert [e["key"] for e in events[1:]] == [f"exclusive:k{i}" for i in range(5, 15)]


def test_a_lease_lost_while_held_is_reported(sqlite_url):
    from celery_exclusive.core import config, policies

    backend = backend_for_url(sqlite_url)
    settings = config.Settings(backend_url=sqlite_url, lease_ttl=30)
    outcome = policies.claim(settings, backend, "exclusive:k", "t.lost", "task-1")
    backend.force_release("exclusive:k")
    outcome.lease.release()  # the store no longer had it: a loss
    [event] = wait_for(lambda: [json.loads(e) for e in read_events(backend, "exclusive:")])
    assert (event["kind"], event["key"], event["task_id"]) == ("lost", "exclusive:k", "task-1")
    assert "no longer had it" in event["reason"]


@pytest.mark.parametrize(
    "policy, kind", [("skip", "skipped"), ("requeue", "requeued"), ("rerun", "coalesced")]
)
def test_each_duplicate_outcome_is_reported_with_whom_it_yielded_to(sqlite_url, policy, kind):
    from celery_exclusive.core import config, policies

    backend = backend_for_url(sqlite_url)
    settings = config.Settings(
        backend_url=sqlite_url, lease_ttl=30, on_duplicate=policy, wait_timeout=0.2
    )
    holder = acquire(backend, "exclusive:k", 30, name="t", task_id="holder-1")
    try:
        if policy == "rerun":  # the first duplicate becomes the pending rerun
            backend.swap_mark(
                "exclusive:k", "rerun", None, json.dumps({"task_id": "r-1", "arguments": "{}"}), 30
            )
        policies.claim(settings, backend, "exclusive:k", "t", "dup-1", arguments="{}")
        [event] = wait_for(lambda: [json.loads(e) for e in read_events(backend, "exclusive:")])
        assert (event["kind"], event["task_id"]) == (kind, "dup-1")
        assert event["other"] == ("r-1" if policy == "rerun" else "holder-1")
    finally:
        holder.release()


@pytest.mark.parametrize("policy, kind", [("skip", "skipped"), ("requeue", "requeued")])
def test_a_duplicate_that_yielded_to_a_lock_is_reported_naming_the_lock(sqlite_url, policy, kind):
    from celery_exclusive.core import config, policies

    backend = backend_for_url(sqlite_url)
    settings = config.Settings(backend_url=sqlite_url, lease_ttl=30, on_duplicate=policy)
    with ExclusiveLock("exclusive:k", sqlite_url, 30, name="billing.report"):
        policies.claim(settings, backend, "exclusive:k", "t", "dup-1")
        [event] = wait_for(lambda: [json.loads(e) for e in read_events(backend, "exclusive:")])
    assert (event["kind"], event["task_id"], event["other"]) == (kind, "dup-1", None)
    assert event["holder"] == (
        f"an exclusive lock of billing.report in process {os.getpid()} on {socket.gethostname()}"
    )


def test_a_call_that_gets_its_key_reports_nothing(sqlite_url):
    from celery_exclusive.core import config, policies

    backend = backend_for_url(sqlite_url)
    settings = config.Settings(backend_url=sqlite_url, lease_ttl=30)
    outcome = policies.claim(settings, backend, "exclusive:k", "t", "task-1")
    outcome.lease.release()
    time.sleep(feed_module.FLUSH_DELAY * 3)
    assert read_events(backend, "exclusive:") == []


# --- from real workers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(redis_server):
    from tests.conftest import fresh_redis_db

    broker, store = fresh_redis_db(redis_server), fresh_redis_db(redis_server)
    env = {"EXCLUSIVE_TEST_BROKER": broker, "EXCLUSIVE_TEST_STORE": store}
    worker = Worker("tests.support.apps.web_app", env, concurrency=3, name="feed").start()
    yield store, broker
    worker.stop()


def test_duplicates_on_a_worker_reach_the_feed_another_process_reads(workers):
    from celery import Celery

    store, broker = workers
    client = Celery("web-feed-client", broker=broker, backend=broker)
    backend = backend_for_url(store)
    first = client.send_task("web.hold", (1, 2.0))
    wait_for(lambda: backend.holders_of("exclusive:job:1"))
    assert client.send_task("web.hold", (1, 0)).get(timeout=20)["outcome"] == "skipped"
    assert first.get(timeout=20) == "held 1"
    [event] = wait_for(lambda: [json.loads(e) for e in read_events(backend, "exclusive:")])
    assert (event["kind"], event["key"], event["task"]) == (
        "skipped",
        "exclusive:job:1",
        "web.hold",
    )
    assert event["other"] == first.id
