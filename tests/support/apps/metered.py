"""A Celery app exposing its metrics as the README's recipe does, for the metrics tests.

EXCLUSIVE_TEST_BROKER   broker, result backend and lease store (Redis URL)
EXCLUSIVE_TEST_METRICS  the port the worker serves its metrics on
"""

from __future__ import annotations

import os
import time

from celery import Celery
from celery.signals import worker_init

from celery_exclusive import ExclusiveTask, metrics

app = Celery("metered")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("EXCLUSIVE_TEST_BROKER", "cache+memory://"),
    exclusive_lease_ttl=2,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


@worker_init.connect
def expose_metrics(sender, **kwargs):
    if "EXCLUSIVE_TEST_METRICS" in os.environ:  # a worker started by the metrics tests
        metrics.serve_worker(sender, port=int(os.environ["EXCLUSIVE_TEST_METRICS"]))


# Not sent again when its lease is lost: one loss, one acquisition, counted.
@app.task(
    base=ExclusiveTask, exclusive_key="{key}", name="metered.hold", exclusive_requeue_lost=False
)
def hold(key: str, seconds: float) -> str:
    time.sleep(seconds)
    return key
