"""What the beat leader records per schedule entry, and when a tick counts as sent.

Before every send the leader reads the entry's record, refuses the tick if the record
shows it sent already, and otherwise writes the new run into the record with a fenced
write (:meth:`~celery_exclusive.backends.base.Backend.write_record`). The record, not
the wrapped scheduler, decides: a scheduler that reloaded its entries from a stale
row, a schedule file, or an admin form holds an older last run than the record.

Why a read and a fenced write make a compare-and-set here
---------------------------------------------------------
Only the holder of the beat's lease can write a record, and the write checks the
lease in the same atomic step as it sets the value. A grant is one unbroken stretch
of time: once its owner token has expired or been released it is never held again
(a new grant gets a new owner token). So if the fenced write at time *w* succeeds,
this beat held the lease over the whole stretch from its grant to *w*, which
contains the read at *r < w*; nobody else could write the record between *r* and
*w*, and the record still held what was read. If the write fails, nothing was
written and the beat stops sending. That is a compare-and-set under the lease, in
two round trips, with no new store operation: every store that keeps records
(memory, SQLite, Redis, Consul) gives it as it is. Like every fence it assumes the
store keeps what it acknowledged (see the Sentinel caveat in the docs, how-to/stores/redis.md).

When a tick counts as already sent
----------------------------------
The record holds the time of the last send (``last_run_at``). The inner scheduler
is about to send because it believes the last run was earlier. The tick is already
sent when the entry's own schedule, asked with the recorded run instead, says it is
not due now:

- interval (``schedule``), crontab, solar and any schedule whose ``is_due`` looks at
  the last run: refused until the schedule's next time after the recorded run, so
  two sends of one entry are never closer than the schedule allows;
- a fixed-time schedule whose ``is_due`` ignores the last run (django-celery-beat's
  ``clocked``, recognised by its ``clocked_time``): sent once for that time, ever. A
  recorded run at or after ``clocked_time`` refuses it; a one-off moved to a new time
  later than its last run runs again.

The clocks compared are the beats' own, as everywhere in Celery beat: the hosts that
run beat must agree on the time to well within the shortest interval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Optional


@dataclass(frozen=True)
class SentRun:
    """The last send of one schedule entry, as the leader that sent it recorded it."""

    #: When it was sent (timezone-aware, UTC).
    last_run_at: datetime
    #: How many times the entry has been sent in all, by every leader (None in records
    #: written before counts were kept).
    total_run_count: Optional[int]
    #: The fencing token of the lease the send was made under.
    fencing_token: int

    def encode(self) -> str:
        return json.dumps(
            {
                "last_run_at": self.last_run_at.isoformat(),
                "total_run_count": self.total_run_count,
                "fencing_token": self.fencing_token,
            }
        )

    @classmethod
    def decode(cls, value: str) -> SentRun:
        """Raises ValueError (or KeyError, TypeError) for a value that is not a record."""
        data = json.loads(value)
        count = data.get("total_run_count")
        return cls(
            last_run_at=as_utc(datetime.fromisoformat(data["last_run_at"])),
            total_run_count=None if count is None else int(count),
            fencing_token=int(data.get("fencing_token") or 0),
        )


def already_sent(entry: Any, run: SentRun) -> bool:
    """Whether the tick ``entry`` is due for now was sent already, as ``run`` records.

    ``entry`` is a Celery ``ScheduleEntry`` (or one of a scheduler's own, such as
    django-celery-beat's ``ModelEntry``) whose ``schedule`` said it is due.
    """
    schedule = entry.schedule
    clocked_time = getattr(schedule, "clocked_time", None)
    if isinstance(clocked_time, datetime):
        return run.last_run_at >= as_utc(clocked_time)
    now = entry.default_now()
    zone = now.tzinfo if now.tzinfo is not None else timezone.utc
    due, _ = schedule.is_due(run.last_run_at.astimezone(zone))
    return not due


def in_zone_of(moment: datetime, like: Optional[datetime]) -> datetime:
    """``moment`` (aware) as the scheduler writes its own times, like ``like``:
    naive UTC where the scheduler keeps naive times, else in ``like``'s time zone."""
    if like is None or like.tzinfo is None:
        return moment.astimezone(timezone.utc).replace(tzinfo=None)
    return moment.astimezone(like.tzinfo)


def as_utc(moment: datetime) -> datetime:
    """An aware UTC datetime; naive ones are UTC, as Celery reads them."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc)
