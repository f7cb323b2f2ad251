"""ExclusiveTask on real Celery workers (prefork, two worker processes), per lease store.

Each run appends (key, fencing token, start, end) to a ledger in Redis; overlap is
checked from the ledger, outside the workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from celery_exclusive import DuplicateSkipped
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.workers import overlaps, read_ledger

KEYS = [f"key-{i}" for i in range(10)]


@pytest.fixture(scope="module", params=["redis", "sqlite"])
def stack(request, redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, request.param, tmp_path_factory)
    with stack.running(stack.worker("w1"), stack.worker("w2")):
        yield stack


# --- exclusion ------------------------------------------------------------------


def test_two_workers_never_overlap_runs_of_one_key(cluster):
    results = [ledger_app.hold_requeue.delay(KEYS[i % len(KEYS)], 0.01) for i in range(200)]
    states = [r.get(timeout=120) and r.state for r in results]
    entries = read_ledger(cluster.ledger)
    assert states == ["SUCCESS"] * 200
    assert len(entries) == 200
    assert overlaps(entries) == []
    assert len({e["pid"] for e in entries}) > 1, "work was not spread across processes"


def test_skipped_duplicates_end_in_a_readable_state_and_never_overlap(cluster):
    results = [ledger_app.hold_skip.delay(KEYS[i % 3], 0.05) for i in range(60)]
    outcomes = {"SUCCESS": 0, "FAILURE": 0}
    for result in results:
        with contextlib.suppress(DuplicateSkipped):
            result.get(timeout=60)
        outcomes[result.state] += 1
    entries = read_ledger(cluster.ledger)
    assert outcomes["SUCCESS"] + outcomes["FAILURE"] == 60
    assert outcomes["SUCCESS"] == len(entries)
    assert outcomes["FAILURE"] > 0, "expected some duplicates with 4 processes on 3 keys"
    assert overlaps(entries) == []


def test_fencing_tokens_increase_with_each_run_of_a_key(cluster):
    for _ in range(3):
        ledger_app.hold_skip.delay("fenced", 0).get(timeout=30)
    tokens = [e["token"] for e in read_ledger(cluster.ledger)]
    assert tokens == sorted(set(tokens)) and len(tokens) == 3


# --- duplicates -------------------------------------------------------------------


def test_skip_raises_duplicate_skipped_naming_the_key_and_the_holder(cluster):
    holder = start_holding(ledger_app.hold_skip, "busy", 1.5, cluster)
    duplicate = ledger_app.hold_skip.delay("busy", 0)
    with pytest.raises(DuplicateSkipped) as info:
        duplicate.get(timeout=60)
    assert info.value.key == "exclusive:busy"
    assert info.value.holder_task_id == holder.id
    assert duplicate.state == "FAILURE"
    holder.get(timeout=60)


def test_requeue_runs_the_duplicate_after_the_holder_finishes(cluster):
    holder = start_holding(ledger_app.hold_requeue, "busy", 1.0, cluster)
    duplicate = ledger_app.hold_requeue.delay("busy", 0)
    first, second = holder.get(timeout=20), duplicate.get(timeout=20)
    assert second["start"] >= first["end"]
    assert second["requeues"] >= 1
    assert second["retries"] == 0, "requeues must not spend the task's max_retries"


def test_wait_is_woken_by_the_release_not_by_its_timeout(cluster):
    holder = start_holding(ledger_app.hold_wait, "busy", 1.0, cluster)
    duplicate = ledger_app.hold_wait.delay("busy", 0)
    first, second = holder.get(timeout=20), duplicate.get(timeout=20)
    assert second["start"] >= first["end"]
    assert second["requeues"] == 0, "the duplicate should have waited, not been requeued"
    # exclusive_wait_timeout is 30 s: starting this soon means the release woke it.
    assert second["start"] - first["end"] < 5


# --- lease lifetime ---------------------------------------------------------------


def test_a_task_running_three_ttls_keeps_its_lease_and_excludes_duplicates(cluster):
    holder = start_holding(ledger_app.hold_skip, "long", cluster.ttl * 3, cluster)
    time.sleep(cluster.ttl * 2)
    duplicate = ledger_app.hold_skip.delay("long", 0)
    with pytest.raises(DuplicateSkipped):
        duplicate.get(timeout=60)
    entry = holder.get(timeout=30)
    assert entry["lost"] is False
    assert [e["task_id"] for e in read_ledger(cluster.ledger)] == [holder.id]


# --- signals ----------------------------------------------------------------------


def test_signals_fire_inside_the_worker(cluster):
    holder = start_holding(ledger_app.hold_skip, "signalled", 1.0, cluster)
    duplicate = ledger_app.hold_skip.delay("signalled", 0)
    with pytest.raises(DuplicateSkipped):
        duplicate.get(timeout=60)
    holder.get(timeout=60)
    calls = {holder.id, duplicate.id}

    def seen() -> list[dict]:
        # A release of the test before may be noted after the ledger was emptied for this
        # one: only this test's calls count.
        entries = map(json.loads, cluster.ledger.lrange("signals", 0, -1))
        return [s for s in entries if s["task_id"] in calls]

    expected = sorted(
        [
            ("lease_acquired", holder.id),
            ("duplicate_detected", duplicate.id),
            ("lease_released", holder.id),
        ]
    )
    # The holder's release is noted once the store answered it, which may be after its
    # result (stored by the same script) is read here.
    assert wait_until(lambda: len(seen()) >= len(expected), timeout=10), seen()
    time.sleep(0.2)  # a signal too many would be noted by now
    signals = seen()
    # Each process writes its own signals to the ledger: the holder's acquisition and
    # the duplicate's detection, in two processes, may be written in either order.
    assert sorted((s["signal"], s["task_id"]) for s in signals) == expected
    holder_signals = [s["signal"] for s in signals if s["task_id"] == holder.id]
    assert holder_signals == ["lease_acquired", "lease_released"]
    [detected] = [s for s in signals if s["signal"] == "duplicate_detected"]
    assert detected["policy"] == "skip" and detected["holder_task_id"] == holder.id
    assert {s["key"] for s in signals} == {"exclusive:signalled"}


# --- release on every exit ----------------------------------------------------------
#
# Last in the module: the tests that kill a pool child. Celery's prefork pool can leave a
# task it received just after a child's SIGKILL unrun for a long while, so no test of
# other behaviour runs on these workers after them.


@pytest.mark.parametrize("how", ["raise", "ignore", "reject"])
def test_the_lease_is_released_when_the_body_ends_abnormally(cluster, how):
    result = ledger_app.fail.delay(f"exit-{how}", how)
    if how == "raise":
        with pytest.raises(ValueError):
            result.get(timeout=60)
        assert cluster.holders(f"exit-{how}") == []
    else:
        key = f"exit-{how}".encode()
        assert wait_until(lambda: key in cluster.ledger.lrange("entered", 0, -1), timeout=10)
        assert wait_until(lambda: not cluster.holders(f"exit-{how}"), timeout=10)
    ledger_app.hold_skip.delay(f"exit-{how}", 0).get(timeout=60)


def test_a_retry_does_not_find_its_own_lease(cluster):
    entry = ledger_app.retry_once.delay("retrying").get(timeout=20)
    assert entry["retries"] == 1
    assert cluster.holders("retrying") == []


def test_the_lease_is_released_after_a_soft_time_limit(cluster):
    with pytest.raises(SoftTimeLimitExceeded):
        ledger_app.overrun.delay("soft").get(timeout=60)
    assert cluster.holders("soft") == []


def test_the_main_process_frees_the_lease_of_a_child_killed_by_a_hard_time_limit(cluster):
    with pytest.raises(TimeLimitExceeded):
        ledger_app.overrun_hard.delay("hard").get(timeout=60)
    # Its lease lasts 30 s: gone long before, the main process released it.
    assert wait_until(lambda: not cluster.holders("hard"), timeout=10)


def test_the_main_process_frees_the_lease_of_a_sigkilled_child(cluster):
    result = start_holding(ledger_app.hold_long_lease, "killed", 60, cluster)
    [info] = cluster.holders("killed")
    os.kill(info.holder["pid"], signal.SIGKILL)
    # Its lease lasts 30 s: gone long before, the main process released it.
    freed = wait_until(lambda: not cluster.holders("killed"), timeout=10)
    assert freed, "expected the worker's main process to release it"
    with pytest.raises(Exception, match="WorkerLost|SIGKILL|exited"):
        result.get(timeout=60)
    ledger_app.hold_skip.delay("killed", 0).get(timeout=60)
