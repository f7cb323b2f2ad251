"""Revoking a call frees what it reserved, on a real worker: a call revoked before it
ran leaves no enqueue mark behind to answer later sends with a call that never runs.

One worker with two children, both kept busy by holders on other keys where the calls
under test are to wait in the queue (or among the worker's prefetched messages) while
they are revoked. Leases last 30 s, so that what a revoke frees at once is told from
what lapses on its own.
"""

from __future__ import annotations

import pytest
from celery import states

from celery_exclusive import backend_for_url
from celery_exclusive.backends.line import LINE, entries_of
from celery_exclusive.core import marks
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, start_holding, wait_until
from tests.support.workers import read_ledger


@pytest.fixture(scope="module")
def stack(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    stack.ttl = 30.0
    with stack.running(stack.worker("r1", concurrency=2)):
        yield stack


@pytest.fixture
def busy(stack):
    """The worker's two children held by calls on other keys for three seconds."""
    stack.reset()
    holders = [start_holding(ledger_app.hold_skip, f"busy-{i}", 3.0, stack) for i in range(2)]
    yield holders
    for holder in holders:
        holder.get(timeout=30)


def enqueue_mark(stack, key: str):
    return backend_for_url(stack.store).read_mark("exclusive:" + key, marks.QUEUED)


def runs_of(stack, key: str) -> list[str]:
    return [e["task_id"] for e in read_ledger(stack.ledger) if e["key"] == key]


def sent_again_and_run(stack, key: str, revoked) -> None:
    """A new send of ``key`` is a call of its own (not answered with the revoked one),
    and it alone runs."""
    again = ledger_app.enqueued_once.delay(key, 0)
    assert again.id != revoked.id
    again.get(timeout=30)
    assert runs_of(stack, key) == [again.id]


def test_a_revoked_call_frees_its_enqueue_mark_at_once(stack, busy):
    first = ledger_app.enqueued_once.delay("report", 0)
    assert enqueue_mark(stack, "report") == first.id
    first.revoke()
    assert enqueue_mark(stack, "report") is None
    second = ledger_app.enqueued_once.delay("report", 0)
    assert second.id != first.id
    second.get(timeout=30)
    assert wait_until(lambda: first.state == states.REVOKED, timeout=30)
    assert runs_of(stack, "report") == [second.id]


def test_a_call_revoked_by_its_id_alone_frees_its_mark_when_the_worker_drops_it(stack, busy):
    first = ledger_app.enqueued_once.delay("export", 0)
    ledger_app.app.AsyncResult(first.id).revoke()  # a result that knows only the id
    assert wait_until(lambda: first.state == states.REVOKED, timeout=30)
    assert wait_until(lambda: enqueue_mark(stack, "export") is None, timeout=10)
    sent_again_and_run(stack, "export", first)


def test_a_call_whose_message_expired_frees_its_mark(stack, busy):
    first = ledger_app.enqueued_once.apply_async(("digest", 0), expires=0.5)
    assert wait_until(lambda: first.state == states.REVOKED, timeout=30)
    assert wait_until(lambda: enqueue_mark(stack, "digest") is None, timeout=10)
    sent_again_and_run(stack, "digest", first)


def test_a_waiting_call_revoked_with_terminate_leaves_the_line_at_once(stack):
    stack.reset()
    holder = start_holding(ledger_app.hold_wait, "line", 5.0, stack)
    waiter = ledger_app.hold_wait.delay("line", 0)
    backend = backend_for_url(stack.store)
    assert wait_until(lambda: marks.waiting(backend, "exclusive:line", waiter.id), timeout=15)
    waiter.revoke(terminate=True)
    # Its place would lapse only after a lease ttl (30 s) without it.
    assert wait_until(lambda: waiter.id not in line_ids(stack, "line"), timeout=10)
    holder.get(timeout=30)
    assert wait_until(lambda: waiter.state == states.REVOKED, timeout=30)
    assert runs_of(stack, "line") == [holder.id]


def line_ids(stack, key: str) -> list[str]:
    """Every id in the line of ``key`` as the store holds it, lapsed places too."""
    line = backend_for_url(stack.store).read_mark("exclusive:" + key, LINE)
    return [entry["id"] for entry in entries_of(line)]


def test_a_revoke_that_stops_no_running_call_leaves_its_mark_its_own(stack):
    stack.reset()
    running = start_holding(ledger_app.enqueued_once, "running", 2.0, stack)
    running.revoke()  # without terminate: Celery lets a started call finish
    assert enqueue_mark(stack, "running") == running.id
    assert ledger_app.enqueued_once.delay("running", 0).id == running.id
    running.get(timeout=30)
    assert runs_of(stack, "running") == [running.id]


def test_a_revoke_leaves_the_mark_of_a_call_waiting_in_line_its_own(stack):
    stack.reset()
    # The holder, sent by name, holds no enqueue mark: the waiter's send takes it.
    holder = ledger_app.app.send_task(ledger_app.enqueued_wait.name, args=("queue", 3.0))
    assert wait_until(lambda: stack.holders("queue"), timeout=15)
    waiter = ledger_app.enqueued_wait.delay("queue", 0)
    backend = backend_for_url(stack.store)
    assert wait_until(lambda: marks.waiting(backend, "exclusive:queue", waiter.id), timeout=15)
    waiter.revoke()  # without terminate: the waiting call goes on
    assert enqueue_mark(stack, "queue") == waiter.id
    assert ledger_app.enqueued_wait.delay("queue", 0).id == waiter.id
    holder.get(timeout=30)
    waiter.get(timeout=30)
    assert runs_of(stack, "queue") == [holder.id, waiter.id]
