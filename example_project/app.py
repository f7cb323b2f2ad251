"""The example's Celery app: three kinds of work that must not run twice at once.

- ``settle(invoice_id)``: a payment provider's webhook fires two or three times for
  one invoice. Settling twice would charge twice, so duplicates are **skipped**.
- ``sync_calendar(calendar_id, change)``: a calendar's change notifications say
  "something changed, go look". Each must lead to a sync that sees it, and two syncs of
  one calendar at once would interleave writes, so duplicates are **coalesced**
  (``rerun``): one follow-up sync after the running one, with the latest change.
- ``nightly_report()``: sent by ``celery beat``, which runs twice for availability; the
  leader-elected scheduler makes only one of them send.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

from celery import Celery
from celery.beat import BeatLazyFunc
from celery.signals import task_failure

from celery_exclusive import DuplicateCoalesced, DuplicateSkipped, ExclusiveTask, duplicate_detected
from example_project import (
    fs_transport,  # noqa: F401 - registers the atomicfs:// transport
    journal,
)

VAR = os.environ.get("EXAMPLE_VAR_DIR", os.path.join(os.path.dirname(__file__), "var"))
JOURNAL = os.path.join(VAR, "journal.sqlite3")
QUEUE = os.path.join(VAR, "queue")
for folder in (QUEUE, os.path.join(VAR, "processed")):
    os.makedirs(folder, exist_ok=True)

#: How often the "nightly" report is due here, so that a short run shows a few.
REPORT_EVERY = 2.0


def _sent_by() -> dict:
    """Evaluated by the beat as it sends (BeatLazyFunc): which beat sent the tick, when."""
    return {"pid": os.getpid(), "at": time.time()}


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
    task_acks_late=True,  # a pending rerun whose worker dies is redelivered
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # Leases: the embedded default (a SQLite file) unless --backend chose a store.
    exclusive_lease_ttl=10,
    exclusive_requeue_delay=0.3,
    exclusive_requeue_max_delay=2,
    beat_scheduler="exclusive",
    exclusive_beat_lease_ttl=3,
    beat_schedule={
        "nightly-report": {
            "task": "nightly_report",
            "schedule": timedelta(seconds=REPORT_EVERY),
            "kwargs": {"sent": BeatLazyFunc(_sent_by)},
        }
    },
)
if os.environ.get("EXAMPLE_BACKEND_URL"):
    app.conf.exclusive_backend_url = os.environ["EXAMPLE_BACKEND_URL"]


def _run(task, key: str, seconds: float, note: str = "", sent_at: float | None = None) -> None:
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
        note=note,
        sent_at=sent_at,
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
    exclusive_on_duplicate="rerun",
)
def sync_calendar(self, calendar_id: int, change: int) -> None:
    _run(self, f"calendar:{calendar_id}", 0.8, note=f"saw change {change}")


@app.task(
    base=ExclusiveTask,
    bind=True,
    name="nightly_report",
    exclusive_key="nightly-report",
    exclusive_on_duplicate="skip",
)
def nightly_report(self, sent: dict) -> None:
    _run(self, "nightly-report", 0.1, note=f"sent by beat pid {sent['pid']}", sent_at=sent["at"])


@duplicate_detected.connect
def _note_requeue(sender, key, task_id, policy, holder_task_id, **kwargs):
    if policy == "requeue":
        journal.record(
            JOURNAL,
            task_id=task_id,
            task=sender,
            key=key.split(":", 1)[1],
            event="requeued",
            holder=holder_task_id,
        )


@task_failure.connect
def _note_excluded(sender, task_id, exception, args, kwargs, **extra):
    """A skipped or coalesced duplicate ends as a failure carrying whom it yielded to;
    any other failure is written down as one, with its error."""
    if isinstance(exception, DuplicateSkipped):
        journal.record(
            JOURNAL,
            task_id=task_id,
            task=sender.name,
            key=exception.key.split(":", 1)[1],
            event="coalesced" if isinstance(exception, DuplicateCoalesced) else "skipped",
            holder=exception.holder_task_id,
        )
    else:
        journal.record(
            JOURNAL,
            task_id=task_id,
            task=sender.name,
            key=", ".join(map(str, args)),
            event="failed",
            note=f"{type(exception).__name__}: {exception}",
        )
