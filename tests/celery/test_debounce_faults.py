"""A debounce under real faults: the worker holding its burst's messages SIGKILLed, the
lease store stopped mid-burst. Nothing is lost: the latest change runs, and every
other call names a run that covers it.

A module of its own: the workers of tests/celery/test_debounce.py's stack would take
this broker's messages while it runs.
"""

from __future__ import annotations

import signal
import time

import pytest

from celery_exclusive import DuplicateCoalesced
from tests.celery.test_debounce import SLACK, burst, ran_by, runs_of
from tests.support.apps import kept
from tests.support.apps.kept import DEBOUNCE
from tests.support.cluster import Stack, wait_until
from tests.support.servers import RedisServer


def test_a_burst_whose_worker_is_killed_before_its_run_still_runs_once(
    redis_server, client_dbs, tmp_path_factory
):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    stack.configure_client(kept.app)
    env = {"visibility_timeout": 4}
    app = "tests.support.apps.kept"
    holding = stack.worker("deb-held", env=env, app=app, concurrency=1).start()
    taking_over = stack.worker("deb-restored", env=env, app=app, concurrency=1)
    try:
        calls, _ = burst(kept.debounced, "tenant", range(1, 4))
        # Each call joined the burst and went back to the queue with a countdown, which
        # the only worker reserved: it dies with the three messages unacknowledged.
        assert wait_until(lambda: holding.output().count("debounced: requeued") == 3, 10)
        # Reserved: each message received twice, as the call came and as it came back.
        assert wait_until(lambda: holding.output().count("] received") == 6, 10)
        holding.stop(signal.SIGKILL, group=True)
        taking_over.start()
        assert wait_until(lambda: runs_of(stack, "tenant"), timeout=60)
        time.sleep(DEBOUNCE + SLACK)
        [runner] = ran_by(calls, stack, "tenant")
        assert runner.get(timeout=30)["version"] == 3
        for call in calls:
            if call is not runner:
                with pytest.raises(DuplicateCoalesced, match=runner.id):
                    call.get(timeout=30)
    finally:
        holding.stop(signal.SIGKILL, group=True)
        taking_over.stop(signal.SIGKILL, group=True)


def test_a_burst_across_a_store_outage_loses_no_change(redis_server, client_dbs, tmp_path_factory):
    store_server = RedisServer()
    store_server.start()
    stack = Stack(redis_server, *client_dbs, store_server.url, tmp_path_factory)
    stack.configure_client(kept.app)
    worker = stack.worker("deb-outage", app="tests.support.apps.kept", concurrency=2)
    try:
        worker.start()
        calls, _ = burst(kept.debounced, "ledger-sync", range(1, 3))
        store_server.stop()
        calls += burst(kept.debounced, "ledger-sync", range(3, 5))[0]
        worker.wait_for_log("requeued (exclusive_on_backend_error='requeue')", timeout=15)
        time.sleep(DEBOUNCE)  # the burst falls due while the store is away
        store_server.start()
        ended = {}
        for call in calls:
            try:
                ended[call.id] = call.get(timeout=60)
            except DuplicateCoalesced as coalesced:
                ended[call.id] = coalesced.holder_task_id
        runs = runs_of(stack, "ledger-sync")
        ran = {run["task_id"] for run in runs}
        assert ran and all(ended[run_id]["version"] for run_id in ran)
        # The latest change ran last; every other call ran or names a run.
        last = max(runs, key=lambda run: run["start"])["task_id"]
        assert ended[last]["version"] == 4
        assert all(call.id in ran or ended[call.id] in ran for call in calls)
    finally:
        worker.stop(signal.SIGKILL, group=True)
        store_server.cleanup()
