"""Django in the test process itself: the project's settings on a fresh SQLite file.

The test (or benchmark) process reads and edits the schedule through the ORM, as an
admin would, while the beats run in their own processes on the same file.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from datetime import timedelta
from typing import Optional


def configure() -> str:
    """Configure Django once in this process, migrate, and return the database file.

    ``settings.configure()`` rather than ``DJANGO_SETTINGS_MODULE``: with that variable
    set, every Celery app created later in this process would load Celery's Django
    fixup, and the other tests' apps are not Django projects.
    """
    import django
    from django.conf import settings
    from django.core.management import call_command

    if not settings.configured:
        directory = tempfile.mkdtemp(prefix="django-beat-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        from tests.support.django_beat import settings as project

        values = {name: getattr(project, name) for name in dir(project) if name.isupper()}
        values["DATABASES"] = {"default": project.database(os.path.join(directory, "db"))}
        settings.configure(**values)
        django.setup()
        call_command("migrate", verbosity=0)
    return settings.DATABASES["default"]["NAME"]


def empty_schedule() -> None:
    """Delete every periodic task, schedule and the change marker."""
    from django_celery_beat import models

    for model in (
        models.PeriodicTask,
        models.PeriodicTasks,
        models.IntervalSchedule,
        models.CrontabSchedule,
        models.SolarSchedule,
        models.ClockedSchedule,
    ):
        model.objects.all().delete()


def periodic(name: str, seconds: int, due_in: Optional[float] = None, **fields):
    """A ledger task named ``name`` every ``seconds``. With ``due_in``, its last run is
    set so that it is first due that many seconds from now (negative: overdue)."""
    from django.utils import timezone
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    from tests.support.django_beat.ledger import TASK

    interval = IntervalSchedule.objects.create(every=seconds, period=IntervalSchedule.SECONDS)
    if due_in is not None:
        fields["last_run_at"] = timezone.now() - timedelta(seconds=seconds - due_in)
    return PeriodicTask.objects.create(
        name=name, task=TASK, kwargs=json.dumps({"entry": name}), interval=interval, **fields
    )


def one_off(name: str, due_in: float):
    """A ledger task sent once, ``due_in`` seconds from now (a ``ClockedSchedule``)."""
    from django.utils import timezone
    from django_celery_beat.models import ClockedSchedule, PeriodicTask

    from tests.support.django_beat.ledger import TASK

    clocked = ClockedSchedule.objects.create(
        clocked_time=timezone.now() + timedelta(seconds=due_in)
    )
    return PeriodicTask.objects.create(
        name=name, task=TASK, kwargs=json.dumps({"entry": name}), clocked=clocked, one_off=True
    )
