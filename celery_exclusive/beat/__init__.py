"""The leader-elected beat scheduler: ``beat_scheduler = "exclusive"`` (or
``"celery_exclusive.beat:LeaderScheduler"``).

:mod:`.scheduler` elects the leader and sends ticks; :mod:`.records` keeps each
entry's last send in the store, fenced by the leader's lease; :mod:`.entries` brings
a wrapped scheduler's entries in line with those records.
"""

from .scheduler import LeaderScheduler

__all__ = ["LeaderScheduler"]
