"""The leader-elected beat on the PostgreSQL and etcd stores: real ``celery beat``
processes, the leader SIGKILLed then stopped, every tick sent exactly once."""

from __future__ import annotations

import math
import signal

import pytest

from celery_exclusive.backends.etcd.connection import LEASE_SLACK
from tests.beat import test_beat as beat
from tests.stores.test_store_workers import STORES, store_url
from tests.support.workers import Worker


@pytest.fixture(params=STORES)
def beat_stack(request, redis_server, tmp_path):
    stack = beat.Stack(redis_server, "sqlite", tmp_path)
    stack.store = stack.env["EXCLUSIVE_TEST_STORE"] = store_url(request, request.param)
    stack.worker = Worker("tests.support.apps.beat_app", stack.env, pool="solo", name="beat-worker")
    stack.worker.start()
    yield stack
    stack.stop()


def test_across_a_kill_and_a_sigterm_every_tick_is_sent_exactly_once(beat_stack):
    stack = beat_stack
    beats = [stack.beat("b1"), stack.beat("b2"), stack.beat("b3")]
    stack.wait_for_new_leader(old_pid=-1, timeout=30)
    first = next(b for b in beats if b.pid == stack.leader().holder["pid"])
    stack.wait_for_sends(first.pid, 3)

    killed, second, window_kill = beat.failover(stack, first, signal.SIGKILL, beats)
    stack.wait_for_sends(second.pid, 3)
    handed, third, window_term = beat.failover(stack, second, signal.SIGTERM, beats)
    stack.wait_for_sends(third.pid, 3)
    third.stop(signal.SIGTERM)
    ticks = stack.wait_until_drained()

    assert beat.duplicates(ticks) == []
    assert beat.missing(ticks) <= window_kill | window_term, stack.logs()
    # etcd leases last whole seconds: the dead leader's lasts ceil(ttl) + LEASE_SLACK.
    assert killed <= math.ceil(beat.TTL) + LEASE_SLACK + beat.RETRY + beat.SLACK
    assert handed <= beat.RETRY + beat.SLACK
    assert {t["pid"] for t in ticks} == {first.pid, second.pid, third.pid}
    assert not any("Traceback" in b.output() for b in beats), stack.logs()
