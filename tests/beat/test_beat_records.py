"""When a beat record shows a tick as sent already, for each kind of schedule.

The leader refuses a tick its record shows as sent (``beat_records.already_sent``):
the schedule is asked again with the recorded run instead of the wrapped scheduler's.
These are Celery's and django-celery-beat's own schedule classes at a fixed "now".
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab, schedule, solar

from celery_exclusive.beat.records import SentRun, already_sent
from tests.support.apps.beat_app import every_second

NOW = datetime(2026, 6, 1, 12, 0, 30, tzinfo=timezone.utc)
app = Celery("records", set_as_current=False)


def now() -> datetime:
    return NOW


def entry(schedule_) -> ScheduleEntry:
    return ScheduleEntry(name="entry", task="t", schedule=schedule_, app=app)


def ran(at: datetime) -> SentRun:
    return SentRun(last_run_at=at, total_run_count=3, fencing_token=7)


def sent(schedule_, at: datetime) -> bool:
    return already_sent(entry(schedule_), ran(at))


# --- interval ---------------------------------------------------------------------------


def test_an_interval_tick_counts_as_sent_within_an_interval_of_the_recorded_run():
    assert sent(schedule(timedelta(seconds=15), nowfun=now), NOW - timedelta(seconds=10))


def test_an_interval_tick_is_due_once_an_interval_has_passed_since_the_recorded_run():
    assert not sent(schedule(timedelta(seconds=15), nowfun=now), NOW - timedelta(seconds=16))


# --- crontab ----------------------------------------------------------------------------


def test_a_crontab_tick_counts_as_sent_when_the_record_holds_its_run():
    every_5_minutes = crontab(minute="*/5", nowfun=now, app=app)
    assert sent(every_5_minutes, datetime(2026, 6, 1, 12, 0, 0, 200_000, tzinfo=timezone.utc))


def test_a_crontab_tick_is_due_when_the_record_holds_only_the_one_before():
    every_5_minutes = crontab(minute="*/5", nowfun=now, app=app)
    assert not sent(every_5_minutes, datetime(2026, 6, 1, 11, 55, 0, 300_000, tzinfo=timezone.utc))


# --- solar ------------------------------------------------------------------------------


def paris_sunrise() -> solar:
    pytest.importorskip("ephem")
    return solar("sunrise", 48.85, 2.35, nowfun=now, app=app)


def test_a_solar_tick_counts_as_sent_when_the_record_holds_todays_event():
    # Sunrise in Paris on 1 June 2026 is at 03:51 UTC.
    assert sent(paris_sunrise(), datetime(2026, 6, 1, 3, 55, tzinfo=timezone.utc))


def test_a_solar_tick_is_due_when_the_record_holds_yesterdays_event():
    assert not sent(paris_sunrise(), datetime(2026, 5, 31, 3, 55, tzinfo=timezone.utc))


# --- clocked (one-off) ------------------------------------------------------------------


def clocked_at(when: datetime):
    clockedschedule = pytest.importorskip("django_celery_beat.clockedschedule")
    return clockedschedule.clocked(when, nowfun=now)


def test_a_one_off_counts_as_sent_once_the_record_shows_a_run_at_or_after_its_time():
    due_at = NOW - timedelta(minutes=10)
    assert sent(clocked_at(due_at), due_at + timedelta(seconds=0.2))


def test_a_one_off_counts_as_sent_however_long_ago_it_ran():
    due_at = NOW - timedelta(days=30)
    assert sent(clocked_at(due_at), due_at + timedelta(seconds=1))


def test_a_one_off_moved_to_a_later_time_is_due_again():
    assert not sent(clocked_at(NOW - timedelta(seconds=5)), NOW - timedelta(days=1))


# --- a schedule of the user's own ----------------------------------------------------------


def test_a_schedule_with_only_its_own_is_due_is_asked_with_the_recorded_run():
    if time.time() % 1 > 0.9:  # every_second reads the wall clock: stay inside one second
        time.sleep(0.15)
    this_second = datetime.fromtimestamp(int(time.time()), timezone.utc)
    assert sent(every_second(timedelta(seconds=1)), this_second)
    assert not sent(every_second(timedelta(seconds=1)), this_second - timedelta(seconds=1))


# --- the record itself ----------------------------------------------------------------------


def test_a_record_reads_back_as_written():
    run = SentRun(NOW, total_run_count=12, fencing_token=4)
    assert SentRun.decode(run.encode()) == run


def test_a_record_without_a_run_count_still_reads():
    old = json.dumps({"last_run_at": "2026-06-01T12:00:30+00:00", "fencing_token": 2})
    assert SentRun.decode(old) == SentRun(NOW, total_run_count=None, fencing_token=2)


def test_a_record_with_a_naive_time_reads_it_as_utc():
    value = json.dumps({"last_run_at": "2026-06-01T12:00:30", "fencing_token": 2})
    assert SentRun.decode(value).last_run_at == NOW
