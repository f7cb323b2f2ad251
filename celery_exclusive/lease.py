"""Leases as their holders see them.

Integrations never talk to a store: they call :func:`acquire`, get a
:class:`HeldLease` (or None), and release it. While held, the process's heartbeat
(:mod:`celery_exclusive.heartbeat`) renews it. A call that runs without a lease
because the store was down and ``on_backend_error="run"`` sees an
:class:`UnlockedLease` instead, so code written against ``self.lease`` keeps working.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

from . import signals
from .backends import Backend, Lease
from .errors import ExclusiveError, LeaseLost
from .heartbeat import heartbeat

__all__ = ["HeldLease", "UnlockedLease", "acquire", "acquire_and_read_mark", "heartbeat"]

logger = logging.getLogger("celery_exclusive")

HOSTNAME = socket.gethostname()

#: Called with the lease, in the thread that found the loss, once it is known.
LossListener = Callable[["HeldLease"], None]


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
        self.acquired_at = time.monotonic()
        #: When the last renewal the store accepted was sent (monotonic): the store
        #: keeps the lease at least ``ttl`` past this.
        self.renewed_at = self.acquired_at
        self.lost_reason: Optional[str] = None
        self.released = False
        self._listeners: list[LossListener] = []
        self._loss_lock = threading.Lock()

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
    def lost(self) -> bool:
        """True once the lease is gone. It never becomes False again.

        The heartbeat finds most losses. A lease not renewed for a whole ttl is lost
        too, whether or not the heartbeat has looked yet: after the process was
        stopped (SIGSTOP, a VM pause) its body may resume before the heartbeat does.
        """
        if (
            self.lost_reason is None
            and not self.released
            and time.monotonic() - self.renewed_at >= self.ttl
        ):
            self.mark_lost(
                f"it was not renewed for {self.ttl:.1f}s (the process was paused, or the "
                "heartbeat could not run)"
            )
        return self.lost_reason is not None

    def ensure_held(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is still held; call it before each
        write. A released lease (its retry was sent, its call ended) is not held either."""
        if self.released and self.lost_reason is None:
            raise LeaseLost(
                f"{self.name}[{self.task_id}] no longer holds its lease on {self.key!r}: it "
                "was released (a retry of this call was sent). Stop here: the work is no "
                "longer exclusive.",
                self.key,
                self.name,
            )
        if self.lost:
            raise LeaseLost(
                f"{self.name}[{self.task_id}] lost its lease on {self.key!r} "
                f"({self.lost_reason}); another worker may now hold it. Stop here: the work "
                "is no longer exclusive. Raise lease_ttl if renewals cannot keep up.",
                self.key,
                self.name,
            )

    def release(self, unsure: bool = False) -> bool:
        """Give the lease back. Safe to call twice; a store error is logged, not raised.

        A lease that cannot be released because the store is down simply expires
        after its ttl; failing the finished task for that would be worse. ``unsure``:
        an earlier release whose answer was lost may have freed it already, so a lease
        the store no longer has is not taken for a loss.
        """
        if self.released:
            return False
        self._stop_renewing()
        return self._send_release(unsure)

    def _send_release(self, unsure: bool) -> bool:
        """Ask the store to free the lease, which no longer renews it."""
        try:
            freed = self.backend.release(self.grant)
        except ExclusiveError as exc:
            logger.warning(
                "lease release failed key=%s task_id=%s: %s; it expires by itself within %.1fs",
                self.key,
                self.task_id,
                exc,
                self.ttl,
            )
            return False
        self._given_back(freed, unsure)
        return freed

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

    def release_after_mark(
        self, mark: tuple[str, str], expected: Optional[str], new: str, ttl: float
    ) -> Optional[bool]:
        """Set a mark, then give the lease back, in one step where the store can (see
        :meth:`Backend.swap_mark_and_release`): what a release returns, or None when the
        mark held something else than ``expected`` and the lease is still held.

        A store error is raised, for the caller to say the mark may be missing, once
        the lease was given back the plain way (whose "not held" may then be the
        failed step's own doing, so it is not taken for a loss).
        """
        if self.released:
            return False
        self._stop_renewing()
        try:
            freed = self.backend.swap_mark_and_release(self.grant, mark, expected, new, ttl)
        except ExclusiveError:
            self._send_release(unsure=True)
            raise
        if freed is None:
            self._keep_renewing()
            return None
        self._given_back(freed)
        return freed

    def _stop_renewing(self) -> None:
        """Before a release is sent: no renewal may race it and find the lease gone."""
        self.lost  # noqa: B018 - flags a lease that went a whole ttl without renewal
        self.released = True
        heartbeat().discard(self)

    def _keep_renewing(self) -> None:
        """The release was not done after all: the lease is held, and renewed again."""
        self.released = False
        heartbeat().add(self)

    def _given_back(self, freed: bool, unsure: bool = False) -> None:
        """The store answered a release: say so, and flag a lease it no longer had."""
        if not freed and unsure:
            logger.warning(
                "lease release found nothing to free key=%s task_id=%s: the release "
                "before it, whose answer was lost, freed it, or it was lost meanwhile",
                self.key,
                self.task_id,
            )
        elif not freed:
            # Gone before its holder gave it back: expired, taken by an operator, or lost
            # with a store that forgot it (a failover). The body may have run beside the
            # next holder, so that is a loss, said as loudly as one found by the heartbeat.
            self.mark_lost(
                "the store no longer had it when its holder released it: it expired or "
                "was taken while the body ran"
            )
        if signals.lease_released.receivers:
            signals.lease_released.send(
                sender=self.name,
                key=self.key,
                task_id=self.task_id,
                held_for=time.monotonic() - self.acquired_at,
            )

    def on_loss(self, listener: LossListener) -> None:
        """Call ``listener(lease)`` once the lease is found lost (at once if it already is).

        It runs in the thread that found the loss: usually the heartbeat's, so it must
        not block. :mod:`celery_exclusive.terminate` stops the holder this way.
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

    def mark_lost(self, reason: str) -> None:
        """Flag the lease lost: log it at ERROR, send ``lease_lost``, tell the listeners."""
        with self._loss_lock:
            if self.lost_reason is not None:
                return
            self.lost_reason = reason
            listeners, self._listeners = self._listeners, []
        logger.error(
            "lease lost key=%s task=%s task_id=%s fencing_token=%s: %s",
            self.key,
            self.name,
            self.task_id,
            self.fencing_token,
            reason,
        )
        signals.lease_lost.send(sender=self.name, key=self.key, task_id=self.task_id, reason=reason)
        for listener in listeners:
            try:
                listener(self)
            except Exception:  # one listener's bug must not keep the others from acting
                logger.exception("lease-lost listener failed key=%s", self.key)

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

    def release(self) -> bool:
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
) -> Optional[HeldLease]:
    """Try once to take ``key``; on success the lease is renewed until released.

    ``claimant`` is what the key's line of waiters knows the caller by (see
    :mod:`celery_exclusive.marks`): the line admits only its first. Raises
    :class:`BackendUnavailable` when the store does not answer.
    """
    record = _record(name, task_id, holder)
    grant = backend.try_acquire(key, new_owner(), ttl, limit, record, claimant=claimant)
    return None if grant is None else _hold(backend, grant, name, task_id)


def acquire_and_read_mark(
    backend: Backend,
    key: str,
    ttl: float,
    limit: int,
    name: str,
    task_id: Optional[str],
    claimant: Optional[str],
    mark: tuple[str, str],
) -> tuple[Optional[HeldLease], Optional[str]]:
    """:func:`acquire`, reading the mark ``mark`` (``(key, kind)``) right after the
    grant, in the same round trip where the store can: ``(None, None)`` if not granted."""
    record = _record(name, task_id, None)
    grant, value = backend.try_acquire_and_read_mark(
        key, new_owner(), ttl, limit, record, claimant, mark
    )
    if grant is None:
        return None, None
    return _hold(backend, grant, name, task_id), value


def _record(
    name: str, task_id: Optional[str], holder: Optional[Mapping[str, Any]]
) -> dict[str, Any]:
    """What the store keeps beside a grant, for ``holders()``."""
    return {
        "task": name,
        "task_id": task_id,
        "hostname": HOSTNAME,
        "pid": os.getpid(),
        "acquired_at": time.time(),
        **(holder or {}),
    }


def _hold(backend: Backend, grant: Lease, name: str, task_id: Optional[str]) -> HeldLease:
    """A grant, as its holder runs under it: renewed by the heartbeat from now on."""
    lease = HeldLease(backend, grant, name, task_id)
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
