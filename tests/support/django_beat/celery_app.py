"""The project's Celery app, configured from Django settings as Django projects do."""

from __future__ import annotations

import os

from celery import Celery

from tests.support.django_beat import ledger

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.django_beat.settings")

app = Celery("django_beat")
app.config_from_object("django.conf:settings", namespace="CELERY")
ledger.install(app)
