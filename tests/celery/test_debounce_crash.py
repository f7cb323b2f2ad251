"""A debounce survives the death of the worker holding its burst's messages: the run
still happens, once, with the latest arguments.

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
