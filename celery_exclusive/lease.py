"""Leases as their holders see them, and the heartbeat that keeps them alive.

Integrations never talk to a store: they call :func:`acquire`, get a
:class:`HeldLease` (or None), and release it. Each process has one heartbeat thread,
started on the first lease the process takes (never at import: a thread started
before a fork deadlocks the child), which renews all of the process's leases in one
round trip per store every ``ttl / 3``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Optional

from . import signals
from .backends import Backend, Lease
from .errors import BackendUnavailable, LeaseLost

logger = logging.getLogger("celery_exclusive")

HOSTNAME = socket.gethostname()


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
        self.renewed_at = self.acquired_at
        self.lost_reason: Optional[str] = None
        self.released = False

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
        """Raise :class:`LeaseLost` if the lease was lost; call it before each write."""
        if self.lost:
            raise LeaseLost(
                f"{self.name}[{self.task_id}] lost its lease on {self.key!r} "
                f"({self.lost_reason}); another worker may now hold it. Stop here: the work "
                "is no longer exclusive. Raise lease_ttl if renewals cannot keep up.",
                self.key,
                self.name,
            )

    def release(self) -> bool:
        """Give the lease back. Safe to call twice; a store error is logged, not raised.

        A lease that cannot be released because the store is down simply expires
        after its ttl; failing the finished task for that would be worse.
        """
        if self.released:
            return False
        self.released = True
        heartbeat().discard(self)
        try:
            freed = self.backend.release(self.grant)
        except BackendUnavailable as exc:
            logger.warning(
                "lease release failed key=%s task_id=%s: %s; it expires by itself within %.1fs",
                self.key,
                self.task_id,
                exc,
                self.ttl,
            )
            return False
        signals.lease_released.send(
            sender=self.name,
            key=self.key,
            task_id=self.task_id,
            held_for=time.monotonic() - self.acquired_at,
        )
        return freed

    def mark_lost(self, reason: str) -> None:
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        logger.error(
            "lease lost key=%s task=%s task_id=%s fencing_token=%s: %s",
            self.key,
            self.name,
            self.task_id,
            self.fencing_token,
            reason,
        )
        signals.lease_lost.send(sender=self.name, key=self.key, task_id=self.task_id, reason=reason)

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self.released else "held"
        return f"<HeldLease {self.key!r} token={self.fencing_token} {state}>"


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
    record = {
        "task": name,
        "task_id": task_id,
        "hostname": HOSTNAME,
        "pid": os.getpid(),
        "acquired_at": time.time(),
        **(holder or {}),
    }
    grant = backend.try_acquire(key, uuid.uuid4().hex, ttl, limit, record, claimant=claimant)
    if grant is None:
        return None
    lease = HeldLease(backend, grant, name, task_id)
    heartbeat().add(lease)
    signals.lease_acquired.send(
        sender=name, key=key, task_id=task_id, fencing_token=grant.fencing_token
    )
    return lease


class Heartbeat:
    """Renews every lease this process holds, from one daemon thread."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._leases: set[HeldLease] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: When the thread's current sleep ends (monotonic); None: asleep until woken.
        self._sleeping_until: Optional[float] = None
        #: Seconds the last beat started after it was due (a starved thread shows here).
        self.lag = 0.0

    def add(self, lease: HeldLease) -> None:
        with self._lock:
            self._leases.add(lease)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="celery-exclusive-heartbeat", daemon=True
                )
                self._thread.start()
            # Wake the thread only if this lease needs a beat sooner than the one it
            # sleeps until: waking it on every acquire costs a thread switch per task.
            sleeping_until = self._sleeping_until
            wake = sleeping_until is None or time.monotonic() + lease.ttl / 3 < sleeping_until
        if wake:
            self._wake.set()

    def discard(self, lease: HeldLease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def held(self) -> list[HeldLease]:
        with self._lock:
            return list(self._leases)

    def interval(self) -> Optional[float]:
        with self._lock:
            return self._interval()

    def _interval(self) -> Optional[float]:
        leases = self._leases
        return min(lease.ttl for lease in leases) / 3 if leases else None

    def _run(self) -> None:
        due: Optional[float] = None
        while True:
            # Under the lock, so that add() sees when this sleep ends and wakes the
            # thread if a new lease needs a beat sooner (or the thread is idle).
            with self._lock:
                interval = self._interval()
                now = time.monotonic()
                if interval is None:
                    due = None
                else:
                    # An added lease may shorten the interval; the next beat never moves
                    # later, so a steady stream of new leases cannot postpone renewals.
                    due = now + interval if due is None else min(due, now + interval)
                self._sleeping_until = due
            if due is None:
                self._wake.wait()
                self._wake.clear()
                continue
            if self._wake.wait(max(0.0, due - now)):
                self._wake.clear()
                continue
            self.lag = max(0.0, time.monotonic() - due)
            due = None
            try:
                self.beat()
            except Exception:  # never let the thread die: leases would silently expire
                logger.exception("lease heartbeat failed")

    def beat(self) -> None:
        """Renew every held lease now: one ``renew()`` call per store."""
        by_backend: dict[Backend, list[HeldLease]] = defaultdict(list)
        for lease in self.held():
            by_backend[lease.backend].append(lease)
        for backend, leases in by_backend.items():
            started = time.monotonic()
            try:
                lost = backend.renew([lease.grant for lease in leases])
            except BackendUnavailable as exc:
                self._renewal_failed(leases, exc, started)
                continue
            still_held = set(self.held())
            for lease in leases:
                if lease.grant in lost:
                    if lease in still_held:  # released meanwhile: not a loss
                        lease.mark_lost("the store no longer has it (expired or taken)")
                        self.discard(lease)
                else:
                    lease.renewed_at = started

    def _renewal_failed(self, leases: list[HeldLease], exc: Exception, started: float) -> None:
        for lease in leases:
            if started - lease.renewed_at >= lease.ttl:
                lease.mark_lost(f"it could not be renewed for {lease.ttl:.1f}s: {exc}")
                self.discard(lease)
            else:
                logger.warning(
                    "lease renewal failed key=%s task_id=%s, retrying: %s",
                    lease.key,
                    lease.task_id,
                    exc,
                )


_heartbeat: Optional[Heartbeat] = None
_heartbeat_lock = threading.Lock()


def heartbeat() -> Heartbeat:
    """This process's heartbeat; a forked child gets a fresh one (threads do not fork)."""
    global _heartbeat
    current = _heartbeat
    if current is None or current.pid != os.getpid():
        with _heartbeat_lock:
            if _heartbeat is None or _heartbeat.pid != os.getpid():
                _heartbeat = Heartbeat()
            current = _heartbeat
    return current
