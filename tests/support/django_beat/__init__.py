"""A real Django project running django-celery-beat under the leader-elected beat.

``settings.py`` is what a user writes (``CELERY_BEAT_SCHEDULER = "exclusive"``, the
wrapped ``DatabaseScheduler``, SQLite set up for several beats); ``celery_app.py`` is
the project's Celery app; ``ledger.py`` records every send the worker runs;
``cluster.py`` runs three beats and a worker and kills leaders on a schedule, for the
tests and for ``python -m benchmarks beat``.
"""
