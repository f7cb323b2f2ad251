"""The wrapped scheduler's entries: adopting what the records say, and writing it through.

The leader's records are the authority on what was sent; the wrapped scheduler keeps
its own copy in its own store (django-celery-beat's ``PeriodicTask`` rows, a
``PersistentScheduler`` shelve file), which the admin shows and from which a reload
rebuilds the entries. Whatever the leader takes from a record goes into the
in-memory entries *and* that store, so the admin shows the truth and a reload cannot
roll it back.

No scheduler is named here; entries are told apart by what they have:

- an entry backed by a database row (``entry.model`` and ``entry.save()``, as
  django-celery-beat's ``ModelEntry`` and schedulers built like it): the run is set on
  the row's model too, and written as one ``UPDATE`` of ``last_run_at`` and
  ``total_run_count`` alone (a Django model; any other row through the entry's own
  ``save()``). ``ModelEntry.save()`` reads the row and writes every column back, so an
  admin's edit committed between its read and its write (a task disabled) would be
  undone; the ``UPDATE`` keeps it, and, sending no signal, does not bump
  ``PeriodicTasks.last_change`` (no reload follows);
- any other entry (Celery's ``Scheduler``, ``PersistentScheduler``): set on the entry,
  which lives in the scheduler's schedule; the scheduler's ``sync()`` persists it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Optional

from .records import SentRun, as_utc, in_zone_of

logger = logging.getLogger("celery_exclusive")


def adopt(
    entry: Any, last_run_at: Optional[datetime] = None, total_run_count: Optional[int] = None
) -> None:
    """Set the entry's last run and run count (those given) in memory, row included."""
    model = row_of(entry)
    for holder in (entry, model) if model is not None else (entry,):
        if last_run_at is not None:
            current = holder.last_run_at or entry.last_run_at or entry.default_now()
            holder.last_run_at = in_zone_of(last_run_at, current)
        if total_run_count is not None:
            holder.total_run_count = total_run_count
    if model is not None:
        model.no_changes = True  # a run is not an edit: no reload of every entry


def catch_up(entry: Any, run: SentRun) -> bool:
    """Make ``entry``'s last run and run count the recorded ones; True if they changed.

    The record wins in both directions. An entry behind it was reloaded from a copy
    older than the last send; an entry ahead of it never ran at that time: a scheduler
    that creates an entry stamps it with the creation time ("not run since"), which
    would hold back a tick that is due.
    """
    if armed_again(entry, run):
        return False
    last_run_at, count = entry.last_run_at, total_run_count_of(entry)
    other_run = last_run_at is None or run.last_run_at != as_utc(last_run_at)
    other_count = run.total_run_count is not None and run.total_run_count != count
    if not (other_run or other_count):
        return False
    adopt(
        entry,
        run.last_run_at if other_run else None,
        run.total_run_count if other_count else None,
    )
    return True


def armed_again(entry: Any, run: SentRun) -> bool:
    """Whether ``entry`` is a one-off row armed again since ``run``: it starts afresh.

    django-celery-beat disables a one-off that ran and resets its run count to 0, so
    that an admin can enable it again; the row's last run is then its change time,
    later than the recorded run. Giving it the recorded count back would make
    django-celery-beat disable it again unsent. (The record still refuses a tick whose
    time is at or before the recorded run.)
    """
    model = row_of(entry)
    return (
        model is not None
        and getattr(model, "one_off", False) is True
        and total_run_count_of(entry) == 0
        and entry.last_run_at is not None
        and as_utc(entry.last_run_at) > run.last_run_at
    )


def total_run_count_of(entry: Any) -> int:
    """The run count the scheduler will store for ``entry`` (its row's, if it has one)."""
    model = row_of(entry)
    holder = model if model is not None else entry
    return int(getattr(holder, "total_run_count", 0) or 0)


def write_through(scheduler: Any, entries: Iterable[Any]) -> None:
    """Persist ``entries`` of the wrapped ``scheduler`` in its own store, now.

    A store that fails is logged and left for the scheduler's next sync: the record
    keeps the truth, and refuses whatever a stale copy would send again.
    """
    saved, in_schedule = set(), False
    for entry in entries:
        model = row_of(entry)
        if model is None:
            in_schedule = True
            continue
        if id(model) in saved:
            continue
        saved.add(id(model))
        try:
            _save_run(entry, model)
            dirty = getattr(scheduler, "_dirty", None)
            if isinstance(dirty, set):
                # django-celery-beat's note to save it in its next sync(), which would
                # write the whole row again: what _save_run spares the admin's edits.
                dirty.discard(entry.name)
        except Exception as exc:  # a third-party store: whatever it raises, beat goes on
            logger.warning(
                "beat: could not write the last run of %s to the scheduler's database "
                "(%s: %s); the lease store's record still has it",
                entry.name,
                type(exc).__name__,
                exc,
            )
    if not in_schedule:
        return  # rows written; the scheduler's own sync would write them again, whole
    try:
        scheduler.sync()
    except Exception as exc:
        logger.warning(
            "beat: the wrapped scheduler could not save its schedule (%s: %s); the lease "
            "store's records still have every run",
            type(exc).__name__,
            exc,
        )


def _save_run(entry: Any, model: Any) -> None:
    """Write the entry's last run and run count onto its row, and nothing else."""
    manager = getattr(type(model), "_default_manager", None)
    if manager is None:  # not a Django model: the entry knows how to save itself
        entry.save()
        return
    manager.filter(pk=model.pk).update(
        last_run_at=model.last_run_at, total_run_count=model.total_run_count
    )


def row_of(entry: Any) -> Optional[Any]:
    """The database row (model instance) behind ``entry``, if it is a row-backed entry."""
    model = getattr(entry, "model", None)
    if (
        model is None
        or not hasattr(model, "last_run_at")
        or not callable(getattr(entry, "save", None))
    ):
        return None
    return model


def baseline_changes(scheduler: Any) -> None:
    """Give a scheduler that reloads on a change marker its baseline before it first
    reads its entries.

    django-celery-beat's ``DatabaseScheduler`` reloads when ``PeriodicTasks.last_change``
    moved since its previous check, and its first check, the one after the initial
    read, has nothing to compare with: an admin's edit saved between that read and that
    check (a task disabled, an interval changed) is never picked up, until the
    five-minute full reload. Checking once before the read sets the baseline.
    """
    check = getattr(scheduler, "schedule_changed", None)
    if callable(check) and getattr(scheduler, "_last_timestamp", False) is None:
        check()
