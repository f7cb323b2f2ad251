"""The deadline keeper: every held lease is lost at its local deadline, on time.

A store keeps a lease at least ``ttl`` past the moment it received the grant or the
last renewal, and that moment comes after its holder sent it. So the holder may count
on its lease until the *send* time of its last confirmed grant or renewal + ``ttl``,
by its own monotonic clock, less a safety margin (:func:`safety_margin`). That is the
lease's deadline (:attr:`HeldLease.deadline <celery_exclusive.core.lease.HeldLease.deadline>`).

Only a store's answer moves a deadline later; silence never does. The heartbeat may be
stuck inside a renewal on a store that neither answers nor fails, so the deadline is
kept apart from it: one daemon thread per process sleeps until the earliest deadline of
the leases it watches and, at that moment, flags each lease that is due as lost (which
logs, sends ``lease_lost`` and stops its holder) without asking the store anything.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Optional

from .. import runtime
from .per_process import PerProcess

if TYPE_CHECKING:
    from .watched import WatchedLease

logger = logging.getLogger("celery_exclusive")

#: For this many naps of one lease's span after its last lease, a process without
#: leases keeps sleeping as if it still held one: short tasks leave it without a lease
#: between two of them, and the next lease's deadline then falls after the nap's end,
#: so taking it needs no wake-up (a thread switch per task). As the heartbeat does.
IDLE_NAPS = 3

#: The safety margin, as a share of the ttl and at least SAFETY_MARGIN_MIN seconds. It
#: covers what can make the holder's clock run ahead of the store's expiry: clock
#: rates that differ (NTP slews at most 500 ppm, 0.05%), and the time from the
#: deadline to the holder being told (a thread wake-up and a signal on a loaded host:
#: milliseconds, and on a busy 2-core host up to 75 ms was seen: the floor is twice that).
SAFETY_MARGIN_SHARE = 0.02
SAFETY_MARGIN_MIN = 0.15


def safety_margin(ttl: float) -> float:
    """How long before ``ttl`` runs out the holder counts its lease as lost: 2% of the
    ttl, at least 150 ms (0.6 s of the default 30 s ttl), never more than half the ttl."""
    return min(ttl / 2, max(ttl * SAFETY_MARGIN_SHARE, SAFETY_MARGIN_MIN))


class DeadlineKeeper:
    """Flags leases lost at their deadlines, from one daemon thread per process."""

    def __init__(self) -> None:
        self.pid = runtime.getpid()
        self._leases: set[WatchedLease] = set()
        self._changed = runtime.Condition(runtime.Lock())
        self._thread: Optional[threading.Thread] = None
        #: The deadline the thread sleeps until (monotonic); None: until woken.
        self._sleeping_until: Optional[float] = None
        #: From grant to deadline, for the last lease watched (see IDLE_NAPS).
        self._span = 0.0
        self._idle_naps = 0

    def watch(self, lease: WatchedLease) -> None:
        """Keep ``lease``'s deadline from now until :meth:`forget`."""
        with self._changed:
            self._leases.add(lease)
            self._span, self._idle_naps = lease.ttl - lease.margin, 0
            if self._thread is None:
                self._thread = runtime.Thread(
                    target=self._run, name="celery-exclusive-deadlines", daemon=True
                )
                self._thread.start()
            # Deadlines only move later, so only a lease due before the current sleep
            # ends needs the thread woken (waking it on every grant costs a switch).
            until = self._sleeping_until
            if until is None or lease.deadline < until:
                self._changed.notify()

    def forget(self, lease: WatchedLease) -> None:
        with self._changed:
            self._leases.discard(lease)

    def watched(self) -> list[WatchedLease]:
        with self._changed:
            return list(self._leases)

    def _run(self) -> None:
        while True:
            with self._changed:
                now = runtime.monotonic()
                due = [lease for lease in self._leases if lease.deadline <= now]
                self._leases.difference_update(due)
                if not due:
                    earliest = min((lease.deadline for lease in self._leases), default=None)
                    if earliest is None and self._idle_naps < IDLE_NAPS:
                        earliest = now + self._span  # see IDLE_NAPS
                        self._idle_naps += 1
                    self._sleeping_until = earliest
                    self._changed.wait(None if earliest is None else earliest - now)
                    self._sleeping_until = None
                    continue
            for lease in due:
                try:
                    lease.expire()
                except Exception:  # never let the thread die: deadlines would pass unseen
                    logger.exception("lease deadline keeper failed key=%s", lease.key)
                if lease.deadline > runtime.monotonic():
                    # A renewal confirmed since it was found due moved its deadline:
                    # not lost, and kept to the new deadline.
                    self.watch(lease)


#: This process's keeper; a forked child gets a fresh one (threads do not fork).
keeper = PerProcess(DeadlineKeeper)
