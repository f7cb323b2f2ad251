"""RQ job functions for end-to-end tests, configured from the environment.

Every run appends (key, fencing token, start, end) to the ``ledger`` list in Redis,
so tests can check from outside that no two runs of one key overlapped. The workers
get their lease settings the way users give them: ``EXCLUSIVE_<NAME>`` variables.

EXCLUSIVE_TEST_LEDGER       Redis URL of the ledger
EXCLUSIVE_TEST_DEAD_STORE   a lease store URL nothing answers on
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import redis
from rq import get_current_job

from celery_exclusive import LeaseLost
from celery_exclusive.rq import META_KEY, current_lease, exclusive
from tests.support.apps import ledger_client, steps

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


@exclusive(key="{key}", requeue_lost=False)
def hold_once(key: str, duration: float = 0.0) -> dict:
    """Fails with LeaseLost, and is not sent again, when its lease is lost."""
    return run(key, duration)


@exclusive(key="{key}")
def hold_in_steps(key: str, duration: float) -> dict:
    """Notes in the ledger whether each run completed or was stopped."""
    return steps(key, duration, current_lease(), job_id=get_current_job().id)


@exclusive(key="{key}", on_duplicate="requeue", requeue_max_retries=2)
def hold_give_up(key: str, duration: float = 0.0) -> dict:
    """Requeued twice at most while its key is held, then it gives up."""
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


#: The uniqueness window of the windowed jobs below (seconds after a run ends).
WINDOW = 2.0


@exclusive(key="{key}", unique_for=WINDOW)
def windowed_skip(key: str, duration: float = 0.0) -> dict:
    return run(key, duration)


@exclusive(key="{key}", unique_for=WINDOW, on_duplicate="requeue", requeue_delay=0.2)
def windowed_requeue(key: str, duration: float = 0.0) -> dict:
    return run(key, duration)


#: The rate of ``rated_requeue``: two runs of a key per two seconds.
RATE_RUNS, RATE_PERIOD = 2, 2.0


@exclusive(key="{key}", rate="2/2s", on_duplicate="requeue", requeue_delay=0.2)
def rated_requeue(key: str, duration: float = 0.0) -> dict:
    return run(key, duration)


@exclusive(key="{key}", on_duplicate="replace", terminate_grace=2.0)
def replacing(key: str, duration: float) -> dict:
    """A newer job of its key stops this one and runs instead."""
    return run(key, duration)


#: The debounce period of ``debounced``: RQ's scheduler counts whole seconds.
DEBOUNCE = 1.0


@exclusive(key="{key}", debounce=DEBOUNCE)
def debounced(key: str, version: int, duration: float = 0.0) -> dict:
    """A burst of these runs once, with the latest version, once the calls stop."""
    return {**run(key, duration), "version": version}


@exclusive(key="{key}", on_duplicate="rerun")
def webhook(key: str, version: int, duration: float = 0.0) -> dict:
    """ "Something changed, go look": every change seen, never two syncs at once."""
    return {**run(key, duration), "version": version}


@exclusive(
    key="{key}", on_duplicate="rerun", wait_timeout=0.3, requeue_delay=5, requeue_max_delay=5
)
def webhook_sent_away(key: str, version: int, duration: float = 0.0) -> dict:
    """``webhook`` whose pending rerun soon leaves the line for a requeue of 5 s."""
    return {**run(key, duration), "version": version}


@exclusive(key="{key}", on_duplicate="rerun")
def webhook_until_told(key: str, version: int, timeout: float = 30) -> dict:
    """``webhook`` that runs until the test pushes to ``go:<key>``."""
    return {**run(key, timeout, until_told=True), "version": version}


@exclusive(key="{key}", on_duplicate="rerun")
def stubborn_webhook(key: str, version: int, timeout: float = 30) -> dict:
    """``webhook`` that carries on after losing its lease (for ``timeout`` seconds, or
    until ``release:<key>`` is set in the ledger): only killing its work horse stops
    it. Each run notes in ``started`` when it started."""
    ledger().rpush("started", json.dumps({"key": key, "pid": os.getpid(), "start": time.time()}))
    end = time.time() + timeout
    while True:
        with contextlib.suppress(LeaseLost):  # wherever the interrupt lands
            if time.time() >= end or ledger().exists(f"release:{key}"):
                break
            time.sleep(0.05)
    return {**run(key, 0), "version": version}


@exclusive(key="{key}")
def fail_first_attempt(key: str) -> dict:
    """Raises on its first attempt (for RQ's Retry), runs on the next."""
    if ledger().incr(f"attempts:{key}") == 1:
        raise RuntimeError("first attempt fails")
    return run(key, 0)


@exclusive(key="{key}", unique_for=60, unique_after="end")
def windowed_failing_once(key: str) -> dict:
    """Raises on its first attempt (for RQ's Retry), runs on the next; a window of a
    minute follows every run."""
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


@exclusive(key="{key}", requeue_lost=False)
def stubborn(key: str, duration: float) -> dict:
    """Carries on after losing its lease: only killing its work horse stops it. Not
    sent again when stopped (``requeue_lost=False``)."""
    try:
        time.sleep(duration)
    except LeaseLost:
        time.sleep(duration)
    return run(key, 0)


@exclusive(key="{key}")
def stubborn_in_steps(key: str, duration: float) -> dict:
    """Holds ``key`` for ``duration`` seconds in short sleeps, catching the LeaseLost
    that interrupts it and sleeping on: only killing its work horse stops it. Each run
    notes in ``started`` when it started; a run that returns, in ``ledger``."""
    ledger().rpush("started", json.dumps({"key": key, "pid": os.getpid(), "start": time.time()}))
    end = time.time() + duration
    while time.time() < end:
        with contextlib.suppress(LeaseLost):
            time.sleep(0.05)
    return run(key, 0)
