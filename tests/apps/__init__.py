"""Apps the end-to-end tests run in real worker processes."""

from __future__ import annotations

import functools
import os

import redis


@functools.cache
def ledger_client(variable: str = "EXCLUSIVE_TEST_LEDGER") -> redis.Redis:
    """The Redis ledger named by environment ``variable``, one client per process.

    Opened on first use, inside the worker process, never at import (before a fork).
    """
    return redis.Redis.from_url(os.environ.get(variable, "redis://"))
