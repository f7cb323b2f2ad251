"""Lines of waiters, pending reruns and enqueue marks, on every store."""

from __future__ import annotations

import time

import pytest

from celery_exclusive.backends.line import LINE
from celery_exclusive.core import marks


@pytest.fixture
def store(backend):
    assert backend.capabilities.marks
    return backend


def test_the_first_duplicate_becomes_the_pending_rerun(store):
    assert marks.join_rerun(store, "k", "first", "a1", 10) == "first"
    assert marks.join_rerun(store, "k", "second", "a2", 10) == "first"
    assert marks.pending_rerun(store, "k") == "first"


def test_the_pending_rerun_takes_the_latest_arguments(store):
    marks.join_rerun(store, "k", "first", "a1", 10)
    marks.join_rerun(store, "k", "second", "a2", 10)
    marks.join_rerun(store, "k", "third", "a3", 10)
    assert marks.take_rerun(store, "k", "first") == "a3"


def test_with_first_the_pending_rerun_keeps_its_own_arguments(store):
    marks.join_rerun(store, "k", "first", "a1", 10, latest=False)
    marks.join_rerun(store, "k", "second", "a2", 10, latest=False)
    assert marks.take_rerun(store, "k", "first") == "a1"


def test_the_pending_rerun_rejoining_keeps_the_newer_arguments(store):
    marks.join_rerun(store, "k", "first", "a1", 10)
    marks.join_rerun(store, "k", "second", "a2", 10)
    assert marks.join_rerun(store, "k", "first", "a1", 10) == "first"
    assert marks.take_rerun(store, "k", "first") == "a2"


def test_only_the_pending_rerun_can_take_it_and_only_once(store):
    marks.join_rerun(store, "k", "first", "a1", 10)
    assert marks.take_rerun(store, "k", "second") is None
    assert marks.take_rerun(store, "k", "first") == "a1"
    assert marks.take_rerun(store, "k", "first") is None
    assert marks.join_rerun(store, "k", "later", "a9", 10) == "later"


#: How long a pending rerun counts as alive in the tests below, and a wait past it.
ALIVE_FOR, PAST_IT = 0.3, 0.6


def test_a_duplicate_takes_the_place_of_a_pending_rerun_that_is_no_longer_alive(store):
    marks.join_rerun(store, "k", "dead", "a1", 10, alive_for=ALIVE_FOR)
    time.sleep(PAST_IT)  # it never stood in line, nor was it requeued
    assert marks.join_rerun(store, "k", "next", "a2", 10, alive_for=ALIVE_FOR) == "next"
    assert marks.take_rerun(store, "k", "dead") is None
    assert marks.take_rerun(store, "k", "next") == "a2"


def test_the_carrier_of_an_owed_run_takes_the_place_of_the_pending_rerun_that_owed_it(
    store,
):
    # The pending rerun handed its run on, but the store missed its take of the mark:
    # the mark still names it, alive for a while.
    marks.join_rerun(store, "k", "gave-up", "a1", 10)
    assert marks.join_rerun(store, "k", "carrier", "a1", 10, gone="gave-up") == "carrier"
    assert marks.join_rerun(store, "k", "later", "a2", 10) == "carrier"
    assert marks.take_rerun(store, "k", "carrier") == "a2"


def test_a_dead_pending_rerun_hands_its_run_to_a_carrier_the_mark_names(store):
    marks.join_rerun(store, "k", "dead", "a1", 10)
    marks.join_rerun(store, "k", "joined", "a2", 10)
    assert marks.hand_on_rerun(store, "k", "dead", lambda: "carrier", 10) == "a2"
    assert marks.pending_rerun(store, "k") == "carrier"


def test_a_duplicate_after_the_hand_on_joins_the_carrier_on_its_way(store):
    marks.join_rerun(store, "k", "dead", "a1", 10)
    marks.hand_on_rerun(store, "k", "dead", lambda: "carrier", 10)
    assert marks.join_rerun(store, "k", "later", "a2", 10) == "carrier"
    assert marks.join_rerun(store, "k", "carrier", "a1", 10, gone="dead") == "carrier"
    assert marks.take_rerun(store, "k", "carrier") == "a2"


def test_a_carrier_that_dies_before_it_runs_hands_the_run_on_again(store):
    marks.join_rerun(store, "k", "dead", "a1", 10)
    marks.hand_on_rerun(store, "k", "dead", lambda: "carrier", 10)
    assert marks.hand_on_rerun(store, "k", "carrier", lambda: "next", 10) == "a1"
    assert marks.pending_rerun(store, "k") == "next"


def test_a_carrier_that_never_comes_gives_its_place_to_the_next_duplicate(store):
    marks.join_rerun(store, "k", "dead", "a1", 10)
    marks.hand_on_rerun(store, "k", "dead", lambda: "carrier", ALIVE_FOR)
    time.sleep(PAST_IT)  # its message lost on the way
    assert marks.join_rerun(store, "k", "next", "a2", 10, alive_for=ALIVE_FOR) == "next"
    assert marks.take_rerun(store, "k", "next") == "a2"


def test_a_call_that_was_not_the_pending_rerun_hands_nothing_on_and_names_no_carrier(store):
    marks.join_rerun(store, "k", "pending", "a1", 10)
    named = []
    assert marks.hand_on_rerun(store, "k", "other", lambda: named.append(1) or "c", 10) is None
    assert named == [] and marks.pending_rerun(store, "k") == "pending"


def test_a_pending_rerun_standing_in_line_stays_pending(store):
    marks.join_rerun(store, "k", "waiting", "a1", 10, alive_for=ALIVE_FOR)
    marks.take_place(store, "k", "waiting", 10)
    time.sleep(PAST_IT)
    assert marks.join_rerun(store, "k", "later", "a2", 10, alive_for=ALIVE_FOR) == "waiting"


#: How long the pending rerun below is away on a requeue: far past ALIVE_FOR, so that a
#: slow store or a busy machine cannot delay the check made while it is away past its return.
AWAY = 2.5


def test_a_pending_rerun_away_on_a_requeue_stays_pending_until_it_is_due_back(store):
    marks.join_rerun(store, "k", "away", "a1", 10, alive_for=ALIVE_FOR)
    assert marks.rerun_away(store, "k", "away", AWAY, 10) == "away"
    time.sleep(PAST_IT)  # no longer alive by its own account, but away
    assert marks.join_rerun(store, "k", "later", "a2", 10, alive_for=ALIVE_FOR) == "away"
    time.sleep(AWAY)  # due back, and not back
    assert marks.join_rerun(store, "k", "later", "a2", 10, alive_for=ALIVE_FOR) == "later"


def test_only_the_pending_rerun_itself_can_say_it_is_away(store):
    marks.join_rerun(store, "k", "pending", "a1", 10)
    assert marks.rerun_away(store, "k", "other", 10, 10) == "pending"
    assert marks.rerun_away(store, "empty", "other", 10, 10) is None


def test_waiters_stand_in_line_in_the_order_they_came(store):
    assert [marks.take_place(store, "k", c, 10) for c in ("a", "b", "c")] == [0, 1, 2]
    assert marks.line_of(store, "k") == ["a", "b", "c"]


def test_renewing_a_place_keeps_it(store):
    for claimant in ("a", "b"):
        marks.take_place(store, "k", claimant, 10)
    assert marks.take_place(store, "k", "a", 10) == 0
    assert marks.line_of(store, "k") == ["a", "b"]


def test_a_priority_caller_goes_behind_earlier_priority_callers_but_ahead_of_the_rest(store):
    marks.take_place(store, "k", "ordinary", 10)
    marks.take_place(store, "k", "nightly", 10, priority=True)
    assert marks.take_place(store, "k", "repair", 10, priority=True) == 1
    assert marks.line_of(store, "k") == ["nightly", "repair", "ordinary"]


def test_an_entry_not_renewed_in_time_is_dropped_by_the_next_change(store):
    marks.take_place(store, "k", "dead", 0.2)
    marks.take_place(store, "k", "alive", 10)
    time.sleep(0.3)
    assert marks.take_place(store, "k", "later", 10) == 1
    assert marks.line_of(store, "k") == ["alive", "later"]


def test_leaving_the_line_lets_the_next_one_move_up(store):
    for claimant in ("a", "b"):
        marks.take_place(store, "k", claimant, 10)
    marks.leave_line(store, "k", "a")
    assert marks.line_of(store, "k") == ["b"]
    marks.leave_line(store, "k", "b")
    assert store.read_mark("k", LINE) is None


def test_a_line_lapses_when_all_its_waiters_stop_renewing(store, backend_case):
    marks.take_place(store, "k", "dead", backend_case.short_ttl)
    time.sleep(backend_case.short_ttl * 2.5)
    assert marks.line_of(store, "k") == []


def test_an_enqueue_mark_names_the_task_already_queued_until_cleared(store):
    assert marks.claim_mark(store, "k", marks.QUEUED, "t1", 10) == "t1"
    assert marks.claim_mark(store, "k", marks.QUEUED, "t2", 10) == "t1"
    assert marks.clear_mark(store, "k", marks.QUEUED, "t2") is False
    assert marks.clear_mark(store, "k", marks.QUEUED, "t1") is True
    assert marks.claim_mark(store, "k", marks.QUEUED, "t2", 10) == "t2"


# --- finished marks: which attempt of a task id ended, and whether its body ran --------


def test_a_duplicates_end_ends_its_attempt_for_a_copy_but_not_for_a_resumed_call(store):
    marks.mark_finished(store, "k", "t", 0, 10, as_duplicate=True)
    mark = marks.finished_mark(store, "k", "t")
    assert marks.attempt_of(mark) == 0
    assert marks.ended(mark, 0) and not marks.ended(mark, 0, resumed=True)
    assert not marks.ended(mark, 1)  # a later retry is no copy of it


def test_a_runs_end_ends_its_attempt_for_a_resumed_call_too(store):
    marks.mark_finished(store, "k", "t", 0, 10)
    assert marks.ended(marks.finished_mark(store, "k", "t"), 0, resumed=True)


def test_a_runs_end_replaces_a_duplicates_end_of_the_same_attempt(store):
    marks.mark_finished(store, "k", "t", 0, 10, as_duplicate=True)
    marks.mark_finished(store, "k", "t", 0, 10)
    assert marks.run_recorded(marks.finished_mark(store, "k", "t"), 0)


def test_a_duplicates_end_never_replaces_a_runs_end(store):
    marks.mark_finished(store, "k", "t", 0, 10)
    marks.mark_finished(store, "k", "t", 0, 10, as_duplicate=True)
    assert marks.run_recorded(marks.finished_mark(store, "k", "t"), 0)


def test_the_end_of_a_later_attempt_is_kept_over_an_earlier_ones(store):
    marks.mark_finished(store, "k", "t", 2, 10, as_duplicate=True)
    marks.mark_finished(store, "k", "t", 1, 10)
    assert marks.attempt_of(marks.finished_mark(store, "k", "t")) == 2


def test_a_duplicates_end_reads_as_no_end_to_an_earlier_version(store):
    # Earlier versions read the mark as a whole number of retries and compare it with
    # their own: below zero, their copies act as they did before.
    marks.mark_finished(store, "k", "t", 0, 10, as_duplicate=True)
    assert int(marks.finished_mark(store, "k", "t")) < 0


#: The bound on the replaced runs below (their ttl and grace), and a wait past it.
STOPS_WITHIN, PAST_THE_BOUND = 0.5, 0.7


def test_a_replaced_run_is_waited_for_from_its_release_once_its_replacing_call_says_so(
    store,
):
    marks.mark_replaced(store, "k", 1, "old", "new", STOPS_WITHIN)
    time.sleep(PAST_THE_BOUND)  # the release was held up this long after the mark
    marks.mark_replaced(store, "k", 1, "old", "new", STOPS_WITHIN, freed=True)
    # Counted from the mark, the bound would have passed.
    left = marks.replaced_runs_left(store, "k", 2)
    assert list(left) == [1] and 0 < left[1] <= STOPS_WITHIN


def test_a_run_its_replacing_call_never_said_freed_is_waited_for_from_the_next_grant(store):
    marks.mark_replaced(store, "k", 1, "old", "new", STOPS_WITHIN)  # then it died
    time.sleep(PAST_THE_BOUND)
    # A grant of the key came after the release, however late: the bound counts from it,
    assert marks.replaced_runs_left(store, "k", 2) == {1: STOPS_WITHIN}
    # and for the calls after it too, not from each one's own grant again.
    time.sleep(PAST_THE_BOUND)
    assert marks.replaced_runs_left(store, "k", 3) == {}
