"""Pending reruns, reservations and enqueue marks, on every store."""

from __future__ import annotations

import pytest

from celery_exclusive import marks


@pytest.fixture
def store(backend):
    assert backend.stores_marks
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


def test_a_reservation_goes_to_the_first_priority_caller(store):
    assert marks.reserve(store, "k", "nightly", 10) is True
    assert marks.reserve(store, "k", "other", 10) is False
    assert marks.reserve(store, "k", "nightly", 10) is True  # renewing it


def test_an_enqueue_mark_names_the_task_already_queued_until_cleared(store):
    assert marks.claim_mark(store, "k:~queued", "t1", 10) == "t1"
    assert marks.claim_mark(store, "k:~queued", "t2", 10) == "t1"
    assert marks.clear_mark(store, "k:~queued", "t2") is False
    assert marks.clear_mark(store, "k:~queued", "t1") is True
    assert marks.claim_mark(store, "k:~queued", "t2", 10) == "t2"
