"""A Celery app for the leader-elected beat tests, configured from the environment.

One schedule entry fires at the start of every wall-clock second. Its kwargs are
evaluated by the beat process as it sends, so each run carries the second it was
sent for (the tick's identity) and the pid of the beat that sent it; the worker
appends both to a ledger list in Redis.

EXCLUSIVE_TEST_BROKER   broker URL
EXCLUSIVE_TEST_STORE    lease store URL (exclusive_backend_url)
EXCLUSIVE_TEST_LEDGER   Redis URL of the ledger
EXCLUSIVE_TEST_TTL      the beat's lease ttl in seconds
EXCLUSIVE_TEST_INNER    exclusive_beat_scheduler, if set
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import redis
from celery import Celery
from celery.beat import BeatLazyFunc
from celery.schedules import schedstate, schedule

from tests.support.apps import ledger_client


class every_second(schedule):  # noqa: N801 - named like Celery's own schedules
    """Due once per wall-clock second, right after the second starts.

    Celery's plain ``schedule(1)`` runs one second after the last *send*, so its ticks
    drift and have no identity; here a tick is a whole second, and the same second
    sent twice is a duplicate.
    """

    def is_due(self, last_run_at) -> schedstate:
        now = time.time()
        until_next = 1.0 - now % 1.0
        return schedstate(int(now) > int(last_run_at.timestamp()), until_next)

    def now(self):
        """Now; when ``reserve()`` asks (``ScheduleEntry._next_instance``, for the run's
        new last run), also kept as the run's time: ``is_due`` judges the next tick
        against it, so its second is the run's identity."""
        global _reserved_at
        now = super().now()
        if sys._getframe(2).f_code.co_name == "_next_instance":
            _reserved_at = now.timestamp()
        return now


#: The time ``reserve()`` stamped on the last run it made in this process.
_reserved_at = 0.0


def sent_stamp() -> dict:
    """Evaluated in the beat process at send time (BeatLazyFunc).

    The slot is the second of the run as the scheduler stamped it, not of the send:
    the leader records the run, then publishes, and under load that can cross into the
    next second, whose own tick is then due by the schedule, rightly. Two sends of one
    slot are thus two runs the schedule counts as one tick.
    """
    now = time.time()
    return {"slot": int(_reserved_at or now), "at": now, "pid": os.getpid()}


app = Celery("beat_app")
app.conf.update(
    broker_url=os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://"),
    exclusive_backend_url=os.environ.get("EXCLUSIVE_TEST_STORE", "memory://"),
    exclusive_beat_lease_ttl=float(os.environ.get("EXCLUSIVE_TEST_TTL", "2.4")),
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "tick": {
            "task": "beat_app.record_tick",
            "schedule": every_second(timedelta(seconds=1)),
            "kwargs": {"sent": BeatLazyFunc(sent_stamp)},
        }
    },
)
if os.environ.get("EXCLUSIVE_TEST_INNER"):
    app.conf.exclusive_beat_scheduler = os.environ["EXCLUSIVE_TEST_INNER"]


def ledger() -> redis.Redis:
    return ledger_client()


@app.task(name="beat_app.record_tick")
def record_tick(sent: dict) -> None:
    ledger().rpush("ticks", json.dumps({**sent, "received": time.time()}))
