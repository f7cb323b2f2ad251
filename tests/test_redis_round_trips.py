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
from redis.connection import AbstractConnection

from celery_exclusive import ExclusiveTask
from celery_exclusive.backends.redis import layout
from celery_exclusive.marks import finished_attempt


@pytest.fixture
def app(redis_url):
    app = Celery("round_trips", broker="memory://", set_as_current=False)
    app.conf.update(exclusive_backend_url=redis_url, task_always_eager=False)
    return app


@contextlib.contextmanager
def counting_round_trips(monkeypatch, key: str):
    """Count what the process sends to Redis about ``key``: one send per command or
    pipeline (other tests' clients and heartbeats in this process send too)."""
    sent: list[bytes] = []
    send = AbstractConnection.send_packed_command
    name = ("{" + layout.escape(key)).encode()  # its entries' names, and its marks'

    def counted(self, command, check_health=True):
        packed = command if isinstance(command, bytes) else b"".join(command)
        if name in packed:
            sent.append(packed)
        return send(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    yield sent


def as_a_worker_calls(task, *args):
    """Call ``task`` the way Celery's tracer does in a worker: a request of its own."""
    task_id = str(uuid.uuid4())
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


def test_an_acks_late_call_records_that_it_ended(app):
    @app.task(name="rt.late", base=ExclusiveTask, acks_late=True, shared=False)
    def late(invoice: int) -> int:
        return invoice

    _, task_id = as_a_worker_calls(late, 7)
    backend = late.exclusive_backend
    key = late.exclusive_key_for((7,), {})
    assert finished_attempt(backend, key, task_id) == 0
    assert backend.holders_of(key) == []


def test_an_acks_late_call_reads_its_finished_mark_after_its_grant(app, monkeypatch):
    """Only a holder of the key writes the mark, so a read that follows the grant on
    the same connection cannot miss a write of the attempt before; one that preceded it
    could (the previous holder marks and releases in between)."""

    @app.task(name="rt.order", base=ExclusiveTask, acks_late=True, shared=False)
    def order(invoice: int) -> int:
        return invoice

    as_a_worker_calls(order, 0)
    invoice = uuid.uuid4().int
    with counting_round_trips(monkeypatch, order.exclusive_key_for((invoice,), {})) as sent:
        as_a_worker_calls(order, invoice)
    first = sent[0]
    assert b"EVALSHA" in first and b"GET" in first
    assert first.index(b"EVALSHA") < first.index(b"\r\nGET\r\n")
