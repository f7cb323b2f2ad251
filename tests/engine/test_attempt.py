"""The attempt engine, host by host capability: what one call gets, decided once.

These run the engine in this process on the memory store; the same decisions on real
Celery and RQ workers are in ``test_same_outcome_on_both_hosts.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from celery_exclusive import BackendUnavailable, ConfigurationError, LeaseLost, backend_for_url
from celery_exclusive.core import kill_notes, marks, outcomes
from celery_exclusive.core.config import Settings
from celery_exclusive.core.lease import HeldLease, UnlockedLease
from celery_exclusive.core.lock import ExclusiveLock
from celery_exclusive.engine import attempt
from celery_exclusive.engine.arguments import encode_call

ROOT = Path(__file__).resolve().parents[2]
DEAD_STORE = "redis://127.0.0.1:1/0"
WORKER = attempt.Host(can_requeue=True)
DIRECT = attempt.Host(can_requeue=False)
ACKS_LATE = attempt.Host(can_requeue=True, redelivery=True, finished_ttl=60)
#: Celery's ``acks_late`` with ``reject_on_worker_lost``: a stopped body's message comes
#: back by itself, with the arguments it was sent with.
REDELIVERED_WHEN_STOPPED = attempt.Host(
    can_requeue=True, redelivery=True, redelivered_when_stopped=True, finished_ttl=60
)


def a_call(url: str, task_id: str | None = "task-1", requeues: int = 0, **settings):
    settings = Settings(backend_url=url, lease_ttl=5, requeue_delay=0.1, **settings)
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    return attempt.Call("t", task_id, key, settings, backend_for_url(url), (1,), {}, requeues)


def holding(call: attempt.Call) -> ExclusiveLock:
    return ExclusiveLock(call.key, call.settings.backend_url, 5, name="holder")


def test_a_free_key_runs_the_body_under_its_lease_and_gives_it_back(memory_url):
    call = a_call(memory_url)
    seen = []
    outcome = attempt.run(call, WORKER, lambda args, kwargs: seen.append(attempt.current_lease()))
    assert outcome == outcomes.Ran(None)
    lease = seen[0]
    assert isinstance(lease, HeldLease) and lease.key == call.key and lease.released
    assert attempt.current_lease() is None


def test_a_duplicate_is_requeued_with_its_next_count_where_the_host_can_requeue(memory_url):
    call = a_call(memory_url, on_duplicate="requeue", requeues=3)
    with holding(call):
        outcome = attempt.run(call, WORKER, pytest.fail)
    assert isinstance(outcome, outcomes.Requeue)
    assert (outcome.cause, outcome.requeues) == ("held", 4)


def test_a_duplicate_waits_in_the_keys_line_where_the_host_has_no_queue(memory_url):
    call = a_call(memory_url, on_duplicate="requeue", wait_timeout=0.2)
    with holding(call):
        outcome = attempt.run(call, DIRECT, pytest.fail)
    assert isinstance(outcome, outcomes.Waited)
    assert outcome.wait_timeout == 0.2


def test_a_duplicate_gives_up_after_requeue_max_retries(memory_url):
    call = a_call(memory_url, on_duplicate="requeue", requeue_max_retries=2, requeues=2)
    with holding(call):
        outcome = attempt.run(call, WORKER, pytest.fail)
    assert isinstance(outcome, outcomes.GaveUp)
    assert (outcome.cause, outcome.requeues) == ("held", 2)


def test_a_store_that_does_not_answer_requeues_the_call_where_it_can():
    outcome = attempt.run(a_call(DEAD_STORE), WORKER, pytest.fail)
    assert isinstance(outcome, outcomes.Requeue) and outcome.cause == "unanswered"


def test_a_store_that_does_not_answer_fails_a_call_without_a_queue():
    outcome = attempt.run(a_call(DEAD_STORE), DIRECT, pytest.fail)
    assert isinstance(outcome, outcomes.Unanswered)


def test_a_store_that_does_not_answer_runs_the_body_unlocked_under_run():
    call = a_call(DEAD_STORE, on_backend_error="run")
    outcome = attempt.run(call, DIRECT, lambda args, kwargs: attempt.current_lease())
    assert isinstance(outcome, outcomes.Ran) and isinstance(outcome.result, UnlockedLease)


def test_a_second_delivery_while_the_first_runs_is_set_aside(memory_url):
    call = a_call(memory_url)
    outcome = attempt.run(
        call, ACKS_LATE, lambda args, kwargs: attempt.run(call, ACKS_LATE, pytest.fail)
    )
    assert isinstance(outcome.result, outcomes.SetAside)


def test_a_second_delivery_of_an_attempt_that_ended_is_dropped(memory_url):
    call = a_call(memory_url)
    assert attempt.run(call, ACKS_LATE, lambda args, kwargs: "first") == outcomes.Ran("first")
    assert attempt.run(call, ACKS_LATE, pytest.fail) == outcomes.Dropped(call.key)


def test_a_copy_of_an_attempt_that_ended_finding_its_key_held_is_dropped_not_skipped(
    memory_url,
):
    call = a_call(memory_url, on_duplicate="skip")
    attempt.run(call, ACKS_LATE, lambda args, kwargs: "first")
    with holding(call):  # a later call holds the key when the message comes again
        assert attempt.run(call, ACKS_LATE, pytest.fail) == outcomes.Dropped(call.key)


def test_a_copy_of_an_attempt_that_ended_leaves_the_pending_rerun_its_arguments(memory_url):
    call = a_call(memory_url, on_duplicate="rerun")
    attempt.run(call, ACKS_LATE, lambda args, kwargs: "first")
    newer = encode_call(call.name, (4,), {})
    with holding(call):
        marks.join_rerun(call.backend, call.key, "task-4", newer, ttl=30)
        outcome = attempt.run(call, ACKS_LATE, pytest.fail)
        pending = json.loads(call.backend.read_mark(call.key, marks.RERUN))
    assert outcome == outcomes.Dropped(call.key)
    assert (pending["task_id"], pending["arguments"]) == ("task-4", newer)


def test_a_copy_of_an_attempt_that_ended_does_not_become_the_pending_rerun(memory_url):
    call = a_call(memory_url, on_duplicate="rerun")
    attempt.run(call, ACKS_LATE, lambda args, kwargs: "first")
    with holding(call):
        outcome = attempt.run(call, ACKS_LATE, pytest.fail)
        pending = call.backend.read_mark(call.key, marks.RERUN)
    assert outcome == outcomes.Dropped(call.key)
    assert pending is None


def test_a_copy_of_an_attempt_that_ended_is_dropped_while_its_retry_holds_the_key(memory_url):
    call = a_call(memory_url)
    attempt.run(call, ACKS_LATE, lambda args, kwargs: "first")
    retry = dataclasses.replace(call, retries=1)
    outcome = attempt.run(
        retry, ACKS_LATE, lambda args, kwargs: attempt.run(call, ACKS_LATE, pytest.fail)
    )
    assert outcome.result == outcomes.Dropped(call.key)


def test_a_copy_of_an_attempt_that_ended_leaves_the_arguments_its_retry_runs_with(memory_url):
    call = a_call(memory_url, on_duplicate="rerun")
    attempt.run(call, ACKS_LATE, lambda args, kwargs: "first")
    newest = encode_call(call.name, (3,), {})
    retry = dataclasses.replace(call, retries=1)  # the pending rerun now, with (3,)
    marks.join_rerun(call.backend, call.key, "task-1", newest, ttl=30)
    kept = []

    def body(args, kwargs):
        kept.append(attempt.run(call, ACKS_LATE, pytest.fail))  # attempt 0, once more
        kept.append(marks.resume_arguments(call.backend, call.key, "task-1"))

    attempt.run(retry, ACKS_LATE, body)
    assert kept == [outcomes.Dropped(call.key), newest]


def test_a_retry_of_an_attempt_that_ended_finding_its_key_held_is_a_duplicate(memory_url):
    call = a_call(memory_url, on_duplicate="skip")
    attempt.run(call, ACKS_LATE, lambda args, kwargs: "first")
    retry = dataclasses.replace(call, retries=1)  # retry() sent it again: attempt 1
    with holding(call):
        outcome = attempt.run(retry, ACKS_LATE, pytest.fail)
    assert isinstance(outcome, outcomes.Skipped)


def test_a_skipped_duplicate_delivered_again_once_the_key_is_free_is_dropped_not_run(
    memory_url,
):
    call = a_call(memory_url, on_duplicate="skip")
    with holding(call):
        assert isinstance(attempt.run(call, ACKS_LATE, pytest.fail), outcomes.Skipped)
    assert attempt.run(call, ACKS_LATE, pytest.fail) == outcomes.Dropped(call.key)


def test_a_coalesced_duplicate_delivered_again_leaves_a_newer_change_pending(memory_url):
    call = a_call(memory_url, on_duplicate="rerun", wait_timeout=0.2)
    call = dataclasses.replace(call, as_of=call.backend.store_time())  # stamped when sent
    newer = encode_call(call.name, (4,), {}, as_of=call.as_of + 1)
    with holding(call):
        marks.join_rerun(call.backend, call.key, "task-0", "{}", ttl=30)
        assert isinstance(attempt.run(call, ACKS_LATE, pytest.fail), outcomes.Coalesced)
        marks.join_rerun(call.backend, call.key, "task-4", newer, ttl=30)  # a later change
        again = attempt.run(call, ACKS_LATE, pytest.fail)
        pending = json.loads(call.backend.read_mark(call.key, marks.RERUN))
    assert again == outcomes.Dropped(call.key)
    assert (pending["task_id"], pending["arguments"]) == ("task-0", newer)


def test_a_duplicate_that_gave_up_delivered_again_is_dropped(memory_url):
    call = a_call(memory_url, on_duplicate="requeue", requeue_max_retries=0)
    with holding(call):
        assert isinstance(attempt.run(call, ACKS_LATE, pytest.fail), outcomes.GaveUp)
    assert attempt.run(call, ACKS_LATE, pytest.fail) == outcomes.Dropped(call.key)


def test_a_call_that_gives_up_says_so_before_it_records_its_end(memory_url, monkeypatch, caplog):
    # A process that dies while it records the end leaves a copy that finds the record
    # and is dropped: the line said before is then all that tells the call gave up.
    call = a_call(memory_url, on_duplicate="requeue", requeue_max_retries=1, requeues=1)

    def dies(*args, **kwargs):
        said = [r.getMessage() for r in caplog.records if "gives up after" in r.getMessage()]
        assert len(said) == 1
        assert said[0].startswith("t[task-1] gives up after 1 requeues: held by ")
        assert said[0].endswith(f"take {call.key!r} (exclusive_requeue_max_retries=1)")
        raise SystemExit("killed")

    monkeypatch.setattr(marks, "mark_finished", dies)
    caplog.set_level("WARNING", logger="celery_exclusive")
    with holding(call), pytest.raises(SystemExit):
        attempt.run(call, ACKS_LATE, pytest.fail)


def test_a_copy_set_aside_and_skipped_later_leaves_the_attempt_it_copies_to_run(memory_url):
    # The copy of a running call, set aside, comes back once that call lost its lease to
    # another holder; the stopped call is sent again (resumed) and must still run.
    standby = a_call(memory_url, on_duplicate="skip", requeues=1)
    with holding(standby):
        assert isinstance(attempt.run(standby, ACKS_LATE, pytest.fail), outcomes.Skipped)
    resumed = dataclasses.replace(standby, resumed=True)
    assert attempt.run(resumed, ACKS_LATE, lambda args, kwargs: "ran") == outcomes.Ran("ran")


def test_a_resumed_call_runs_after_a_copy_of_its_message_was_skipped(memory_url):
    # The broker delivered the message again while its run was being stopped for a lost
    # lease, and another call held the key: that copy was skipped. The library's own
    # resend of the stopped run must still run, and its end drops later copies.
    call = a_call(memory_url, on_duplicate="skip")
    with holding(call):
        assert isinstance(attempt.run(call, ACKS_LATE, pytest.fail), outcomes.Skipped)
    resumed = dataclasses.replace(call, requeues=1, resumed=True)
    assert attempt.run(resumed, ACKS_LATE, lambda args, kwargs: "ran") == outcomes.Ran("ran")
    assert attempt.run(resumed, ACKS_LATE, pytest.fail) == outcomes.Dropped(call.key)


def test_a_duplicate_whose_message_cannot_come_again_records_no_end(memory_url):
    call = a_call(memory_url, on_duplicate="skip")
    with holding(call):
        attempt.run(call, WORKER, pytest.fail)
    assert marks.finished_mark(call.backend, call.key, "task-1") is None


def lose_the_lease(args, kwargs):
    """A body whose lease is found lost while it runs, and which stops there."""
    lease = attempt.current_lease()
    lease.mark_lost("freed by the test", "released")
    lease.ensure_held()


def test_a_body_stopped_by_the_loss_of_its_lease_is_requeued(memory_url):
    call = a_call(memory_url, requeues=1)
    outcome = attempt.run(call, WORKER, lose_the_lease)
    assert isinstance(outcome, outcomes.Requeue)
    assert (outcome.cause, outcome.requeues) == ("lost", 2)


def test_a_call_stopped_by_the_loss_of_its_lease_is_sent_again_with_its_own_arguments(
    memory_url,
):
    outcome = attempt.run(a_call(memory_url, on_duplicate="rerun"), WORKER, lose_the_lease)
    assert isinstance(outcome, outcomes.Requeue) and outcome.cause == "lost"
    assert (outcome.args, outcome.kwargs) == (None, None)  # None: the call's own


def test_a_pending_rerun_stopped_by_the_loss_of_its_lease_is_sent_again_with_the_pending_arguments(
    memory_url,
):
    call = a_call(memory_url, on_duplicate="rerun")
    # A duplicate with newer arguments joined this call while it waited as the key's
    # pending rerun: it runs with them, not with its own (1,).
    newest = encode_call(call.name, (3,), {"changed": "later"})
    marks.join_rerun(call.backend, call.key, "task-1", newest, ttl=30)
    ran_with = []

    def body(args, kwargs):
        ran_with.append((args, kwargs))
        lose_the_lease(args, kwargs)

    outcome = attempt.run(call, WORKER, body)
    assert ran_with == [((3,), {"changed": "later"})]
    assert isinstance(outcome, outcomes.Requeue) and outcome.cause == "lost"
    assert (outcome.args, outcome.kwargs) == ((3,), {"changed": "later"})


def stopped_as_pending_rerun(call: attempt.Call, newest: str) -> None:
    """Run ``call`` as the pending rerun of its key, with ``newest``, and stop its body
    by the loss of its lease: its message comes back by itself."""
    marks.join_rerun(call.backend, call.key, call.task_id, newest, ttl=30)
    stopped = attempt.run(call, REDELIVERED_WHEN_STOPPED, lose_the_lease)
    assert isinstance(stopped, outcomes.Redelivered)


def test_a_pending_rerun_delivered_again_after_its_body_was_stopped_runs_with_the_pending_arguments(
    memory_url,
):
    call = a_call(memory_url, on_duplicate="rerun")
    stopped_as_pending_rerun(call, encode_call(call.name, (3,), {"changed": "later"}))
    # The broker delivers the message again: the same task id, its own arguments (1,).
    ran_with = []
    attempt.run(
        call, REDELIVERED_WHEN_STOPPED, lambda args, kwargs: ran_with.append((args, kwargs))
    )
    assert ran_with == [((3,), {"changed": "later"})]


def test_a_pending_rerun_delivered_again_runs_unlocked_with_the_pending_arguments(
    memory_url, monkeypatch
):
    call = a_call(memory_url, on_duplicate="rerun", on_backend_error="run")
    stopped_as_pending_rerun(call, encode_call(call.name, (3,), {"changed": "later"}))

    def unanswered(*args, **kwargs):
        raise BackendUnavailable("the store did not answer", memory_url)

    # The store answers the read of the kept arguments, then not the grant.
    monkeypatch.setattr(call.backend, "try_acquire", unanswered)
    ran_with = []
    outcome = attempt.run(
        call, REDELIVERED_WHEN_STOPPED, lambda args, kwargs: ran_with.append((args, kwargs))
    )
    assert isinstance(outcome, outcomes.Ran)
    assert ran_with == [((3,), {"changed": "later"})]


def test_a_pending_rerun_delivered_again_while_its_key_is_held_is_pending_again_with_its_arguments(
    memory_url,
):
    call = a_call(memory_url, on_duplicate="rerun", wait_timeout=0.2)
    newest = encode_call(call.name, (3,), {"changed": "later"})
    stopped_as_pending_rerun(call, newest)
    with holding(call):
        outcome = attempt.run(call, REDELIVERED_WHEN_STOPPED, pytest.fail)
        assert isinstance(outcome, outcomes.Requeue)
        pending = json.loads(call.backend.read_mark(call.key, marks.RERUN))
    assert (pending["task_id"], pending["arguments"]) == ("task-1", newest)


def test_a_pending_rerun_delivered_again_joins_a_newer_pending_rerun_without_replacing_it(
    memory_url,
):
    call = a_call(memory_url, on_duplicate="rerun", wait_timeout=0.2)
    stopped_as_pending_rerun(call, encode_call(call.name, (3,), {}))
    # A duplicate with newer arguments became the pending rerun since the run took its.
    newer = encode_call(call.name, (4,), {})
    with holding(call):
        marks.join_rerun(call.backend, call.key, "task-4", newer, ttl=30)
        outcome = attempt.run(call, REDELIVERED_WHEN_STOPPED, pytest.fail)
        pending = json.loads(call.backend.read_mark(call.key, marks.RERUN))
    assert outcome == outcomes.Coalesced(call.key, "task-4")
    assert (pending["task_id"], pending["arguments"]) == ("task-4", newer)
    assert marks.resume_arguments(call.backend, call.key, "task-1") is None  # it ended


def test_a_pending_rerun_runs_with_its_arguments_when_the_store_cannot_keep_them(
    memory_url, monkeypatch
):
    def unanswered(*args, **kwargs):
        raise BackendUnavailable("the store did not answer", memory_url)

    monkeypatch.setattr(marks, "keep_resume", unanswered)
    call = a_call(memory_url, on_duplicate="rerun")
    newest = encode_call(call.name, (3,), {"changed": "later"})
    marks.join_rerun(call.backend, call.key, "task-1", newest, ttl=30)
    ran_with = []
    attempt.run(call, ACKS_LATE, lambda args, kwargs: ran_with.append((args, kwargs)))
    assert ran_with == [((3,), {"changed": "later"})]


def test_the_arguments_kept_for_a_delivery_that_comes_again_go_when_its_attempt_ends(memory_url):
    call = a_call(memory_url, on_duplicate="rerun")
    newest = encode_call(call.name, (3,), {"changed": "later"})
    marks.join_rerun(call.backend, call.key, "task-1", newest, ttl=30)
    kept = []

    def body(args, kwargs):
        kept.append(marks.resume_arguments(call.backend, call.key, "task-1"))

    attempt.run(call, ACKS_LATE, body)
    assert kept == [newest]
    assert marks.resume_arguments(call.backend, call.key, "task-1") is None


def test_a_call_that_is_no_pending_rerun_keeps_no_arguments_for_its_message(memory_url):
    call = a_call(memory_url, on_duplicate="rerun")
    kept = []

    def body(args, kwargs):
        kept.append(marks.resume_arguments(call.backend, call.key, "task-1"))

    attempt.run(call, ACKS_LATE, body)
    assert kept == [None]


def test_a_pending_rerun_killed_for_not_stopping_is_sent_again_with_the_arguments_of_its_note():
    settings = Settings(backend_url="memory://", requeue_delay=0.1)
    noted = encode_call("t", (3,), {"changed": "later"})
    outcome = attempt.rerun_of_killed(settings, "exclusive:k", 0, noted)
    assert outcome is not None and outcome.cause == "lost"
    assert (outcome.args, outcome.kwargs) == ((3,), {"changed": "later"})


#: The engine running a call in a process of its own, as a pool child or a work horse
#: does: the call is the pending rerun of its key (with the newer arguments argv[1]),
#: and its body catches the LeaseLost that stops it, so its process is killed.
STUBBORN_RERUN = """
import contextlib, sys, threading, time
from celery_exclusive import BackendUnavailable, LeaseLost, backend_for_url
from celery_exclusive.core import marks
from celery_exclusive.core.config import Settings
from celery_exclusive.engine import attempt

settings = Settings(backend_url="memory://", on_duplicate="rerun", terminate_grace=0.2)
call = attempt.Call("t", "task-1", "exclusive:k", settings, backend_for_url("memory://"), (1,))
marks.join_rerun(call.backend, call.key, "task-1", sys.argv[1], ttl=30)


def stubborn(args, kwargs):
    # Found lost by another thread, as the heartbeat finds it.
    lease = attempt.current_lease()
    threading.Timer(0.1, lease.mark_lost, ("freed by the test", "released")).start()
    while True:
        with contextlib.suppress(LeaseLost):
            time.sleep(0.05)


attempt.run(call, attempt.Host(can_requeue=True, stop_process=True), stubborn)
"""


def test_a_pending_rerun_killed_for_not_stopping_notes_the_arguments_it_ran_with(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its notes, and the child's
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    newest = encode_call("t", (3,), {"changed": "later"})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", STUBBORN_RERUN, newest], env=env, cwd=ROOT)
    assert child.wait(timeout=60) == -signal.SIGKILL
    note = kill_notes.take_kill_note("task-1", child.pid)
    assert note is not None and note.arguments == newest


def test_a_body_stopped_by_the_loss_of_its_lease_fails_when_the_task_opts_out(memory_url):
    with pytest.raises(LeaseLost):
        attempt.run(a_call(memory_url, requeue_lost=False), WORKER, lose_the_lease)


def test_a_body_stopped_by_the_loss_of_its_lease_fails_without_a_queue(memory_url):
    with pytest.raises(LeaseLost):
        attempt.run(a_call(memory_url), DIRECT, lose_the_lease)


def test_a_call_resuming_a_stopped_run_is_requeued_not_skipped(memory_url):
    call = a_call(memory_url, on_duplicate="skip")
    call.resumed = True
    with holding(call):
        outcome = attempt.run(call, WORKER, pytest.fail)
    assert isinstance(outcome, outcomes.Requeue) and outcome.cause == "held"


def test_a_call_refused_as_its_holder_lets_go_runs_rather_than_skipped_as_held_by_nobody(
    memory_url, monkeypatch
):
    # A body's own retry (retry(throw=False)) meets its run as it ends: the grant is
    # refused, the holder releases, and the read of who holds the key finds nobody.
    call = a_call(memory_url, on_duplicate="skip")
    call.retries = 1
    lock = holding(call)
    held = lock.__enter__()
    read_holders = call.backend.holders_of

    def after_the_release(key):
        if not held.released:
            lock.__exit__(None, None, None)
        return read_holders(key)

    monkeypatch.setattr(call.backend, "holders_of", after_the_release)
    ran = []
    outcome = attempt.run(call, WORKER, lambda args, kwargs: ran.append(args))
    assert outcome == outcomes.Ran(None) and ran == [(1,)]


@pytest.mark.parametrize("where", ["close", "_leave"])
def test_an_interrupt_landing_as_the_body_exits_still_ends_the_attempt_and_its_stopper(
    memory_url, monkeypatch, where
):
    """The loss's LeaseLost is raised once, wherever the body's thread is: here as the
    exit of its block begins, before the stopper was left or the attempt ended. Its
    grace timer must not outlive the call (it would kill the process under the next
    one), nor the lease stay held and renewed."""
    from celery_exclusive.core import terminate

    host = attempt.Host(can_requeue=True, stop_process=False)
    call = a_call(memory_url, on_lease_lost="terminate", requeue_lost=False)
    original = getattr(attempt._Holding, where)
    interrupted = []

    def interrupt_first(self, *args):
        if not interrupted:
            interrupted.append(True)
            self.lease.mark_lost("taken away", "released")
            raise self.lease.loss_error()
        return original(self, *args)

    monkeypatch.setattr(attempt._Holding, where, interrupt_first)
    with pytest.raises(LeaseLost):
        attempt.run(call, host, lambda args, kwargs: None)
    assert interrupted
    assert terminate._running() == []  # the stopper left, its grace timer cancelled
    assert attempt.current() is None
    assert backend_for_url(memory_url).holders_of(call.key) == []


# --- a uniqueness window after the run ---------------------------------------------------


def test_a_run_under_unique_for_keeps_its_lease_that_long_after_it_ends(memory_url):
    call = a_call(memory_url, unique_for=30.0)
    seen = []
    assert attempt.run(call, WORKER, lambda a, k: seen.append(attempt.current_lease()))
    [info] = call.backend.holders_of(call.key)
    assert info.task_id == "task-1" and info.fencing_token == seen[0].fencing_token
    assert 25 < info.expires_in <= 30 and seen[0].kept_for == 30.0


def test_a_kept_lease_is_not_said_released(memory_url):
    from celery_exclusive import signals

    released = []

    def note(sender=None, **kwargs):
        released.append(kwargs["key"])

    signals.lease_released.connect(note, weak=False)
    try:
        call = a_call(memory_url, unique_for=30.0)
        attempt.run(call, WORKER, lambda a, k: None)
    finally:
        signals.lease_released.disconnect(note)
    assert released == [] and call.backend.holders_of(call.key)


def test_a_call_meeting_a_window_is_a_duplicate_naming_the_run_that_keeps_it(memory_url):
    first = a_call(memory_url, unique_for=30.0)
    attempt.run(first, WORKER, lambda a, k: None)
    again = dataclasses.replace(first, task_id="task-2")
    outcome = attempt.run(again, WORKER, lambda a, k: pytest.fail("ran in the window"))
    assert outcome == outcomes.Skipped(first.key, "task-1", None)


def test_a_run_that_raised_frees_its_key_at_once_unless_the_window_follows_every_end(
    memory_url,
):
    def fails(args, kwargs):
        raise ValueError("no")

    for after, holders in (("success", 0), ("end", 1)):
        call = a_call(memory_url, unique_for=30.0, unique_after=after)
        with pytest.raises(ValueError):
            attempt.run(call, WORKER, fails)
        assert len(call.backend.holders_of(call.key)) == holders, after


def test_a_run_whose_lease_was_lost_keeps_no_window(memory_url):
    call = a_call(memory_url, unique_for=30.0, on_lease_lost="log")

    def loses_its_lease(args, kwargs):
        call.backend.force_release(call.key)
        attempt.current_lease().mark_lost("taken by the test")

    attempt.run(call, WORKER, loses_its_lease)
    assert call.backend.holders_of(call.key) == []


def test_under_a_rate_a_run_keeps_its_slot_a_period_after_its_grant(memory_url):
    call = a_call(memory_url, rate="2/30s", limit=2)  # as the settings' check sets it
    for task_id in ("task-1", "task-2"):
        attempt.run(dataclasses.replace(call, task_id=task_id), WORKER, lambda a, k: None)
    assert sorted(info.task_id for info in call.backend.holders_of(call.key)) == [
        "task-1",
        "task-2",
    ]
    third = dataclasses.replace(call, task_id="task-3")
    assert isinstance(attempt.run(third, WORKER, lambda a, k: None), outcomes.Skipped)


def test_unique_for_on_a_store_without_windows_is_refused_naming_the_capability():
    call = a_call("etcd://127.0.0.1:9/none", unique_for=30.0)
    with pytest.raises(ConfigurationError, match="does not offer windows.*exclusive_unique_for"):
        attempt.run(call, WORKER, lambda a, k: pytest.fail("ran"))


# --- debounce ------------------------------------------------------------------------------


def a_burst_call(url: str, key: str, task_id: str, **settings) -> attempt.Call:
    call = a_call(url, task_id, debounce=5.0, **settings)
    call.key = key
    return call


def test_a_debounced_call_goes_back_to_the_queue_for_the_period_without_running(memory_url):
    call = a_call(memory_url, debounce=5.0)
    outcome = attempt.run(call, WORKER, pytest.fail)
    assert isinstance(outcome, outcomes.Requeue)
    assert (outcome.cause, outcome.countdown, outcome.requeues) == ("debounce", 5.0, 0)


def test_a_burst_runs_once_with_its_latest_arguments_and_its_other_calls_are_covered(
    memory_url, monkeypatch
):
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    calls = [a_burst_call(memory_url, key, f"call-{n}") for n in range(3)]
    for n, call in enumerate(calls):
        call.args = (n,)
        assert attempt.run(call, WORKER, pytest.fail).cause == "debounce"
    clock = calls[0].backend.store_time
    monkeypatch.setattr(calls[0].backend, "store_time", lambda: clock() + 5.0)  # due now
    ran, ends = [], []
    for call in calls:
        call.debounced = True
        ends.append(attempt.run(call, WORKER, lambda a, k, call=call: ran.append((call, a))))
    # Whichever call comes back first takes the burst, and runs the latest change.
    assert ran == [(calls[0], (2,))]
    assert ends[1:] == [outcomes.Coalesced(key, "call-0", debounced=True)] * 2


def test_a_call_come_back_before_its_burst_is_due_goes_back_until_it_is(memory_url):
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    calls = [a_burst_call(memory_url, key, f"call-{n}") for n in range(2)]
    for call in calls:
        attempt.run(call, WORKER, pytest.fail)
    calls[0].debounced = True
    outcome = attempt.run(calls[0], WORKER, pytest.fail)
    assert outcome.cause == "debounce" and 4.5 < outcome.countdown <= 5.0


def test_a_burst_bounded_by_max_wait_is_due_no_later_than_max_wait_after_its_first_call(
    memory_url, monkeypatch
):
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    first = a_burst_call(memory_url, key, "first", debounce_max_wait=6.0)
    assert attempt.run(first, WORKER, pytest.fail).countdown == 5.0
    later = a_burst_call(memory_url, key, "later", debounce_max_wait=6.0)
    clock = later.backend.store_time
    monkeypatch.setattr(later.backend, "store_time", lambda: clock() + 4.0)  # 4 s on
    assert attempt.run(later, WORKER, pytest.fail).countdown == pytest.approx(2.0, abs=0.1)


def test_a_call_after_a_burst_ran_opens_a_new_burst(memory_url, monkeypatch):
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    first = a_burst_call(memory_url, key, "first")
    attempt.run(first, WORKER, pytest.fail)
    clock = first.backend.store_time
    monkeypatch.setattr(first.backend, "store_time", lambda: clock() + 5.0)
    first.debounced = True
    assert attempt.run(first, WORKER, lambda a, k: "ran") == outcomes.Ran("ran")
    second = a_burst_call(memory_url, key, "second")
    assert attempt.run(second, WORKER, pytest.fail).countdown == 5.0


def test_the_run_a_burst_left_is_requeued_not_skipped_when_it_meets_a_holder(
    memory_url, monkeypatch
):
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    call = a_burst_call(memory_url, key, "only", on_duplicate="skip")
    attempt.run(call, WORKER, pytest.fail)
    clock = call.backend.store_time
    monkeypatch.setattr(call.backend, "store_time", lambda: clock() + 5.0)
    call.debounced = True
    with holding(call):
        outcome = attempt.run(call, WORKER, pytest.fail)
    assert isinstance(outcome, outcomes.Requeue) and outcome.cause == "held"
    # Back once the holder is gone: it took the burst, and runs it.
    assert attempt.run(call, WORKER, lambda a, k: "ran") == outcomes.Ran("ran")


def test_a_debounced_call_without_a_queue_runs_at_once(memory_url):
    call = a_call(memory_url, debounce=5.0)
    assert attempt.run(call, DIRECT, lambda a, k: "ran") == outcomes.Ran("ran")


def test_an_older_change_joining_after_a_newer_one_was_taken_is_covered_by_that_run(
    memory_url, monkeypatch
):
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    older = a_burst_call(memory_url, key, "older")
    older.as_of = 100.0  # sent first; its first try failed, so it joins late
    newer = a_burst_call(memory_url, key, "newer")
    newer.as_of = 200.0
    attempt.run(newer, WORKER, pytest.fail)
    clock = newer.backend.store_time
    monkeypatch.setattr(newer.backend, "store_time", lambda: clock() + 5.0)
    newer.debounced = True
    assert attempt.run(newer, WORKER, lambda a, k: "ran") == outcomes.Ran("ran")
    outcome = attempt.run(older, WORKER, pytest.fail)
    assert outcome == outcomes.Coalesced(key, "newer", debounced=True)


def test_a_copy_of_a_call_that_ran_its_burst_is_dropped_not_joined_again(memory_url, monkeypatch):
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    call = a_burst_call(memory_url, key, "only")
    attempt.run(call, ACKS_LATE, pytest.fail)
    clock = call.backend.store_time
    monkeypatch.setattr(call.backend, "store_time", lambda: clock() + 5.0)
    call.debounced = True
    assert attempt.run(call, ACKS_LATE, lambda a, k: "ran") == outcomes.Ran("ran")
    call.debounced = False  # its first message, delivered again
    assert isinstance(attempt.run(call, ACKS_LATE, pytest.fail), outcomes.Dropped)


def test_a_take_whose_answer_is_lost_runs_unlocked_with_the_bursts_change(memory_url, monkeypatch):
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    first = a_burst_call(memory_url, key, "first", on_backend_error="run")
    first.args = (1,)
    last = a_burst_call(memory_url, key, "last", on_backend_error="run")
    last.args = (2,)
    for call in (first, last):
        attempt.run(call, WORKER, pytest.fail)
    clock = first.backend.store_time
    monkeypatch.setattr(first.backend, "store_time", lambda: clock() + 5.0)
    swap = first.backend.swap_mark

    def lost_after_applying(key, kind, expected, new, ttl):
        swap(key, kind, expected, new, ttl)
        if kind == "debounce":
            raise BackendUnavailable("the answer was lost", memory_url)
        return True

    monkeypatch.setattr(first.backend, "swap_mark", lost_after_applying)
    first.debounced = True
    ran = []
    attempt.run(first, WORKER, lambda a, k: ran.append(a))
    assert ran == [(2,)]


# --- replace ---------------------------------------------------------------------------------


def test_a_newer_call_under_replace_stops_the_running_one_and_runs_after_it(memory_url):
    import threading
    import time

    settings = Settings(
        backend_url=memory_url, lease_ttl=1.0, terminate_grace=0.5, on_duplicate="replace"
    )
    key = f"exclusive:{uuid.uuid4().hex[:8]}"

    def call_of(task_id: str) -> attempt.Call:
        return attempt.Call("t", task_id, key, settings, backend_for_url(memory_url))

    seen: dict = {}

    def running(args, kwargs):
        seen["old token"] = attempt.current_lease().fencing_token
        try:
            while True:  # until its loss stops it
                attempt.current_lease().ensure_held()
                time.sleep(0.02)
        finally:
            seen["old ended"] = time.monotonic()  # its body, not its thread, stopped

    def stopped_by_the_newer_call():
        seen["old"] = attempt.run(call_of("old"), WORKER, running)

    old = threading.Thread(target=stopped_by_the_newer_call)
    old.start()
    assert wait_for(lambda: "old token" in seen)

    def runs_instead(args, kwargs):
        seen["new started"] = time.monotonic()
        return attempt.current_lease().fencing_token

    new = attempt.run(call_of("new"), WORKER, runs_instead)
    old.join(5)
    assert seen["old"] == outcomes.Replaced(key, "new")
    assert isinstance(new, outcomes.Ran) and new.result > seen["old token"]
    assert seen["new started"] >= seen["old ended"]


def test_a_replaced_call_that_comes_again_ends_replaced_rather_than_replace_its_successor(
    memory_url,
):
    settings = Settings(backend_url=memory_url, lease_ttl=5.0, on_duplicate="replace")
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    backend = backend_for_url(memory_url)
    marks.mark_replaced(backend, key, 7, "old", "new", 10.0)
    again = attempt.Call("t", "old", key, settings, backend, retries=1)  # its retry
    assert attempt.run(again, WORKER, pytest.fail) == outcomes.Replaced(key, "new")


def test_a_first_delivery_under_replace_reads_no_replaced_mark_before_its_grant(memory_url):
    # Nothing can have replaced a call that never held its key: the one read its grant
    # makes (whether a replaced run still goes on) is all that replace adds.
    settings = Settings(backend_url=memory_url, lease_ttl=5.0, on_duplicate="replace")
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    backend = backend_for_url(memory_url)
    reads = []
    original = backend.read_mark
    backend.read_mark = lambda k, kind, *a: reads.append(kind) or original(k, kind, *a)
    first = attempt.Call("t", "first", key, settings, backend)
    assert isinstance(attempt.run(first, WORKER, lambda a, k: None), outcomes.Ran)
    assert reads.count(marks.REPLACED) == 1


def test_a_call_replacing_a_run_another_call_replaced_first_never_says_it_stopped(memory_url):
    """Two newer calls meet one running call at once: the one whose release finds the
    grant already freed (by the other) says nothing of whether the run stopped, so the
    call that runs next still waits for it."""
    import threading

    from celery_exclusive.core import policies

    settings = Settings(backend_url=memory_url, lease_ttl=5.0, on_duplicate="replace")
    backend = backend_for_url(memory_url)
    key = f"exclusive:{uuid.uuid4().hex[:8]}"
    running = backend.try_acquire(key, "owner-a", 5.0, 1, {"task_id": "a", "ttl": 5.0})
    seen_by_the_later = backend.holders_of(key)  # read before the first replaced it

    class AsReadBefore:
        """The store as the later call found it: the running call still holding."""

        def __getattr__(self, name):
            return getattr(backend, name)

        def holders_of(self, key):
            return seen_by_the_later

    def duplicate(task_id: str, store) -> policies.Duplicate:
        return policies.Duplicate(
            settings, store, key, "t", task_id, 0, None, "a", None, "task", False, 0, False
        )

    first = threading.Thread(target=policies.replace_running, args=(duplicate("b", backend),))
    first.start()  # replaces a's run, takes the key, waits for a to stop
    assert wait_for(lambda: [i.task_id for i in backend.holders_of(key)] == ["b"])
    later = policies.replace_running(duplicate("c", AsReadBefore()))
    assert isinstance(later, outcomes.Requeue)  # b holds the key now
    [run] = marks.replaced_runs(backend, key, own_token=0)
    assert (run["token"], run["by"], run["stopped"]) == (running.fencing_token, "b", False)
    marks.note_stopped(backend, key, running.fencing_token)  # a says it stopped
    first.join(5)
    assert not first.is_alive()


def wait_for(predicate, timeout: float = 5.0) -> bool:
    import time

    until = time.monotonic() + timeout
    while not predicate() and time.monotonic() < until:
        time.sleep(0.01)
    return predicate()
