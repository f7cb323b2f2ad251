"""A rate per key (``exclusive_rate``): at most N runs of a key start in any
period, across every worker and process; the excess is skipped (a rate limit) or
delayed (a throttle), as ``exclusive_on_duplicate`` says.

Real prefork workers (two, three processes each) on one broker; every run noted in a
Redis ledger with its start (one host: the workers' and the store's clocks agree).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.apps import kept
from tests.support.apps.kept import RATE_PERIOD, RATE_RUNS
from tests.support.cluster import KEEPING_STORES, kept_stack, wait_until
from tests.support.workers import read_ledger

#: How late a body may start after its grant (the store decides by the grant).
SLACK = 0.1


@pytest.fixture(scope="module", params=KEEPING_STORES)
def stack(request, redis_server, client_dbs, tmp_path_factory):
    with kept_stack(request, redis_server, client_dbs, tmp_path_factory, "rate", 3) as stack:
        yield stack


def starts_of(cluster, key: str) -> list[float]:
    return sorted(e["start"] for e in read_ledger(cluster.ledger) if e["key"] == key)


def most_in_a_period(starts: list[float]) -> int:
    """The most runs that started within one period (sliding, as the store counts)."""
    return max(
        sum(1 for other in starts if start <= other < start + RATE_PERIOD - SLACK)
        for start in starts
    )


def most_granted_in_a_period(cluster, key: str) -> int:
    """As most_in_a_period, by the grants themselves: a Redis fencing token is the time
    of its grant by the store's clock (µs), so no slack is needed."""
    tokens = sorted(e["token"] / 1e6 for e in read_ledger(cluster.ledger) if e["key"] == key)
    return max(
        sum(1 for other in tokens if token <= other < token + RATE_PERIOD) for token in tokens
    )


def test_bursts_across_period_boundaries_run_no_more_than_the_rate(cluster):
    results = []
    for _ in range(5):  # a burst every 0.7 s: period boundaries fall inside bursts
        results += [kept.rated_skip.delay("api", 0.05) for _ in range(6)]
        time.sleep(0.7)
    outcomes = [result.get(timeout=60) for result in results]
    ran = [o for o in outcomes if o.get("outcome") != "skipped"]
    skipped = [o for o in outcomes if o.get("outcome") == "skipped"]
    starts = starts_of(cluster, "api")
    assert len(starts) == len(ran) and len(ran) + len(skipped) == 30
    assert most_in_a_period(starts) == RATE_RUNS, starts
    assert len(ran) >= RATE_RUNS * 2, "the rate admitted too little to tell anything"
    if cluster.store.startswith("redis"):
        assert most_granted_in_a_period(cluster, "api") == RATE_RUNS


def test_a_throttle_delays_the_excess_and_runs_every_call(cluster):
    calls = [kept.rated_wait.delay("webhook", 0.05) for _ in range(8)]
    assert sorted(c.get(timeout=90)["task_id"] for c in calls) == sorted(c.id for c in calls)
    starts = starts_of(cluster, "webhook")
    assert len(starts) == 8
    assert most_in_a_period(starts) <= RATE_RUNS, starts
    if cluster.store.startswith("redis"):
        assert most_granted_in_a_period(cluster, "webhook") <= RATE_RUNS
    # Eight runs at three a period: the last starts two periods after the first.
    assert starts[-1] - starts[0] >= 2 * RATE_PERIOD - SLACK, starts


def test_runs_whose_processes_are_killed_keep_their_slots_a_period_after_their_grants(cluster):
    sent_at = time.time()  # before any of their grants
    for _ in range(RATE_RUNS):
        kept.rated_skip.delay("killed", 30.0)
    assert wait_until(lambda: len(cluster.holders("killed")) == RATE_RUNS, timeout=15)
    for holder in cluster.holders("killed"):
        os.kill(holder.holder["pid"], signal.SIGKILL)
    # Each slot is kept to a period after its grant, as the end of its run keeps it: the
    # calls sent meanwhile find none, however soon the worker frees what the dead held.
    first = wait_until(lambda: run_once(kept.rated_skip, "killed"), timeout=30, step=0.05)
    assert first, "no call ran after the killed runs' period"
    assert first["start"] >= sent_at + RATE_PERIOD - SLACK
    # ... and no longer than that and one renewal interval (a third of the lease's ttl).
    assert first["start"] < sent_at + RATE_PERIOD + 3.0


def run_once(task, key: str):
    """The run of one call of ``key`` (skip_state="success"), or None if it was skipped."""
    outcome = task.delay(key, 0).get(timeout=30)
    return None if outcome.get("outcome") == "skipped" else outcome
