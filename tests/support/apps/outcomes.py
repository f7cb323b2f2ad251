"""A Celery app whose duplicates end in each ``exclusive_skip_state``, for a test of
what ``task_failure`` / ``task_success`` handlers and ``AsyncResult.get()`` see.

EXCLUSIVE_TEST_BROKER   broker and result backend URL (Redis)
EXCLUSIVE_TEST_STORE    lease store URL
EXCLUSIVE_TEST_LEDGER   Redis URL of the ledger the signal handlers write to
"""

from __future__ import annotations

import json
import os

from celery import Celery
from celery.signals import task_failure, task_success

from celery_exclusive import ExclusiveTask
from tests.support.apps import ledger_client
from tests.support.in_process import in_worker

app = Celery("outcomes")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("EXCLUSIVE_TEST_BROKER", "cache+memory://"),
    exclusive_backend_url=os.environ.get("EXCLUSIVE_TEST_STORE", "memory://"),
    exclusive_lease_ttl=5,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


@app.task(name="outcomes.settle_failure", base=ExclusiveTask, exclusive_key="invoice:{n}")
def settle_failure(n: int) -> str:
    return f"settled {n}"


@app.task(
    name="outcomes.settle_success",
    base=ExclusiveTask,
    exclusive_key="invoice:{n}",
    exclusive_skip_state="success",
)
def settle_success(n: int) -> str:
    return f"settled {n}"


def _failed(sender=None, task_id=None, exception=None, **kwargs):
    entry = {"signal": "task_failure", "task_id": task_id, "error": type(exception).__name__}
    ledger_client().rpush("signals", json.dumps(entry))


def _succeeded(sender=None, result=None, **kwargs):
    entry = {"signal": "task_success", "task_id": sender.request.id, "result": result}
    ledger_client().rpush("signals", json.dumps(entry))


in_worker((task_failure, _failed), (task_success, _succeeded))
