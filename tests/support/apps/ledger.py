"""A Celery app for end-to-end tests, configured from the environment.

Every run of an exclusive task appends (key, fencing token, start, end) to a ledger
list in Redis, so tests can check from outside that no two runs overlapped.

EXCLUSIVE_TEST_BROKER   broker (and result backend) URL
EXCLUSIVE_TEST_STORE    lease store URL (exclusive_backend_url)
EXCLUSIVE_TEST_LEDGER   Redis URL of the ledger
EXCLUSIVE_TEST_TTL      lease ttl in seconds
EXCLUSIVE_TEST_VISIBILITY_TIMEOUT   the Redis broker's visibility timeout (seconds)
EXCLUSIVE_TEST_MAX_CONNECTIONS  broker connection pool size (greenlet pools need more)
EXCLUSIVE_TEST_KEY_PREFIX   exclusive_key_prefix (default "exclusive:")
EXCLUSIVE_TEST_PROBE_ORDER  if set, note whether a ledger task still holds its key when
                            Celery stores its result or publishes its next link
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery
from celery import signals as celery_signals
from celery.backends.redis import RedisBackend as RedisResults
from celery.exceptions import Ignore, Reject

from celery_exclusive import ExclusiveTask, LeaseLost, backend_for_url, signals
from tests.support.apps import ledger_client, steps
from tests.support.in_process import in_worker

app = Celery("ledger")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("EXCLUSIVE_TEST_BROKER", "cache+memory://"),
    exclusive_backend_url=os.environ.get("EXCLUSIVE_TEST_STORE", "memory://"),
    exclusive_lease_ttl=float(os.environ.get("EXCLUSIVE_TEST_TTL", "2")),
    exclusive_requeue_delay=0.05,
    exclusive_requeue_max_delay=0.5,
    exclusive_wait_timeout=30,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_extended=True,
)
transport_options: dict = {}
if os.environ.get("EXCLUSIVE_TEST_VISIBILITY_TIMEOUT"):
    transport_options["visibility_timeout"] = float(os.environ["EXCLUSIVE_TEST_VISIBILITY_TIMEOUT"])
if os.environ.get("EXCLUSIVE_TEST_MAX_CONNECTIONS"):
    transport_options["max_connections"] = int(os.environ["EXCLUSIVE_TEST_MAX_CONNECTIONS"])
if transport_options:
    app.conf.broker_transport_options = transport_options
if os.environ.get("EXCLUSIVE_TEST_PROBE_ORDER"):
    app.conf.result_backend = f"{__name__}:ProbedResults+{app.conf.result_backend}"
for name in (
    "on_duplicate",
    "on_backend_error",
    "on_lease_lost",
    "wait_timeout",
    "limit",
    "key_prefix",
):
    value = os.environ.get(f"EXCLUSIVE_TEST_{name.upper()}")
    if value is not None:
        number = int(value) if name == "limit" else float(value) if value[0].isdigit() else None
        app.conf[f"exclusive_{name}"] = value if number is None else number


def ledger() -> redis.Redis:
    return ledger_client()


def run(task, key: str, duration: float) -> dict:
    """The body every ledger task shares: hold the key for ``duration`` seconds, or
    until a test ends the hold early by setting ``release:<key>`` in the ledger."""
    lease = task.lease
    start = time.time()
    until = time.monotonic() + duration
    while time.monotonic() < until and not ledger().exists(f"release:{key}"):
        time.sleep(min(0.05, max(0.0, until - time.monotonic())))
    entry = {
        "key": key,
        "token": lease.fencing_token if lease else None,
        "held": lease.held if lease is not None else None,
        "start": start,
        "end": time.time(),
        "task_id": task.request.id,
        "pid": os.getpid(),
        "lost": lease.lost if lease else None,
        "requeues": int(getattr(task.request, "exclusive_requeues", 0) or 0),
        "retries": task.request.retries,
    }
    ledger().rpush("ledger", json.dumps(entry))
    return entry


def _note_order(moment: str, key: str, task_id: str) -> None:
    """Note in the ledger's "order" list whether ``task_id`` still holds ``key``."""
    store = backend_for_url(app.conf.exclusive_backend_url)
    held = any(info.task_id == task_id for info in store.holders_of("exclusive:" + key))
    entry = {"moment": moment, "key": key, "task_id": task_id, "held": held}
    ledger().rpush("order", json.dumps(entry))


class ProbedResults(RedisResults):
    """Celery's Redis result backend, noting first whether the task whose result it
    stores still holds its key: what another worker could see next (the result, a
    chord's callback sent from here) must not come before the release."""

    def store_result(self, task_id, result, state, traceback=None, request=None, **kwargs):
        if request is not None and str(request.task).startswith("ledger.hold_"):
            _note_order("result", request.args[0], task_id)
        return super().store_result(task_id, result, state, traceback, request, **kwargs)


def _note_next_link(sender=None, body=None, headers=None, **extra) -> None:
    """In a worker, a ledger task that sends another (a chain's next link, a callback)
    notes whether the sender still holds the key they share."""
    parent = (headers or {}).get("parent_id")
    if (
        os.environ.get("EXCLUSIVE_TEST_PROBE_ORDER")
        and parent
        and str(sender).startswith("ledger.hold_")
    ):
        _note_order("next link", body[0][0], parent)


def _ledger_task(policy: str):
    @app.task(
        name=f"ledger.hold_{policy}",
        base=ExclusiveTask,
        bind=True,
        exclusive_key="{key}",
        exclusive_on_duplicate=policy,
    )
    def hold(self, key: str, duration: float = 0.0) -> dict:
        return run(self, key, duration)

    return hold


hold_skip = _ledger_task("skip")
hold_requeue = _ledger_task("requeue")
hold_wait = _ledger_task("wait")


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_duplicate="requeue",
    exclusive_requeue_max_retries=2,
)
def hold_give_up(self, key: str, duration: float = 0.0) -> dict:
    """Requeued twice at most while its key is held, then it gives up."""
    return run(self, key, duration)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", acks_late=True)
def hold_acks_late(self, key: str, duration: float = 0.0) -> dict:
    return run(self, key, duration)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    acks_late=True,
    exclusive_on_duplicate="wait",
)
def hold_acks_late_wait(self, key: str, duration: float = 0.0) -> dict:
    return run(self, key, duration)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_lease_lost="terminate",
    exclusive_terminate_grace=1.0,
    exclusive_requeue_lost=False,
)
def hold_terminate(self, key: str, duration: float, stubborn: bool = False) -> dict:
    """Hold ``key`` for ``duration`` seconds in short sleeps; a ``stubborn`` body catches
    the LeaseLost that interrupts it and sleeps on. Each run notes when it started and
    (unless killed) how it ended. Not sent again when stopped (``requeue_lost=False``)."""
    return hold_stopped_on_loss(self, key, duration, stubborn)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_lease_lost="terminate",
    exclusive_terminate_grace=1.0,
    exclusive_requeue_max_delay=0.5,
)
def hold_terminate_again(self, key: str, duration: float, stubborn: bool = False) -> dict:
    """``hold_terminate`` as most tasks have it: sent again when stopped by a loss."""
    return hold_stopped_on_loss(self, key, duration, stubborn)


def hold_stopped_on_loss(self, key: str, duration: float, stubborn: bool) -> dict:
    """The body of ``hold_terminate`` and its sibling."""
    lease = self.lease
    start, ended = time.time(), "returned"
    ledger().rpush("started", json.dumps({"key": key, "pid": os.getpid(), "start": start}))
    try:
        while time.time() < start + duration:
            try:
                time.sleep(0.05)
            except LeaseLost:
                if not stubborn:
                    raise
                ended = "ignored LeaseLost"
    except LeaseLost:
        ended = "LeaseLost"
        raise
    finally:
        entry = {
            "key": key,
            "token": lease.fencing_token,
            "start": start,
            "end": time.time(),
            "task_id": self.request.id,
            "pid": os.getpid(),
            "lost": lease.lost,
            "ended": ended,
        }
        ledger().rpush("ledger", json.dumps(entry))
    return entry


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", max_retries=5)
def retry_once(self, key: str) -> dict:
    """Retries itself once, immediately: the retry must not find its own lease."""
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return run(self, key, 0)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}")
def fail(self, key: str, how: str) -> None:
    ledger().rpush("entered", key)
    if how == "raise":
        raise ValueError("boom")
    if how == "ignore":
        raise Ignore()
    if how == "reject":
        raise Reject("rejected", requeue=False)
    if how == "sleep":
        time.sleep(30)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", soft_time_limit=0.5)
def overrun(self, key: str) -> None:
    time.sleep(5)


@app.task(
    base=ExclusiveTask, bind=True, exclusive_key="{key}", time_limit=1, exclusive_lease_ttl=30
)
def overrun_hard(self, key: str) -> None:
    time.sleep(10)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", exclusive_requeue_lost=False)
def taken_before_it_returns(self, key: str) -> dict:
    """Returns after an operator took its key away, as if its lease expired just then:
    what the store answers next is the first its holder hears of it."""
    self.exclusive_backend.force_release(self.lease.key)
    return run(self, key, 0)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", exclusive_lease_ttl=30)
def hold_long_lease(self, key: str, duration: float = 0.0) -> dict:
    """A lease far longer than any test waits: if it is gone, someone released it."""
    return run(self, key, duration)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_lease_lost="abort",
    exclusive_requeue_lost=False,
)
def hold_abort(self, key: str, duration: float) -> dict:
    entry = run(self, key, duration)
    self.lease.ensure_held()
    return entry


def _record_signal(signal, sender, key, task_id, **extra):
    """Every celery-exclusive signal the worker sends, as seen from inside the worker."""
    entry = {
        "signal": signal.name,
        "sender": sender,
        "key": key,
        "task_id": task_id,
        "pid": os.getpid(),
    }
    entry.update({k: v for k, v in extra.items() if k in ("policy", "holder_task_id")})
    ledger().rpush("signals", json.dumps(entry))


in_worker(
    (signals.lease_acquired, _record_signal),
    (signals.lease_released, _record_signal),
    (signals.lease_lost, _record_signal),
    (signals.duplicate_detected, _record_signal),
    (celery_signals.before_task_publish, _note_next_link),
)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_limit=2,
    exclusive_on_duplicate="requeue",
)
def hold_two(self, key: str, duration: float = 0.0) -> dict:
    return run(self, key, duration)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", exclusive_on_duplicate="rerun")
def webhook(self, key: str, version: int, duration: float = 0.0) -> dict:
    """ "Something changed, go look": every change must be seen, never concurrently."""
    return look(self, key, version, duration)


def look(task, key: str, version: int, duration: float) -> dict:
    """The body of the webhooks: ``run``, noting in ``versions`` which change it saw."""
    entry = run(task, key, duration)
    ledger().rpush("versions", json.dumps({"task_id": task.request.id, "version": version}))
    return {**entry, "version": version}


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_duplicate="rerun",
    acks_late=True,
    reject_on_worker_lost=True,
)
def redelivered_webhook(self, key: str, version: int, duration: float = 0.0) -> dict:
    """``webhook`` whose message the broker delivers again when its process dies."""
    return look_noting_start(self, key, version, duration)


def look_noting_start(task, key: str, version: int, duration: float) -> dict:
    """``look``, noting first in ``started`` the change the run starts with, and where."""
    ledger().rpush("started", json.dumps({"key": key, "pid": os.getpid(), "version": version}))
    return look(task, key, version, duration)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_duplicate="rerun",
    retry_on_worker_lost=True,
    default_retry_delay=0,
)
def retried_when_lost_webhook(self, key: str, version: int, duration: float = 0.0) -> dict:
    """``redelivered_webhook`` without ``acks_late``: Celery retries it when its process
    dies (``retry_on_worker_lost``)."""
    return look_noting_start(self, key, version, duration)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", exclusive_on_duplicate="rerun")
def retried_webhook(self, key: str, version: int, duration: float = 0.0) -> dict:
    """``webhook`` whose first attempt meets an error and is retried (``retry()``)."""
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return look(self, key, version, duration)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_duplicate="rerun",
    exclusive_terminate_grace=1.0,
)
def stubborn_webhook(self, key: str, version: int, duration: float = 30.0) -> dict:
    """``webhook`` whose body catches the LeaseLost that interrupts it and carries on
    (for ``duration`` seconds, or until ``release:<key>`` is set in the ledger): only
    killing its process stops it. Each run notes in ``started`` when it started."""
    ledger().rpush("started", json.dumps({"key": key, "pid": os.getpid(), "start": time.time()}))
    end = time.time() + duration
    while True:
        try:  # wherever the interrupt lands
            if time.time() >= end or ledger().exists(f"release:{key}"):
                break
            time.sleep(0.05)
        except LeaseLost:
            pass
    entry = run(self, key, 0)
    ledger().rpush("versions", json.dumps({"task_id": self.request.id, "version": version}))
    return {**entry, "version": version}


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_priority=True,
    exclusive_on_duplicate="requeue",
)
def nightly(self, key: str, duration: float = 0.0) -> dict:
    return {**run(self, key, duration), "priority": True}


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}", exclusive_scope="enqueue")
def enqueued_once(self, key: str, duration: float = 0.0) -> dict:
    return run(self, key, duration)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_scope="enqueue",
    exclusive_on_duplicate="requeue",
)
def enqueued_then_requeue(self, key: str, duration: float = 0.0) -> dict:
    return run(self, key, duration)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_scope="enqueue",
    exclusive_on_duplicate="wait",
)
def enqueued_wait(self, key: str, duration: float = 0.0) -> dict:
    return run(self, key, duration)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_scope="enqueue",
    max_retries=1,
)
def enqueued_retry_going_on(self, key: str, countdown: float) -> dict:
    """Sends its retry and goes on (``throw=False``), once."""
    if self.request.retries == 0:
        self.retry(countdown=countdown, throw=False)
    return run(self, key, 0)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_scope="enqueue",
    max_retries=1,
)
def enqueued_retry_elsewhere(self, key: str, then: str, countdown: float, going_on: bool) -> dict:
    """Sends its retry once, for the key ``then``: raised, or (``going_on``) with
    ``throw=False``, its body then going on."""
    if self.request.retries == 0:
        retry_args = (then, then, countdown, going_on)
        if not going_on:
            raise self.retry(args=retry_args, countdown=countdown)
        self.retry(args=retry_args, countdown=countdown, throw=False)
    return run(self, key, 0)


@app.task(
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_scope="enqueue",
    max_retries=5,
)
def enqueued_retrying(self, key: str) -> dict:
    if self.request.retries < 3:
        raise self.retry(countdown=0.1)
    return run(self, key, 0)


@app.task(base=ExclusiveTask, bind=True, exclusive_key="{key}")
def hold_in_steps(self, key: str, duration: float) -> dict:
    """Hold ``key`` for ``duration`` seconds in short sleeps; each run notes in the
    ledger whether it completed or was stopped (by the loss of its lease)."""
    return steps(key, duration, self.lease, task_id=self.request.id)
