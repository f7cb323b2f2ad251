"""Apps the end-to-end tests run in real worker processes."""

from __future__ import annotations

import functools
import json
import os
import time

import redis


@functools.cache
def ledger_client(variable: str = "EXCLUSIVE_TEST_LEDGER") -> redis.Redis:
    """The Redis ledger named by environment ``variable``, one client per process.

    Opened on first use, inside the worker process, never at import (before a fork).
    """
    return redis.Redis.from_url(os.environ.get(variable, "redis://"))


def steps(key: str, duration: float, lease, **call) -> dict:
    """Hold ``key`` for ``duration`` seconds in short sleeps, under ``lease``; note in
    the ledger whether the run completed or was stopped (by the loss of its lease), with
    ``call`` (its task or job id)."""
    start, completed = time.time(), False
    try:
        while time.time() < start + duration:
            time.sleep(0.05)
        completed = True
    finally:
        entry = {
            "key": key,
            "token": lease.fencing_token,
            "start": start,
            "end": time.time(),
            "completed": completed,
            **call,
        }
        ledger_client().rpush("ledger", json.dumps(entry))
    return entry
