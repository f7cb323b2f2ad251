"""A Celery app whose tasks hold leases for as long as they are told, for the web view's
tests: duplicates under each policy, and bodies an operator may release.

EXCLUSIVE_TEST_BROKER   broker and result backend URL (Redis)
EXCLUSIVE_TEST_STORE    lease store URL
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_exclusive import ExclusiveTask

app = Celery("web_app")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("EXCLUSIVE_TEST_BROKER", "cache+memory://"),
    exclusive_backend_url=os.environ.get("EXCLUSIVE_TEST_STORE", "memory://"),
    exclusive_lease_ttl=3,
    exclusive_terminate_grace=1,
    exclusive_skip_state="success",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


@app.task(name="web.hold", base=ExclusiveTask, exclusive_key="job:{n}")
def hold(n: int, seconds: float) -> str:
    time.sleep(seconds)
    return f"held {n}"


@app.task(
    name="web.hold_or_requeue",
    base=ExclusiveTask,
    exclusive_key="job:{n}",
    exclusive_on_duplicate="requeue",
    exclusive_requeue_delay=30,
    exclusive_requeue_max_delay=30,
)
def hold_or_requeue(n: int, seconds: float) -> str:
    time.sleep(seconds)
    return f"held {n}"


@app.task(
    name="web.hold_or_rerun",
    base=ExclusiveTask,
    exclusive_key="job:{n}",
    exclusive_on_duplicate="rerun",
    exclusive_wait_timeout=30,
)
def hold_or_rerun(n: int, seconds: float) -> str:
    time.sleep(seconds)
    return f"held {n}"
