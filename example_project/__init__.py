"""A runnable tour of celery-exclusive: webhook-style duplicates against real workers.

``python -m example_project`` starts two Celery workers and a producer on this machine
alone (filesystem broker, SQLite leases: no server), then prints what ran, what was
excluded, and why.
"""
