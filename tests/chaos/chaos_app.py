"""The Celery app the chaos suite's workers run, configured from the environment.

Each completed run appends (key, fencing token, start, end, lost) to a ledger list in
a Redis that the chaos never touches, so the checks see every run whatever happened
to the workers and to the lease store.

CHAOS_BROKER   broker URL (results are not stored: the ledger says what completed)
CHAOS_STORE    lease store URL, on a Redis server the chaos restarts
CHAOS_LEDGER   Redis URL of the ledger (``app.conf.chaos_ledger``: the harness sets it
               in its own process, which sends the first copy of each job)
CHAOS_TTL      lease ttl in seconds
"""

from __future__ import annotations

import functools
import json
import os
import time

import redis
from celery import Celery, signals
from celery.exceptions import WorkerLostError
from celery.worker.request import Request

from celery_exclusive import ExclusiveTask
from tests.support.in_process import in_worker

app = Celery("chaos")
app.conf.update(
    broker_url=os.environ.get("CHAOS_BROKER", "memory://"),
    exclusive_backend_url=os.environ.get("CHAOS_STORE", "memory://"),
    exclusive_lease_ttl=float(os.environ.get("CHAOS_TTL", "3")),
    exclusive_on_duplicate="requeue",
    exclusive_requeue_delay=0.1,
    exclusive_requeue_max_delay=1.0,
    # A SIGKILLed child's task goes back to the queue instead of being acked as failed.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_ignore_result=True,
    # A whole worker SIGKILLed leaves its unacked messages to be restored after the
    # visibility timeout, by a sweep that kombu runs every interval x throttle seconds
    # (10 x 10 by default: longer than the drain waits). Each sweep holds a mutex in
    # the broker that a worker SIGKILLed during it leaves behind until it expires (300 s
    # by default: no message would be restored before the drain gives up).
    broker_transport_options={
        "visibility_timeout": 10,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 5,
    },
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    chaos_ledger=os.environ.get("CHAOS_LEDGER", "redis://"),
)


def ledger() -> redis.Redis:
    return _client(app.conf.chaos_ledger)


@functools.cache
def _client(url: str) -> redis.Redis:
    """One client per process and URL, opened on first use (never before a fork)."""
    return redis.Redis.from_url(url)


class NotedRequest(Request):
    """Notes when a job's message goes back to the queue because its pool child died
    (acks_late + reject_on_worker_lost): that copy is sent again, as by a publish."""

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        exc = getattr(exc_info, "exception", None)
        if isinstance(getattr(exc, "exc", exc), WorkerLostError):
            ledger().hset("published", self.args[1], time.time())


@app.task(
    name="chaos.work", base=ExclusiveTask, bind=True, exclusive_key="{key}", Request=NotedRequest
)
def work(self, key: str, job: int, duration: float) -> None:
    """Hold ``key`` for ``duration`` seconds, then say so in the ledger."""
    lease = self.lease
    start = time.time()
    time.sleep(duration)
    entry = {
        "key": key,
        "job": job,
        "token": lease.fencing_token if lease else None,
        "start": start,
        "end": time.time(),
        "lost": lease.lost if lease else None,
        "pid": os.getpid(),
    }
    pipe = ledger().pipeline()
    pipe.rpush("ledger", json.dumps(entry)).sadd("done", job)
    pipe.execute()


def _published(sender, body, **extra) -> None:
    """When the last copy of a job was sent (the first, from the harness's process, or a
    requeue, from a worker): a copy no worker started before a whole worker was
    SIGKILLed can be lost in the broker's fetch window."""
    if sender == "chaos.work":
        job = body[0][1]  # protocol 2: (args, kwargs, embed)
        ledger().hset("published", job, time.time())


def _started(task_id, task, args, **extra) -> None:
    """Note when a worker last started a copy of the job: a copy published after that
    and never started may have been lost by the broker (see the harness)."""
    if task.name == "chaos.work":
        ledger().hset("started", args[1], time.time())


in_worker((signals.after_task_publish, _published), (signals.task_prerun, _started))
