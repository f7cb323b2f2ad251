"""A Celery app whose task runs step by step under its lease and writes a ledger of it
on the host's monotonic clock (tests/support/deadline_holder.py's format).

EXCLUSIVE_TEST_BROKER   broker URL
EXCLUSIVE_TEST_STORE    lease store URL (exclusive_backend_url)
EXCLUSIVE_TEST_TTL      lease ttl in seconds
EXCLUSIVE_TEST_LEDGER_FILE  the ledger file

Ledger lines: ``step <t> <token> <task id>`` before each step, ``ended <t> <token>
<task id> <deadline>`` when the body returns (with the lease's deadline then),
``lost <t> <cause> <task id>`` when ``lease_lost`` is sent, ``outcome <t> <task id>
<state> <exception type>`` when Celery is done with the task. ``steps_then_clean_up``
also notes ``started <t> <pid> <task id>``, then ``cleaning <t> <task id>`` and
``cleaned <t> <task id>`` around the cleanup its body runs however it ends.
"""

from __future__ import annotations

import functools
import os
import time

from celery import Celery
from celery import signals as celery_signals

from celery_exclusive import ExclusiveTask, lease_lost
from tests.support.deadlines import Ledger

app = Celery("deadlines")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    exclusive_backend_url=os.environ.get("EXCLUSIVE_TEST_STORE", "memory://"),
    exclusive_lease_ttl=float(os.environ.get("EXCLUSIVE_TEST_TTL", "3")),
    exclusive_terminate_grace=30.0,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)

#: Seconds between two steps of a body.
STEP = 0.01
#: ``steps_then_clean_up``: its cleanup takes CLEANUP seconds, well within its GRACE.
CLEANUP = 0.5
GRACE = 2.0


@functools.cache
def ledger() -> Ledger:
    """Opened in the worker's child, never at import (before a fork)."""
    return Ledger(os.environ["EXCLUSIVE_TEST_LEDGER_FILE"])


# Not sent again when its lease is lost: the tests read how the stopped call ended.
@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", exclusive_requeue_lost=False)
def steps(self, key: str, seconds: float) -> None:
    """Hold ``key`` for ``seconds``, noting each step under the lease's fencing token."""
    run_steps(self, seconds)


def run_steps(task, seconds: float) -> None:
    """The body of ``steps``: a step every STEP seconds for ``seconds``, then ``ended``."""
    lease = task.lease
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ledger().note("step", lease.fencing_token, task.request.id)
        time.sleep(STEP)
    # Before deadlines were kept, a lease counted as held for a ttl after its last
    # confirmed renewal was sent: the same test then measures the code without them.
    deadline = getattr(lease, "deadline", lease.renewed_at + lease.ttl)
    ledger().note("ended", lease.fencing_token, task.request.id, f"{deadline:.6f}")


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_requeue_lost=False,
    exclusive_terminate_grace=GRACE,
)
def steps_then_clean_up(self, key: str, seconds: float) -> None:
    """``steps``, then a cleanup that takes CLEANUP seconds, in a ``finally`` (a
    rollback, a temporary file removed): it runs when LeaseLost stops the steps too."""
    ledger().note("started", os.getpid(), self.request.id)
    try:
        run_steps(self, seconds)
    finally:
        ledger().note("cleaning", self.request.id)
        time.sleep(CLEANUP)
        ledger().note("cleaned", self.request.id)


def _note_loss(sender=None, cause=None, task_id=None, **kwargs) -> None:
    ledger().note("lost", cause, task_id)


def _note_outcome(sender=None, task_id=None, state=None, retval=None, **kwargs) -> None:
    failure = type(retval).__name__ if isinstance(retval, BaseException) else "-"
    ledger().note("outcome", task_id, state, failure)


# Only in a worker, which is given the ledger: a test that imports this module for its
# constants must not find these handlers in its own process.
if "EXCLUSIVE_TEST_LEDGER_FILE" in os.environ:
    lease_lost.connect(_note_loss, weak=False)
    celery_signals.task_postrun.connect(_note_outcome, weak=False)
