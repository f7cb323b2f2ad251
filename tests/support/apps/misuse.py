"""Celery apps with one mistake each, for the start-up checks of real workers and beats.

MISUSE_CASE picks the mistake:

forgotten_base      a task with exclusive_key but no base=ExclusiveTask; this module
                    then never imports celery_exclusive (the ``celery`` program does)
misspelt_setting    app.conf.exclusive_lease_tll
django_unread       Django-style CELERY_EXCLUSIVE_* settings read without namespace="CELERY"
leftover_once       celery-once's once={...} left on an ExclusiveTask
leftover_settings   celery-singleton's singleton_lock_expiry, no task using celery-singleton
"""

from __future__ import annotations

import os

from celery import Celery

CASE = os.environ.get("MISUSE_CASE", "")

app = Celery("misuse", set_as_current=False)
app.conf.update(broker_url="memory://", broker_connection_retry_on_startup=True)


if CASE == "forgotten_base":

    @app.task(exclusive_key="invoice:{invoice_id}", name="billing.settle")
    def settle(invoice_id):
        return invoice_id

elif CASE == "misspelt_setting":
    app.conf.exclusive_lease_tll = 60

elif CASE == "django_unread":

    class DjangoSettings:
        CELERY_BROKER_URL = "memory://"
        CELERY_EXCLUSIVE_ON_DUPLICATE = "wait"

    app.config_from_object(DjangoSettings)

elif CASE == "leftover_once":
    from celery_exclusive import ExclusiveTask

    @app.task(base=ExclusiveTask, once={"keys": ["invoice_id"]}, name="billing.settle")
    def settle_once(invoice_id, note=None):
        return invoice_id

elif CASE == "leftover_settings":
    from celery_exclusive import ExclusiveTask

    app.conf.singleton_lock_expiry = 600

    @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}", name="billing.settle")
    def settle_singleton(invoice_id):
        return invoice_id
