"""Beyond a mutex, on real workers: semaphores, coalesced reruns, priority handoff,
first-come-first-served waiters and enqueue-time dedup. Three worker processes
(prefork, concurrency 4), Redis store.

Concurrency 4 leaves every worker a free child while one runs the holder and another
waits as the pending rerun: a worker whose children are all busy keeps the messages
it prefetched until one frees up, and those would arrive after the run they duplicate.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from celery_exclusive import DuplicateCoalesced, DuplicateSkipped, backend_for_url
from celery_exclusive.core import marks
from celery_exclusive.core.lock import ExclusiveLock
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.workers import read_ledger


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    with stack.running(*(stack.worker(f"c{i}", concurrency=4) for i in range(3))):
        yield stack


def most_at_once(entries: list[dict]) -> int:
    """The largest number of runs in progress at the same instant."""
    edges = sorted([(e["start"], 1) for e in entries] + [(e["end"], -1) for e in entries])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


# --- semaphores ---------------------------------------------------------------------


def test_a_limit_of_two_never_runs_three_at_once(cluster):
    results = [ledger_app.hold_two.delay("pool", 0.2) for _ in range(24)]
    assert all(r.get(timeout=60) for r in results)
    entries = read_ledger(cluster.ledger)
    assert len(entries) == 24
    assert most_at_once(entries) == 2


def test_slots_of_a_limit_recover_after_their_holders_are_killed(cluster):
    first = ledger_app.hold_two.delay("pool", 30)
    second = ledger_app.hold_two.delay("pool", 30)
    assert wait_until(lambda: len(cluster.holders("pool")) == 2, timeout=15)
    for info in cluster.holders("pool"):
        os.kill(info.holder["pid"], signal.SIGKILL)
    entries = [ledger_app.hold_two.delay("pool", 0).get(timeout=20) for _ in range(2)]
    assert len(entries) == 2
    del first, second


# --- coalesced reruns ----------------------------------------------------------------


def versions(cluster) -> list[int]:
    return [json.loads(v)["version"] for v in cluster.ledger.lrange("versions", 0, -1)]


def test_fifty_duplicate_webhooks_during_one_run_give_exactly_one_follow_up(cluster):
    holder = start_holding(ledger_app.webhook, "calendar", 3.0, cluster, args=(0,))
    duplicates = [ledger_app.webhook.delay("calendar", v) for v in range(1, 51)]
    outcomes = [d.get(timeout=60, propagate=False) for d in duplicates]
    holder.get(timeout=30)
    ran = [o for o in outcomes if isinstance(o, dict)]
    coalesced = [o for o in outcomes if isinstance(o, DuplicateCoalesced)]
    assert len(ran) == 1 and len(coalesced) == 49
    assert {c.holder_task_id for c in coalesced} == {duplicates[outcomes.index(ran[0])].id}
    assert len(read_ledger(cluster.ledger)) == 2
    follow_up = versions(cluster)[1]
    assert follow_up in range(1, 51)
    assert ran[0]["start"] >= read_ledger(cluster.ledger)[0]["end"]


def test_the_pending_rerun_still_runs_when_the_holder_is_killed(cluster):
    start_holding(ledger_app.webhook, "calendar", 30, cluster, args=(0,))
    [info] = cluster.holders("calendar")
    duplicates = [ledger_app.webhook.delay("calendar", v) for v in range(1, 11)]
    assert wait_until(lambda: sum(d.state == "FAILURE" for d in duplicates) == 9, timeout=20), (
        "nine duplicates should coalesce into the pending one"
    )
    os.kill(info.holder["pid"], signal.SIGKILL)
    outcomes = [d.get(timeout=30, propagate=False) for d in duplicates]
    assert sum(isinstance(o, dict) for o in outcomes) == 1
    assert len(read_ledger(cluster.ledger)) == 1  # the killed holder recorded nothing


def test_the_run_a_pending_rerun_owed_goes_to_a_new_call_when_its_worker_dies(cluster):
    # No acks_late: the message of a pending rerun whose worker dies is gone for good.
    holder = start_holding(ledger_app.webhook, "calendar", 8, cluster, args=(0,))
    pending = ledger_app.webhook.delay("calendar", 1)
    store = backend_for_url(cluster.store)
    rerun = lambda: marks.pending_rerun(store, "exclusive:calendar")  # noqa: E731
    assert wait_until(lambda: rerun() == pending.id, 10)
    waiter = next(
        s["pid"]
        for s in map(json.loads, cluster.ledger.lrange("signals", 0, -1))
        if s["task_id"] == pending.id and s.get("policy") == "rerun"
    )
    os.kill(waiter, signal.SIGKILL)
    # The worker's main process hands the run on: a new call becomes the pending rerun.
    assert wait_until(lambda: rerun() not in (None, pending.id), 10), rerun()
    owed = rerun()
    follow_up = ledger_app.webhook.delay("calendar", 2)
    with pytest.raises(DuplicateCoalesced, match=owed):
        follow_up.get(timeout=30)
    ran = ledger_app.webhook.AsyncResult(owed).get(timeout=60)
    assert ran["version"] == 2  # the follow-up's change, seen by the owed run
    assert ran["start"] >= holder.get(timeout=60)["end"]
    assert versions(cluster) == [0, 2]


def run_as_pending_rerun(cluster, task, key: str, *extra) -> tuple[object, object]:
    """Hold ``key`` here while ``task(key, 1, *extra)`` becomes its pending rerun and
    ``task(key, 2|3, *extra)`` coalesce into it, then free it: the pending call runs
    with the newest arguments, version 3. Return its result and its holder info."""
    store = backend_for_url(cluster.store)
    with ExclusiveLock("exclusive:" + key, cluster.store, cluster.ttl, name="test holder"):
        pending = task.delay(key, 1, *extra)
        assert wait_until(lambda: marks.pending_rerun(store, "exclusive:" + key) == pending.id, 15)
        for version in (2, 3):
            with pytest.raises(DuplicateCoalesced):
                task.delay(key, version, *extra).get(timeout=30)
    assert wait_until(lambda: cluster.holders(key), timeout=15), "the pending rerun never ran"
    [holder] = cluster.holders(key)
    assert holder.task_id == pending.id
    return pending, holder


def holds_anew(cluster, key: str, stopped) -> bool:
    """Whether ``key`` is held again, under a later grant than ``stopped``'s."""
    return [info.fencing_token > stopped.fencing_token for info in cluster.holders(key)] == [True]


def said_of(cluster, *names: str) -> str:
    """The lines of the workers' logs that name any of ``names`` (a task id, a pid)."""
    return "\n".join(
        line
        for worker in cluster.workers
        for line in worker.output().splitlines()
        if any(name in line for name in names)
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_a_pending_rerun_stopped_by_its_lost_lease_runs_again_with_the_pending_arguments(
    cluster,
):
    pending, first = run_as_pending_rerun(cluster, ledger_app.webhook, "resumed", 30.0)
    backend_for_url(cluster.store).force_release("exclusive:resumed")
    # Stopped at its next renewal, sent again, and holding the key under a new grant.
    assert wait_until(lambda: holds_anew(cluster, "resumed", first), timeout=cluster.ttl + 10)
    cluster.ledger.set("release:resumed", 1)  # the run that follows may end now
    rerun = pending.get(timeout=30)
    assert rerun["version"] == 3, "the coalesced duplicates' change was lost"
    assert rerun["requeues"] == 1 and rerun["token"] > first.fencing_token


def test_a_pending_rerun_killed_for_its_lost_lease_runs_again_with_the_pending_arguments(
    cluster,
):
    pending, first = run_as_pending_rerun(cluster, ledger_app.stubborn_webhook, "revived")
    pid = first.holder["pid"]
    backend_for_url(cluster.store).force_release("exclusive:revived")
    # Found lost within ttl / 3; killed when it has not stopped 1 s (its grace) later.
    assert wait_until(lambda: not alive(pid), timeout=cluster.ttl + 5), "never killed"
    assert wait_until(lambda: holds_anew(cluster, "revived", first), timeout=cluster.ttl + 10), (
        "not sent again; the workers said:\n" + said_of(cluster, pending.id, str(pid))
    )
    cluster.ledger.set("release:revived", 1)
    rerun = pending.get(timeout=30)
    assert rerun["version"] == 3, "the coalesced duplicates' change was lost"
    assert rerun["pid"] != pid and rerun["token"] > first.fencing_token


def started_with(cluster, key: str, pid: int) -> list[int]:
    """The versions the runs on ``key`` in process ``pid`` started with
    (``redelivered_webhook``; a pool child runs the calls of other tests too)."""
    started = [json.loads(raw) for raw in cluster.ledger.lrange("started", 0, -1)]
    return [s["version"] for s in started if s["pid"] == pid and s["key"] == key]


def run_until_delivered_again(cluster, key: str, stop, task=ledger_app.redelivered_webhook) -> dict:
    """Run ``task`` on ``key`` as its pending rerun (with the newest arguments, version
    3), ``stop(first holder)`` in its body, and return the result of the call when it
    comes back (``redelivered_webhook``: acks_late with reject_on_worker_lost, Celery
    hands its message back to the broker; ``retried_when_lost_webhook``: Celery retries
    it. Either way with the arguments it was sent with: version 1)."""
    pending, first = run_as_pending_rerun(cluster, task, key, 30.0)
    assert wait_until(lambda: started_with(cluster, key, first.holder["pid"]) == [3], timeout=10)
    stop(first)
    assert wait_until(lambda: holds_anew(cluster, key, first), timeout=cluster.ttl + 10)
    cluster.ledger.set(f"release:{key}", 1)
    rerun = pending.get(timeout=30)
    assert rerun["token"] > first.fencing_token
    store = backend_for_url(cluster.store)
    kept = lambda: marks.resume_arguments(store, "exclusive:" + key, pending.id)  # noqa: E731
    assert wait_until(lambda: kept() is None, timeout=10), "kept past the end of its attempt"
    return rerun


def test_a_pending_rerun_whose_process_died_is_delivered_again_with_the_pending_arguments(
    cluster,
):
    stop = lambda first: os.kill(first.holder["pid"], signal.SIGKILL)  # noqa: E731
    rerun = run_until_delivered_again(cluster, "redelivered", stop)
    assert rerun["version"] == 3, "the coalesced duplicates' change was lost"


def test_a_pending_rerun_stopped_by_its_lost_lease_is_delivered_again_with_the_pending_arguments(
    cluster,
):
    store = backend_for_url(cluster.store)
    stop = lambda first: store.force_release("exclusive:handed-back")  # noqa: E731
    rerun = run_until_delivered_again(cluster, "handed-back", stop)
    assert rerun["version"] == 3, "the coalesced duplicates' change was lost"


def dropped_by_a_worker(cluster, task_id: str) -> bool:
    """Whether a worker dropped a copy of ``task_id``'s message as one of an ended run."""
    return any(
        "redelivered copy dropped key=" in line and task_id in line
        for worker in cluster.workers
        for line in worker.output().splitlines()
    )


def test_a_message_delivered_again_after_its_run_leaves_the_pending_rerun_the_newest_change(
    cluster,
):
    # An acks_late message can come again after its run ended (its acknowledgement
    # lost with the worker's connection): here, while a later call holds the key and
    # a newer change waits as the pending rerun.
    key, task = "late-copy", ledger_app.redelivered_webhook
    first = task.delay(key, 1)
    assert first.get(timeout=30)["version"] == 1
    store = backend_for_url(cluster.store)
    with ExclusiveLock("exclusive:" + key, cluster.store, cluster.ttl, name="test holder"):
        pending = task.delay(key, 2)
        assert wait_until(lambda: marks.pending_rerun(store, "exclusive:" + key) == pending.id, 15)
        task.apply_async((key, 1), task_id=first.id)  # the same message, once more
        assert wait_until(lambda: dropped_by_a_worker(cluster, first.id), timeout=15)
    assert pending.get(timeout=30)["version"] == 2, "the copy handed the rerun its old change"
    assert first.state == "SUCCESS" and first.get(timeout=5)["version"] == 1
    seen = [json.loads(v)["task_id"] for v in cluster.ledger.lrange("versions", 0, -1)]
    assert seen.count(first.id) == 1, "the copy ran again"


def test_a_coalesced_duplicate_delivered_again_leaves_the_pending_rerun_the_newest_change(
    cluster,
):
    key, task = "coalesced-copy", ledger_app.redelivered_webhook
    store = backend_for_url(cluster.store)
    with ExclusiveLock("exclusive:" + key, cluster.store, cluster.ttl, name="test holder"):
        pending = task.delay(key, 1)
        assert wait_until(lambda: marks.pending_rerun(store, "exclusive:" + key) == pending.id, 15)
        coalesced = []
        for version in (2, 3):  # one after the other: the latest change is 3
            coalesced.append(task.delay(key, version))
            with pytest.raises(DuplicateCoalesced):
                coalesced[-1].get(timeout=30)
        task.apply_async((key, 2), task_id=coalesced[0].id)  # its message, once more
        assert wait_until(lambda: dropped_by_a_worker(cluster, coalesced[0].id), timeout=15)
    assert pending.get(timeout=30)["version"] == 3, "the copy handed the rerun its old change"


def test_a_skipped_duplicate_delivered_again_once_the_key_is_free_does_not_run(cluster):
    # Skipped so that it would not run twice: its message coming again (its
    # acknowledgement lost) must not run it once the key is free.
    key, task = "skipped-copy", ledger_app.hold_acks_late
    with ExclusiveLock("exclusive:" + key, cluster.store, cluster.ttl, name="test holder"):
        skipped = task.delay(key, 0.0)
        with pytest.raises(DuplicateSkipped):
            skipped.get(timeout=30)
    task.apply_async((key, 0.0), task_id=skipped.id)  # its message, once more
    assert wait_until(lambda: dropped_by_a_worker(cluster, skipped.id), timeout=15)
    assert [e for e in read_ledger(cluster.ledger) if e["task_id"] == skipped.id] == []
    assert skipped.state == "FAILURE"


def test_a_pending_rerun_that_retries_is_retried_with_the_pending_arguments(cluster):
    store = backend_for_url(cluster.store)
    task = ledger_app.retried_webhook
    with ExclusiveLock("exclusive:retried", cluster.store, cluster.ttl, name="test holder"):
        pending = task.delay("retried", 1)
        assert wait_until(lambda: marks.pending_rerun(store, "exclusive:retried") == pending.id, 15)
        for version in (2, 3):
            with pytest.raises(DuplicateCoalesced):
                task.delay("retried", version).get(timeout=30)
    ran = pending.get(timeout=30)
    assert ran["retries"] == 1
    assert ran["version"] == 3, "the retry went with its message's own arguments"


def test_a_pending_rerun_whose_process_died_is_retried_with_the_pending_arguments(cluster):
    stop = lambda first: os.kill(first.holder["pid"], signal.SIGKILL)  # noqa: E731
    task = ledger_app.retried_when_lost_webhook
    rerun = run_until_delivered_again(cluster, "retried-when-lost", stop, task)
    assert rerun["version"] == 3, "the coalesced duplicates' change was lost"
    assert rerun["retries"] == 1


def test_a_waiting_pending_rerun_whose_process_died_is_retried_as_the_pending_rerun(cluster):
    # Celery retries it itself (retry_on_worker_lost): no new call takes its run.
    store = backend_for_url(cluster.store)
    key, task = "lost-waiter", ledger_app.retried_when_lost_webhook
    with ExclusiveLock("exclusive:" + key, cluster.store, cluster.ttl, name="test holder"):
        pending = task.delay(key, 1)
        assert wait_until(lambda: marks.pending_rerun(store, "exclusive:" + key) == pending.id, 15)
        for version in (2, 3):
            with pytest.raises(DuplicateCoalesced):
                task.delay(key, version).get(timeout=30)
        signals = lambda: map(json.loads, cluster.ledger.lrange("signals", 0, -1))  # noqa: E731
        waits = lambda: [  # noqa: E731
            s["pid"] for s in signals() if s["task_id"] == pending.id and s.get("policy")
        ]
        [waiter] = waits()
        os.kill(waiter, signal.SIGKILL)
        # The retry waits for the key again, as the pending rerun.
        assert wait_until(lambda: len(waits()) == 2, timeout=15), waits()
        assert marks.pending_rerun(store, "exclusive:" + key) == pending.id
    ran = pending.get(timeout=30)
    assert (ran["version"], ran["retries"]) == (3, 1)
    assert [e["task_id"] for e in read_ledger(cluster.ledger) if e["key"] == key] == [pending.id]


# --- priority handoff -------------------------------------------------------------------


def test_a_priority_caller_gets_the_key_next_despite_ten_requeueing_contenders(cluster):
    holder = start_holding(ledger_app.hold_requeue, "report", 1.5, cluster)
    ordinary = [ledger_app.hold_requeue.delay("report", 0.05) for _ in range(10)]
    time.sleep(0.3)  # the ten are requeueing now
    urgent = ledger_app.nightly.delay("report", 0.05)
    assert urgent.get(timeout=30)["priority"]
    assert all(o.get(timeout=60) for o in ordinary)
    holder.get(timeout=60)
    order = [e["task_id"] for e in sorted(read_ledger(cluster.ledger), key=lambda e: e["start"])]
    assert order[:2] == [holder.id, urgent.id]
    assert len(order) == 12


def test_a_priority_callers_turn_lapses_when_it_dies(cluster):
    start_holding(ledger_app.hold_skip, "report", 30, cluster)
    urgent = ledger_app.nightly.delay("report", 0)
    store = backend_for_url(cluster.store)
    assert wait_until(lambda: store.read_mark("exclusive:report", "line"), timeout=10)
    reserver = next(
        s["pid"]
        for s in map(json.loads, cluster.ledger.lrange("signals", 0, -1))
        if s["task_id"] == urgent.id and s.get("policy") == "priority"
    )
    os.kill(reserver, signal.SIGKILL)
    assert wait_until(lambda: not store.read_mark("exclusive:report", "line"), cluster.ttl + 1)


# --- first come, first served -----------------------------------------------------------


def test_waiters_are_served_in_the_order_they_started_waiting(cluster):
    holder = start_holding(ledger_app.hold_wait, "queue", 3.0, cluster)
    store = backend_for_url(cluster.store)
    waiters = []
    for _ in range(6):
        waiter = ledger_app.hold_wait.delay("queue", 0.05)
        in_line = wait_until(lambda w=waiter: w.id in marks.line_of(store, "exclusive:queue"), 10)
        assert in_line, "the waiter never stood in line"
        waiters.append(waiter)
    # Contenders asking again and again all along must not get in ahead of the line.
    requeueing = [ledger_app.hold_requeue.delay("queue", 0.05) for _ in range(5)]
    assert all(w.get(timeout=60) for w in waiters + requeueing)
    holder.get(timeout=60)
    order = [e["task_id"] for e in sorted(read_ledger(cluster.ledger), key=lambda e: e["start"])]
    assert order[:7] == [holder.id] + [w.id for w in waiters]
    assert len(order) == 12


# --- enqueue-time dedup -------------------------------------------------------------------


def test_a_hundred_delays_for_one_key_send_one_message(cluster):
    results = [ledger_app.enqueued_once.delay("export", 0.5) for _ in range(100)]
    assert len({r.id for r in results}) == 1
    results[0].get(timeout=20)
    assert len(read_ledger(cluster.ledger)) == 1


def test_after_the_run_ends_the_key_can_be_enqueued_again(cluster):
    first = ledger_app.enqueued_once.delay("export", 0)
    first.get(timeout=20)
    second = ledger_app.enqueued_once.delay("export", 0)
    assert second.id != first.id
    second.get(timeout=20)


def test_a_task_that_retries_itself_three_times_completes(cluster):
    entry = ledger_app.enqueued_retrying.delay("retried").get(timeout=30)
    assert entry["retries"] == 3


def test_a_retry_is_sent_while_another_call_holds_the_enqueue_mark(cluster):
    # The call sent by name never held the mark; its retries go out through apply_async
    # while a later call, due in a while, holds it: a retry is the same call going on,
    # never a duplicate to refuse (refused, it would stay RETRY for ever). The later call
    # is due long after the three retries, however loaded the machine.
    later = ledger_app.enqueued_retrying.apply_async(("marked",), countdown=10)
    by_name = ledger_app.app.send_task(ledger_app.enqueued_retrying.name, args=("marked",))
    assert by_name.get(timeout=30)["retries"] == 3
    assert later.get(timeout=30)["retries"] == 3
    assert [e["task_id"] for e in read_ledger(cluster.ledger)] == [by_name.id, later.id]


def test_a_body_that_sent_its_retry_and_went_on_keeps_the_mark_for_the_retry(cluster):
    first = ledger_app.enqueued_retry_going_on.delay("going-on", 5.0)
    assert wait_until(lambda: len(read_ledger(cluster.ledger)) == 1, timeout=20)
    # Its run ended, but its retry is queued: a send of the key is that call's.
    assert ledger_app.enqueued_retry_going_on.delay("going-on", 5.0).id == first.id
    assert wait_until(lambda: len(read_ledger(cluster.ledger)) == 2, timeout=30)
    assert [e["retries"] for e in read_ledger(cluster.ledger)] == [0, 1]
    store = backend_for_url(cluster.store)
    assert wait_until(lambda: store.read_mark("exclusive:going-on", marks.QUEUED) is None, 10)
    again = ledger_app.enqueued_retry_going_on.delay("going-on", 0.1)
    assert again.id != first.id
    again.get(timeout=30)
    assert wait_until(lambda: len(read_ledger(cluster.ledger)) == 4, timeout=30)  # and its retry


@pytest.mark.parametrize("going_on", [False, True], ids=["raised", "going-on"])
def test_a_retry_sent_for_another_key_leaves_no_mark_on_the_first(cluster, going_on):
    retrying = ledger_app.enqueued_retry_elsewhere
    first = retrying.delay(f"before-{going_on}", f"after-{going_on}", 5.0, going_on)
    assert wait_until(lambda: len(read_ledger(cluster.ledger)) == going_on, timeout=20)
    store = backend_for_url(cluster.store)
    after, before = f"exclusive:after-{going_on}", f"exclusive:before-{going_on}"
    assert wait_until(lambda: store.read_mark(after, marks.QUEUED) == first.id, timeout=20)
    # The first key's call is over once its run ended: a send of it is a new call,
    # while the retry, queued for the other key, still holds that one.
    assert wait_until(lambda: store.read_mark(before, marks.QUEUED) is None, timeout=10)
    again = retrying.delay(f"before-{going_on}", f"before-{going_on}", 0.1, False)
    assert again.id != first.id
    assert retrying.delay(f"after-{going_on}", "elsewhere", 0.1, False).id == first.id
    again.get(timeout=30)

    def ran() -> list[tuple[str, str]]:
        return [(e["task_id"], e["key"]) for e in read_ledger(cluster.ledger)]

    # The retry runs on its key once (a body that went on ran on the first key before).
    assert wait_until(lambda: (first.id, f"after-{going_on}") in ran(), timeout=30), ran()
    assert (again.id, f"before-{going_on}") in ran()
    assert [run[0] for run in ran()].count(first.id) == 1 + going_on


def test_a_call_sent_by_name_and_requeued_is_sent_again_while_another_holds_the_mark(cluster):
    # Its requeue goes out through apply_async while the holder's enqueue mark is taken:
    # the library's own send is the same call going on, never a duplicate to refuse.
    holder = start_holding(ledger_app.enqueued_then_requeue, "line", 3.0, cluster)
    by_name = ledger_app.app.send_task(ledger_app.enqueued_then_requeue.name, args=("line", 0))
    assert by_name.get(timeout=30)["task_id"] == by_name.id
    holder.get(timeout=30)
    assert [e["task_id"] for e in read_ledger(cluster.ledger)] == [holder.id, by_name.id]


def test_a_task_sent_by_name_is_still_covered_by_the_run_time_lease(cluster):
    holder = start_holding(ledger_app.enqueued_once, "export", 1.0, cluster)
    by_name = ledger_app.app.send_task(ledger_app.enqueued_once.name, args=("export", 0))
    assert by_name.id != holder.id
    with pytest.raises(Exception, match="skipped"):
        by_name.get(timeout=60)
