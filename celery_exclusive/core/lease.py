"""Leases as their holders see them.

Integrations never talk to a store: they call :func:`acquire`, get a
:class:`HeldLease` (or None), and release it. While held, the process's heartbeat
(:mod:`celery_exclusive.core.heartbeat`) renews it. A call that runs without a lease
because the store was down and ``on_backend_error="run"`` sees an
:class:`UnlockedLease` instead, so code written against ``self.lease`` keeps working.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

from .. import runtime, signals, telemetry
from ..backends import NO_END, Backend, End, Lease, MarkRead, MarkSwap
from ..backends.base import require
from ..errors import LOSS_ADVICE, BackendUnavailable, ExclusiveError, LeaseLost
from . import holders, losses
from .deadline import keeper, safety_margin
from .heartbeat import heartbeat

__all__ = ["HeldLease", "UnlockedLease", "acquire", "heartbeat"]

logger = logging.getLogger("celery_exclusive")

HOSTNAME = socket.gethostname()

#: Called with the lease, in the thread that found the loss, once it is known.
LossListener = Callable[["HeldLease"], None]

#: Seconds a thread that finds a loss already being announced by another waits for
#: that announcement (its log line, ``lease_lost``, the listeners) to be done: what the
#: holder does next (raise LeaseLost, end its call) comes after the loss was signalled.
ANNOUNCE_WAIT = 5.0


class HeldLease:
    """A lease its holder is running under: ``self.lease`` inside a task.

    ``fencing_token`` strictly increases with every grant of ``key``: hand it to the
    storage the task writes so that storage can refuse a stale holder.
    """

    def __init__(self, backend: Backend, grant: Lease, name: str, task_id: Optional[str]):
        self.backend = backend
        self.grant = grant
        self.name = name
        self.task_id = task_id
        self.acquired_at = runtime.monotonic()
        #: When the grant's answer came (monotonic): the store granted it before then.
        self.answered_at = self.acquired_at
        #: When the last renewal the store accepted was sent (monotonic): the store
        #: keeps the lease at least ``ttl`` past this. Callers set ``acquired_at`` and
        #: this to when the grant was sent.
        self.renewed_at = self.acquired_at
        #: Subtracted from ``ttl`` for the deadline (see :mod:`.deadline`).
        self.margin = safety_margin(grant.ttl)
        self.lost_reason: Optional[str] = None
        #: Why it was lost: a key of errors.LOSS_ADVICE (None while held).
        self.lost_cause: Optional[str] = None
        self.released = False
        #: When its holder ended the body and began giving the lease back (monotonic);
        #: None while the body runs. A loss after this is no loss of the body's.
        self.ended_at: Optional[float] = None
        #: Whether the release made its end's write (the body's result, stored with it).
        self.written = False
        #: Seconds the store keeps it after its run (:meth:`keep_for`), once it said so.
        self.kept_for: Optional[float] = None
        self._listeners: list[LossListener] = []
        self._loss_lock = runtime.Lock()
        #: Set once the loss has been logged, signalled and told to the listeners; the
        #: thread doing that is ``_announcer``. Made with the loss (under the lock, before
        #: ``lost_reason``): a lease that is never lost, nearly all, makes none.
        self._announced: Any = None
        self._announcer: Optional[int] = None
        #: The trace of the call this lease was granted to (:mod:`celery_exclusive.telemetry`).
        self.trace = telemetry.NO_TRACE

    @property
    def key(self) -> str:
        return self.grant.key

    @property
    def fencing_token(self) -> int:
        return self.grant.fencing_token

    @property
    def ttl(self) -> float:
        return self.grant.ttl

    @property
    def held(self) -> bool:
        """True while the lease is neither lost nor released."""
        return not self.released and not self.lost

    @property
    def deadline(self) -> float:
        """When the lease is lost unless a renewal sent before then is confirmed
        (monotonic): the send time of the last confirmed grant or renewal + ttl − the
        safety margin. The store keeps the key at least until then."""
        return self.renewed_at + self.ttl - self.margin

    @property
    def lost(self) -> bool:
        """True once the lease is gone while its body ran. It never becomes False again.

        A plain read. The store's answers (at a renewal, at the release) and the
        deadline keeper flag most losses; a lease whose deadline passed before its body
        ended is lost too, whether or not anyone has flagged it yet: a process stopped
        past its deadline (SIGSTOP, a VM pause) may resume before the keeper does.
        """
        if self.lost_reason is not None:
            return True
        ended_at = self.ended_at
        return (runtime.monotonic() if ended_at is None else ended_at) >= self.deadline

    def expire(self) -> None:
        """Flag the lease lost if its deadline passed before its body ended (what the
        deadline keeper calls). Asks the store nothing: the store may not be answering.

        A loss flagged already by another thread is waited for until it has been
        announced, so that whatever the caller does about it next (raise LeaseLost, end
        the call) comes after ``lease_lost`` was sent."""
        if self.lost_reason is not None:
            self._await_announcement()
        elif self.lost:
            self.mark_lost(self._expiry_reason(), "expired")

    def _expiry_reason(self) -> str:
        return (
            f"it was not renewed within its deadline ({self.ttl:.1f}s ttl less a "
            f"{self.margin:.2f}s margin since the last confirmed renewal was sent): the "
            "store did not answer in time, or the process was paused"
        )

    def ensure_held(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is still held; call it before each
        write. A released lease (its retry was sent, its call ended) is not held either."""
        if self.released and self.lost_reason is None:
            raise LeaseLost(
                f"{holders.holding(self.name, self.task_id)} no longer holds its lease on "
                f"{self.key!r}: it "
                "was released (a retry of this call was sent). Stop here: the work is no "
                "longer exclusive.",
                self.key,
                self.name,
            )
        if self.lost:
            self.expire()  # a deadline nobody flagged yet: say so before raising
            raise self.loss_error()

    def loss_error(self) -> LeaseLost:
        """The :class:`LeaseLost` a holder of this lost lease raises. Takes no lock and
        sends nothing (a signal handler may call it): a deadline nobody has flagged yet
        is named as such."""
        reason, cause = self.lost_reason, self.lost_cause
        if reason is None:
            reason, cause = self._expiry_reason(), "expired"
        return LeaseLost(
            f"{holders.holding(self.name, self.task_id)} lost its lease on {self.key!r} "
            f"({reason}); another worker may now hold it. Stop here: the work "
            f"is no longer exclusive. {LOSS_ADVICE[cause or 'unknown']}",
            self.key,
            self.name,
            cause,
        )

    def release(self, end: End = NO_END, unsure: bool = False) -> Optional[bool]:
        """Give the lease back, ending its attempt as ``end`` says (:class:`End`: the
        finished mark swapped first, the result written only if the lease was still
        held, in one step where the store can). Safe to call twice.

        Returns True if the store freed it, False if it no longer had it or did not
        answer, None if the end's mark held something else (nothing changed: the lease
        is still held, and renewed). :attr:`written` says whether the end's write was
        made; it is not, and the lease goes back as it would without it, when the body
        ended past its deadline (what it returned is not to be trusted) or the store
        refuses the write.

        A store that does not answer is logged, not raised: the lease expires by itself
        after its ttl, and failing the finished call for that would be worse. With a
        mark it is raised, for the caller to say the mark may be missing, once the lease
        was given back the plain way. ``unsure``: an earlier release whose answer was
        lost may have freed it already, so a lease the store no longer has is not taken
        for a loss.
        """
        if self.released:
            return False
        self._stop_renewing()
        try:
            if end.write is not None and self.lost:
                end = dataclasses.replace(end, write=None)
            try:
                freed = self.backend.release(self.grant, end)
            except BackendUnavailable as exc:
                if end == NO_END:
                    self._release_failed(exc)
                    return False
                # The step may have run, its answer lost. The end's mark goes first, on
                # its own (a copy taking the key after the release must find it), then
                # the lease the plain way: finding nothing to free then is no loss.
                marked = end.mark is not None and self._mark_on_its_own(end.mark)
                freed = self._send_plain_release(unsure=True)
                if marked:
                    return freed
                if end.mark is not None:
                    raise
                self._release_failed(exc, "the write left to its owner")
                return False
            except ExclusiveError as exc:
                if end.write is None:
                    self._release_failed(exc)
                    return False
                # Refused, not unanswered (a store that cannot make the write after
                # all): nothing ran. The lease goes back as it would without a write.
                self._keep_renewing()
                return self.release(dataclasses.replace(end, write=None), unsure)
            if freed is None:
                self._keep_renewing()
                return None
            self.written = bool(freed) and end.write is not None
            self._given_back(freed, unsure)
            return freed
        finally:
            if self.released:
                keeper().forget(self)

    def keep_for(self, seconds: float) -> bool:
        """End the lease's renewals but not the lease: the key stays held for ``seconds``
        from now, then lapses (``exclusive_unique_for``: a window after the run). One
        renewal with that ttl, never a release; a store whose renewals cannot take
        another ttl has no ``windows`` capability. Returns whether the store still had
        the lease and keeps it so; a store that does not answer leaves it to lapse at
        its own ttl, which a WARNING says."""
        if self.released:
            return False
        self._stop_renewing()
        try:
            # After any renewal in flight has ended: applied later, it would set the ttl
            # back. Its answer may come after the deadline (a slow store): up to a ttl.
            heartbeat().settle(self, self.ttl)
            kept = dataclasses.replace(self.grant, ttl=seconds)
            try:
                lost = self.backend.renew([kept])
            except ExclusiveError as exc:
                logger.warning(
                    "lease of key=%s task_id=%s could not be kept for its window of %gs "
                    "(%s): the key frees when its lease lapses, within %.1fs",
                    self.key,
                    self.task_id,
                    seconds,
                    exc,
                    self.ttl,
                )
                return False
            if lost:
                self.mark_lost(
                    "the store no longer had it when its holder kept it past its run: it "
                    "expired or was taken while the body ran"
                )
            else:
                self.kept_for = seconds
            self.trace.kept(self._held_for(), seconds, not lost)
            return not lost
        finally:
            keeper().forget(self)

    def _mark_on_its_own(self, mark: MarkSwap) -> bool:
        """Swap an end's mark apart from the release; True if it holds ``new`` now."""
        backend = self.backend
        try:
            swapped = backend.swap_mark(mark.key, mark.kind, mark.expected, mark.new, mark.ttl)
            return swapped or backend.read_mark(mark.key, mark.kind) == mark.new
        except ExclusiveError:
            return False

    def _send_plain_release(self, unsure: bool) -> bool:
        """Ask the store to free the lease, which no longer renews it, ending nothing."""
        try:
            freed = self.backend.release(self.grant)
        except ExclusiveError as exc:
            self._release_failed(exc)
            return False
        self._given_back(freed, unsure)
        return freed

    def _release_failed(self, exc: ExclusiveError, then: str = "") -> None:
        self.trace.released(self._held_for(), freed=False, late=False, answered=False)
        logger.warning(
            "lease release failed key=%s task_id=%s: %s; it expires by itself within %.1fs%s",
            self.key,
            self.task_id,
            exc,
            self.ttl,
            f"; {then}" if then else "",
        )

    @contextlib.contextmanager
    def released_on_error(self) -> Iterator[None]:
        """Release the lease if the ``with`` block raises. What fails between a grant
        and the body leaves nobody to run under the lease, and the heartbeat would
        renew it for as long as the process lives."""
        try:
            yield
        except BaseException:
            self.release()
            raise

    def _stop_renewing(self) -> None:
        """Before a release is sent: the body has ended, and no renewal may race the
        release and find the lease gone. The deadline keeper keeps watching until the
        store answers; a deadline that passes now is no loss of the body's."""
        self.ended_at = runtime.monotonic()
        self.expire()  # a deadline passed before the body ended: that is a loss
        self.released = True
        heartbeat().discard(self)

    def _keep_renewing(self) -> None:
        """The release was not done after all: the lease is held, and renewed again."""
        self.released = False
        self.ended_at = None
        heartbeat().add(self)

    def _given_back(self, freed: bool, unsure: bool = False) -> None:
        """The store answered a release: say so, and flag a lease it no longer had."""
        late = False
        if not freed and unsure:
            logger.warning(
                "lease release found nothing to free key=%s task_id=%s: the release "
                "before it, whose answer was lost, freed it, or it was lost meanwhile",
                self.key,
                self.task_id,
            )
        elif not freed and self.lost_reason is None and runtime.monotonic() >= self.deadline:
            # The body ended before the deadline, the release reached the store after it:
            # the store let the lease expire meanwhile, and nobody held the key while the
            # body ran. Late, not lost.
            late = True
            logger.warning(
                "lease release arrived after the lease expired key=%s task_id=%s: its body "
                "ended %.2fs before its deadline, so it ran under the lease; the store is "
                "slow to answer",
                self.key,
                self.task_id,
                self.deadline - (self.ended_at or self.deadline),
            )
        elif not freed:
            # Gone before its holder gave it back: expired, taken by an operator, or lost
            # with a store that forgot it (a failover). The body may have run beside the
            # next holder, so that is a loss, said as loudly as one found by the heartbeat.
            self.mark_lost(
                "the store no longer had it when its holder released it: it expired or "
                "was taken while the body ran"
            )
        held_for = self._held_for()
        self.trace.released(held_for, freed, late)
        if signals.lease_released.receivers:
            signals.lease_released.send(
                sender=self.name, key=self.key, task_id=self.task_id, held_for=held_for
            )

    def _held_for(self) -> float:
        return runtime.monotonic() - self.acquired_at

    def on_loss(self, listener: LossListener) -> None:
        """Call ``listener(lease)`` once the lease is found lost (at once if it already is).

        It runs in the thread that found the loss: usually the heartbeat's, so it must
        not block. :mod:`celery_exclusive.core.terminate` stops the holder this way.
        """
        with self._loss_lock:
            already = self.lost_reason is not None
            if not already:
                self._listeners.append(listener)
        if already:
            listener(self)

    def remove_loss_listener(self, listener: LossListener) -> None:
        with self._loss_lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def mark_lost(self, reason: str, cause: Optional[str] = None) -> None:
        """Flag the lease lost: log it at ERROR, send ``lease_lost``, tell the listeners.

        ``cause`` (a key of :data:`~celery_exclusive.errors.LOSS_ADVICE`) is read back
        from the store when the caller cannot tell (:func:`.losses.cause_of`). The first
        thread to flag the loss announces it; another that finds it flagged returns once
        that announcement is done (see :data:`ANNOUNCE_WAIT`), never before.
        """
        if self.lost_reason is not None:
            self._await_announcement()
            return
        cause = cause or losses.cause_of(self)
        with self._loss_lock:
            flagged_elsewhere = self.lost_reason is not None
            if not flagged_elsewhere:
                self._announced = runtime.Event()
                self.lost_reason, self.lost_cause = reason, cause
                self._announcer = runtime.get_ident()
                listeners, self._listeners = self._listeners, []
        if flagged_elsewhere:
            self._await_announcement()
            return
        try:
            logger.error(
                "lease lost key=%s task=%s task_id=%s fencing_token=%s cause=%s: %s",
                self.key,
                self.name,
                self.task_id,
                self.fencing_token,
                cause,
                reason,
            )
            self.trace.lost(cause, reason)
            signals.lease_lost.send(
                sender=self.name, key=self.key, task_id=self.task_id, reason=reason, cause=cause
            )
            for listener in listeners:
                try:
                    listener(self)
                except Exception:  # one listener's bug must not keep the others from acting
                    logger.exception("lease-lost listener failed key=%s", self.key)
        finally:
            self._announced.set()

    def _await_announcement(self) -> None:
        """Wait until the thread announcing the loss is done (not in that thread itself:
        a listener may look at the lease)."""
        if self._announcer != runtime.get_ident():
            self._announced.wait(ANNOUNCE_WAIT)

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self.released else "held"
        return f"<HeldLease {self.key!r} token={self.fencing_token} {state}>"


class UnlockedLease:
    """``self.lease`` of a call running *without* a lease: the store did not answer and
    ``exclusive_on_backend_error="run"`` chose to run anyway (with a WARNING).

    It says so: ``held`` is False and ``fencing_token`` None (storage that checks
    fences should treat None as "unfenced"). ``lost`` is False, since nothing was held
    to lose, and ``ensure_held()`` does nothing: failing open was the setting's
    choice, so code that calls it before each write keeps running. Check ``held``
    where a write must never happen unlocked.
    """

    held = False
    lost = False
    released = True
    fencing_token: Optional[int] = None
    lost_reason: Optional[str] = None

    def __init__(self, key: str, name: str, task_id: Optional[str], reason: str):
        self.key = key
        self.name = name
        self.task_id = task_id
        #: Why it runs unlocked (the store's error).
        self.reason = reason

    def ensure_held(self) -> None:
        """Nothing to check: the call runs unlocked by the ``run`` setting's choice."""

    def release(self, end: End = NO_END, unsure: bool = False) -> bool:
        """Nothing to give back: nothing was taken."""
        return False

    def __repr__(self) -> str:
        return f"<UnlockedLease {self.key!r}>"


def acquire(
    backend: Backend,
    key: str,
    ttl: float,
    limit: int = 1,
    name: str = "",
    task_id: Optional[str] = None,
    holder: Optional[Mapping[str, Any]] = None,
    claimant: Optional[str] = None,
    read: Optional[MarkRead] = None,
) -> Optional[HeldLease]:
    """Try once to take ``key``; on success the lease is renewed until released.

    ``claimant`` is what the key's line of waiters knows the caller by (see
    :mod:`celery_exclusive.core.marks`): the line admits only its first. ``read`` (a
    :class:`MarkRead`) is read right after the attempt, granted or not, in the same
    round trip where the store can; if reading it fails, a grant goes back. Raises
    :class:`BackendUnavailable` when the store does not answer.
    """
    if limit > 1:
        require(backend, "limits", key)
    record = _record(name, task_id, ttl, limit, holder)
    sent_at = runtime.monotonic()
    grant = backend.try_acquire(key, new_owner(), ttl, limit, record, claimant, read)
    if read is not None and not read.done:
        try:
            read.value, read.done = backend.read_mark(read.key, read.kind), True
        except ExclusiveError:
            if grant is not None:
                with contextlib.suppress(ExclusiveError):  # else it expires by itself
                    backend.release(grant)
            raise
    return None if grant is None else _hold(backend, grant, name, task_id, sent_at)


def _record(
    name: str,
    task_id: Optional[str],
    ttl: float,
    limit: int,
    holder: Optional[Mapping[str, Any]],
) -> dict[str, Any]:
    """What the store keeps beside a grant, for ``holders()`` (with the ttl, the time
    since the last renewal: ``LeaseInfo.renewed_ago``; with the limit, a semaphore's
    slots)."""
    return {
        "task": name,
        "task_id": task_id,
        "hostname": HOSTNAME,
        "pid": runtime.getpid(),
        "acquired_at": runtime.wall(),
        "ttl": ttl,
        "limit": limit,
        **(holder or {}),
    }


def _hold(
    backend: Backend, grant: Lease, name: str, task_id: Optional[str], sent_at: float
) -> HeldLease:
    """A grant, as its holder runs under it: renewed by the heartbeat and kept to its
    deadline from now on. ``sent_at``: when the grant was asked for, where its ttl
    starts at the earliest."""
    lease = HeldLease(backend, grant, name, task_id)
    lease.acquired_at = lease.renewed_at = sent_at
    lease.trace = telemetry.current()  # the call taking it here, if traced
    lease.trace.granted(grant.fencing_token)
    keeper().watch(lease)
    heartbeat().add(lease)
    if signals.lease_acquired.receivers:
        signals.lease_acquired.send(
            sender=name, key=grant.key, task_id=task_id, fencing_token=grant.fencing_token
        )
    return lease


def new_owner() -> str:
    """A grant's owner token: 128 random bits, as hex (what ``uuid4().hex`` gives, at a
    quarter of its cost)."""
    return os.urandom(16).hex()
