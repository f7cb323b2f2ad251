"""The heartbeat: one thread per process renewing every lease the process holds.

The thread starts with the process's first lease (never at import: a thread started
before a fork deadlocks the child) and renews each store's leases in one round trip, on
a schedule: every lease at most a third of its ttl after its grant or its last renewal
was *sent*. That is every ``ttl / 3``, and sooner for a lease whose grant was so slow
to answer that the store's next renewal would come too late for it.

Renewals are sent on schedule whether or not the ones before them have answered. Each
runs in a thread of its own and applies the store's answer when it comes: a lease the
store kept lasts until that renewal's send time + ttl (its deadline, kept by
:mod:`.deadline`), never less than before, since answers may come out of order.
Waiting for each answer before sending the next would add the round trips up: with a
3 s ttl, two round trips of 1.5 s in a row cost a lease the store had extended all
along. On schedule, a slow store costs a lease only when its grant and its first
renewal together take longer than its ttl less the safety margin, or a later renewal
longer than two thirds of it: round trips under half the ttl lose nothing.

A renewal that fails is retried at once, with a short backoff, until the lease would
expire: a store outage costs nothing as long as one renewal gets through before then.
Waiting for the next regular renewal instead would lose a lease to an outage of only a
third of its ttl, when two renewals fall inside it. A lease is flagged lost when the
store says it is gone, or by the deadline keeper (:mod:`.deadline`) when its deadline
passed; an answer that comes after its lease was released or lost changes nothing.

A store that hangs holds up nothing: the heartbeat never waits for an answer, and each
store's renewals run apart from the others'. Each store has at most :data:`IN_FLIGHT`
renewals unanswered at once, so a store that never answers costs that many threads and
connections, not one more every third of a ttl.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .. import runtime, telemetry
from ..errors import ExclusiveError
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
#: For this many renewal intervals after its last lease was taken, a process without
#: leases keeps its thread's sleep as if it still held one: short tasks leave it without
#: a lease between two of them, and the next lease then finds the thread asleep until a
#: time soon enough for it, with no wake-up (a thread switch per task) needed.
IDLE_BEATS = 3
#: Renewals one store may have unanswered at once; one due beyond them goes when one of
#: them ends. On schedule one goes every third of a ttl, so a fourth would go a whole
#: ttl after the first: by then the first confirms nothing (its leases' deadlines have
#: passed). Exempt: the renewal that carries a lease's first, which a grant slow to
#: answer needs sooner than the store's next one. There is one per lease, and only for
#: a grant the store answered, so a store that answers nothing never gets one.
IN_FLIGHT = 3


class _Renewal:
    """One ``renew()`` call on one store, in a thread of its own, which applies the
    store's answer to its leases when it comes."""

    def __init__(self, heartbeat: Heartbeat, backend: Backend, leases: list[WatchedLease]):
        self.heartbeat = heartbeat
        self.backend = backend
        self.leases = leases
        self.done = runtime.Event()
        #: When the renewal was sent (monotonic): a confirmed lease lasts ttl past it.
        self.started = runtime.monotonic()

    def start(self) -> None:
        runtime.Thread(target=self._run, name="celery-exclusive-renewal", daemon=True).start()

    def _run(self) -> None:
        try:
            lost = self.backend.renew([lease.grant for lease in self.leases])
        except ExclusiveError as exc:  # unavailable, or refused (a permission changed)
            self.heartbeat._failed(self, exc)
        except Exception:  # a bug: said, and left to the next renewal
            logger.exception("lease renewal failed on %s", self.backend.safe_url)
        else:
            self.heartbeat._confirmed(self, lost)
        finally:
            self.heartbeat._ended(self)
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
    attempts: int = 1


@dataclass
class _Store:
    """The leases of one store and their renewals."""

    leases: set[WatchedLease] = field(default_factory=set)
    #: Those no renewal was sent for yet (see IN_FLIGHT).
    unrenewed: set[WatchedLease] = field(default_factory=set)
    #: When its next renewal is due (monotonic); None once it has no leases.
    due: Optional[float] = None
    #: Sent and not ended yet.
    in_flight: set[_Renewal] = field(default_factory=set)
    #: Send time of the newest renewal the store answered (monotonic).
    answered: float = float("-inf")
    #: Set while its renewals fail.
    outage: Optional[_Outage] = None
    #: Whether a renewal was held back by IN_FLIGHT (and said so) since the store last
    #: had none in flight.
    held_back: bool = False

    def interval(self) -> float:
        return min(lease.ttl for lease in self.leases) / 3

    def may_send(self) -> bool:
        return len(self.in_flight) < IN_FLIGHT or bool(self.unrenewed)


class Heartbeat:
    """Renews every lease this process holds, from one daemon thread."""

    def __init__(self) -> None:
        self.pid = runtime.getpid()
        self._lock = runtime.Lock()
        self._wake = runtime.Event()
        self._thread: Optional[threading.Thread] = None
        #: The stores this process holds leases on, or whose renewals are in flight.
        self._stores: dict[Backend, _Store] = {}
        #: When the thread's current sleep ends (monotonic); None: asleep until woken.
        self._sleeping_until: Optional[float] = None
        #: Seconds the last renewal started after it was due (a starved thread, or a
        #: store that leaves IN_FLIGHT renewals unanswered, shows here).
        self.lag = 0.0
        #: When the last lease was added (monotonic), and a third of its ttl; the end of
        #: the thread's sleep while it holds none (see IDLE_BEATS).
        self._last_added, self._last_interval = 0.0, 0.0
        self._idle_until: Optional[float] = None

    def add(self, lease: WatchedLease) -> None:
        """Renew ``lease`` until :meth:`discard`, first a third of its ttl after its
        grant (or last confirmed renewal) was sent, or at once if that has passed."""
        with self._lock:
            state = self._stores.setdefault(lease.backend, _Store())
            state.leases.add(lease)
            state.unrenewed.add(lease)
            if self._thread is None:
                self._thread = runtime.Thread(
                    target=self._run, name="celery-exclusive-heartbeat", daemon=True
                )
                self._thread.start()
            self._last_added, self._last_interval = runtime.monotonic(), lease.ttl / 3
            # A store's next renewal never moves later, so a steady stream of new leases
            # cannot postpone renewals. Wake the thread only if this lease needs one
            # sooner than the thread sleeps: waking it on every acquire costs a thread
            # switch per task.
            needed = lease.renewed_at + lease.ttl / 3
            state.due = needed if state.due is None else min(state.due, needed)
            sleeping_until = self._sleeping_until
            wake = sleeping_until is None or needed < sleeping_until
        if wake:
            self._wake.set()

    def discard(self, lease: WatchedLease) -> None:
        with self._lock:
            state = self._stores.get(lease.backend)
            if state is not None:
                state.leases.discard(lease)
                state.unrenewed.discard(lease)

    def settle(self, lease: WatchedLease, timeout: float) -> None:
        """Return once no renewal of ``lease`` is in flight, or after ``timeout``: one
        sent before :meth:`discard` and applied after a change of the lease's ttl (a
        window kept after its run) would undo the change."""
        with self._lock:
            state = self._stores.get(lease.backend)
            flights = [r for r in state.in_flight if lease in r.leases] if state else []
        until = runtime.monotonic() + timeout
        for renewal in flights:
            renewal.done.wait(max(0.0, until - runtime.monotonic()))

    def held(self) -> list[WatchedLease]:
        with self._lock:
            return [lease for state in self._stores.values() for lease in state.leases]

    def interval(self) -> Optional[float]:
        """A third of the shortest ttl held: the longest a renewal waits."""
        with self._lock:
            intervals = [state.interval() for state in self._stores.values() if state.leases]
        return min(intervals, default=None)

    def _run(self) -> None:
        while True:
            # Under the lock, so that add() sees when this sleep ends and wakes the
            # thread if a new lease needs a renewal sooner (or the thread is idle).
            with self._lock:
                now = runtime.monotonic()
                if any(state.leases for state in self._stores.values()):
                    self._idle_until = None
                elif now - self._last_added >= IDLE_BEATS * self._last_interval:
                    self._idle_until = None  # idle for long: asleep until the next lease
                elif self._idle_until is None or self._idle_until <= now:
                    self._idle_until = now + self._last_interval  # see IDLE_BEATS
                wake_at = min(self._pending(), default=None)
                self._sleeping_until = wake_at
            if wake_at is None:
                self._wake.wait()
                self._wake.clear()
                continue
            if wake_at > now and self._wake.wait(wake_at - now):
                self._wake.clear()
                continue
            try:
                self._send_due()
            except Exception:  # never let the thread die: leases would silently expire
                logger.exception("lease heartbeat failed")

    def _pending(self) -> Iterator[float]:
        """When the stores' next renewals are due, those held back by IN_FLIGHT left
        out once said (a renewal that ends wakes the thread). Call with the lock held."""
        if self._idle_until is not None:
            yield self._idle_until
        for state in self._stores.values():
            if state.due is not None and (state.may_send() or not state.held_back):
                yield state.due

    def _send_due(self) -> None:
        """Send every store's renewal that is due now."""
        held_back: list[tuple[Backend, int, float]] = []
        renewals: list[_Renewal] = []
        with self._lock:
            now = runtime.monotonic()
            for backend, state in list(self._stores.items()):
                if state.due is None or state.due > now:
                    continue
                if not state.leases:  # nothing left there to renew
                    self._let_go(backend, state)
                elif not state.may_send():
                    if not state.held_back:
                        state.held_back = True
                        oldest = min(renewal.started for renewal in state.in_flight)
                        held_back.append((backend, len(state.in_flight), now - oldest))
                else:
                    self.lag = max(0.0, now - state.due)
                    renewals.extend(self._renewal(backend, state))
        for renewal in renewals:
            renewal.start()
        for backend, in_flight, waited in held_back:
            logger.warning(
                "lease renewals on %s go unanswered: %d in flight, the oldest sent %.1fs "
                "ago; the next goes once one ends, and a lease none confirms in time is "
                "lost at its deadline",
                backend.safe_url,
                in_flight,
                waited,
            )

    def _renewal(self, backend: Backend, state: _Store) -> list[_Renewal]:
        """A renewal of the store's leases (those not past their deadline: the keeper
        says they are lost), not started yet; the next is due a third of a ttl later.
        Call with the lock held."""
        state.due = runtime.monotonic() + state.interval()
        leases = [lease for lease in state.leases if not lease.lost]
        if not leases:
            return []
        state.unrenewed.clear()
        renewal = _Renewal(self, backend, leases)
        state.in_flight.add(renewal)
        return [renewal]

    def _let_go(self, backend: Backend, state: _Store) -> None:
        """Forget a store without leases, once its renewals have ended. Call with the
        lock held."""
        state.due, state.outage = None, None
        if not state.in_flight and not state.leases:
            del self._stores[backend]

    def send(self, stores: Optional[Iterable[Backend]] = None) -> list[_Renewal]:
        """Renew every held lease now, one ``renew()`` call per store (only on ``stores``
        if given), as IN_FLIGHT allows; return the renewals sent, without waiting."""
        with self._lock:
            chosen = list(self._stores) if stores is None else set(stores) & set(self._stores)
            renewals = [
                renewal
                for backend in chosen
                if self._stores[backend].leases and self._stores[backend].may_send()
                for renewal in self._renewal(backend, self._stores[backend])
            ]
        for renewal in renewals:
            renewal.start()
        return renewals

    def beat(self, stores: Optional[Iterable[Backend]] = None) -> None:
        """Renew every held lease now, one ``renew()`` call per store (only on
        ``stores`` if given), and return once the answers are applied, or the leases'
        deadlines have passed."""
        for renewal in self.send(stores):
            # Not past the deadline: by then the keeper has flagged what it did not
            # confirm, and the store may have freed the key.
            renewal.done.wait(max(0.0, renewal.deadline - runtime.monotonic()))

    def _confirmed(self, renewal: _Renewal, lost: set) -> None:
        """The store answered ``renewal``: the leases it kept last until its send time
        + ttl (never less than before: answers may come out of order); those it no
        longer had are lost. Leases released or lost meanwhile are left as they are."""
        gone = []
        late: list[tuple[WatchedLease, float]] = []
        ended: Optional[_Outage] = None
        with self._lock:
            state = self._stores.get(renewal.backend)
            if state is None:
                return
            state.answered = max(state.answered, renewal.started)
            if state.outage is not None and renewal.started >= state.outage.since:
                state.outage, ended = None, state.outage
            for lease in renewal.leases:
                if lease not in state.leases:  # released, or found gone already
                    continue
                if lease.grant in lost:
                    state.leases.discard(lease)
                    gone.append(lease)
                elif not lease.lost and renewal.started > lease.renewed_at:
                    since_last = renewal.started - lease.renewed_at
                    if since_last > lease.ttl * telemetry.LATE_SHARE:
                        late.append((lease, since_last))
                    lease.renewed_at = renewal.started
        for lease, since_last in late:
            lease.trace.renewed_late(since_last, lease.deadline - runtime.monotonic())
        for lease in gone:
            lease.mark_lost("the store no longer has it (expired or taken)")
        if ended is not None:
            logger.warning(
                "lease renewals on %s succeed again after %.2fs and %d failed attempt(s)",
                renewal.backend.safe_url,
                renewal.started - ended.since,
                ended.attempts,
            )

    def _failed(self, renewal: _Renewal, exc: Exception) -> None:
        """The store refused ``renewal`` or did not answer it: retry soon, with backoff,
        unless a renewal sent after it was answered meanwhile."""
        with self._lock:
            state = self._stores.get(renewal.backend)
            if state is None or state.answered > renewal.started:
                return
            alive = [lease for lease in renewal.leases if lease in state.leases]
            alive = [lease for lease in alive if not lease.lost]
            if not alive:
                return
            ceiling = min(RETRY_MAX, min(lease.ttl for lease in alive) * RETRY_SHARE)
            outage = state.outage
            first = outage is None
            if outage is None:
                outage = state.outage = _Outage(renewal.started, min(RETRY_FIRST, ceiling))
            else:
                outage.delay = min(outage.delay * 2, ceiling)
                outage.attempts += 1
            retry_at = runtime.monotonic() + outage.delay
            state.due = retry_at if state.due is None else min(state.due, retry_at)
            sleeping_until = self._sleeping_until
        if sleeping_until is None or retry_at < sleeping_until:
            self._wake.set()
        if first:
            expires_in = min(lease.deadline for lease in alive) - runtime.monotonic()
            logger.warning(
                "lease renewal failed key=%s task_id=%s%s on %s; retrying every %.2fs at "
                "most until it would expire, in %.1fs: %s",
                alive[0].key,
                alive[0].task_id,
                f" (and {len(alive) - 1} more lease(s))" if len(alive) > 1 else "",
                renewal.backend.safe_url,
                ceiling,
                expires_in,
                exc,
            )
        else:
            logger.debug("lease renewal retry %d failed: %s", outage.attempts, exc)

    def _ended(self, renewal: _Renewal) -> None:
        """``renewal`` is answered or failed: a renewal held back for it may go."""
        with self._lock:
            state = self._stores.get(renewal.backend)
            if state is None:
                return
            state.in_flight.discard(renewal)
            if not state.in_flight:
                state.held_back = False
            if not state.leases and state.due is None:
                self._let_go(renewal.backend, state)
            wake = state.due is not None and state.due <= runtime.monotonic()
        if wake:
            self._wake.set()


#: This process's heartbeat; a forked child gets a fresh one (threads do not fork).
heartbeat = PerProcess(Heartbeat)
