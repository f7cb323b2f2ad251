"""A Celery app whose workers share a SQLite lease store on this host, for tests that
give one worker a clock of its own (libfaketime) or take its database file away.

Each run notes in a Redis ledger its key, fencing token, start and end, read from the
ledger server's clock (``TIME``): a worker's own clock may be faked. Each run notes
its start in "started" too, and a call that fails notes its error in "failures".

EXCLUSIVE_TEST_BROKER   broker and result backend URL (Redis)
EXCLUSIVE_TEST_STORE    the sqlite:/// lease store
EXCLUSIVE_TEST_LEDGER   Redis URL of the ledger
EXCLUSIVE_TEST_TTL      lease ttl in seconds
EXCLUSIVE_TEST_NAME     the worker's name, noted with each run
EXCLUSIVE_TEST_SLEEP_BY_SELECT  if set, ``time.sleep`` waits in ``select()`` (below)
"""

from __future__ import annotations

import json
import os
import select
import time

from celery import Celery
from celery import signals as celery_signals

from celery_exclusive import ExclusiveTask, LeaseLost
from tests.support.apps import ledger_client
from tests.support.in_process import in_worker

if os.environ.get("EXCLUSIVE_TEST_SLEEP_BY_SELECT"):
    # libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC=1 (the wall clock faked, the
    # monotonic clock real) turns the deadline of clock_nanosleep(CLOCK_MONOTONIC,
    # TIMER_ABSTIME), which time.sleep() uses, into a negative time: EINVAL. select()
    # it leaves alone.
    def _sleep(seconds: float) -> None:
        select.select([], [], [], seconds)

    time.sleep = _sleep

app = Celery("host_store")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("EXCLUSIVE_TEST_BROKER", "cache+memory://"),
    exclusive_backend_url=os.environ.get("EXCLUSIVE_TEST_STORE", "memory://"),
    exclusive_lease_ttl=float(os.environ.get("EXCLUSIVE_TEST_TTL", "5")),
    exclusive_wait_timeout=120,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


def server_time() -> float:
    """Now by the ledger server's clock, which no worker's faked clock changes."""
    seconds, micros = ledger_client().time()
    return seconds + micros / 1e6


def note(list_name: str, entry: dict) -> None:
    entry.update(pid=os.getpid(), worker=os.environ.get("EXCLUSIVE_TEST_NAME"))
    ledger_client().rpush(list_name, json.dumps(entry))


@app.task(
    name="host.hold",
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_duplicate="wait",
)
def hold(self, key: str, duration: float) -> dict:
    """Hold ``key`` for ``duration`` seconds."""
    lease = self.lease
    start = server_time()
    note("started", {"key": key, "token": lease.fencing_token, "start": start})
    try:
        time.sleep(duration)
    except LeaseLost:
        note("stopped", {"key": key, "at": server_time()})
        raise
    entry = {
        "key": key,
        "token": lease.fencing_token,
        "start": start,
        "end": server_time(),
        "lost": lease.lost,
        "task_id": self.request.id,
    }
    note("ledger", entry)
    return entry


def _note_failure(sender=None, task_id=None, exception=None, **extra) -> None:
    if getattr(sender, "name", None) == "host.hold":
        note(
            "failures",
            {
                "task_id": task_id,
                "error": type(exception).__name__,
                "message": str(exception),
                "at": server_time(),
            },
        )


in_worker((celery_signals.task_failure, _note_failure))
