"""The celery-redbeat side of ``python -m benchmarks beat``: the same entries and ledger.

RedBeat keeps the schedule and its lock in Redis; the lock's timeout plays the lease
ttl's part and beat's loop interval its retry interval.

EXCLUSIVE_TEST_BROKER   broker URL
EXCLUSIVE_TEST_STORE    Redis URL of RedBeat's schedule and lock
EXCLUSIVE_TEST_LEDGER   Redis URL of the ledger
EXCLUSIVE_TEST_TTL      RedBeat's lock timeout in seconds
"""

from __future__ import annotations

import os

from celery import Celery

from benchmarks.beat import INTERVALS
from tests.support.django_beat import ledger

app = Celery("redbeat_bench")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    broker_connection_retry_on_startup=True,
    beat_scheduler="redbeat.RedBeatScheduler",
    beat_max_loop_interval=1,
    redbeat_redis_url=os.environ.get("EXCLUSIVE_TEST_STORE", "redis://"),
    redbeat_lock_timeout=int(float(os.environ.get("EXCLUSIVE_TEST_TTL", "3"))),
    beat_schedule={
        name: {"task": ledger.TASK, "schedule": seconds, "kwargs": {"entry": name}}
        for name, seconds in INTERVALS.items()
    },
)
ledger.install(app)
