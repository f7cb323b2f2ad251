"""A Celery app on a filesystem broker that leaves ``exclusive_backend_url`` unset, so
its leases live in the default store: for a test of what that default is.

EXCLUSIVE_TEST_APP      the app's main name
EXCLUSIVE_TEST_QUEUE    the folder its broker keeps messages in
EXCLUSIVE_TEST_LEDGER   Redis URL of the ledger
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from celery_exclusive import ExclusiveTask
from example_project import fs_transport  # noqa: F401 - registers atomicfs://
from tests.support.apps import ledger_client


def make_app(name: str, queue: str) -> Celery:
    os.makedirs(queue, exist_ok=True)
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url="atomicfs://",
        broker_transport_options={
            "data_folder_in": queue,
            "data_folder_out": queue,
            # kombu's default control folder is relative to the working directory.
            "control_folder": os.path.join(queue, "control"),
            "polling_interval": 0.05,
        },
        task_ignore_result=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        exclusive_lease_ttl=5,
    )

    @app.task(
        name="private.hold",
        base=ExclusiveTask,
        bind=True,
        exclusive_key="invoice:{invoice_id}",
    )
    def hold(self, invoice_id: int, duration: float) -> None:
        start = time.time()
        time.sleep(duration)
        entry = {
            "app": self.app.main,
            "key": self.lease.key,
            "token": self.lease.fencing_token,
            "store": self.exclusive_settings.backend_url,
            "start": start,
            "end": time.time(),
        }
        ledger_client().rpush("ledger", json.dumps(entry))

    return app


app = make_app(
    os.environ.get("EXCLUSIVE_TEST_APP", "private"),
    os.environ.get("EXCLUSIVE_TEST_QUEUE", "/tmp/celery-exclusive-test-queue"),
)
