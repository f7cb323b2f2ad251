"""The ledger of beat sends: which entry was sent when, by which beat, as the worker ran it.

Every entry of these tests runs the task ``beat_ledger.tick`` with its own name as the
``entry`` keyword. The beat stamps each message as it publishes it (the
``before_task_publish`` signal, in the beat process) with the time and its pid; the
worker appends entry, stamp and run time to the Redis list ``sends``.

EXCLUSIVE_TEST_LEDGER   Redis URL of the ledger
"""

from __future__ import annotations

import json
import os
import time

from celery.signals import before_task_publish

from tests.support.apps import ledger_client
from tests.support.in_process import in_beat

TASK = "beat_ledger.tick"
LIST = "sends"


def install(app) -> None:
    """Register the ledger task on ``app``."""

    @app.task(name=TASK, bind=True)
    def tick(self, entry: str) -> None:
        send = {
            "entry": entry,
            "sent_at": self.request.get("sent_at"),
            "beat": self.request.get("sent_by"),
            "ran_at": time.time(),
        }
        ledger_client().rpush(LIST, json.dumps(send))


def stamp(sender=None, headers=None, **kwargs) -> None:
    if sender == TASK and headers is not None:
        headers["sent_at"] = time.time()
        headers["sent_by"] = os.getpid()


in_beat((before_task_publish, stamp))
