"""What Celery does with the message of a call whose pool process was lost, as the
worker's main process reads it to decide what the death leaves to do: record that the
attempt ended (acknowledged), and, unless the call comes back, hand the run its
coalesced duplicates are owed to a new call (Celery 5.7's ``Request.on_failure``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_exclusive.celery import execution
from celery_exclusive.celery.worker import when_lost

needs_retry_when_lost = pytest.mark.skipif(
    not execution._CELERY_RETRIES_WHEN_LOST, reason="Celery before 5.7: no retry_on_worker_lost"
)


def a_task(acks_late=False, reject_on_worker_lost=False, retry_on_worker_lost=False):
    return SimpleNamespace(
        acks_late=acks_late,
        reject_on_worker_lost=reject_on_worker_lost,
        retry_on_worker_lost=retry_on_worker_lost,
    )


def test_an_early_acknowledged_call_is_over():
    assert when_lost(a_task(), None) == (True, False)


def test_an_acks_late_call_without_reject_on_worker_lost_is_over():
    assert when_lost(a_task(acks_late=True), None) == (True, False)


def test_an_acks_late_call_with_reject_on_worker_lost_comes_back_unacknowledged():
    assert when_lost(a_task(acks_late=True, reject_on_worker_lost=True), None) == (False, True)


@needs_retry_when_lost
def test_a_call_retried_when_lost_comes_back_acknowledged():
    task = a_task(acks_late=True, reject_on_worker_lost=True, retry_on_worker_lost=True)
    assert when_lost(task, True) == (True, True)
    assert when_lost(a_task(retry_on_worker_lost=True), True) == (True, True)


@needs_retry_when_lost
def test_a_call_whose_retries_are_spent_is_over_even_with_reject_on_worker_lost():
    # Celery 5.7 neither retries it nor hands its message back: it stores the failure.
    task = a_task(acks_late=True, reject_on_worker_lost=True, retry_on_worker_lost=True)
    assert when_lost(task, None) == (True, False)


@needs_retry_when_lost
def test_a_retry_that_could_not_be_sent_leaves_the_message_to_reject_on_worker_lost():
    task = a_task(acks_late=True, reject_on_worker_lost=True, retry_on_worker_lost=True)
    assert when_lost(task, False) == (False, True)
    assert when_lost(a_task(retry_on_worker_lost=True), False) == (True, False)


def test_retry_on_worker_lost_means_nothing_to_a_celery_that_ignores_it(monkeypatch):
    monkeypatch.setattr(execution, "_CELERY_RETRIES_WHEN_LOST", False)
    task = a_task(acks_late=True, reject_on_worker_lost=True, retry_on_worker_lost=True)
    assert when_lost(task, None) == (False, True)
    assert not execution.retried_when_lost(task)
