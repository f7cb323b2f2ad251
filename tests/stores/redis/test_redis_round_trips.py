"""What one uncontended call costs the Redis store, in round trips, as a worker makes it.

A call's lease costs two round trips: one before the body (the grant) and one after it
(the release), both awaited. An ``acks_late`` call also reads, as it takes the key,
whether its attempt already ended, and records at the end that it did: the read goes
in the grant's round trip and the record in the release's, so it costs no more.
"""

from __future__ import annotations

import contextlib
import uuid

import pytest
from celery import Celery
from celery.app.task import Context
from celery.app.trace import build_tracer

from celery_exclusive import ExclusiveTask
from celery_exclusive.backends.redis import layout
from celery_exclusive.core import marks
from celery_exclusive.core.marks import finished_attempt
from tests.conftest import fresh_redis_db
from tests.support.redis_sends import sent_by_this_thread


@pytest.fixture
def app(redis_url):
    app = Celery("round_trips", broker="memory://", set_as_current=False)
    app.conf.update(exclusive_backend_url=redis_url, task_always_eager=False)
    return app


@contextlib.contextmanager
def counting_round_trips(monkeypatch, key: str, also: bytes = b""):
    """Count what this thread sends to Redis about ``key`` (or naming ``also``): one
    send per command or pipeline."""
    name = ("{" + layout.escape(key)).encode()  # its entries' names, and its marks'
    yield sent_by_this_thread(
        monkeypatch, lambda packed: name in packed or bool(also and also in packed)
    )


def as_a_worker_calls(task, *args, task_id=None):
    """Call ``task`` the way Celery's tracer does in a worker: a request of its own."""
    task_id = task_id or str(uuid.uuid4())
    request = Context(id=task_id, args=args, kwargs={}, called_directly=False, is_eager=False)
    task.request_stack.push(request)
    try:
        return task(*args), task_id
    finally:
        task.request_stack.pop()


@pytest.mark.parametrize("acks_late", [False, True], ids=["acks_early", "acks_late"])
def test_an_uncontended_call_costs_two_round_trips(app, monkeypatch, acks_late):
    @app.task(name="rt.settle", base=ExclusiveTask, acks_late=acks_late, shared=False)
    def settle(invoice: int) -> int:
        return invoice

    as_a_worker_calls(settle, 0)  # connects and loads the scripts
    invoice = uuid.uuid4().int
    with counting_round_trips(monkeypatch, settle.exclusive_key_for((invoice,), {})) as sent:
        assert as_a_worker_calls(settle, invoice)[0] == invoice
    assert len(sent) == 2, sent


def test_a_call_queued_with_scope_both_costs_one_more_round_trip_to_clear_its_mark(
    app, monkeypatch
):
    """With ``exclusive_scope="both"`` the producer marks the key queued; the worker's
    call takes the key, releases it, and clears that mark if it is still its own: one
    compare-and-swap, no read before it."""

    @app.task(name="rt.both", base=ExclusiveTask, exclusive_scope="both", shared=False)
    def both(invoice: int) -> int:
        return invoice

    as_a_worker_calls(both, 0)  # connects and loads the scripts
    invoice, task_id = uuid.uuid4().int, str(uuid.uuid4())
    key = both.exclusive_key_for((invoice,), {})
    backend = both.exclusive_backend
    assert marks.claim_mark(backend, key, marks.QUEUED, task_id, 60) == task_id  # as sent
    with counting_round_trips(monkeypatch, key) as sent:
        assert as_a_worker_calls(both, invoice, task_id=task_id)[0] == invoice
    assert len(sent) == 3, sent
    assert backend.read_mark(key, marks.QUEUED) is None


def test_an_acks_late_call_records_that_it_ended(app):
    @app.task(name="rt.late", base=ExclusiveTask, acks_late=True, shared=False)
    def late(invoice: int) -> int:
        return invoice

    _, task_id = as_a_worker_calls(late, 7)
    backend = late.exclusive_backend
    key = late.exclusive_key_for((7,), {})
    assert finished_attempt(backend, key, task_id) == 0
    assert backend.holders_of(key) == []


def test_an_acks_late_call_reads_its_finished_mark_in_its_grant_s_script(app, monkeypatch):
    """Only a holder of the key writes the mark, so a read in the grant's own atomic
    step cannot miss a write of the attempt before; one sent before the grant could
    (the previous holder marks and releases in between)."""

    @app.task(name="rt.order", base=ExclusiveTask, acks_late=True, shared=False)
    def order(invoice: int) -> int:
        return invoice

    as_a_worker_calls(order, 0)
    invoice, task_id = uuid.uuid4().int, str(uuid.uuid4())
    key = order.exclusive_key_for((invoice,), {})
    with counting_round_trips(monkeypatch, key) as sent:
        as_a_worker_calls(order, invoice, task_id=task_id)
    first = sent[0]
    assert first.count(b"EVALSHA") == 1 and b"\r\nGET\r\n" not in first
    assert layout.mark(marks.finished_key(key, task_id), marks.DONE).encode() in first


# --- with the result: what Celery's tracer does after the call, counted too ------------


@pytest.fixture
def results_app(redis_server, redis_url):
    """Results in another database of the lease store's server."""
    app = Celery("round_trips_results", broker="memory://", set_as_current=False)
    app.conf.update(
        exclusive_backend_url=redis_url,
        result_backend=fresh_redis_db(redis_server),
        task_always_eager=False,
    )
    return app


def as_the_tracer_runs(task, *args, task_id=None, **options):
    """Run ``task`` as a worker's tracer does: the call, then its result stored by the
    result backend (unless the call stored it with its release)."""
    task_id = task_id or str(uuid.uuid4())
    tracer = build_tracer(task.name, task, eager=False, propagate=True, app=task.app)
    tracer(task_id, args, {}, {"id": task_id, "delivery_info": {}, **options})
    return task_id


@pytest.mark.parametrize("scope", ["run", "both"])
def test_with_its_result_on_the_lease_stores_server_a_call_costs_two_round_trips_in_all(
    results_app, monkeypatch, scope
):
    @results_app.task(name="rt.stored", base=ExclusiveTask, exclusive_scope=scope, shared=False)
    def stored(invoice: int) -> int:
        return invoice

    as_the_tracer_runs(stored, 0)  # connects and loads the scripts
    invoice, task_id = uuid.uuid4().int, str(uuid.uuid4())
    key = stored.exclusive_key_for((invoice,), {})
    backend = stored.exclusive_backend
    if scope == "both":
        assert marks.claim_mark(backend, key, marks.QUEUED, task_id, 60) == task_id  # as sent
    result_key = results_app.backend.get_key_for_task(task_id)
    with counting_round_trips(monkeypatch, key, also=result_key) as sent:
        as_the_tracer_runs(stored, invoice, task_id=task_id)
    assert len(sent) == 2, sent  # the grant; the release with the result (and the mark)
    assert stored.AsyncResult(task_id).get(timeout=5) == invoice
    assert backend.read_mark(key, marks.QUEUED) is None


def test_a_call_whose_result_is_ignored_still_clears_its_enqueue_mark(results_app):
    @results_app.task(name="rt.ignored", base=ExclusiveTask, exclusive_scope="both", shared=False)
    def ignored(invoice: int) -> int:
        return invoice

    invoice, task_id = uuid.uuid4().int, str(uuid.uuid4())
    key = ignored.exclusive_key_for((invoice,), {})
    backend = ignored.exclusive_backend
    assert marks.claim_mark(backend, key, marks.QUEUED, task_id, 60) == task_id
    as_the_tracer_runs(ignored, invoice, task_id=task_id, ignore_result=True)
    assert backend.read_mark(key, marks.QUEUED) is None
    assert ignored.AsyncResult(task_id).state == "PENDING"  # nothing stored


@pytest.mark.parametrize("differs", ["serializer", "address"])
def test_a_result_backend_the_script_cannot_write_for_keeps_celerys_own_store(
    results_app, monkeypatch, differs
):
    """A pickled result (the script reads a stored state as JSON, to keep a success), or
    a backend reached by another address: the release, then Celery's read and write."""
    if differs == "serializer":
        results_app.conf.update(result_serializer="pickle", accept_content=["json", "pickle"])
    else:
        url = results_app.conf.result_backend
        results_app.conf.result_backend = url.replace("127.0.0.1", "localhost")

    @results_app.task(name="rt.celerys", base=ExclusiveTask, shared=False)
    def celerys(invoice: int) -> int:
        return invoice

    as_the_tracer_runs(celerys, 0)
    invoice, task_id = uuid.uuid4().int, str(uuid.uuid4())
    key = celerys.exclusive_key_for((invoice,), {})
    result_key = results_app.backend.get_key_for_task(task_id)
    with counting_round_trips(monkeypatch, key, also=result_key) as sent:
        as_the_tracer_runs(celerys, invoice, task_id=task_id)
    assert len(sent) == 4, sent  # grant, release; Celery's read, its write and publish
    assert celerys.AsyncResult(task_id).get(timeout=5) == invoice
