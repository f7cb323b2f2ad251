"""What a call gets when its key is held: the decision, not its execution.

:func:`claim` returns one outcome and the integration (Celery task or RQ job)
carries it out in its own terms: :class:`Run` the body under the lease,
:class:`Skip` with a terminal result naming the holder, :class:`Coalesce` into the
pending rerun, or :class:`Requeue` after a delay. Nothing here knows Celery or RQ.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Optional, Union

from kombu.utils.json import dumps, loads

from . import marks, signals
from .backends import Backend
from .config import Settings
from .errors import ExclusiveError
from .lease import HeldLease, acquire


@dataclass(frozen=True)
class Run:
    lease: HeldLease
    #: A pending rerun's arguments (JSON) to run with instead of the call's own.
    arguments: Optional[str] = None


@dataclass(frozen=True)
class Skip:
    key: str
    holder_task_id: Optional[str]


@dataclass(frozen=True)
class Coalesce:
    """A duplicate under ``rerun`` that joined the pending rerun instead of running."""

    key: str
    rerun_task_id: str


@dataclass(frozen=True)
class Requeue:
    key: str
    countdown: float
    holder_task_id: Optional[str]


Outcome = Union[Run, Skip, Coalesce, Requeue]


def claim(
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    requeues: int = 0,
    arguments: Optional[str] = None,
) -> Outcome:
    """Take ``key`` or decide what the duplicate gets under ``settings.on_duplicate``.

    ``arguments`` (JSON) is what a ``rerun`` duplicate hands to the pending rerun.
    Raises :class:`BackendUnavailable` if the store does not answer; what happens then
    (``on_backend_error``) is the integration's call, since only it can requeue.
    """
    lease = _try(settings, backend, key, name, task_id)
    if lease is not None:
        return _run(settings, backend, key, task_id, lease)

    holder = holder_of(backend, key)
    if settings.priority and task_id and marks.reserve(backend, key, task_id, settings.lease_ttl):
        _detected(name, key, task_id, "priority", holder)
        lease = wait_for(settings, backend, key, name, task_id, reserved=True)
        if lease is not None:
            return Run(lease)
        countdown = requeue_delay(settings, requeues)
        # Keep the turn while the message is away; it lapses if the task never returns.
        marks.reserve(backend, key, task_id, countdown + settings.lease_ttl)
        return Requeue(key, countdown, holder)

    policy = settings.on_duplicate
    _detected(name, key, task_id, policy, holder)
    if policy == "rerun" and task_id:
        pending = marks.join_rerun(
            backend,
            key,
            task_id,
            arguments or "",
            _pending_ttl(settings),
            latest=settings.rerun_args == "latest",
        )
        if pending != task_id:
            return Coalesce(key, pending)
        # This call is the pending rerun: it waits for the key like "wait" does.
    if policy in ("wait", "rerun"):
        lease = wait_for(settings, backend, key, name, task_id)
        if lease is not None:
            return _run(settings, backend, key, task_id, lease)
        # Waited long enough: fall back to requeue, never drop.
    if policy == "skip":
        return Skip(key, holder)
    return Requeue(key, requeue_delay(settings, requeues), holder)


def wait_for(
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    reserved: bool = False,
) -> Optional[HeldLease]:
    """Block up to ``wait_timeout`` for ``key``; woken by the holder's release.

    Each wait is also bounded by a third of the lease ttl, so a holder that died
    without releasing (its lease simply expires) is noticed without a wake-up. A
    ``reserved`` caller renews its reservation on every round.
    """
    deadline = time.monotonic() + settings.wait_timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        backend.wait(key, min(remaining, settings.lease_ttl / 3), reserved=reserved)
        if reserved:
            marks.reserve(backend, key, task_id, settings.lease_ttl)
        lease = _try(settings, backend, key, name, task_id)
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


def encode_call(name: str, args, kwargs) -> str:
    """A call's arguments as JSON, for a pending rerun to run with.

    kombu's JSON, as Celery's messages use: dates, UUIDs and decimals come back as
    they went in.
    """
    try:
        return dumps({"args": list(args), "kwargs": dict(kwargs)})
    except TypeError as exc:
        raise ExclusiveError(
            f"{name}: on_duplicate='rerun' keeps the latest duplicate's arguments in the "
            f"lease store as JSON, and these are not serializable: {exc}."
        ) from None


def decode_call(arguments: str) -> tuple[tuple, dict]:
    call = loads(arguments)
    return tuple(call["args"]), call["kwargs"]


def _try(
    settings: Settings, backend: Backend, key: str, name: str, task_id: Optional[str]
) -> Optional[HeldLease]:
    # The task id is the claimant: a reservation made for this task lets it through.
    return acquire(
        backend, key, settings.lease_ttl, settings.limit, name, task_id, claimant=task_id
    )


def _run(
    settings: Settings,
    backend: Backend,
    key: str,
    task_id: Optional[str],
    lease: HeldLease,
) -> Run:
    if settings.on_duplicate == "rerun" and task_id:
        return Run(lease, marks.take_rerun(backend, key, task_id))
    return Run(lease)


def _pending_ttl(settings: Settings) -> float:
    """How long a pending rerun stays pending without its task coming back: one wait,
    one requeue delay, and a lease ttl of slack."""
    return settings.wait_timeout + settings.requeue_max_delay + settings.lease_ttl


def _detected(
    name: str, key: str, task_id: Optional[str], policy: str, holder: Optional[str]
) -> None:
    signals.duplicate_detected.send(
        sender=name, key=key, task_id=task_id, policy=policy, holder_task_id=holder
    )
