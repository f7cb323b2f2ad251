"""The finished mark of an ``acks_late`` call around its body, when things go wrong.

The mark is read as the call takes its key and written, from what was read, as the
key goes back (one step where the store can). Whatever fails in between, the key is
not left held: a grant nobody runs under would be renewed by the heartbeat for as long
as the process lives. The memory store stands in for any store here; the Redis cases
use a real server.
"""

from __future__ import annotations

import uuid

import pytest
from celery import Celery
from celery.app.task import Context

from celery_exclusive import ExclusiveTask, signals
from celery_exclusive.backends import NO_END, MarkRead
from celery_exclusive.backends.memory import MemoryBackend
from celery_exclusive.core import marks
from celery_exclusive.core.heartbeat import heartbeat
from celery_exclusive.core.lease import acquire
from celery_exclusive.errors import BackendUnavailable, ConfigurationError


@pytest.fixture
def app():
    app = Celery("attempt_end", broker="memory://", set_as_current=False)
    app.conf.update(
        exclusive_backend_url=f"memory://{uuid.uuid4().hex}",
        task_always_eager=False,
        exclusive_on_backend_error="run",
    )
    return app


@pytest.fixture
def losses():
    found: list[str] = []

    def listener(sender, **kwargs):
        found.append(kwargs["reason"])

    signals.lease_lost.connect(listener, weak=False)
    yield found
    signals.lease_lost.disconnect(listener)


def as_a_worker_calls(task, *args):
    """Call ``task`` as Celery's tracer does in a worker; return its result and id."""
    request = Context(
        id=str(uuid.uuid4()), args=args, kwargs={}, called_directly=False, is_eager=False
    )
    task.request_stack.push(request)
    try:
        return task(*args), request.id
    finally:
        task.request_stack.pop()


def renewed(key: str) -> list:
    return [lease for lease in heartbeat().held() if lease.key == key]


def test_a_mark_that_moved_while_the_body_ran_is_written_and_the_key_freed(app, losses):
    @app.task(name="end.moved", base=ExclusiveTask, acks_late=True, shared=False, bind=True)
    def moved(self, n):
        # Another write moves the mark away from what the grant read (none).
        marks.mark_finished(self.lease.backend, self.lease.key, self.request.id, 0, 60)
        return n

    _, task_id = as_a_worker_calls(moved, 1)
    key = moved.exclusive_key_for((1,), {})
    assert moved.exclusive_backend.holders_of(key) == []
    assert renewed(key) == []
    assert marks.finished_attempt(moved.exclusive_backend, key, task_id) == 0
    assert losses == []


def test_a_store_error_as_the_mark_is_written_still_frees_the_key(app, monkeypatch, losses):
    @app.task(name="end.error", base=ExclusiveTask, acks_late=True, shared=False)
    def error(n):
        return n

    calls, release = [], MemoryBackend.release

    def failing(self, lease, end=NO_END):
        if end.mark is None:
            return release(self, lease, end)
        calls.append(end)
        raise BackendUnavailable("blip", self.safe_url)

    monkeypatch.setattr(MemoryBackend, "release", failing)
    as_a_worker_calls(error, 2)
    key = error.exclusive_key_for((2,), {})
    assert calls
    assert error.exclusive_backend.holders_of(key) == []
    assert renewed(key) == []
    assert losses == []


def test_a_mark_written_and_key_freed_whose_answer_was_lost_is_no_loss(app, monkeypatch, losses):
    @app.task(name="end.unanswered", base=ExclusiveTask, acks_late=True, shared=False)
    def unanswered(n):
        return n

    release = MemoryBackend.release

    def done_then_lost(self, lease, end=NO_END):
        freed = release(self, lease, end)
        if end.mark is None:
            return freed
        raise BackendUnavailable("reply lost", self.safe_url)

    monkeypatch.setattr(MemoryBackend, "release", done_then_lost)
    _, task_id = as_a_worker_calls(unanswered, 3)
    key = unanswered.exclusive_key_for((3,), {})
    assert unanswered.exclusive_backend.holders_of(key) == []
    assert marks.finished_attempt(unanswered.exclusive_backend, key, task_id) == 0
    assert losses == []


def test_a_store_error_on_the_mark_read_after_the_grant_gives_the_grant_back(app, monkeypatch):
    @app.task(name="end.read", base=ExclusiveTask, acks_late=True, shared=False)
    def read(n):
        return n

    read_mark, fail = MemoryBackend.read_mark, [True]

    def flaky(self, key, kind):
        if fail and kind == marks.DONE:
            fail.clear()
            raise BackendUnavailable("blip", self.safe_url)
        return read_mark(self, key, kind)

    monkeypatch.setattr(MemoryBackend, "read_mark", flaky)
    as_a_worker_calls(read, 4)  # runs unlocked: exclusive_on_backend_error="run"
    key = read.exclusive_key_for((4,), {})
    assert not fail
    assert read.exclusive_backend.holders_of(key) == []
    assert renewed(key) == []


def test_a_store_error_checking_a_semaphore_for_a_copy_gives_the_slot_back(app, monkeypatch):
    @app.task(name="end.slot", base=ExclusiveTask, acks_late=True, shared=False)
    def slot(n):
        return n

    slot.exclusive_limit = 2

    def failing(self, key):
        raise BackendUnavailable("blip", self.safe_url)

    monkeypatch.setattr(MemoryBackend, "holders_of", failing)
    as_a_worker_calls(slot, 5)  # runs unlocked: exclusive_on_backend_error="run"
    monkeypatch.undo()
    key = slot.exclusive_key_for((5,), {})
    assert slot.exclusive_backend.holders_of(key) == []
    assert renewed(key) == []


def test_a_mark_that_cannot_be_read_after_a_redis_grant_gives_the_grant_back(redis_url):
    from celery_exclusive.backends.redis import RedisBackend, layout

    backend = RedisBackend(redis_url)
    backend.connection.client.rpush(layout.mark("done-of-k", "x"), "not a string")  # GET: WRONGTYPE
    with pytest.raises(ConfigurationError):
        acquire(backend, "k", 10, read=MarkRead("done-of-k", "x"))
    assert backend.holders_of("k") == []
    backend.close()
