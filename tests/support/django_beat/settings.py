"""Django settings of the test project: django-celery-beat's tables in one SQLite file.

EXCLUSIVE_TEST_DJANGO_DB  the database file (the test creates and migrates it)
EXCLUSIVE_TEST_BROKER     broker URL
EXCLUSIVE_TEST_STORE      lease store URL
EXCLUSIVE_TEST_TTL        the beat's lease ttl in seconds
"""

from __future__ import annotations

import os


def database(path: str) -> dict:
    """SQLite shared by several beat processes and the test.

    ``timeout``: wait for another process's write lock instead of failing at once;
    ``transaction_mode="IMMEDIATE"``: take the write lock when a transaction starts,
    since a read that later upgrades to a write can fail with "database is locked"
    without waiting.
    """
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": path,
        "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
    }


SECRET_KEY = "celery-exclusive tests"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {"default": database(os.environ.get("EXCLUSIVE_TEST_DJANGO_DB", "beat.sqlite3"))}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
TIME_ZONE = "UTC"

CELERY_BROKER_URL = os.environ.get("EXCLUSIVE_TEST_BROKER", "memory://")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULER = "exclusive"
CELERY_BEAT_MAX_LOOP_INTERVAL = 1
CELERY_EXCLUSIVE_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_EXCLUSIVE_BACKEND_URL = os.environ.get("EXCLUSIVE_TEST_STORE", "memory://")
CELERY_EXCLUSIVE_BEAT_LEASE_TTL = float(os.environ.get("EXCLUSIVE_TEST_TTL", "3"))
