"""The simulated store: the memory store's semantics, reached over a simulated link.

One :class:`~celery_exclusive.backends.memory.MemoryBackend` (the real code) holds the
state every process shares. Each process reaches it through its own
:class:`LinkedStore`, a :class:`~celery_exclusive.backends.Backend` whose every call
crosses a link the seed shapes: the request may wait before it lands (so requests of
several processes land in another order than they were sent), may be lost before it
lands (the call fails, nothing changed), or land and lose its answer (the call fails,
the change was made); the answer may wait too. A call of a dead process never lands.

Every grant is checked as it lands: the fencing tokens of one key rise strictly in the
order the store grants them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from celery_exclusive.backends import NO_END, Backend, Capabilities, End, Lease, LeaseInfo
from celery_exclusive.backends.base import HoldersPage, MarkRead
from celery_exclusive.backends.memory import MemoryBackend
from celery_exclusive.errors import BackendUnavailable

from .scheduler import Killed, Scheduler


@dataclass
class LinkFaults:
    """How the links misbehave while faults are on (probabilities per call, seconds)."""

    #: A request lost before it lands.
    lose_request: float = 0.0
    #: A request that lands and loses its answer.
    lose_answer: float = 0.0
    #: The longest one-way delay, each way; drawn uniformly from 0.
    delay: float = 0.0
    #: A call that takes a long way (a delay up to ``slow`` seconds).
    slow_share: float = 0.0
    slow: float = 0.0

    @classmethod
    def draw(cls, rng: random.Random, ttl: float) -> LinkFaults:
        """A misbehaving link for leases of ``ttl``, drawn from ``rng`` (in one order: a
        world's seeds keep their schedules)."""
        return cls(
            lose_request=rng.choice([0.0, 0.02, 0.05]),
            lose_answer=rng.choice([0.0, 0.02, 0.05]),
            delay=rng.choice([0.0, 0.01, 0.1, ttl / 8]),
            slow_share=rng.choice([0.0, 0.01, 0.05]),
            slow=rng.choice([ttl / 2, ttl]),
        )


class Violation(AssertionError):
    """An invariant of the lease protocol does not hold."""


class SharedStore:
    """The state every process's link reaches: one memory store, and the grant order."""

    def __init__(self, scheduler: Scheduler, name: str) -> None:
        self.scheduler = scheduler
        self.memory = MemoryBackend(f"memory://{name}")
        self.faults = LinkFaults()
        self.faults_on = False
        #: A partition: while set (and faults are on), every request is lost.
        self.outage = False
        #: Processes whose link is cut (pid -> until when): their requests and the
        #: answers to them are lost, while every other process reaches the store.
        self.partitioned: dict[int, float] = {}
        #: The last fencing token granted per key, in grant order.
        self.last_token: dict[str, int] = {}
        #: When each grant was applied (store time), by key and fencing token.
        self.granted_at: dict[tuple[str, int], float] = {}
        #: When each task id was granted a lease (store time of the grant).
        self.grants_of: dict[str, list[float]] = {}
        #: The store calls whose caller dies once they are applied: (the call's name,
        #: its number among the calls of that name, from 1).
        self.kill_at_calls: set[tuple[str, int]] = set()
        self.calls_of: dict[str, int] = {}
        #: When the store applied its holder's release of each grant (by owner token).
        self.freed_at: dict[str, float] = {}
        self.calls = 0

    def granted(self, lease: Lease) -> None:
        last = self.last_token.get(lease.key)
        if last is not None and lease.fencing_token <= last:
            raise Violation(
                f"fencing token {lease.fencing_token} granted for {lease.key!r} after "
                f"{last}: tokens must rise with every grant"
            )
        self.last_token[lease.key] = lease.fencing_token
        self.granted_at[(lease.key, lease.fencing_token)] = self.scheduler.now

    def granted_to(self, task_id: Optional[str]) -> None:
        if task_id:
            self.grants_of.setdefault(task_id, []).append(self.scheduler.now)


def _step(what: str) -> str:
    """A store call's step name: the method, and for a mark the mark's kind
    (``swap_mark:done``), so that a kill can follow the recording of an end."""
    found = re.match(r"(\w+)\((?:[^,]*, (\w+))?", what)
    if found is None:
        return what
    method, kind = found.groups()
    return f"{method}:{kind}" if method in ("read_mark", "swap_mark") and kind else method


class LinkedStore(Backend):
    """One process's client of the shared store, over a link that misbehaves."""

    capabilities = Capabilities(limits=True, records=True, marks=True, windows=True)

    def __init__(self, shared: SharedStore, rng: random.Random, label: str) -> None:
        super().__init__(f"memory://{shared.memory.url.split('//')[1]}")
        self.shared = shared
        self.rng = rng
        self.label = label

    # --- the link --------------------------------------------------------------------

    def _call(self, what: str, apply: Callable[[], Any]) -> Any:
        scheduler, shared = self.shared.scheduler, self.shared
        if not scheduler.running_process().alive:
            raise Killed
        shared.calls += 1
        name = _step(what)
        number = shared.calls_of[name] = shared.calls_of.get(name, 0) + 1
        faults = shared.faults if shared.faults_on else LinkFaults()
        rng = self.rng
        out = self._delay(faults)
        if out:
            scheduler.block(scheduler.now + out)
        else:
            scheduler.yield_now()
        if not scheduler.running_process().alive:
            raise Killed
        cut = self._cut()
        lose = faults.lose_request or (shared.outage and shared.faults_on) or cut
        if lose and (
            cut or rng.random() < faults.lose_request or (shared.outage and shared.faults_on)
        ):
            scheduler.trace(f"{scheduler.now:9.3f} {self.label} {what}: request lost")
            raise BackendUnavailable(f"{what}: the request was lost (simulated)", self.safe_url)
        try:
            result = apply()
        except BackendUnavailable:
            raise
        if shared.faults_on and (name, number) in shared.kill_at_calls:
            scheduler.trace(f"{scheduler.now:9.3f} {self.label} {what} -> {_short(result)}")
            scheduler.kill(scheduler.running_process(), "SIGKILL after a store call")
            raise Killed
        lost = faults.lose_answer and rng.random() < faults.lose_answer
        scheduler.trace(
            f"{scheduler.now:9.3f} {self.label} {what} -> {_short(result)}"
            + (" (answer lost)" if lost else "")
        )
        back = self._delay(faults)
        if back:
            scheduler.block(scheduler.now + back)
        if not scheduler.running_process().alive:
            raise Killed
        lost = lost or self._cut()
        if lost:
            raise BackendUnavailable(f"{what}: the answer was lost (simulated)", self.safe_url)
        return result

    def _cut(self) -> bool:
        """Whether the calling process's link is cut now (a partition of its own)."""
        shared = self.shared
        until = shared.partitioned.get(shared.scheduler.running_process().pid)
        return shared.faults_on and until is not None and shared.scheduler.now < until

    def _delay(self, faults: LinkFaults) -> float:
        rng = self.rng
        if faults.slow_share and rng.random() < faults.slow_share:
            return rng.uniform(0, faults.slow)
        return rng.uniform(0, faults.delay) if faults.delay else 0.0

    # --- the protocol, each call over the link -------------------------------------------

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
        read: Optional[MarkRead] = None,
    ) -> Optional[Lease]:
        memory = self.shared.memory

        def apply() -> Optional[Lease]:
            grant = memory.try_acquire(key, owner, ttl, limit, holder, claimant)
            if grant is not None:
                self.shared.granted(grant)
                self.shared.granted_to((holder or {}).get("task_id"))
            return grant

        return self._call(f"try_acquire({key}, claimant={claimant})", apply)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        keys = ",".join(sorted({lease.key for lease in leases}))
        return self._call(f"renew({keys})", lambda: self.shared.memory.renew(leases))

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        mark = f", mark {end.mark.new}" if end.mark is not None else ""
        shared = self.shared

        def apply() -> Optional[bool]:
            freed = shared.memory.release(lease, end)
            if freed:
                shared.freed_at.setdefault(lease.owner, shared.scheduler.now)
            return freed

        return self._call(f"release({lease.key}, token {lease.fencing_token}{mark})", apply)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        scheduler = self.shared.scheduler
        if not scheduler.running_process().alive:
            raise Killed
        shared = self.shared
        if shared.faults_on and (
            shared.outage or self._cut() or self.rng.random() < shared.faults.lose_request
        ):
            scheduler.block(scheduler.now + self.rng.uniform(0, timeout))
            raise BackendUnavailable("wait: the link broke (simulated)", self.safe_url)
        self.shared.memory.wait(key, timeout, claimant)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        return self._call(f"holders({prefix})", lambda: self.shared.memory.holders(prefix))

    def holders_of(self, key: str) -> list[LeaseInfo]:
        return self._call(f"holders_of({key})", lambda: self.shared.memory.holders_of(key))

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        memory = self.shared.memory
        return self._call("holders_page", lambda: memory.holders_page(prefix, cursor, count, kinds))

    def force_release(self, key: str) -> int:
        return self._call(f"force_release({key})", lambda: self.shared.memory.force_release(key))

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        return self._call(
            f"read_mark({key}, {kind})", lambda: self.shared.memory.read_mark(key, kind)
        )

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        memory = self.shared.memory
        return self._call(
            f"swap_mark({key}, {kind}, {_short(expected)} -> {_short(new)})",
            lambda: memory.swap_mark(key, kind, expected, new, ttl),
        )

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        memory = self.shared.memory
        return self._call(f"read_record({lease_key})", lambda: memory.read_record(lease_key, name))

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        memory = self.shared.memory
        return self._call(
            f"write_record({lease.key})", lambda: memory.write_record(lease, name, value)
        )

    def store_time(self) -> float:
        return self.shared.memory.store_time()

    def __repr__(self) -> str:
        return f"<store link of {self.label}>"


def _short(value: Any) -> str:
    if isinstance(value, Lease):
        return f"granted token {value.fencing_token}"
    if isinstance(value, list) and value and isinstance(value[0], LeaseInfo):
        return "[" + ", ".join(f"{i.task_id} token {i.fencing_token}" for i in value) + "]"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
