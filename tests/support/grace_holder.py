"""A process whose body, told its lease was lost, cleans up for CLEANUP seconds in
``finally``, under ``stop_on_loss(kill_process=True)`` with a grace of GRACE seconds:

    python -m tests.support.grace_holder STORE_URL KEY CLEANUP GRACE LEDGER_FILE

Ledger lines (tests/support/deadlines.py's format, the host's monotonic clock):
``granted <t>``, ``cleanup <t>`` when the cleanup starts, ``cleaned <t>`` when it ends.
A process killed for overrunning its grace writes no ``cleaned``.
"""

from __future__ import annotations

import os
import sys
import time

from celery_exclusive import LeaseLost
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.lease import acquire
from celery_exclusive.core.terminate import stop_on_loss
from tests.support.deadlines import Ledger


def main(url: str, key: str, cleanup: float, grace: float, ledger_path: str) -> None:
    ledger = Ledger(ledger_path)
    lease = acquire(backend_for_url(url), key, 1.5, name="grace.holder", task_id=str(os.getpid()))
    assert lease is not None, "the key was held"
    ledger.note("granted")
    try:
        with stop_on_loss(lease, grace=grace, kill_process=True):
            try:
                while True:
                    time.sleep(0.01)
            finally:
                ledger.note("cleanup")
                until = time.monotonic() + cleanup
                while time.monotonic() < until:
                    time.sleep(0.01)
                ledger.note("cleaned")
    except LeaseLost:
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
