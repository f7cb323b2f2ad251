"""RQ job functions for end-to-end tests, configured from the environment.

Every run appends (key, fencing token, start, end) to the ``ledger`` list in Redis,
so tests can check from outside that no two runs of one key overlapped. The workers
get their lease settings the way users give them: ``EXCLUSIVE_<NAME>`` variables.

EXCLUSIVE_TEST_LEDGER       Redis URL of the ledger
EXCLUSIVE_TEST_DEAD_STORE   a lease store URL nothing answers on
"""

from __future__ import annotations

import json
import os
import time

import redis
from rq import get_current_job

from celery_exclusive import LeaseLost
from celery_exclusive.rq import META_KEY, current_lease, exclusive
from tests.apps import ledger_client

DEAD_STORE = os.environ.get("EXCLUSIVE_TEST_DEAD_STORE", "redis://127.0.0.1:1/0")


def ledger() -> redis.Redis:
    return ledger_client()


def run(key: str, duration: float, until_told: bool = False) -> dict:
    """The body every ledger job shares: hold the key for ``duration`` seconds, or
    ``until_told``: until the test pushes to the ledger list ``go:<key>``."""
    job = get_current_job()
    lease = current_lease()
    start = time.time()
    if until_told:
        ledger().blpop(f"go:{key}", timeout=duration)
    else:
        time.sleep(duration)
    entry = {
        "key": key,
        "token": lease.fencing_token if lease else None,
        "start": start,
        "end": time.time(),
        "job_id": job.id,
        "pid": os.getpid(),
        "lost": lease.lost if lease else None,
        "lease": type(lease).__name__ if lease else None,
        "requeues": (job.meta.get(META_KEY) or {}).get("requeues", 0),
    }
    ledger().rpush("ledger", json.dumps(entry))
    return entry


@exclusive(key="{key}")
def hold_skip(key: str, duration: float = 0.0) -> dict:
    return run(key, duration)


@exclusive(key="{key}", lease_ttl=30)
def hold_until_told(key: str, timeout: float = 30) -> dict:
    """Its lease outlives any test's wait: if it is gone, someone released it."""
    return run(key, timeout, until_told=True)


@exclusive(key="{key}", on_duplicate="requeue")
def hold_requeue(key: str, duration: float = 0.0) -> dict:
    return run(key, duration)


@exclusive(key="{key}", on_duplicate="wait", wait_timeout=30)
def hold_wait(key: str, duration: float = 0.0) -> dict:
    return run(key, duration)


def plain(key: str, duration: float = 0.0) -> dict:
    """Not marked: runs as with RQ's own Job class, with no lease."""
    return run(key, duration)


@exclusive(key="{key}", backend_url=DEAD_STORE, on_backend_error="run")
def unlocked_when_store_down(key: str) -> dict:
    return run(key, 0)


@exclusive(key="{key}", backend_url=DEAD_STORE)
def requeued_when_store_down(key: str) -> dict:
    return run(key, 0)


@exclusive(key="{key}", on_duplicate="rerun")
def webhook(key: str, version: int, duration: float = 0.0) -> dict:
    """ "Something changed, go look": every change seen, never two syncs at once."""
    return {**run(key, duration), "version": version}


@exclusive(key="{key}")
def fail_first_attempt(key: str) -> dict:
    """Raises on its first attempt (for RQ's Retry), runs on the next."""
    if ledger().incr(f"attempts:{key}") == 1:
        raise RuntimeError("first attempt fails")
    return run(key, 0)


def record_success(job, connection, result) -> None:
    """An on_success callback: says in the ledger whose success it saw."""
    ledger().rpush("callbacks", job.id)


@exclusive(key="{key}")
def fenced(key: str) -> object:
    """For calls made in the test process: no ledger, just the lease it ran under."""
    lease = current_lease()
    return {"lease": type(lease).__name__, "token": lease.fencing_token}


@exclusive(key="{key}")
async def fenced_async(key: str) -> object:
    """An async job function: RQ runs the coroutine it returns."""
    lease = current_lease()
    return {"lease": type(lease).__name__, "token": lease.fencing_token}


@exclusive(key="{key}")
def stubborn(key: str, duration: float) -> dict:
    """Carries on after losing its lease: only killing its work horse stops it."""
    try:
        time.sleep(duration)
    except LeaseLost:
        time.sleep(duration)
    return run(key, 0)
