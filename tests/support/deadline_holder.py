"""A process that holds one lease and runs a body under it, step by step, writing a
ledger of what happened on the host's monotonic clock (CLOCK_MONOTONIC is one clock
for every process of a Linux host, so a test compares its own readings with these):

    python -m tests.support.deadline_holder STORE_URL KEY TTL LEDGER_FILE

Ledger lines: ``granted <t> <token>`` once the lease is held, ``step <t> <token>``
before each step of the body (a fenced write: it names the token it writes under),
``lost <t> <cause>`` when ``lease_lost`` is sent, ``stopped <t>`` when LeaseLost
stopped the body, ``released <t> <freed>`` when the release returned.

The body runs in the main thread under :func:`stop_on_loss`, as a Celery prefork
child's or an RQ work horse's does.
"""

from __future__ import annotations

import os
import sys
import time

from celery_exclusive import LeaseLost, lease_lost
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.lease import acquire
from celery_exclusive.core.terminate import stop_on_loss
from tests.support.deadlines import Ledger

#: Seconds between two steps of the body.
STEP = 0.01


def main(url: str, key: str, ttl: float, ledger_path: str) -> None:
    ledger = Ledger(ledger_path)
    backend = backend_for_url(url)
    lease = None
    while lease is None:
        lease = acquire(backend, key, ttl, name="deadline.holder", task_id=str(os.getpid()))
        if lease is None:
            time.sleep(0.05)

    def note_loss(sender, cause=None, **kwargs) -> None:
        ledger.note("lost", cause)

    lease_lost.connect(note_loss, weak=False)
    ledger.note("granted", lease.fencing_token)
    try:
        with stop_on_loss(lease, grace=30.0):
            while True:
                ledger.note("step", lease.fencing_token)
                time.sleep(STEP)
    except LeaseLost:
        ledger.note("stopped")
    ledger.note("released", lease.release())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4])
