"""The leader-elected beat over django-celery-beat's real ``DatabaseScheduler``, in process.

Each test runs two or three ``LeaderScheduler`` instances (one per "beat") over the
same SQLite database and lease store, and drives them tick by tick, so that the
moment that matters (a kill before the row was saved, an admin saving a stale form,
a reload between two reads of one tick) happens exactly where it must. A beat
"killed" here is abandoned as SIGKILL leaves one: no close, no sync, its lease
freed as expiry would free it. Sends are the messages published to the broker.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
from celery import Celery
from celery.signals import before_task_publish

if importlib.util.find_spec("django_celery_beat") is None:  # Django needs Python >= 3.10
    pytest.skip("django-celery-beat is not installed", allow_module_level=True)

from celery_exclusive.beat.scheduler import LeaderScheduler  # noqa: E402
from tests.support.beats import die, run_due  # noqa: E402
from tests.support.django_beat import db  # noqa: E402
from tests.support.django_beat.db import one_off, periodic  # noqa: E402
from tests.support.django_beat.ledger import TASK  # noqa: E402

db.configure()

from django.utils import timezone  # noqa: E402
from django_celery_beat.models import PeriodicTask, PeriodicTasks  # noqa: E402
from django_celery_beat.schedulers import DatabaseScheduler  # noqa: E402


@pytest.fixture(autouse=True)
def empty_schedule():
    db.empty_schedule()


@pytest.fixture
def app(memory_url):
    app = Celery("inproc", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        exclusive_backend_url=memory_url,
        exclusive_beat_lease_ttl=3,
        exclusive_beat_scheduler="django_celery_beat.schedulers:DatabaseScheduler",
        beat_max_loop_interval=1,
    )
    return app


@pytest.fixture
def sent():
    """Names of the entries published, in order."""
    names: list[str] = []

    def record(sender=None, body=None, **kwargs):
        if sender == TASK:
            names.append(body[1]["entry"])

    before_task_publish.connect(record, weak=False)
    yield names
    before_task_publish.disconnect(record)


def row(name: str) -> PeriodicTask:
    return PeriodicTask.objects.get(name=name)


def roll_back(task: PeriodicTask) -> None:
    """Put the row back as it was before the beat saved its run (a beat killed before its
    sync), without telling any scheduler (no change marker)."""
    PeriodicTask.objects.filter(pk=task.pk).update(
        last_run_at=task.last_run_at, total_run_count=task.total_run_count, enabled=task.enabled
    )


# --- after a kill -------------------------------------------------------------------------


def killed_after_a_send(app, sent) -> tuple[LeaderScheduler, float]:
    """Beat A sends every-15s and dies before its row is saved; beat B takes over."""
    before = periodic("every-15s", 15, due_in=-1)
    a = LeaderScheduler(app)
    run_due(a)
    assert sent == ["every-15s"]
    sent_at = row("every-15s").last_run_at.timestamp()
    roll_back(before)
    die(a)
    b = LeaderScheduler(app)
    run_due(b)
    return b, sent_at


def test_a_successor_does_not_resend_what_a_killed_leader_sent_before_saving_its_row(app, sent):
    b, _ = killed_after_a_send(app, sent)
    PeriodicTasks.update_changed()  # any save, or another beat starting: B reloads its rows
    run_due(b)
    assert sent == ["every-15s"]


def test_a_successor_writes_the_recorded_run_into_the_row(app, sent):
    _, sent_at = killed_after_a_send(app, sent)
    after = row("every-15s")
    assert after.last_run_at.timestamp() == pytest.approx(sent_at, abs=0.001)
    assert after.total_run_count == 1


def test_a_one_off_sent_before_a_kill_is_not_sent_again(app, sent):
    before = one_off("one-off", due_in=-1)
    a = LeaderScheduler(app)
    run_due(a)
    assert sent == ["one-off"]
    roll_back(before)
    die(a)
    b = LeaderScheduler(app)
    run_due(b)
    PeriodicTasks.update_changed()
    run_due(b)
    assert sent == ["one-off"]


def test_a_one_off_sent_before_a_kill_is_disabled_by_the_successor(app, sent):
    before = one_off("one-off", due_in=-1)
    a = LeaderScheduler(app)
    run_due(a)
    roll_back(before)
    die(a)
    run_due(LeaderScheduler(app))
    assert row("one-off").enabled is False


def test_a_beat_started_before_a_one_off_ran_does_not_send_it_after_a_handover(app, sent):
    one_off("one-off", due_in=-1)
    a, follower = LeaderScheduler(app), LeaderScheduler(app)
    run_due(a)
    run_due(follower)  # does not lead
    assert sent == ["one-off"]
    a.close()  # SIGTERM: saves, hands over
    run_due(follower)
    assert follower.lease is not None
    assert sent == ["one-off"]


def test_a_one_off_armed_again_after_it_ran_is_sent_by_the_next_leader(app, sent):
    one_off("one-off", due_in=-1)
    a = LeaderScheduler(app)
    run_due(a)
    PeriodicTasks.update_changed()
    run_due(a)  # django-celery-beat disables the one-off that ran, and resets its count
    assert row("one-off").enabled is False
    again = row("one-off")
    again.clocked.clocked_time = timezone.now()
    again.clocked.save()
    again.enabled = True
    again.save()  # the admin arms it again, for a later time
    a.close()
    run_due(LeaderScheduler(app))
    assert sent == ["one-off", "one-off"]


# --- while one beat leads -------------------------------------------------------------------


def test_an_admin_save_of_a_row_read_before_a_send_does_not_send_it_again(app, sent):
    periodic("every-15s", 15, due_in=-1)
    stale = row("every-15s")  # an admin opens the change form
    a = LeaderScheduler(app)
    run_due(a)
    stale.description = "edited"
    stale.save()  # saves the old last run and count too, and marks the schedule changed
    run_due(a)
    assert sent == ["every-15s"]


def test_a_refused_tick_puts_the_row_back_to_what_the_record_says(app, sent):
    periodic("every-15s", 15, due_in=-1)
    stale = row("every-15s")
    a = LeaderScheduler(app)
    run_due(a)
    sent_at = row("every-15s").last_run_at
    stale.save()
    run_due(a)
    assert row("every-15s").last_run_at == sent_at
    assert row("every-15s").total_run_count == 1


class ChangedTwice(DatabaseScheduler):
    """Another process saves a periodic task between the two reads of the change marker
    that one ``tick()`` makes (as each starting beat did when it upserted
    ``celery.backend_cleanup``). No timing puts a save there reliably, so this
    scheduler makes the save itself, in the database, just before each read."""

    saves_pending = 0

    def schedule_changed(self):
        if self.saves_pending:
            self.saves_pending -= 1
            PeriodicTasks.update_changed()
        return super().schedule_changed()


def test_two_reloads_in_one_tick_do_not_send_an_entry_twice(app, sent):
    app.conf.exclusive_beat_scheduler = ChangedTwice
    periodic("every-2s", 2, due_in=-1)
    a = LeaderScheduler(app)
    run_due(a)
    time.sleep(2.05)
    a.inner.saves_pending = 2
    run_due(a)
    assert sent == ["every-2s", "every-2s"]


def test_every_send_is_written_to_its_row_at_once(app, sent):
    periodic("every-1s", 1, due_in=-1)
    a = LeaderScheduler(app)
    run_due(a)
    time.sleep(1.05)
    run_due(a)
    assert len(sent) >= 2
    assert row("every-1s").total_run_count == len(sent)


def test_a_follower_writes_nothing_to_the_schedulers_tables_until_it_leads(app, sent):
    periodic("every-15s", 15, due_in=-1)
    other = LeaderScheduler(app)
    run_due(other)
    marker, rows = PeriodicTasks.last_change(), list(PeriodicTask.objects.values())
    follower = LeaderScheduler(app)  # a beat starting: no default-entry upsert
    run_due(follower)
    follower.sync()
    assert (PeriodicTasks.last_change(), list(PeriodicTask.objects.values())) == (marker, rows)
    other.close()
    run_due(follower)
    assert follower.lease is not None and follower.inner_ready


class EditedRightAfterItsFirstRead(DatabaseScheduler):
    """An admin disables ``to-disable`` just after the scheduler's initial read of its rows,
    before its first check for changes."""

    edited = False

    def all_as_schedule(self):
        schedule = super().all_as_schedule()
        if not self.edited:
            self.edited = True
            task = row("to-disable")
            task.enabled = False
            task.save(update_fields=["enabled"])
        return schedule


def test_an_edit_saved_right_after_the_first_read_of_the_rows_is_picked_up(app, sent):
    app.conf.exclusive_beat_scheduler = EditedRightAfterItsFirstRead
    periodic("to-disable", 1, due_in=-1)
    a = LeaderScheduler(app)
    for _ in range(3):
        run_due(a)
        time.sleep(1.05)
    assert sent.count("to-disable") <= 1


def test_a_send_is_written_to_its_row_as_its_run_columns_alone(app, sent):
    """An admin's save committed while the leader writes a send back (a task disabled)
    is kept: the write touches last_run_at and total_run_count, not the whole row."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    task = periodic("every-1s", 1, due_in=-1)
    a = LeaderScheduler(app)
    run_due(a)  # takes over, sends once
    time.sleep(1.05)
    with CaptureQueriesContext(connection) as queries:
        run_due(a)
    # A tick slower than the 1 s interval (a loaded machine) sends a third time: the
    # spec is the shape of each write-back, not the count.
    assert len(sent) >= 2
    writes = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].startswith("UPDATE") and f'"id" = {task.pk}' in q["sql"]
    ]
    assert writes and all('"enabled"' not in sql for sql in writes), writes
