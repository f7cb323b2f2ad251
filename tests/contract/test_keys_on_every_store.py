"""Whatever a call's arguments hold, its key reaches the store as text every store can
keep, or the call is refused with an ExclusiveKeyError naming the task and argument:
never a store client's own error. Runs once per store in ``conftest.BACKEND_CASES``.
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_exclusive import ExclusiveKeyError, ExclusiveTask
from celery_exclusive.rq import exclusive

#: Not text: what bytes decoded with errors="surrogateescape" (os.fsdecode) contain.
LONE_SURROGATE = "7\udcff"


@pytest.fixture
def app(backend_case):
    app = Celery("keys", set_as_current=False)
    app.conf.update(task_always_eager=True, exclusive_backend_url=backend_case.url)
    return app


def test_a_task_key_holding_a_lone_surrogate_is_refused_naming_task_and_argument(app, backend):
    @app.task(base=ExclusiveTask, name="billing.settle", exclusive_key="invoice:{number}")
    def settle(number):
        return "ran"

    with pytest.raises(ExclusiveKeyError, match="billing.settle.*'number'.*lone surrogate") as e:
        settle.delay(LONE_SURROGATE).get()
    assert (e.value.task, e.value.argument) == ("billing.settle", "number")
    assert backend.holders("") == []


def test_a_lone_surrogate_in_the_default_key_is_escaped_and_the_call_runs(app):
    @app.task(base=ExclusiveTask, bind=True, name="billing.settle")
    def settle(self, number):
        return self.lease.key

    assert settle.delay(LONE_SURROGATE).get() == 'exclusive:billing.settle:{"number":"7\\udcff"}'


def test_an_rq_function_whose_key_holds_a_lone_surrogate_is_refused(backend_case, backend):
    @exclusive(key="invoice:{number}", backend_url=backend_case.url)
    def settle(number):
        return "ran"

    with pytest.raises(ExclusiveKeyError, match="lone surrogate") as refused:
        settle(LONE_SURROGATE)
    assert refused.value.argument == "number"
    assert backend.holders("") == []
