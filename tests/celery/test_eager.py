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
    held, release = threading.Event(), threading.Event()

    @app.task(base=ExclusiveTask, exclusive_key="k")
    def hold(wait):
        if wait:
            held.set()
            release.wait(5)
        return "ran"

    holder = threading.Thread(target=hold, args=(True,))
    holder.start()
    held.wait(5)
    try:
        with pytest.raises(DuplicateSkipped):
            hold(False)
    finally:
        release.set()
        holder.join()


def test_a_direct_call_on_the_key_its_caller_holds_is_re_entrant(app):
    @app.task(base=ExclusiveTask, bind=True, exclusive_key="k")
    def nested(self, depth):
        token = self.lease.fencing_token
        return [token, *nested(depth - 1)] if depth else [token]

    assert nested(2) == [1, 1, 1]
    assert nested.delay(1).get() == [2, 2]


def test_a_key_that_cannot_be_built_fails_the_call_naming_the_argument(app):
    @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}")
    def settle(n):
        pass

    with pytest.raises(ExclusiveKeyError) as info:
        settle.delay(7).get()
    assert info.value.argument == "invoice_id"
    assert "settle" in str(info.value)


def test_self_lease_says_it_is_unlocked_when_the_store_is_down_and_calls_run(app):
    from tests.support.servers import free_port

    app.conf.update(
        exclusive_backend_url=f"redis://127.0.0.1:{free_port()}/0",
        exclusive_on_backend_error="run",
    )

    @app.task(base=ExclusiveTask, bind=True, exclusive_key="invoice:{n}")
    def settle(self, n):
        self.lease.ensure_held()  # the documented pattern keeps working: no lease to check
        return self.lease.key, self.lease.held, self.lease.fencing_token, self.lease.lost

    assert settle.delay(7).get() == ("exclusive:invoice:7", False, None, False)


def test_a_key_naming_no_argument_is_refused_when_the_task_is_sent():
    app = Celery("sender", broker="memory://", set_as_current=False)

    @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice}")
    def settle(invoice_id):
        pass

    with pytest.raises(ExclusiveKeyError, match="'invoice'"):
        settle.delay(7)


def tenant_key(args, kwargs):
    return f"tenant:{kwargs['tenant_id']}"


def test_a_plain_function_given_as_exclusive_key_is_called_with_args_and_kwargs(app):
    @app.task(base=ExclusiveTask, bind=True, exclusive_key=tenant_key)
    def rebuild(self, tenant_id):
        return self.lease.key

    assert rebuild.delay(tenant_id=3).get() == "exclusive:tenant:3"


def test_a_key_method_written_on_a_task_class_gets_the_task(app):
    class PerTenant(ExclusiveTask):
        def exclusive_key(self, args, kwargs):
            return f"{self.name}:{kwargs['tenant_id']}"

    @app.task(base=PerTenant, bind=True, name="index.rebuild")
    def rebuild(self, tenant_id):
        return self.lease.key

    assert rebuild.delay(tenant_id=3).get() == "exclusive:index.rebuild:3"
