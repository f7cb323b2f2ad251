"""Tasks timed by the store: a window after their run (``exclusive_unique_for``), a
rate (``exclusive_rate``) and a debounce (``exclusive_debounce``); and a task whose
newer call replaces the running one (``exclusive_on_duplicate="replace"``). Each run is
noted in the ledger as the ledger's tasks do.

An app of their own, configured as the ledger's from the same ``EXCLUSIVE_TEST_*``
variables: a worker refuses to start with such a task on a store without the
``windows`` capability, and the ledger's workers run on every store.
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from celery_exclusive import ExclusiveTask
from tests.support.apps.ledger import ledger, run

app = Celery("kept")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    result_backend=os.environ.get("EXCLUSIVE_TEST_BROKER", "cache+memory://"),
    exclusive_backend_url=os.environ.get("EXCLUSIVE_TEST_STORE", "memory://"),
    exclusive_lease_ttl=float(os.environ.get("EXCLUSIVE_TEST_TTL", "2")),
    # As the ledger's: a call sent again (its own retry meeting its run) comes back soon.
    exclusive_requeue_delay=0.05,
    exclusive_requeue_max_delay=0.5,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_extended=True,
)
if os.environ.get("EXCLUSIVE_TEST_VISIBILITY_TIMEOUT"):
    # A whole worker SIGKILLed leaves the messages it reserved (a countdown's) to be
    # restored this long after, by a sweep run every second (see tests/chaos/chaos_app.py).
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["EXCLUSIVE_TEST_VISIBILITY_TIMEOUT"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 5,
    }


#: The uniqueness window of the windowed tasks below (seconds after a run ends).
WINDOW = 2.0


def _windowed_task(name: str, **options):
    @app.task(
        name=f"kept.windowed_{name}",
        base=ExclusiveTask,
        bind=True,
        exclusive_key="{key}",
        exclusive_unique_for=WINDOW,
        exclusive_requeue_delay=0.2,
        **options,
    )
    def windowed(self, key: str, duration: float = 0.0, fail: bool = False) -> dict:
        """A ledger run; then, with ``fail``, it raises."""
        entry = run(self, key, duration)
        if fail:
            raise ValueError(f"run of {key} failed on purpose")
        return entry

    return windowed


windowed_skip = _windowed_task("skip", exclusive_on_duplicate="skip")
windowed_requeue = _windowed_task("requeue", exclusive_on_duplicate="requeue")
windowed_wait = _windowed_task("wait", exclusive_on_duplicate="wait", exclusive_wait_timeout=10)
windowed_after_end = _windowed_task(
    "after_end", exclusive_on_duplicate="skip", exclusive_unique_after="end"
)


#: The rate of the rated tasks below: runs per period of one key.
RATE, RATE_RUNS, RATE_PERIOD = "3/2s", 3, 2.0


def _rated_task(name: str, **options):
    @app.task(
        name=f"kept.rated_{name}",
        base=ExclusiveTask,
        bind=True,
        exclusive_key="{key}",
        exclusive_rate=RATE,
        **options,
    )
    def rated(self, key: str, duration: float = 0.0) -> dict:
        return run(self, key, duration)

    return rated


rated_skip = _rated_task("skip", exclusive_skip_state="success")
rated_wait = _rated_task("wait", exclusive_on_duplicate="wait", exclusive_wait_timeout=30)


@app.task(
    name="kept.windowed_retry_going_on",
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_unique_for=60.0,
)
def windowed_retry_going_on(self, key: str) -> dict:
    """Sends its retry once and goes on (``throw=False``), under a window of a minute."""
    if self.request.retries == 0:
        self.retry(countdown=0, throw=False, max_retries=1)
    return run(self, key, 0)


#: The debounce period of the debounced tasks below, and the bounded one's max wait.
DEBOUNCE, DEBOUNCE_MAX_WAIT = 1.0, 2.0


def _debounced_task(name: str, **options):
    @app.task(
        name=f"kept.debounced_{name}",
        base=ExclusiveTask,
        bind=True,
        exclusive_key="{key}",
        exclusive_debounce=DEBOUNCE,
        **options,
    )
    def debounced(self, key: str, version: int, duration: float = 0.0) -> dict:
        """A ledger run; it returns the version of the change it ran with."""
        return {**run(self, key, duration), "version": version}

    return debounced


debounced = _debounced_task("plain")
debounced_bounded = _debounced_task("bounded", exclusive_debounce_max_wait=DEBOUNCE_MAX_WAIT)


@app.task(
    name="kept.replacing",
    base=ExclusiveTask,
    bind=True,
    exclusive_key="{key}",
    exclusive_on_duplicate="replace",
    exclusive_terminate_grace=2.0,
)
def replacing(self, key: str, duration: float) -> dict:
    """A ledger run; when and how it stopped noted in the ledger's "stops" list, even
    when a newer call stopped it."""
    started, how = time.time(), "returned"
    try:
        return run(self, key, duration)
    except BaseException as exc:
        how = type(exc).__name__
        raise
    finally:
        stop = {"task_id": self.request.id, "start": started, "end": time.time(), "how": how}
        ledger().rpush("stops", json.dumps(stop))
