"""The app of the rolling-upgrade tests, run by workers of both releases.

It is imported by workers of the current package (as ``tests.upgrade.app``) and, copied
alone into a directory of its own, by workers of the previous release: so it imports
nothing of the tests, and only the package's long-stable public API (``ExclusiveTask``,
``exclusive_*`` settings, ``self.lease.fencing_token``).

Each run appends to the ledger list ``ledger`` (key, call id, task id, fencing token,
start, end) and which release ran it: ``ROLLING_UPGRADE_RELEASE`` of the worker's
environment and the file ``celery_exclusive`` was imported from. Each duplicate a worker
meets (its key held by another call: the ``duplicate_detected`` signal) is appended to
``duplicates``, with the holder's task id and the release that met it.

ROLLING_UPGRADE_BROKER    broker URL
ROLLING_UPGRADE_STORE     lease store URL (exclusive_backend_url)
ROLLING_UPGRADE_LEDGER    Redis URL of the ledger
ROLLING_UPGRADE_RELEASE   "previous" or "current": the release the worker runs
"""

from __future__ import annotations

import json
import os
import sys
import time

import redis
from celery import Celery

import celery_exclusive
from celery_exclusive import ExclusiveTask, duplicate_detected

RELEASE = os.environ.get("ROLLING_UPGRADE_RELEASE")

if RELEASE:  # in a worker: say which package it runs, before anything else
    print(
        f"rolling upgrade: the {RELEASE} release imports celery_exclusive from "
        f"{celery_exclusive.__file__}",
        file=sys.stderr,
        flush=True,
    )

app = Celery("rolling_upgrade")
app.conf.update(
    broker_url=os.environ.get("ROLLING_UPGRADE_BROKER", "memory://"),
    exclusive_backend_url=os.environ.get("ROLLING_UPGRADE_STORE", "memory://"),
    # Long enough that no pause of a slow machine lets a lease expire under its run:
    # nothing here dies, every lease is released.
    exclusive_lease_ttl=10.0,
    exclusive_requeue_delay=0.05,
    exclusive_requeue_max_delay=0.5,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)

_ledger: list = []


def ledger() -> redis.Redis:
    """The ledger's client, opened in the process that runs the task (after the fork)."""
    if not _ledger:
        _ledger.append(redis.Redis.from_url(os.environ["ROLLING_UPGRADE_LEDGER"]))
    return _ledger[0]


@app.task(
    name="rolling_upgrade.hold",
    base=ExclusiveTask,
    bind=True,
    exclusive_key="upgrade:{key}",
    exclusive_on_duplicate="requeue",
)
def hold(self, key: str, call: str, duration: float) -> None:
    """Hold ``key`` for ``duration`` seconds; note the run in the ledger."""
    token = self.lease.fencing_token
    start = time.time()
    time.sleep(duration)
    entry = {
        "key": key,
        "call": call,
        "token": token,
        "start": start,
        "end": time.time(),
        "release": RELEASE,
        "package": celery_exclusive.__file__,
        "task_id": self.request.id,
        "pid": os.getpid(),
    }
    ledger().rpush("ledger", json.dumps(entry))


def _note_duplicate(sender=None, key=None, task_id=None, holder_task_id=None, **extra) -> None:
    entry = {"key": key, "task_id": task_id, "holder_task_id": holder_task_id, "release": RELEASE}
    ledger().rpush("duplicates", json.dumps(entry))


if RELEASE:  # only in a worker (a producer importing the app connects nothing)
    duplicate_detected.connect(_note_duplicate, weak=False)
