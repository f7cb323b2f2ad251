"""Ledgers on the host's monotonic clock, and the next holder, for the deadline tests.

CLOCK_MONOTONIC is one clock for every process of a Linux host, so a test compares its
own readings with those a holder process wrote.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.lease import acquire


class Ledger:
    """Lines appended with one write each (O_APPEND), so readers never see half of one."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(self, event: str, *values: object) -> None:
        line = " ".join([event, f"{time.monotonic():.6f}", *map(str, values)]) + "\n"
        os.write(self.fd, line.encode())


def read_ledger(path: str | Path) -> list[tuple[str, float, list[str]]]:
    """``(event, monotonic time, rest)`` for each line of a ledger."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    entries = []
    for line in text.splitlines():
        event, at, *rest = line.split()
        entries.append((event, float(at), rest))
    return entries


def take_over(url: str, key: str, ttl: float, timeout: float = 60) -> tuple[float, int]:
    """Take ``key`` as the next holder, asking every 10 ms: when the granted request was
    sent (the earliest the store can have granted it), and its fencing token."""
    backend = backend_for_url(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sent_at = time.monotonic()
        lease = acquire(backend, key, ttl, name="deadline.next")
        if lease is not None:
            lease.release()
            return sent_at, lease.fencing_token
        time.sleep(0.01)
    raise AssertionError(f"{key!r} was not free within {timeout}s")
