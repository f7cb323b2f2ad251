"""What a call gets when its key is held: the decision, not its execution.

:func:`claim` takes the key or returns what the duplicate gets, one of the outcomes of
:mod:`.outcomes`: a :class:`Granted` key to run under, :class:`~.outcomes.Skipped`,
:class:`~.outcomes.Coalesced` into the pending rerun, a ``"held"``
:class:`~.outcomes.Requeue`, :class:`~.outcomes.SetAside` (a second copy of a call that
is running now) or :class:`~.outcomes.Dropped` (a copy of a call that ran to the end).
What a duplicate gets under ``on_duplicate`` is a small function of
:data:`STRATEGIES`, found by name: a new strategy is one function and one row. Nothing
here knows Celery or RQ; what the host can do with the answer is the engine's to decide.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

from .. import runtime, signals, telemetry
from ..backends import Backend, Lease, MarkRead
from ..errors import BackendUnavailable, ConfigurationError
from . import feed, holders, marks
from .config import Settings
from .lease import HeldLease, acquire
from .outcomes import Coalesced, Dropped, Requeue, SetAside, Skipped

#: Seconds a waiter sleeps when the store woke it at once but refused the grant; it
#: doubles while that goes on.
SPIN_PAUSE = 0.01


@dataclass(frozen=True)
class Granted:
    """The key was taken: the body runs under ``lease``."""

    lease: HeldLease
    #: A pending rerun's arguments (JSON) to run with instead of the call's own.
    arguments: Optional[str] = None
    #: With ``redelivery``, whether the call's finished mark (see
    #: :func:`marks.finished_attempt`) was read with the grant (in its round trip where
    #: the store could, else right after it), and its value then (None: absent).
    finished_read: bool = False
    finished: Optional[str] = None


#: What :func:`claim` answers.
Claimed = Union[Granted, Skipped, Coalesced, Requeue, SetAside, Dropped]


@dataclass(frozen=True)
class Duplicate:
    """A call that found its key held, as a strategy sees it."""

    settings: Settings
    backend: Backend
    key: str
    name: str
    task_id: Optional[str]
    requeues: int
    #: The call's arguments (JSON), which a ``rerun`` duplicate hands to the pending rerun.
    arguments: Optional[str]
    #: The task id of a holder (or of the first in line), and the holder in words when
    #: it is no task (a lock, a foreign client).
    holder: Optional[str]
    described: Optional[str]
    #: What the host calls a call, in words: ``task`` or ``job``.
    noun: str
    redelivery: bool
    retries: int
    resumed: bool
    #: The pending rerun that handed this call the run it owed (it died or gave up):
    #: never joined, whatever the rerun mark still says of it.
    owed_by: Optional[str] = None
    #: Called with a pending rerun's arguments before this call takes them (see
    #: :func:`_run`).
    keep_taken: Optional[Callable[[str], None]] = None

    def requeued(self) -> Requeue:
        """Go back to the queue for a while; the engine decides whether it can."""
        return Requeue(
            self.key,
            requeue_delay(self.settings, self.requeues),
            f"held by {holders.named(self.holder, self.described, self.noun)}",
            "held",
            self.requeues + 1,
            self.holder,
            holder=self.described,
        )

    def granted(self, lease: HeldLease) -> Union[Granted, Dropped]:
        """The key came free for it after all: it runs (or, a copy of an attempt that
        ended, is dropped)."""
        run = _run(self.settings, self.backend, self.key, self.task_id, lease, self.keep_taken)
        return _unless_ended(
            self.backend, run, self.task_id, self.retries, self.resumed, self.redelivery
        )


#: A duplicate strategy: what a call that found its key held gets.
Strategy = Callable[[Duplicate], Claimed]


def skip(duplicate: Duplicate) -> Claimed:
    """End at once without running, naming the holder."""
    return Skipped(duplicate.key, duplicate.holder, duplicate.described)


def requeue(duplicate: Duplicate) -> Claimed:
    """Go back to the queue and try again after a backoff."""
    return duplicate.requeued()


def wait(duplicate: Duplicate) -> Claimed:
    """Stand in the key's line up to ``wait_timeout``, then go back to the queue (never
    dropped): the requeued message joins the back of the line when it comes back."""
    d = duplicate
    lease = wait_for(d.settings, d.backend, d.key, d.name, d.task_id)
    return d.requeued() if lease is None else d.granted(lease)


def rerun(duplicate: Duplicate) -> Claimed:
    """Join the key's pending rerun, which runs once after the holder with the latest
    arguments; the first duplicate becomes the pending rerun and waits like ``wait``."""
    d = duplicate
    if not d.task_id:
        return wait(d)  # a direct call cannot be run again for others: it waits
    settings = d.settings
    pending = marks.join_rerun(
        d.backend,
        d.key,
        d.task_id,
        d.arguments or "",
        _pending_ttl(settings),
        latest=settings.rerun_args == "latest",
        alive_for=settings.lease_ttl,
        gone=d.owed_by,
    )
    if pending != d.task_id:
        return Coalesced(d.key, pending)
    # This call is the pending rerun: it waits for the key like "wait" does, and stays
    # pending while it stands in the key's line.
    lease = wait_for(settings, d.backend, d.key, d.name, d.task_id)
    if lease is not None:
        return d.granted(lease)
    requeued = d.requeued()
    # Out of the line while its message is away: it stays pending for as long as
    # coming back takes, and a duplicate takes its place if it never does.
    away = requeued.countdown + settings.lease_ttl
    pending = marks.rerun_away(d.backend, d.key, d.task_id, away, _pending_ttl(settings))
    if pending not in (None, d.task_id):
        return Coalesced(d.key, pending)  # replaced while it waited: the newer one runs
    return requeued


def replace_running(duplicate: Duplicate) -> Claimed:
    """``replace``: stop the running holder and run instead.

    The holder's grant is freed, after a replaced mark naming it, its call and this
    call: its holder finds it gone at its next renewal, learns why, and stops as a lost
    lease stops it (its ``LeaseLost``, its grace, the kill after it), ending replaced;
    its call, should it come again, ends replaced too. This call takes the key (its
    fencing token higher, so the replaced run's late writes are refused) and runs once
    that run said it stopped, or once its lease's ttl and grace have passed, by when its
    own deadline has stopped it. A holder that is no task (a lock, a foreign client), or
    this call itself, is not replaced: the call comes back.
    """
    d = duplicate
    grants = [info for info in d.backend.holders_of(d.key) if info.task_id == d.holder]
    if not d.task_id or not d.holder or not grants or d.holder == d.task_id:
        return d.requeued()
    replaced, settings = grants[0], d.settings
    token = replaced.fencing_token or 0
    ttl = replaced.holder.get("ttl")
    ttl = ttl if isinstance(ttl, (int, float)) and ttl > 0 else settings.lease_ttl
    stops_within = max(ttl, settings.lease_ttl) + settings.terminate_grace
    first = marks.mark_replaced(d.backend, d.key, token, d.holder, d.task_id, stops_within)
    released = d.backend.release(Lease(d.key, replaced.owner, token, 0.0, 1))
    # The grant is freed (by this release, or another's before it): the bound on the
    # run's stop counts from now (marks.mark_replaced says why).
    marks.mark_replaced(d.backend, d.key, token, d.holder, d.task_id, stops_within, freed=True)
    if released is False and first:
        marks.note_stopped(d.backend, d.key, token)  # it ended as it was replaced
    lease = _try(settings, d.backend, d.key, d.name, d.task_id, d.task_id)
    if lease is None:
        return d.requeued()  # another call took the key first: it meets that one next
    if not after_the_replaced_run(d.backend, lease):
        return d.requeued()  # replaced in turn as it waited: it learns so as it comes back
    return d.granted(lease)


def after_the_replaced_run(backend: Backend, lease: HeldLease) -> bool:
    """Holding ``lease`` under ``replace``: wait until every run a newer call replaced on
    its key has stopped, if one may still run (whoever holds the key now: the replacing
    call, or any call granted it since, as when the replacing call had to go back to
    the queue). False, the lease given back: it was lost meanwhile (a newer call
    replaced this one as it waited), or the store did not answer, and the call goes
    back to the queue rather than run beside a run that may go on."""
    try:
        # Bounded by this first look: only the holder's grant is ever replaced, so no
        # run to wait for comes meanwhile (a newer call replacing this one frees it).
        left = marks.replaced_runs_left(backend, lease.key, lease.fencing_token)
        until, running = runtime.monotonic() + max(left.values(), default=0.0), bool(left)
        while running and runtime.monotonic() < until and lease.held:
            runtime.sleep(REPLACE_POLL)
            runs = marks.replaced_runs(backend, lease.key, lease.fencing_token)
            running = any(run["token"] in left for run in runs)
    except BackendUnavailable:
        lease.release()
        return False
    if not lease.held:
        lease.release()
        return False
    return True


#: Seconds between two looks of a replacing call at whether the run it replaced stopped.
REPLACE_POLL = 0.05

#: The duplicate strategies by ``on_duplicate`` name (see ``config.OnDuplicate``).
STRATEGIES: dict[str, Strategy] = {
    "skip": skip,
    "requeue": requeue,
    "wait": wait,
    "rerun": rerun,
    "replace": replace_running,
}


def find_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ConfigurationError naming the choices if none is."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigurationError(
            f"exclusive_on_duplicate={name!r} names no duplicate strategy; use one of "
            f"{', '.join(repr(n) for n in STRATEGIES)}."
        ) from None


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
    noun: str = "task",
    owed_by: Optional[str] = None,
    keep_taken: Optional[Callable[[str], None]] = None,
) -> Claimed:
    """Take ``key`` or decide what the duplicate gets under ``settings.on_duplicate``
    (:data:`STRATEGIES`), or under ``priority``: it waits in line ahead of the rest.

    ``arguments`` (JSON) is what a ``rerun`` duplicate hands to the pending rerun;
    ``owed_by``, the pending rerun that handed this call its run, which it never joins;
    ``keep_taken``, called with the pending rerun's arguments before the call takes them
    (a host whose message may come again keeps them for its task id first).
    With ``redelivery`` (a broker may deliver this call's message twice), a call whose
    own ``task_id`` holds the key is :class:`~.outcomes.SetAside`, and one whose attempt
    ``retries`` already ended is :class:`~.outcomes.Dropped` (see :func:`marks.ended`),
    whatever the policy.
    Raises :class:`BackendUnavailable` if the store does not answer; what happens then
    (``on_backend_error``) is the integration's call, since only it can requeue.
    """
    for last_try in (False, True):
        finished_read, finished = False, None
        if redelivery and task_id:
            # Whether this attempt already ran to the end, read as the key is tried.
            read = MarkRead(marks.finished_key(key, task_id), marks.DONE)
            lease = acquire(
                backend, key, settings.lease_ttl, settings.limit, name, task_id, None, task_id, read
            )
            finished, finished_read = read.value, lease is not None
        else:
            lease = _try(settings, backend, key, name, task_id, task_id)
        if lease is not None:
            if settings.on_duplicate == "replace" and not after_the_replaced_run(backend, lease):
                return _after_a_replaced_run(settings, key, requeues)
            return _granted(
                settings,
                backend,
                lease,
                task_id,
                requeues,
                retries,
                resumed,
                redelivery,
                finished_read,
                finished,
                keep_taken,
            )
        if redelivery and marks.ended(finished, retries, resumed):
            return Dropped(key)  # even where a later attempt (a retry) holds the key
        # Whom this call yields to: a task holding the key, else any holder (a lock, a
        # foreign client: named in words), else whoever is first in line for the key.
        infos = backend.holders_of(key)
        holding = [info.task_id for info in infos if info.task_id]
        described = None if holding else holders.first_described(infos)
        holder = next(iter(holding), None)
        if holder is None and described is None:
            holder = next(iter(marks.line_of(backend, key)), None)
        if holder is not None or described is not None or last_try:
            break
        # Refused, yet nobody holds the key or waits for it now: it came free between
        # the grant and the read. Tried once more, the call is not ended as a duplicate
        # of nobody (a call's own retry, sent as its run goes on, meets it as it ends).
    if redelivery and task_id and (task_id in holding or marks.waiting(backend, key, task_id)):
        # A copy of a call that runs now, or waits for the key now: it runs once.
        return SetAside(key, requeue_delay(settings, requeues), requeues + 1)
    if redelivery and task_id:
        # Its own first delivery may have held the key as it tried, and ended since
        # (it writes its finished mark before it releases): read as of the refused grant,
        # the mark may not have been there yet.
        finished = marks.finished_mark(backend, key, task_id)
        if marks.ended(finished, retries, resumed):
            return Dropped(key)
    if task_id and (requeues or retries or resumed) and task_id in holding:
        # Not a copy (its message comes once), yet sent again (requeued, retried) and its
        # own id holds the key: the grant of an earlier attempt of it whose answer never
        # reached it, or whose release went unanswered. It is no duplicate of itself: it
        # comes back once that grant lapses, whatever the policy. (A new message reusing
        # a running call's id is skipped.)
        settings = replace(settings, on_duplicate="requeue")
    elif holder is None and described is None:
        # The key kept coming free between a refused grant and the read: the call met
        # nobody to be a duplicate of, so it is not ended as one; it comes back.
        settings = replace(settings, on_duplicate="requeue")
    duplicate = Duplicate(
        settings,
        backend,
        key,
        name,
        task_id,
        requeues,
        arguments,
        holder,
        described,
        noun,
        redelivery,
        retries,
        resumed,
        owed_by,
        keep_taken,
    )
    if settings.priority and task_id:
        _detected(name, key, task_id, "priority", holder)
        requeued = duplicate.requeued()
        # If it has to be requeued, it keeps its turn while the message is away; the
        # turn lapses if the task never comes back.
        away = requeued.countdown + settings.lease_ttl
        lease = wait_for(settings, backend, key, name, task_id, priority=True, keep_place=away)
        if lease is not None:
            return _unless_ended(backend, Granted(lease), task_id, retries, resumed, redelivery)
        return requeued
    _detected(name, key, task_id, settings.on_duplicate, holder)
    return find_strategy(settings.on_duplicate)(duplicate)


def _after_a_replaced_run(settings: Settings, key: str, requeues: int) -> Requeue:
    """A call granted a key whose replaced run may go on, that could not wait for it."""
    reason = "waiting for a run a newer call replaced to stop"
    return Requeue(key, requeue_delay(settings, requeues), reason, "held", requeues + 1)


def _granted(
    settings: Settings,
    backend: Backend,
    lease: HeldLease,
    task_id: Optional[str],
    requeues: int,
    retries: int,
    resumed: bool,
    redelivery: bool,
    finished_read: bool,
    finished: Optional[str],
    keep_taken: Optional[Callable[[str], None]] = None,
) -> Claimed:
    """What a call that took ``lease`` gets: it runs, unless (with ``redelivery``) it is
    a copy of a call that runs now or whose attempt already ended."""
    copy = redelivery and task_id and settings.limit > 1
    if copy:
        with lease.released_on_error():
            if _held_by(backend, lease.key, task_id, lease):
                # A semaphore had a slot left for the copy: give it back.
                lease.release()
                return SetAside(lease.key, requeue_delay(settings, requeues), requeues + 1)
    run = _run(settings, backend, lease.key, task_id, lease, keep_taken)
    if finished_read and not copy:
        run = replace(run, finished_read=True, finished=finished)
    # A copy that found no other slot of its task id held may have found it just after
    # that delivery ended: its finished mark, written before its release, is read again
    # now (as of the grant it may not have been there yet).
    return _unless_ended(backend, run, task_id, retries, resumed, redelivery)


def wait_for(
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    priority: bool = False,
    keep_place: Optional[float] = None,
    holder: Optional[Mapping[str, Any]] = None,
) -> Optional[HeldLease]:
    """Stand in the key's line and wait up to ``wait_timeout`` for its turn.

    The store lets in only the first in line, so waiters are served first come,
    first served (priority callers first), and woken by the holder's release. Each
    wait is also bounded by a third of the lease ttl: the caller renews its place in
    line that often, and notices a holder that died without releasing (its lease
    simply expires). On timeout the caller steps out of the line and None is
    returned; with ``keep_place`` it keeps its place for that many seconds instead.
    ``holder`` is written beside the grant, as :func:`.lease.acquire` takes it (a lock's
    says it is one).
    """
    started = runtime.monotonic()
    with telemetry.waiting("task" if task_id else "call") as waiting:
        lease = _wait_in_line(settings, backend, key, name, task_id, priority, keep_place, holder)
        waiting.set("exclusive.granted", lease is not None)
    if signals.lease_waited.receivers:
        signals.lease_waited.send(
            sender=name,
            key=key,
            task_id=task_id,
            waited=runtime.monotonic() - started,
            granted=lease is not None,
        )
    return lease


def _wait_in_line(
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    priority: bool,
    keep_place: Optional[float],
    holder: Optional[Mapping[str, Any]],
) -> Optional[HeldLease]:
    claimant = task_id or uuid.uuid4().hex  # a direct call has no task id
    deadline = runtime.monotonic() + settings.wait_timeout
    grace, beat = settings.lease_ttl, settings.lease_ttl / 3
    marks.take_place(backend, key, claimant, grace, priority)
    renewed_at, pause = runtime.monotonic(), SPIN_PAUSE
    while True:
        now = runtime.monotonic()
        if now >= deadline:
            if keep_place is None:
                marks.leave_line(backend, key, claimant)
            else:
                marks.take_place(backend, key, claimant, keep_place, priority, away=True)
            return None
        if now - renewed_at >= beat:
            marks.take_place(backend, key, claimant, grace, priority)
            renewed_at = now
        backend.wait(key, min(deadline, renewed_at + beat) - now, claimant)
        lease = _try(settings, backend, key, name, task_id, claimant, holder)
        if lease is not None:
            return lease  # the grant took this caller out of the line
        if runtime.monotonic() - now < SPIN_PAUSE:
            # The store said the key was free for us, yet the grant was refused (Consul's
            # lock delay, a grant racing ours): do not spin on it.
            runtime.sleep(pause)
            pause = min(pause * 2, beat)
        else:
            pause = SPIN_PAUSE


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


def _try(
    settings: Settings,
    backend: Backend,
    key: str,
    name: str,
    task_id: Optional[str],
    claimant: Optional[str],
    holder: Optional[Mapping[str, Any]] = None,
) -> Optional[HeldLease]:
    """Try once to take ``key``; ``claimant`` is what the key's line knows the caller
    by: its task id, or a direct call's own id."""
    return acquire(
        backend,
        key,
        settings.lease_ttl,
        settings.limit,
        name,
        task_id,
        holder=holder,
        claimant=claimant,
    )


def _run(
    settings: Settings,
    backend: Backend,
    key: str,
    task_id: Optional[str],
    lease: HeldLease,
    keep_taken: Optional[Callable[[str], None]] = None,
) -> Granted:
    """Run under ``lease``, with a pending rerun's arguments if there is one (if taking
    them fails, the lease goes back); ``keep_taken`` is given them before they are taken."""
    if settings.on_duplicate == "rerun" and task_id:
        with lease.released_on_error():
            return Granted(lease, marks.take_rerun(backend, key, task_id, keep_taken))
    return Granted(lease)


def _unless_ended(
    backend: Backend,
    run: Granted,
    task_id: Optional[str],
    retries: int,
    resumed: bool,
    redelivery: bool,
) -> Union[Granted, Dropped]:
    """With ``redelivery``: a grant taken by a copy of a call whose attempt already
    ended goes back, and the copy is :class:`Ended`. Otherwise ``run`` goes on,
    carrying the call's finished mark as read with the grant (read now if it was won
    after waiting): what the end of its attempt swaps the mark from."""
    if not (redelivery and task_id):
        return run
    lease, finished = run.lease, run.finished
    if not run.finished_read:
        try:
            with lease.released_on_error():
                finished = marks.finished_mark(backend, lease.key, task_id)
        except BackendUnavailable as exc:
            if run.arguments is None or isinstance(exc, marks.LostTake):
                raise
            # The pending rerun's arguments were taken: the call carries them on.
            raise marks.LostTake(exc, run.arguments) from None
    if marks.ended(finished, retries, resumed):
        lease.release()
        return Dropped(lease.key)
    return replace(run, finished_read=True, finished=finished)


def _pending_ttl(settings: Settings) -> float:
    """How long a pending rerun's mark lasts unrefreshed: as long as the run it holds
    may still be owed (:data:`marks.RERUN_TTL`). Whether its task is still alive is
    decided sooner, by the mark's own ``until`` and the key's line
    (``marks.join_rerun``): a task that comes back later than that, from behind a
    backlog, finds the mark and takes its run with the newest arguments; a duplicate
    that finds it not alive takes its place, and those arguments with it."""
    return max(marks.RERUN_TTL, settings.wait_timeout + settings.requeue_max_delay)


def _detected(
    name: str, key: str, task_id: Optional[str], policy: str, holder: Optional[str]
) -> None:
    signals.duplicate_detected.send(
        sender=name, key=key, task_id=task_id, policy=policy, holder_task_id=holder
    )
