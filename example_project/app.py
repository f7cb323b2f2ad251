"""The example's Celery app and tasks.

Two tasks with two duplicate policies:

- ``settle(invoice_id)``: a payment provider's webhook fires two or three times for
  the same invoice. Settling twice would charge twice, so duplicates are skipped.
- ``sync_calendar(calendar_id)``: every change notification must lead to a sync, but
  two syncs of one calendar at once would interleave writes, so duplicates are
  requeued and run one after another.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_exclusive import ExclusiveTask, duplicate_detected
from example_project import (
    fs_transport,  # noqa: F401 - registers the atomicfs:// transport
    journal,
)

VAR = os.environ.get("EXAMPLE_VAR_DIR", os.path.join(os.path.dirname(__file__), "var"))
JOURNAL = os.path.join(VAR, "journal.sqlite3")
QUEUE = os.path.join(VAR, "queue")
for folder in (QUEUE, os.path.join(VAR, "processed")):
    os.makedirs(folder, exist_ok=True)

app = Celery("example_project")
app.conf.update(
    # No server by default; docker-compose.yml points the workers at RabbitMQ instead.
    broker_url=os.environ.get("EXAMPLE_BROKER_URL", "atomicfs://"),
    broker_transport_options={
        "data_folder_in": QUEUE,
        "data_folder_out": QUEUE,
        "processed_folder": os.path.join(VAR, "processed"),
        "control_folder": os.path.join(VAR, "control"),
        "store_processed": True,  # claims are renames within VAR: one filesystem
        "polling_interval": 0.05,
    },
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # Leases: the embedded default (a SQLite file) unless --backend chose a store.
    exclusive_lease_ttl=10,
    exclusive_requeue_delay=0.3,
    exclusive_requeue_max_delay=2,
)
if os.environ.get("EXAMPLE_BACKEND_URL"):
    app.conf.exclusive_backend_url = os.environ["EXAMPLE_BACKEND_URL"]


def _run(task, key: str, seconds: float) -> None:
    started = time.time()
    time.sleep(seconds)
    journal.record(
        JOURNAL,
        task_id=task.request.id,
        task=task.name,
        key=key,
        event="ran",
        fencing_token=task.lease.fencing_token,
        started=started,
        ended=time.time(),
        worker=f"{task.request.hostname} pid {os.getpid()}",
    )


@app.task(
    base=ExclusiveTask,
    bind=True,
    name="settle",
    exclusive_key="invoice:{invoice_id}",
    exclusive_on_duplicate="skip",
)
def settle(self, invoice_id: int) -> None:
    _run(self, f"invoice:{invoice_id}", 0.6)


@app.task(
    base=ExclusiveTask,
    bind=True,
    name="sync_calendar",
    exclusive_key="calendar:{calendar_id}",
    exclusive_on_duplicate="requeue",
)
def sync_calendar(self, calendar_id: int) -> None:
    _run(self, f"calendar:{calendar_id}", 0.4)


@duplicate_detected.connect
def _note_duplicate(sender, key, task_id, policy, holder_task_id, **kwargs):
    journal.record(
        JOURNAL,
        task_id=task_id,
        task=sender,
        key=key.split(":", 1)[1],
        event="skipped" if policy == "skip" else "requeued",
        holder=holder_task_id,
    )
