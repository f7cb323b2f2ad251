"""ExclusiveTask with task_always_eager and direct calls, on the in-process store."""

from __future__ import annotations

import threading

import pytest
from celery import Celery
from celery._state import _set_task_join_will_block

from celery_exclusive import DuplicateSkipped, ExclusiveKeyError, ExclusiveTask


@pytest.fixture(autouse=True)
def join_flag_reset():
    """Eager calls toggle Celery's process-wide "join will block" flag without a lock;
    two threads calling at once (as one test here does) can leave it set."""
    yield
    _set_task_join_will_block(False)


@pytest.fixture
def app(memory_url):
    app = Celery("eager", set_as_current=False)
    app.conf.update(task_always_eager=True, exclusive_backend_url=memory_url)
    return app


def test_the_body_sees_its_lease(app):
    @app.task(base=ExclusiveTask, bind=True, exclusive_key="invoice:{n}")
    def settle(self, n):
        return self.lease.key, self.lease.fencing_token, self.lease.lost

    assert settle.delay(7).get() == ("exclusive:invoice:7", 1, False)


def test_the_lease_is_released_after_an_eager_call(app):
    @app.task(base=ExclusiveTask, bind=True, exclusive_key="invoice:{n}")
    def settle(self, n):
        return self.lease.fencing_token

    assert [settle.delay(7).get() for _ in range(3)] == [1, 2, 3]


def test_a_nested_duplicate_is_skipped_with_the_holder_named(app):
    @app.task(base=ExclusiveTask, exclusive_key="invoice:{n}")
    def inner(n):
        return "ran"

    @app.task(base=ExclusiveTask, bind=True, exclusive_key="invoice:{n}")
    def outer(self, n):
        with pytest.raises(DuplicateSkipped) as info:
            inner.delay(n).get(disable_sync_subtasks=False)
        return info.value.holder_task_id == self.request.id

    assert outer.delay(7).get() is True


def test_an_eager_requeue_waits_for_the_holder_instead(app):
    release = threading.Event()
    order = []

    @app.task(base=ExclusiveTask, exclusive_key="k", exclusive_on_duplicate="requeue")
    def hold(tag):
        order.append(f"{tag}-start")
        if tag == "first":
            release.wait(5)
        order.append(f"{tag}-end")

    first = threading.Thread(target=hold.delay, args=("first",))
    first.start()
    while "first-start" not in order:
        pass
    threading.Timer(0.2, release.set).start()
    second = hold.delay("second")
    first.join()
    assert second.successful()
    assert order == ["first-start", "first-end", "second-start", "second-end"]


def test_a_direct_call_is_exclusive_too(app):
    @app.task(base=ExclusiveTask, bind=True, exclusive_key="k")
    def nested(self, depth):
        return nested(depth - 1) if depth else "bottom"

    with pytest.raises(DuplicateSkipped):
        nested(1)


def test_a_key_that_cannot_be_built_fails_the_call_naming_the_argument(app):
    @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}")
    def settle(n):
        pass

    with pytest.raises(ExclusiveKeyError) as info:
        settle.delay(7).get()
    assert info.value.argument == "invoice_id"
    assert "settle" in str(info.value)
