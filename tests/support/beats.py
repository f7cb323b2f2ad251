"""Leader-elected beat schedulers driven tick by tick inside the test process."""

from __future__ import annotations

from celery_exclusive.beat.scheduler import LeaderScheduler
from celery_exclusive.core.lease import heartbeat


def run_due(beat: LeaderScheduler, ticks: int = 20) -> None:
    """Tick until nothing is due now. A beat that does not lead ticks once, which waits
    up to ``lease_ttl / 3`` for the lease to come free."""
    for _ in range(ticks):
        if beat.tick() > 0 or beat.lease is None:
            return


def die(beat: LeaderScheduler) -> None:
    """Leave ``beat`` as SIGKILL would: nothing closed or synced, and its lease gone as
    if it had expired."""
    heartbeat().discard(beat.lease)
    beat.backend.force_release(beat.lease_key)
