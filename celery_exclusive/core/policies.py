"""What a call gets when its key is held: the decision, not its execution.

:func:`claim` returns one outcome and the integration (Celery task or RQ job)
carries it out in its own terms: :class:`Run` the body under the lease,
:class:`Skip` with a terminal result naming the holder, :class:`Coalesce` into the
pending rerun, :class:`Requeue` after a delay, :class:`Redelivered` (a second copy
of a call that is running now) set aside without a trace, or :class:`Ended` (a copy of
a call that ran to the end) dropped without one. Nothing here knows Celery or RQ.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, replace
from typing import Optional, Union

from kombu.utils.json import dumps, loads

from .. import signals
from ..backends import Backend, MarkRead
from ..errors import ExclusiveError
from . import feed, marks
from .config import Settings
from .holders import first_described as described_holder
from .lease import HeldLease, acquire

#: Seconds a waiter sleeps when the store woke it at once but refused the grant; it
#: doubles while that goes on.
SPIN_PAUSE = 0.01


@dataclass(frozen=True)
class Run:
    lease: HeldLease
    #: A pending rerun's arguments (JSON) to run with instead of the call's own.
    arguments: Optional[str] = None
    #: With ``redelivery``, whether the call's finished mark (see
    #: :func:`marks.finished_attempt`) was read with the grant (in its round trip where
    #: the store could, else right after it), and its value then (None: absent).
    finished_read: bool = False
    finished: Optional[str] = None


@dataclass(frozen=True)
class Skip:
    key: str
    holder_task_id: Optional[str]
    #: The holder in words, when it is no task (a lock, a foreign client: see holders.py).
    holder: Optional[str] = None


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
    #: The holder in words, when it is no task (a lock, a foreign client: see holders.py).
    holder: Optional[str] = None


@dataclass(frozen=True)
class Redelivered:
    """A copy of a call whose own task id holds the key: the broker delivered its
    message again while the first delivery still runs (``acks_late`` past the
    visibility timeout). It is no duplicate: it must not run, nor leave a result."""

    key: str
    countdown: float


@dataclass(frozen=True)
class Ended:
    """A copy of a call whose attempt already ended (its finished mark, read as it
    tried the key, says so: see :func:`marks.ended`): the broker delivered its message
    again after the end (an acknowledgement lost with its worker or its connection). It
    is no duplicate: it must not join a pending rerun, wait, run, nor leave a result.
    A grant it took has gone back."""

    key: str


Outcome = Union[Run, Skip, Coalesce, Requeue, Redelivered, Ended]


@feed.reported
def claim(
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    requeues: int = 0,
    arguments: Optional[str] = None,
    redelivery: bool = False,
    retries: int = 0,
    resumed: bool = False,
) -> Outcome:
    """Take ``key`` or decide what the duplicate gets under ``settings.on_duplicate``.

    ``arguments`` (JSON) is what a ``rerun`` duplicate hands to the pending rerun.
    With ``redelivery`` (a broker may deliver this call's message twice), a call whose
    own ``task_id`` holds the key is :class:`Redelivered`, and one whose attempt
    ``retries`` already ended is :class:`Ended` (see :func:`marks.ended`), whatever the
    policy.
    Raises :class:`BackendUnavailable` if the store does not answer; what happens then
    (``on_backend_error``) is the integration's call, since only it can requeue.
    """
    finished_read, finished = False, None
    if redelivery and task_id:
        # Whether this attempt already ran to the end, read as the key is tried.
        read = MarkRead(marks.finished_key(key, task_id), marks.DONE)
        lease = acquire(
            backend,
            key,
            settings.lease_ttl,
            settings.limit,
            name,
            task_id,
            claimant=task_id,
            read=read,
        )
        finished, finished_read = read.value, lease is not None
    else:
        lease = _try(settings, backend, key, name, task_id, task_id)
    if lease is not None:
        copy = redelivery and task_id and settings.limit > 1
        with lease.released_on_error():
            if copy and _held_by(backend, key, task_id, lease):
                # A semaphore had a slot left for the copy: give it back.
                lease.release()
                return Redelivered(key, requeue_delay(settings, requeues))
        run = _run(settings, backend, key, task_id, lease)
        if finished_read:
            run = replace(run, finished_read=True, finished=finished)
        return _unless_ended(backend, run, task_id, retries, resumed, redelivery)

    if redelivery and marks.ended(finished, retries, resumed):
        return Ended(key)  # even where a later attempt (a retry) holds the key
    # Whom this call yields to: a holder, or else whoever is first in line for the key.
    infos = backend.holders_of(key)
    holders = [info.task_id for info in infos if info.task_id]
    if redelivery and task_id in holders:
        return Redelivered(key, requeue_delay(settings, requeues))
    holder = next(iter(holders), None) or next(iter(marks.line_of(backend, key)), None)
    described = None if holders else described_holder(infos)
    if settings.priority and task_id:
        _detected(name, key, task_id, "priority", holder)
        countdown = requeue_delay(settings, requeues)
        # If it has to be requeued, it keeps its turn while the message is away; the
        # turn lapses if the task never comes back.
        away = countdown + settings.lease_ttl
        lease = wait_for(settings, backend, key, name, task_id, priority=True, keep_place=away)
        if lease is not None:
            return _unless_ended(backend, Run(lease), task_id, retries, resumed, redelivery)
        return Requeue(key, countdown, holder, described)

    policy = settings.on_duplicate
    _detected(name, key, task_id, policy, holder)
    rerun = policy == "rerun" and bool(task_id)
    if rerun:
        pending = marks.join_rerun(
            backend,
            key,
            task_id,
            arguments or "",
            _pending_ttl(settings),
            latest=settings.rerun_args == "latest",
            alive_for=settings.lease_ttl,
        )
        if pending != task_id:
            return Coalesce(key, pending)
        # This call is the pending rerun: it waits for the key like "wait" does, and
        # stays pending while it stands in the key's line.
    if policy in ("wait", "rerun"):
        lease = wait_for(settings, backend, key, name, task_id)
        if lease is not None:
            run = _run(settings, backend, key, task_id, lease)
            return _unless_ended(backend, run, task_id, retries, resumed, redelivery)
        # Waited long enough: fall back to requeue, never drop. The requeued message
        # joins the back of the line when it comes back.
    if policy == "skip":
        return Skip(key, holder, described)
    countdown = requeue_delay(settings, requeues)
    if rerun:
        # Out of the line while its message is away: it stays pending for as long as
        # coming back takes, and a duplicate takes its place if it never does.
        away = countdown + settings.lease_ttl
        pending = marks.rerun_away(backend, key, task_id, away, _pending_ttl(settings))
        if pending not in (None, task_id):
            return Coalesce(key, pending)  # replaced while it waited: the newer one runs
    return Requeue(key, countdown, holder, described)


def wait_for(
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    priority: bool = False,
    keep_place: Optional[float] = None,
) -> Optional[HeldLease]:
    """Stand in the key's line and wait up to ``wait_timeout`` for its turn.

    The store lets in only the first in line, so waiters are served first come,
    first served (priority callers first), and woken by the holder's release. Each
    wait is also bounded by a third of the lease ttl: the caller renews its place in
    line that often, and notices a holder that died without releasing (its lease
    simply expires). On timeout the caller steps out of the line and None is
    returned; with ``keep_place`` it keeps its place for that many seconds instead.
    """
    claimant = task_id or uuid.uuid4().hex  # a direct call has no task id
    deadline = time.monotonic() + settings.wait_timeout
    grace, beat = settings.lease_ttl, settings.lease_ttl / 3
    marks.take_place(backend, key, claimant, grace, priority)
    renewed_at, pause = time.monotonic(), SPIN_PAUSE
    while True:
        now = time.monotonic()
        if now >= deadline:
            if keep_place is None:
                marks.leave_line(backend, key, claimant)
            else:
                marks.take_place(backend, key, claimant, keep_place, priority)
            return None
        if now - renewed_at >= beat:
            marks.take_place(backend, key, claimant, grace, priority)
            renewed_at = now
        backend.wait(key, min(deadline, renewed_at + beat) - now, claimant)
        lease = _try(settings, backend, key, name, task_id, claimant)
        if lease is not None:
            return lease  # the grant took this caller out of the line
        if time.monotonic() - now < SPIN_PAUSE:
            # The store said the key was free for us, yet the grant was refused (Consul's
            # lock delay, a grant racing ours): do not spin on it.
            time.sleep(pause)
            pause = min(pause * 2, beat)
        else:
            pause = SPIN_PAUSE


def holder_of(backend: Backend, key: str) -> Optional[str]:
    """The task id of a current holder of ``key``, if the store still has one."""
    for info in backend.holders_of(key):
        if info.task_id:
            return info.task_id
    return None


def _held_by(backend: Backend, key: str, task_id: str, lease: HeldLease) -> bool:
    """Whether another lease on ``key`` than ``lease`` belongs to ``task_id``."""
    return any(
        info.task_id == task_id and info.owner != lease.grant.owner
        for info in backend.holders_of(key)
    )


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
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    claimant: Optional[str],
) -> Optional[HeldLease]:
    """Try once to take ``key``; ``claimant`` is what the key's line knows the caller
    by: its task id, or a direct call's own id."""
    return acquire(
        backend, key, settings.lease_ttl, settings.limit, name, task_id, claimant=claimant
    )


def _run(
    settings: Settings,
    backend: Backend,
    key: str,
    task_id: Optional[str],
    lease: HeldLease,
) -> Run:
    """Run under ``lease``, with a pending rerun's arguments if there is one (if taking
    them fails, the lease goes back)."""
    if settings.on_duplicate == "rerun" and task_id:
        with lease.released_on_error():
            return Run(lease, marks.take_rerun(backend, key, task_id))
    return Run(lease)


def _unless_ended(
    backend: Backend,
    run: Run,
    task_id: Optional[str],
    retries: int,
    resumed: bool,
    redelivery: bool,
) -> Union[Run, Ended]:
    """With ``redelivery``: a grant taken by a copy of a call whose attempt already
    ended goes back, and the copy is :class:`Ended`. Otherwise ``run`` goes on,
    carrying the call's finished mark as read with the grant (read now if it was won
    after waiting): what the end of its attempt swaps the mark from."""
    if not (redelivery and task_id):
        return run
    lease, finished = run.lease, run.finished
    if not run.finished_read:
        with lease.released_on_error():
            finished = marks.finished_mark(backend, lease.key, task_id)
    if marks.ended(finished, retries, resumed):
        lease.release()
        return Ended(lease.key)
    return replace(run, finished_read=True, finished=finished)


def _pending_ttl(settings: Settings) -> float:
    """How long a pending rerun's mark lasts unrefreshed: one wait, one requeue delay,
    and a lease ttl of slack. Whether its task is still alive is decided sooner, by
    the mark's own ``until`` and the key's line (``marks.join_rerun``)."""
    return settings.wait_timeout + settings.requeue_max_delay + settings.lease_ttl


def _detected(
    name: str, key: str, task_id: Optional[str], policy: str, holder: Optional[str]
) -> None:
    signals.duplicate_detected.send(
        sender=name, key=key, task_id=task_id, policy=policy, holder_task_id=holder
    )
