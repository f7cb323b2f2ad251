"""A Celery app for the compatibility tests: Celery features used with ExclusiveTask.

Configured from the same environment as :mod:`tests.support.apps.ledger`, plus
EXCLUSIVE_TEST_RESULT_SERIALIZER (json or pickle). Every run appends to the ledger.
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery, Task
from celery.exceptions import MaxRetriesExceededError, Retry
from celery.worker.request import Request

from celery_exclusive import DuplicateSkipped, ExclusiveTask, LeaseLost
from tests.support.apps import ledger_client

app = Celery("compat")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("EXCLUSIVE_TEST_BROKER", "cache+memory://"),
    result_serializer=os.environ.get("EXCLUSIVE_TEST_RESULT_SERIALIZER", "json"),
    result_accept_content=["json", "pickle"],
    exclusive_backend_url=os.environ.get("EXCLUSIVE_TEST_STORE", "memory://"),
    exclusive_lease_ttl=float(os.environ.get("EXCLUSIVE_TEST_TTL", "2")),
    exclusive_wait_timeout=30,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


def record(kind: str, **entry) -> None:
    ledger_client().rpush(kind, json.dumps({**entry, "pid": os.getpid(), "at": time.time()}))


def held_run(task, key: str, duration: float) -> dict:
    """Hold ``key`` for ``duration`` seconds and write the run to the ledger."""
    start = time.time()
    time.sleep(duration)
    entry = {
        "key": key,
        "token": task.lease.fencing_token,
        "start": start,
        "end": time.time(),
        "task_id": task.request.id,
    }
    ledger_client().rpush("ledger", json.dumps(entry))
    return entry


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}")
def hold_skip(self, key: str, duration: float = 0.0) -> dict:
    return held_run(self, key, duration)


# --- arguments -------------------------------------------------------------------


@app.task(base=ExclusiveTask, bind=True, exclusive_on_duplicate="wait")
def hold_bytes(self, payload: bytes, duration: float = 0.0) -> str:
    """Keyed on every argument (the default key), bytes included."""
    held_run(self, payload.hex(), duration)
    return self.lease.key


@app.task(base=ExclusiveTask, typing=False)
def add(x, y):
    return x + y


# --- errbacks ----------------------------------------------------------------------


@app.task(base=ExclusiveTask)
def fail(tag):
    raise ValueError(f"failed: {tag}")


@app.task(base=ExclusiveTask)
def on_error(request, exc, traceback, label="default"):
    """A new-style errback: Celery calls it directly, in the failed task's worker (only
    when it is not bound: Celery sends a bound errback the task id instead)."""
    record(
        "errbacks",
        failed_task_id=request.id,
        exc=str(exc),
        label=repr(label),
        key=on_error.lease.key,
    )


@app.task(base=ExclusiveTask)
def reverse(payload: bytes) -> bytes:
    return payload[::-1]


@app.task(base=ExclusiveTask)
def echo(value, label):
    """A callback taking the parent's result (here bytes) and a label."""
    record("callbacks", value=value.decode("latin-1"), label=label)
    return value


# --- retries ---------------------------------------------------------------------


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", max_retries=0)
def fall_back(self, key: str, duration: float) -> dict:
    """Asks for a retry it may not have, and does fallback work instead."""
    try:
        raise self.retry(countdown=1)
    except MaxRetriesExceededError:
        pass
    record("fallbacks", key=key, task_id=self.request.id)
    time.sleep(duration)
    self.lease.ensure_held()
    return held_run(self, key, 0)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", max_retries=1)
def retry_later(self, key: str, duration: float) -> dict:
    """Sends its retry with ``throw=False`` and goes on working until it returns."""
    if self.request.retries == 0:
        self.retry(countdown=duration + 1, throw=False)
        record("fallbacks", key=key, task_id=self.request.id)
        time.sleep(duration)
        self.lease.ensure_held()
    return held_run(self, key, 0)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", max_retries=1)
def retry_caught(self, key: str) -> None:
    """Catches the Retry of a retry that was sent: its lease went with the message."""
    if self.request.retries:
        return
    try:
        self.retry(countdown=0.2)
    except Retry:
        try:
            self.lease.ensure_held()
            record("caught", held=True)
        except LeaseLost:
            record("caught", held=False)


# --- direct calls from inside a task -------------------------------------------------


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="node:{name}",
    exclusive_on_duplicate="requeue",
    exclusive_requeue_delay=0.05,
    exclusive_requeue_max_delay=0.2,
)
def sync_node(self, name: str, children: list, duration: float = 0.0) -> dict:
    """Syncs a node, then its children by calling itself directly."""
    record("nodes", name=name, task_id=self.request.id, token=self.lease.fencing_token)
    time.sleep(duration)
    outcomes = {}
    for child in children:
        try:
            outcomes[child] = sync_node(child, [])
        except DuplicateSkipped as exc:
            outcomes[child] = f"skipped: held by {exc.holder_task_id}"
    return outcomes


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", exclusive_lease_ttl=20)
def hold_long_lease(self, key: str, duration: float) -> dict:
    """A lease far longer than any test waits: if it is gone, someone released it."""
    return held_run(self, key, duration)


# --- the user's own base class ---------------------------------------------------------


class ExpectedError(Exception):
    """An outcome the task declares in ``throws``: logged without a traceback."""


class AuditedRequest(Request):
    """A user's Request: records, in the worker's main process, when a pool process
    takes each task and how it failed. (Celery's own subclass replaces ``on_success``
    whatever the base, so no Request hook can see successes.)"""

    def on_accepted(self, pid, time_accepted):
        record("requests", hook="on_accepted", task_id=self.id)
        return super().on_accepted(pid, time_accepted)

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        record("requests", hook="on_failure", task_id=self.id)
        return super().on_failure(exc_info, send_failed_event, return_ok)


class AuditedTask(Task):
    Request = AuditedRequest
    throws = (ExpectedError,)


class ExclusiveFirst(ExclusiveTask, AuditedTask):
    pass


class AuditedFirst(AuditedTask, ExclusiveTask):
    pass


def _audited(base: type, name: str):
    @app.task(
        base=base,
        bind=True,
        name=f"compat.{name}",
        exclusive_key="{key}",
        exclusive_lease_ttl=20,
    )
    def audited(self, key: str, duration: float, fail: bool = False) -> dict:
        entry = held_run(self, key, duration)
        if fail:
            raise ExpectedError(f"expected failure of {key}")
        return entry

    return audited


audited_exclusive_first = _audited(ExclusiveFirst, "exclusive_first")
audited_audited_first = _audited(AuditedFirst, "audited_first")


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", throws=(ExpectedError,))
def with_throws(self, key: str, duration: float, fail: bool = False) -> dict:
    entry = held_run(self, key, duration)
    if fail:
        raise ExpectedError(f"expected failure of {key}")
    return entry
