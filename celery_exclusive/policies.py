"""What a call gets when its key is held: the decision, not its execution.

:func:`claim` returns one of three outcomes, and the integration (Celery task or
RQ job) carries it out in its own terms: :class:`Run` the body under the lease,
:class:`Skip` with a terminal result naming the holder, or :class:`Requeue` after
a delay. Nothing here knows Celery or RQ.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Optional, Union

from . import signals
from .backends import Backend
from .config import Settings
from .lease import HeldLease, acquire


@dataclass(frozen=True)
class Run:
    lease: HeldLease


@dataclass(frozen=True)
class Skip:
    key: str
    holder_task_id: Optional[str]


@dataclass(frozen=True)
class Requeue:
    key: str
    countdown: float
    holder_task_id: Optional[str]


Outcome = Union[Run, Skip, Requeue]


def claim(
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    requeues: int = 0,
) -> Outcome:
    """Take ``key`` or decide what the duplicate gets under ``settings.on_duplicate``.

    Raises :class:`BackendUnavailable` if the store does not answer; what happens then
    (``on_backend_error``) is the integration's call, since only it can requeue.
    """
    lease = acquire(backend, key, settings.lease_ttl, settings.limit, name, task_id)
    if lease is not None:
        return Run(lease)
    policy = settings.on_duplicate
    if policy == "wait":
        lease = wait_for(settings, backend, key, name, task_id)
        if lease is not None:
            return Run(lease)
        policy = "requeue"  # waited long enough: fall back, never drop
    holder_task_id = holder_of(backend, key)
    signals.duplicate_detected.send(
        sender=name, key=key, task_id=task_id, policy=policy, holder_task_id=holder_task_id
    )
    if policy == "skip":
        return Skip(key, holder_task_id)
    return Requeue(key, requeue_delay(settings, requeues), holder_task_id)


def wait_for(
    settings: Settings, backend: Backend, key: str, name: str, task_id: Optional[str]
) -> Optional[HeldLease]:
    """Block up to ``wait_timeout`` for ``key``; woken by the holder's release.

    Each wait is also bounded by a third of the lease ttl, so a holder that died
    without releasing (its lease simply expires) is noticed without a wake-up.
    """
    deadline = time.monotonic() + settings.wait_timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        backend.wait(key, min(remaining, settings.lease_ttl / 3))
        lease = acquire(backend, key, settings.lease_ttl, settings.limit, name, task_id)
        if lease is not None:
            return lease


def holder_of(backend: Backend, key: str) -> Optional[str]:
    """The task id of a current holder of ``key``, if the store still has one."""
    for info in backend.holders_of(key):
        if info.task_id:
            return info.task_id
    return None


def requeue_delay(settings: Settings, requeues: int) -> float:
    """Exponential backoff with equal jitter: half fixed, half random.

    The fixed half keeps a crowd of duplicates from hammering the store; the random
    half keeps them from all coming back at the same instant.
    """
    ceiling = min(settings.requeue_max_delay, settings.requeue_delay * 2 ** min(requeues, 30))
    return ceiling / 2 + random.uniform(0, ceiling / 2)
