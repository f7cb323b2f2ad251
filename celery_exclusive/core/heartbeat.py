"""The heartbeat: one thread per process renewing every lease the process holds.

The thread starts with the process's first lease (never at import: a thread started
before a fork deadlocks the child) and renews all leases in one round trip per store
every ``ttl / 3``.

A renewal that fails is retried at once, with a short backoff, until the lease would
expire: a store outage costs nothing as long as one renewal gets through before then.
Waiting for the next regular beat instead would lose a lease to an outage of only a
third of its ttl, when two beats fall inside it. A lease is flagged lost when the store
says it is gone, or by the deadline keeper (:mod:`.deadline`) when its deadline passed.

Each store's renewal runs in a thread of its own, and the heartbeat waits for it no
longer than the earliest deadline among its leases: a store that hangs cannot hold up
the renewals of another, nor the retries once it answers again. A renewal still in
flight then is abandoned, not awaited (its answer, whenever it comes, extends its
leases only to the time it was sent + ttl); until it ends, that store gets no second
one, so a hung store costs one thread.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .. import runtime, telemetry
from ..errors import BackendUnavailable, ExclusiveError
from .per_process import PerProcess

if TYPE_CHECKING:
    from ..backends import Backend
    from .watched import WatchedLease

logger = logging.getLogger("celery_exclusive")

#: First retry of a failed renewal, in seconds; it doubles with each failure...
RETRY_FIRST = 0.05
#: ... up to this share of the shortest ttl involved, and never above RETRY_MAX. With a
#: fifteenth of the ttl, an outage ending even a sixth of a ttl before expiry (the
#: worst phase of an outage half a ttl long) is followed by a renewal in time.
RETRY_SHARE = 1 / 15
RETRY_MAX = 1.0
#: For this many beats after its last lease was taken, a process without leases keeps
#: beating as if it still held one: short tasks leave it without a lease between two of
#: them, and the next lease then finds the thread asleep until a beat soon enough, with
#: no wake-up (a thread switch per task) needed.
IDLE_BEATS = 3


class _Renewal:
    """One ``renew()`` call on one store, in a thread of its own. Whoever is waiting may
    give up on it; its answer is applied to its leases when it comes."""

    def __init__(self, heartbeat: Heartbeat, backend: Backend, leases: list[WatchedLease]):
        self.heartbeat = heartbeat
        self.backend = backend
        self.leases = leases
        self.done = runtime.Event()
        self.error: Optional[Exception] = None
        #: When the renewal was sent (monotonic): a confirmed lease lasts ttl past it.
        self.started = runtime.monotonic()
        thread = runtime.Thread(target=self._run, name="celery-exclusive-renewal", daemon=True)
        thread.start()

    def _run(self) -> None:
        try:
            lost = self.backend.renew([lease.grant for lease in self.leases])
        except Exception as exc:  # unavailable, or refused (a permission changed)
            self.error = exc
        else:
            self.heartbeat._confirmed(self.leases, lost, self.started)
        finally:
            self.done.set()

    @property
    def deadline(self) -> float:
        """When the first of its leases is lost unless it is confirmed."""
        return min(lease.deadline for lease in self.leases)


@dataclass
class _Outage:
    """Renewals on one store failing since ``since`` (monotonic)."""

    since: float
    delay: float
    due: float
    attempts: int = 1


class Heartbeat:
    """Renews every lease this process holds, from one daemon thread."""

    def __init__(self) -> None:
        self.pid = runtime.getpid()
        self._leases: set[WatchedLease] = set()
        self._lock = runtime.Lock()
        self._wake = runtime.Event()
        self._thread: Optional[threading.Thread] = None
        #: When the thread's current sleep ends (monotonic); None: asleep until woken.
        self._sleeping_until: Optional[float] = None
        #: Stores whose last renewal failed, and when to retry them.
        self._outages: dict[Backend, _Outage] = {}
        #: Renewals given up on that have not ended yet, by store.
        self._abandoned: dict[Backend, _Renewal] = {}
        #: Seconds the last beat started after it was due (a starved thread shows here).
        self.lag = 0.0
        #: When the last lease was added (monotonic), and a third of its ttl.
        self._last_added, self._last_interval = 0.0, 0.0

    def add(self, lease: WatchedLease) -> None:
        with self._lock:
            self._leases.add(lease)
            if self._thread is None:
                self._thread = runtime.Thread(
                    target=self._run, name="celery-exclusive-heartbeat", daemon=True
                )
                self._thread.start()
            # Wake the thread only if this lease needs a beat sooner than the one it
            # sleeps until: waking it on every acquire costs a thread switch per task.
            now = runtime.monotonic()
            self._last_added, self._last_interval = now, lease.ttl / 3
            sleeping_until = self._sleeping_until
            wake = sleeping_until is None or now + lease.ttl / 3 < sleeping_until
        if wake:
            self._wake.set()

    def discard(self, lease: WatchedLease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def held(self) -> list[WatchedLease]:
        with self._lock:
            return list(self._leases)

    def interval(self) -> Optional[float]:
        with self._lock:
            return self._interval()

    def _interval(self) -> Optional[float]:
        leases = self._leases
        return min(lease.ttl for lease in leases) / 3 if leases else None

    def _run(self) -> None:
        due: Optional[float] = None  # the next regular beat
        while True:
            # Under the lock, so that add() sees when this sleep ends and wakes the
            # thread if a new lease needs a beat sooner (or the thread is idle).
            with self._lock:
                interval = self._interval()
                now = runtime.monotonic()
                if interval is None:
                    self._outages.clear()
                    if now - self._last_added >= IDLE_BEATS * self._last_interval:
                        due = None  # idle for long: asleep until the next lease
                    elif due is None:
                        due = now + self._last_interval  # see IDLE_BEATS
                else:
                    # An added lease may shorten the interval; the next beat never moves
                    # later, so a steady stream of new leases cannot postpone renewals.
                    due = now + interval if due is None else min(due, now + interval)
                retry = min((o.due for o in self._outages.values()), default=None)
                wake_at = due if retry is None or (due is not None and due <= retry) else retry
                self._sleeping_until = wake_at
            if wake_at is None:
                self._wake.wait()
                self._wake.clear()
                continue
            if self._wake.wait(max(0.0, wake_at - now)):
                self._wake.clear()
                continue
            now = runtime.monotonic()
            stores: Optional[list[Backend]] = None  # a regular beat renews on every store
            if due is not None and now >= due:
                self.lag = max(0.0, now - due)
                due = None
            else:
                with self._lock:
                    stores = [b for b, o in self._outages.items() if o.due <= now]
            try:
                self.beat(stores)
            except Exception:  # never let the thread die: leases would silently expire
                logger.exception("lease heartbeat failed")

    def beat(self, stores: Optional[Iterable[Backend]] = None) -> None:
        """Renew every held lease now, one ``renew()`` call per store (only on
        ``stores`` if given: the retries of failed renewals)."""
        by_backend: dict[Backend, list[WatchedLease]] = defaultdict(list)
        for lease in self.held():
            by_backend[lease.backend].append(lease)
        if stores is not None:
            stores = set(stores)
            with self._lock:
                for gone in stores - set(by_backend):  # nothing left there to renew
                    self._outages.pop(gone, None)
            by_backend = {b: leases for b, leases in by_backend.items() if b in stores}
        renewals: list[_Renewal] = []
        for backend, leases in by_backend.items():
            stuck = self._abandoned.get(backend)
            if stuck is not None and not stuck.done.is_set():
                since = runtime.monotonic() - stuck.started
                error = BackendUnavailable(
                    f"its renewal sent {since:.1f}s ago is unanswered", backend.safe_url
                )
                self._renewal_failed(backend, leases, error, runtime.monotonic())
                continue
            self._abandoned.pop(backend, None)
            renewals.append(_Renewal(self, backend, leases))
        for renewal in renewals:
            # Not past the deadline: by then the keeper has flagged what it did not
            # confirm, and the store may have freed the key.
            if not renewal.done.wait(max(0.0, renewal.deadline - runtime.monotonic())):
                self._abandoned[renewal.backend] = renewal
                error = BackendUnavailable(
                    "the store did not answer before the lease's deadline", renewal.backend.safe_url
                )
                self._renewal_failed(renewal.backend, renewal.leases, error, renewal.started)
            elif renewal.error is not None:
                if not isinstance(renewal.error, ExclusiveError):
                    raise renewal.error
                self._renewal_failed(
                    renewal.backend, renewal.leases, renewal.error, renewal.started
                )
            else:
                self._renewal_succeeded(renewal.backend, renewal.started)

    def _confirmed(self, leases: list[WatchedLease], lost: set, started: float) -> None:
        """The store answered a renewal sent at ``started``: the leases it kept last
        until ``started`` + ttl (never less than before: answers may come out of order);
        those it no longer had are lost."""
        still_held = set(self.held())
        for lease in leases:
            if lease.grant in lost:
                if lease in still_held:  # released meanwhile: not a loss
                    lease.mark_lost("the store no longer has it (expired or taken)")
                    self.discard(lease)
            elif started > lease.renewed_at and not lease.lost:
                since_last = started - lease.renewed_at
                if since_last > lease.ttl * telemetry.LATE_SHARE:
                    lease.trace.renewed_late(since_last, lease.deadline - runtime.monotonic())
                lease.renewed_at = started

    def _renewal_failed(
        self, backend: Backend, leases: list[WatchedLease], exc: Exception, started: float
    ) -> None:
        alive = []
        for lease in leases:
            if lease.lost:
                lease.expire()  # its deadline passed: lost, whether the keeper said so yet
                self.discard(lease)
            else:
                alive.append(lease)
        with self._lock:
            if not alive:
                self._outages.pop(backend, None)
                return
            ceiling = min(RETRY_MAX, min(lease.ttl for lease in alive) * RETRY_SHARE)
            outage = self._outages.get(backend)
            first = outage is None
            if outage is None:
                delay = min(RETRY_FIRST, ceiling)
                outage = self._outages[backend] = _Outage(started, delay, 0.0)
            else:
                outage.delay = min(outage.delay * 2, ceiling)
                outage.attempts += 1
            outage.due = runtime.monotonic() + outage.delay
        if first:
            expires_in = min(lease.deadline for lease in alive) - started
            logger.warning(
                "lease renewal failed key=%s task_id=%s%s on %s; retrying every %.2fs at "
                "most until it would expire, in %.1fs: %s",
                alive[0].key,
                alive[0].task_id,
                f" (and {len(alive) - 1} more lease(s))" if len(alive) > 1 else "",
                backend.safe_url,
                ceiling,
                expires_in,
                exc,
            )
        else:
            logger.debug("lease renewal retry %d failed: %s", outage.attempts, exc)

    def _renewal_succeeded(self, backend: Backend, started: float) -> None:
        with self._lock:
            outage = self._outages.pop(backend, None)
        if outage is not None:
            logger.warning(
                "lease renewals on %s succeed again after %.2fs and %d failed attempt(s)",
                backend.safe_url,
                started - outage.since,
                outage.attempts,
            )


#: This process's heartbeat; a forked child gets a fresh one (threads do not fork).
heartbeat = PerProcess(Heartbeat)
