"""A debounce (``exclusive_debounce``): a burst of calls of one key runs once, with
its latest call's arguments, a period after that call came and no later than
``exclusive_debounce_max_wait`` after the burst's first; every other call of it ends
coalesced, naming the call whose run covers it.

Real prefork workers (two, two processes each) on one broker; every run noted in a
Redis ledger with its start (one host: the workers' and the test's clocks agree).
"""

from __future__ import annotations

import contextlib
import time

import pytest

from celery_exclusive import DuplicateCoalesced
from tests.support.apps import kept
from tests.support.apps.kept import DEBOUNCE, DEBOUNCE_MAX_WAIT
from tests.support.cluster import KEEPING_STORES, kept_stack, wait_until
from tests.support.workers import read_ledger

#: Seconds between the calls of a burst: the order in which they reach the workers is
#: the order they were sent in.
SPACING = 0.2
#: How late a run may start after it is due: a countdown's message, taken from the
#: broker by a worker's timer, and a worker process to run it.
SLACK = 1.5


@pytest.fixture(scope="module", params=KEEPING_STORES)
def stack(request, redis_server, client_dbs, tmp_path_factory):
    with kept_stack(request, redis_server, client_dbs, tmp_path_factory, "deb", 2) as stack:
        yield stack


def runs_of(cluster, key: str) -> list[dict]:
    return sorted(
        (e for e in read_ledger(cluster.ledger) if e["key"] == key), key=lambda e: e["start"]
    )


def burst(task, key: str, versions: range) -> tuple[list, list[float]]:
    calls, sent = [], []
    for version in versions:
        sent.append(time.time())
        calls.append(task.delay(key, version))
        time.sleep(SPACING)
    return calls, sent


def ran_by(calls: list, cluster, key: str) -> list:
    """The calls whose bodies ran, in the order they ran."""
    by_id = {call.id: call for call in calls}
    return [by_id[run["task_id"]] for run in runs_of(cluster, key)]


def test_a_burst_runs_once_with_its_last_arguments_a_period_after_its_last_call(cluster):
    calls, sent = burst(kept.debounced, "search-index", range(1, 6))
    assert wait_until(lambda: runs_of(cluster, "search-index"), timeout=30)
    time.sleep(DEBOUNCE + SLACK)  # any second run would have started by now
    [runner] = ran_by(calls, cluster, "search-index")
    ran = runner.get(timeout=30)
    assert ran["version"] == 5
    assert sent[-1] + DEBOUNCE <= ran["start"] <= sent[-1] + DEBOUNCE + SLACK


def test_the_other_calls_of_a_burst_end_coalesced_naming_the_call_that_ran_it(cluster):
    calls, _ = burst(kept.debounced, "preview", range(1, 4))
    assert wait_until(lambda: runs_of(cluster, "preview"), timeout=30)
    [runner] = ran_by(calls, cluster, "preview")
    assert runner.get(timeout=30)["version"] == 3
    for call in calls:
        if call is not runner:
            with pytest.raises(DuplicateCoalesced, match=runner.id):
                call.get(timeout=30)


def test_calls_after_a_burst_ran_make_a_burst_of_their_own(cluster):
    first, _ = burst(kept.debounced, "digest", range(1, 3))
    assert wait_until(lambda: runs_of(cluster, "digest"), timeout=30)
    [before] = runs_of(cluster, "digest")
    second, sent = burst(kept.debounced, "digest", range(3, 5))
    # Each later call runs, or is covered by a run that started after it came, never by
    # the burst that ran before. (How the later calls group depends on when each reached
    # a worker; a call of the first burst coming back late may run the next one.)
    results = {}
    for call in second:
        try:
            results[call.id] = call.get(timeout=30)
        except DuplicateCoalesced as coalesced:
            results[call.id] = kept.app.AsyncResult(coalesced.holder_task_id).get(timeout=30)
    runs = {run["task_id"]: run for run in runs_of(cluster, "digest")}
    for call, at in zip(second, sent):
        covering = runs[results[call.id]["task_id"]]
        assert covering["start"] > at and covering["task_id"] != before["task_id"]
    # The latest change ran, in the key's last run.
    assert results[second[-1].id]["version"] == 4
    assert (
        max(runs.values(), key=lambda run: run["start"])["task_id"]
        == (results[second[-1].id]["task_id"])
    )


def test_calls_that_never_stop_run_at_least_once_every_max_wait(cluster):
    # A call every 0.2 s for 4 s: never a pause of a period, so only the bound runs it.
    calls, sent = burst(kept.debounced_bounded, "feed", range(1, 21))
    for call in calls:  # every call ends: it ran, or a run covers it
        with contextlib.suppress(DuplicateCoalesced):
            call.get(timeout=30)
    runs = runs_of(cluster, "feed")
    assert runs[0]["start"] <= sent[0] + DEBOUNCE_MAX_WAIT + SLACK, (runs[0], sent[0])
    assert len(runs) >= 2
    ran = {run["task_id"]: run for run in runs}
    for call, at in zip(calls, sent):
        if call.id in ran:
            continue
        with pytest.raises(DuplicateCoalesced) as coalesced:
            call.get(timeout=30)
        # Nothing lost: the run that covers it started after it came.
        assert ran[coalesced.value.holder_task_id]["start"] > at
    last = max(runs, key=lambda run: run["start"])
    assert calls[[c.id for c in calls].index(last["task_id"])].get()["version"] == 20


def test_calls_sent_with_a_countdown_make_one_burst_when_they_come(cluster):
    calls, sent = [], []
    for version in range(1, 4):
        sent.append(time.time())
        calls.append(kept.debounced.apply_async(("delayed", version), countdown=1))
        time.sleep(SPACING)
    assert wait_until(lambda: runs_of(cluster, "delayed"), timeout=30)
    time.sleep(DEBOUNCE + SLACK)
    [runner] = ran_by(calls, cluster, "delayed")
    ran = runner.get(timeout=30)
    assert ran["version"] == 3
    # Due a period after the last call came: its countdown, then the debounce.
    assert ran["start"] >= sent[-1] + 1 + DEBOUNCE
