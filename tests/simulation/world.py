"""One simulated world: a broker, Celery-like worker processes running the real engine,
the simulated store, faults drawn from a seed, and the invariants checked after every
step.

The hosts are Celery's prefork children as the engine sees them (:func:`host_for`:
``acks_late``, ``reject_on_worker_lost``, a child that may be killed) and what their
worker's main process does when one dies (:meth:`World._child_died`, as
:class:`celery_exclusive.celery.worker.ExclusiveRequest` does it: free what it held,
send again a call killed for its lost lease, hand a dead pending rerun's run on). Each
outcome is carried out as :class:`celery_exclusive.celery.execution.CeleryOutcomes`
does: a requeue is a copy of the message with a countdown, a set-aside copy comes back
later, a message rejected goes back to the queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import random
import tempfile
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from celery_exclusive import runtime, signals
from celery_exclusive.backends import memory as memory_module
from celery_exclusive.celery.execution import finished_ttl_for
from celery_exclusive.core import kill_notes, marks, outcomes, reaper
from celery_exclusive.core.config import Settings
from celery_exclusive.core.deadline import keeper
from celery_exclusive.core.feed import feed
from celery_exclusive.core.heartbeat import heartbeat
from celery_exclusive.core.lease import HeldLease
from celery_exclusive.core.terminate import _running as running_stoppers
from celery_exclusive.engine import attempt, enqueue
from celery_exclusive.engine.arguments import decode_call
from celery_exclusive.errors import DuplicateSkipped, ExclusiveError, LeaseLost

from .scheduler import Killed, Scheduler, SimEvent
from .store import LinkedStore, LinkFaults, SharedStore, Violation

TASK = "sim.work"

#: The ends a message may reach only one kind of (a copy set aside or dropped, a
#: requeue, a process lost are on the way to one of them).
#: The version of the world's faults. A seed is one schedule of one version: a
#: regression seed names the version it was found in, and replays in it. 1: kills at
#: random times, pauses, outages and a misbehaving link; 2: also partitions of one
#: process's link and kills right after a store call (drawn from a stream of their own,
#: so a seed of version 1 without them keeps its schedule); 3: also calls sent through
#: the task's ``apply_async`` under ``scope="enqueue"``/``"both"`` (beside calls sent by
#: name, which bypass it) and bodies that call ``retry()`` (a stream of their own too);
#: 4: also a uniqueness window after each run (``unique_for``) on keys of one holder,
#: and a rate (``rate``: N runs per period, N the limit); 5: also a debounce
#: (``debounce``, with or without ``debounce_max_wait``) where the scope is ``run``
#: and the policy no ``rerun`` (refused with a debounce); 6: also ``replace`` (a newer
#: call stops the running one) where the options allow it.
FAULTS = 6
#: The store calls after which a step kill may land.
STEPS = (
    "try_acquire",
    "release",
    "renew",
    "read_mark:done",
    "swap_mark:done",
    "read_mark:rerun",
    "swap_mark:rerun",
    "swap_mark:line",
)
TERMINAL = frozenset({"ran", "skipped", "coalesced", "replaced", "gave up", "failed"})


@dataclass
class Config:
    """One schedule's task options, workload and faults (all drawn from its seed)."""

    on_duplicate: str = "skip"
    #: ``celery`` (prefork children) or ``rq`` (work horses: no message comes twice).
    host: str = "celery"
    on_backend_error: str = "requeue"
    limit: int = 1
    priority: bool = False
    acks_late: bool = False
    reject_on_worker_lost: bool = False
    requeue_lost: bool = True
    on_lease_lost: str = "terminate"
    terminate_grace: float = 1.0
    lease_ttl: float = 3.0
    wait_timeout: float = 2.0
    requeue_max_retries: Optional[int] = None
    #: Bodies call lease.ensure_held() before each step (else they rely on being stopped).
    checking_bodies: bool = True
    #: Bodies swallow the LeaseLost that interrupts them (terminate's kill stops them).
    stubborn: bool = False
    keys: int = 1
    messages: int = 6
    children: int = 2
    #: Virtual seconds during which messages arrive and faults happen.
    window: float = 20.0
    #: The longest virtual time a schedule may take to settle once faults stop.
    settle: float = 600.0
    visibility_timeout: float = 30.0
    link: LinkFaults = field(default_factory=LinkFaults)
    kills: int = 0
    pauses: int = 0
    #: Windows in which the store answers nothing (a partition), each ttl/2 to 2 ttl.
    outages: int = 0
    lost_acks: float = 0.0
    #: Windows in which one process's link to the store is black-holed (its requests
    #: and the answers coming back to it are lost) while the others reach the store:
    #: ttl/2 to 2 ttl each, on a process that holds a key when one does.
    partitions: int = 0
    #: Processes killed right after a store call they made was applied, before they
    #: see its answer: the steps a kill at a random time misses (calls take no time).
    step_kills: int = 0
    #: Producers stamp their messages with when they sent them (ExclusiveTask's
    #: apply_async does; a send_task by name does not).
    stamped: bool = True
    #: ``run``, or ``enqueue``/``both``: apply_async sends nothing for a key whose
    #: enqueue mark another call holds (Celery only).
    scope: str = "run"
    #: The share of calls sent by name (``send_task``): they bypass the enqueue mark.
    by_name: float = 0.0
    #: The share of runs whose body calls ``retry()`` once, part way (Celery only).
    retrying: float = 0.0
    #: The chance that a process sending its retry is killed at each step of the send
    #: (once its lease went back; once its message went out).
    handoff_kills: float = 0.0
    #: Seconds a key stays taken after a run of it ends (limit 1 only).
    unique_for: float = 0.0
    #: Which runs keep that window: "success" or "end" (a run that raised or died too).
    unique_after: str = "success"
    #: ``rate``: the limit's runs per this many seconds (0: no rate).
    rate_period: float = 0.0
    #: ``debounce`` and ``debounce_max_wait`` (0: none).
    debounce: float = 0.0
    debounce_max_wait: float = 0.0

    def settings(self) -> Settings:
        return Settings(
            backend_url="memory://",
            lease_ttl=self.lease_ttl,
            limit=self.limit,
            on_duplicate=self.on_duplicate,  # type: ignore[arg-type]
            priority=self.priority,
            wait_timeout=self.wait_timeout,
            requeue_delay=0.2,
            requeue_max_delay=2.0,
            requeue_max_retries=self.requeue_max_retries,
            requeue_lost=self.requeue_lost,
            on_lease_lost=self.on_lease_lost,  # type: ignore[arg-type]
            terminate_grace=self.terminate_grace,
            on_backend_error=self.on_backend_error,  # type: ignore[arg-type]
            scope=self.scope,  # type: ignore[arg-type]
            unique_for=self.unique_for,
            unique_after=self.unique_after,  # type: ignore[arg-type]
            rate=f"{self.limit}/{self.rate_period}s" if self.rate_period else None,
            debounce=self.debounce,
            debounce_max_wait=self.debounce_max_wait,
        )


def draw_config(rng) -> Config:
    """A configuration from the seed: every policy and option, and a mix of faults."""
    on_duplicate = rng.choice(["skip", "requeue", "wait", "rerun"])
    host = rng.choice(["celery", "celery", "rq"])
    acks_late = host == "celery" and rng.random() < 0.5
    priority = rng.random() < 0.15
    ttl = rng.choice([2.0, 3.0, 5.0])
    faulty = rng.random() < 0.8
    link = LinkFaults()
    if faulty:
        link = LinkFaults.draw(rng, ttl)
    return Config(
        on_duplicate=on_duplicate,
        host=host,
        on_backend_error=rng.choice(["requeue", "requeue", "requeue", "run"]),
        limit=rng.choice([1, 1, 1, 2]),
        priority=priority,
        acks_late=acks_late,
        reject_on_worker_lost=acks_late and rng.random() < 0.5,
        requeue_lost=rng.random() < 0.8,
        on_lease_lost=rng.choice(["terminate", "terminate", "abort", "log"]),
        terminate_grace=rng.choice([0.5, 1.0]),
        lease_ttl=ttl,
        wait_timeout=rng.choice([0.5, 2.0, 5.0]),
        requeue_max_retries=rng.choice([None, None, 3]),
        checking_bodies=rng.random() < 0.5,
        stubborn=rng.random() < 0.1,
        keys=rng.choice([1, 1, 2]),
        messages=rng.randint(2, 12),
        children=rng.randint(1, 3),
        window=rng.choice([10.0, 20.0]),
        # Shorter than a run (its copy is set aside), never than what a delivery takes
        # before it holds the key (its wait in line, the store's slowest answers): a copy
        # restored meanwhile is a second delivery nobody can tell from the first
        # (docs/how-to/duplicates/redelivery.md).
        visibility_timeout=max(
            rng.choice([1.5 * ttl, 4 * ttl, 30.0]),
            (5.0 if on_duplicate in ("wait", "rerun") or priority else 0.0)
            + 2 * ttl
            + 8 * max(link.delay, link.slow if link.slow_share else 0.0),
        ),
        link=link,
        kills=rng.choice([0, 0, 1, 2, 3]) if faulty else 0,
        pauses=rng.choice([0, 0, 1, 2]) if faulty else 0,
        outages=rng.choice([0, 0, 1, 2]) if faulty else 0,
        lost_acks=rng.choice([0.0, 0.0, 0.1]) if faulty and acks_late else 0.0,
        stamped=rng.random() < 0.8,
    )


def _with_later_draws(config: Config, seed: int, faults: int) -> Config:
    """``config`` with what worlds after the first add, each drawn from a stream of its
    own: a seed drawn before they existed keeps its schedule in its own world (the
    regression seeds stay pinned)."""
    faulty = config.link != LinkFaults() or config.kills or config.pauses or config.outages
    if faulty and faults >= 2:
        chance = random.Random(seed * 7919 + 17)
        partitions, step_kills = chance.choice([0, 0, 1, 2]), chance.choice([0, 0, 1, 2])
        config = dataclasses.replace(config, partitions=partitions, step_kills=step_kills)
    if faults >= 3 and config.host == "celery":
        chance = random.Random(seed * 7919 + 19)
        scope = chance.choice(["run", "run", "enqueue", "both"])
        config = dataclasses.replace(
            config,
            scope=scope,
            by_name=chance.choice([0.0, 0.3, 0.6]) if scope != "run" else 0.0,
            retrying=chance.choice([0.0, 0.0, 0.1, 0.3]),
            handoff_kills=chance.choice([0.0, 0.0, 0.3]) if faulty else 0.0,
        )
    if faults >= 4 and config.limit == 1:
        chance = random.Random(seed * 7919 + 23)
        config = dataclasses.replace(config, unique_for=chance.choice([0.0, 0.0, 1.0, 4.0]))
        if config.unique_for:
            after = random.Random(seed * 7919 + 41).choice(["success", "end"])
            config = dataclasses.replace(config, unique_after=after)
    if faults >= 4:
        chance = random.Random(seed * 7919 + 29)
        config = dataclasses.replace(config, rate_period=chance.choice([0.0, 0.0, 1.0, 3.0]))
    if faults >= 5 and config.scope == "run" and config.on_duplicate != "rerun":
        chance = random.Random(seed * 7919 + 31)
        debounce = chance.choice([0.0, 0.0, 1.0, 3.0])
        max_wait = chance.choice([0.0, 2.0]) if debounce else 0.0
        config = dataclasses.replace(config, debounce=debounce, debounce_max_wait=max_wait)
    replaceable = (
        config.limit == 1
        and config.on_lease_lost == "terminate"
        and not (config.priority or config.unique_for or config.rate_period or config.debounce)
    )
    if faults >= 6 and replaceable:
        chance = random.Random(seed * 7919 + 37)
        if chance.random() < 0.3:
            config = dataclasses.replace(config, on_duplicate="replace")
    return config


@dataclass
class Message:
    task_id: str
    key: str
    version: int
    duration: float
    requeues: int = 0
    resumed: bool = False
    retries: int = 0
    #: (args, kwargs) sent instead of the message's own (a resumed pending rerun).
    arguments: Optional[tuple] = None
    #: The AS_OF_HEADER it was sent again with.
    as_of: Optional[float] = None
    #: The SET_ASIDE_HEADER.
    set_aside: bool = False
    eta: float = 0.0
    seq: int = 0
    #: Sent by name (``send_task``), bypassing the enqueue mark.
    by_name: bool = False
    #: The step of its body at which each run of it calls ``retry()``, if any.
    retry_at: Optional[int] = None
    #: The DEBOUNCED_HEADER: it joined its key's burst.
    debounced: bool = False
    #: The OWED_BY_HEADER: the pending rerun whose owed run it carries.
    owed_by: Optional[str] = None


@dataclass
class Body:
    """One run of a body, as the ledger sees it."""

    task_id: str
    key: str
    version: int
    process: Any
    lease: Any
    started: float
    ended: Optional[float] = None
    how: str = ""
    lost_at: Optional[float] = None
    #: Its call's outcome was Ran: it ran to its end, the end recorded.
    completed: bool = False
    #: It called ``retry()``: its attempt ended, its lease went back, Retry leaves it.
    handed_off: bool = False


class Traced:
    """What every simulated world has: its seed, its scheduler (whose stream of draws is
    the schedule), the trace of its steps, what the library said at WARNING and above,
    and store outages (``store`` is the world's :class:`SharedStore`)."""

    store: SharedStore

    def __init__(self, seed: int, trace_lines: int) -> None:
        self.seed = seed
        self.scheduler = Scheduler(seed, self._note)
        self.rng = self.scheduler.rng
        self.trace: deque[str] = deque(maxlen=trace_lines)
        self.full_trace: Optional[list[str]] = None
        self.warnings: list[str] = []

    def _note(self, line: str) -> None:
        self.trace.append(line)
        if self.full_trace is not None:
            self.full_trace.append(line)

    def note(self, text: str) -> None:
        self._note(f"{self.scheduler.now:9.3f} {text}")

    def _outage(self, on: bool) -> None:
        self.store.outage = on
        self.note("store outage begins" if on else "store outage ends")


class World(Traced):
    def __init__(
        self,
        seed: int,
        config: Optional[Config] = None,
        trace_lines: int = 400,
        faults: int = FAULTS,
    ) -> None:
        super().__init__(seed, trace_lines)
        if config is None:
            config = draw_config(self.rng)
            config = _with_later_draws(config, seed, faults)
        self.config = config
        self.settings = self.config.settings()
        #: Ids of the calls the library names before it sends them (an owed run's
        #: carrier): drawn from the seed, apart from the schedule's own stream of draws.
        self._ids = random.Random(f"{seed}:ids")
        self.queue: list[Message] = []
        self._seq = itertools.count()
        self.unacked: dict[str, Message] = {}
        self.queue_changed: Optional[SimEvent] = None
        self.bodies: list[Body] = []
        #: task id -> what became of its message(s): (time, kind, detail)
        self.ends: dict[str, list[tuple[float, str, Any]]] = {}
        self.arrived: dict[str, tuple[float, str, int]] = {}
        #: Calls the worker sends for the runs dead pending reruns owed, as ``arrived``.
        self.owed: dict[str, tuple[float, str, int]] = {}
        #: A call whose owed run went to a new call -> that call's task id.
        self.owed_to: dict[str, str] = {}
        self.children: list[Any] = []
        self.running: dict[int, Message] = {}
        self.losses: dict[int, float] = {}
        #: The requeue count of each call's last delivery taken by a child.
        self.taken_requeues: dict[str, int] = {}
        self.faults_until = self.config.window
        #: The calls sent through apply_async that are not over yet, by key.
        self.live: dict[str, set[str]] = {}
        #: Sends refused at enqueue: task id -> (when, key, the call named instead).
        self.refused: dict[str, tuple[float, str, str]] = {}
        self.handoff_chance = random.Random(seed * 7919 + 21)  # the third world's
        #: The leases still held when their holder died, which its worker must keep as
        #: a failed run's (a rate slot, and under ``unique_after="end"`` a window):
        #: owner -> whether a window is owed (the call does not come back).
        self.held_at_death: dict[str, bool] = {}
        config = self.config
        #: No fault of any kind is drawn: every store call is answered.
        self.faultless = config.link == LinkFaults() and not (
            config.kills
            or config.pauses
            or config.outages
            or config.partitions
            or config.step_kills
            or config.lost_acks
            or config.handoff_kills
        )

    # --- the run -----------------------------------------------------------------------

    def run(self) -> None:
        name = f"sim-{self.seed}"
        # The library's own draws (a requeue's jitter) come from the seed too.
        saved_random = random.getstate()
        random.seed(self.seed)
        # Kill notes are files: the world's go to a folder of its own, never beside the
        # notes of real workers on this machine (which a simulated clock could sweep).
        with tempfile.TemporaryDirectory(prefix="sim-notes-") as folder:
            notes = os.path.join(folder, "killed")
            saved_notes_dir = kill_notes.notes_dir
            kill_notes.notes_dir = lambda: notes  # type: ignore[assignment]
            try:
                self._run_installed(name)
            finally:
                kill_notes.notes_dir = saved_notes_dir  # type: ignore[assignment]
                random.setstate(saved_random)

    def _run_installed(self, name: str) -> None:
        scheduler, config = self.scheduler, self.config
        with scheduler.installed():
            self.store = SharedStore(scheduler, name)
            self.store.faults = config.link
            self.store.faults_on = True
            self.queue_changed = SimEvent()
            receiver = self._on_loss
            signals.lease_lost.connect(receiver)
            library = logging.getLogger("celery_exclusive")
            handler = TraceHandler(self)
            library.addHandler(handler)
            propagate, library.propagate = library.propagate, False
            try:
                self._plan()
                scheduler.after_step = self.check
                scheduler.on_death = self._died
                scheduler.run(until=config.window)
                self.store.faults_on = False
                self.note("faults end")
                scheduler.run(until=config.window + config.settle)
                self.check()
                self.check_ends()
            finally:
                library.removeHandler(handler)
                library.propagate = propagate
                signals.lease_lost.disconnect(receiver)
                memory_module._stores.pop(name, None)
                # Also after a violation: the next schedule's processes reuse these pids.
                for per_process in (heartbeat, keeper, feed, running_stoppers):
                    per_process.forget()

    def _plan(self) -> None:
        config, rng, scheduler = self.config, self.rng, self.scheduler
        for i in range(config.children):
            self._spawn_child(i)
        keys = [f"exclusive:k{i}" for i in range(config.keys)]
        self.versions = dict.fromkeys(keys, 0)
        later = random.Random(self.seed * 7919 + 20)  # the third world's, as above
        for _ in range(config.messages):
            message = Message(
                task_id=uuid.UUID(int=rng.getrandbits(128)).hex[:12],
                key=rng.choice(keys),
                version=0,  # the key's next, as it arrives: the latest change is the last
                duration=rng.choice([0.3, 1.0, config.lease_ttl * 1.5, config.lease_ttl * 3]),
                by_name=later.random() < config.by_name,
                retry_at=later.randint(0, 3) if later.random() < config.retrying else None,
            )
            when = rng.uniform(0, config.window * 0.6)
            scheduler.at(when, lambda m=message: self._arrive(m))
        for _ in range(config.kills):
            scheduler.at(rng.uniform(0, config.window), self._kill_a_child)
        for _ in range(config.outages):
            start = rng.uniform(0, config.window)
            length = rng.uniform(config.lease_ttl / 2, config.lease_ttl * 2)
            scheduler.at(start, lambda: self._outage(True))
            scheduler.at(min(start + length, config.window), lambda: self._outage(False))
        chance = random.Random(self.seed * 7919 + 18)  # not the schedule's stream
        for _ in range(config.partitions):
            start = chance.uniform(0, config.window)
            length = chance.uniform(config.lease_ttl / 2, config.lease_ttl * 2)
            pick = chance.random()
            scheduler.at(start, lambda n=length, r=pick: self._partition(n, r))
        self.store.kill_at_calls = {
            (chance.choice(STEPS), chance.randint(1, 30)) for _ in range(config.step_kills)
        }
        for _ in range(config.pauses):
            seconds = rng.choice([0.2, config.lease_ttl * 0.5, config.lease_ttl * 2])
            scheduler.at(rng.uniform(0, config.window), lambda s=seconds: self._pause_a_child(s))

    def _partition(self, seconds: float, pick: float) -> None:
        """Black-hole one process's link for ``seconds``: one that runs a body if any."""
        alive = [c for c in self.children if c.alive]
        holding = [c for c in alive if c.pid in self.running]
        chosen = holding or alive
        if not chosen:
            return
        child = chosen[int(pick * len(chosen))]
        until = min(self.scheduler.now + seconds, self.faults_until)
        self.store.partitioned[child.pid] = until
        self.note(f"{child.name}'s link to the store is cut until {until:.3f}")

    def _arrive(self, message: Message) -> None:
        self.versions[message.key] += 1
        message.version = self.versions[message.key]
        if self.config.scope != "run" and not message.by_name and not self._claim_send(message):
            return
        if self.config.stamped:
            message.as_of = runtime.wall()  # as the producer's apply_async stamps it
        self.arrived[message.task_id] = (self.scheduler.now, message.key, message.version)
        self.note(f"publish {message.task_id} {message.key} v{message.version}")
        self._publish(message, 0.0)

    def _claim_send(self, message: Message) -> bool:
        """``apply_async`` under ``scope="enqueue"``/``"both"``, as ExclusiveTask's: the
        call claims its key's enqueue mark (the producer reaches the store without
        faults). False: refused, nothing sent. Checks that a send is refused only for a
        call not over yet, and accepted only while no other call sent this way is."""
        key, task_id = message.key, message.task_id
        queued = enqueue.claim(_Direct(self.store), TASK, key, task_id, 3600.0)
        live = self.live.setdefault(key, set())
        if queued is None:
            others = sorted(live - {task_id})
            if others and not self._mark_said(key):
                raise Violation(
                    f"{task_id} was sent for {key!r} while {', '.join(others)} was queued or "
                    "running: its enqueue mark was gone, nothing said why"
                )
            live.add(task_id)
            return True
        self.note(f"send of {task_id} ({key} v{message.version}) refused: {queued} is queued")
        self.refused[task_id] = (self.scheduler.now, key, queued)
        in_hand = any(m.task_id == queued for m in self.running.values())
        if queued not in live and not in_hand and not self._mark_said(key):
            raise Violation(
                f"a send for {key!r} was refused in favour of {queued}, which was over: "
                "the new call was dropped, nothing said why (its enqueue mark outlived it)"
            )
        return False

    def _mark_said(self, key: str) -> bool:
        """Whether the library said that ``key``'s enqueue mark was left to expire."""
        return any(f"enqueue mark of {key!r} left to expire" in line for line in self.warnings)

    # --- the broker --------------------------------------------------------------------

    def _publish(self, message: Message, countdown: float) -> None:
        message.eta = self.scheduler.now + countdown
        message.seq = next(self._seq)
        self.queue.append(message)
        if countdown > 0:
            self.scheduler.at(message.eta, self.queue_changed.set)
        else:
            self.queue_changed.set()

    def _take(self) -> Message:
        """Block until a message is due; take it (a delivery)."""
        scheduler = self.scheduler
        while True:
            due = [m for m in self.queue if m.eta <= scheduler.now]
            if due:
                message = min(due, key=lambda m: (m.eta, m.seq))
                self.queue.remove(message)
                return message
            self.queue_changed.clear()
            self.queue_changed.wait()

    def _ack(self, message: Message) -> None:
        self.unacked.pop(message.task_id, None)

    def _deliver_again_if_unacked(self, message: Message) -> None:
        """The visibility timeout of an unacknowledged message passed: the broker puts
        it back in the queue, to be delivered again (Redis's and SQS's transports)."""
        if self.unacked.get(message.task_id) is message:
            del self.unacked[message.task_id]
            self.note(f"visibility timeout: copy of {message.task_id} delivered again")
            self._publish(Message(**{**message.__dict__}), 0.0)

    # --- processes --------------------------------------------------------------------

    def _spawn_child(self, index: int) -> None:
        process = self.scheduler.spawn(f"child{index}", self._child_main)
        self.children.append(process)

    def _child_main(self) -> None:
        backend = LinkedStore(self.store, self.rng, self._label())
        while True:
            message = self._take()
            self._handle(message, backend)

    def _label(self) -> str:
        process = self.scheduler.running_process()
        return process.name

    def _kill_a_child(self) -> None:
        alive = [c for c in self.children if c.alive]
        if alive:
            self.scheduler.kill(self.rng.choice(alive), "SIGKILL by the world")

    def _died(self, process: Any) -> None:
        """A process died (killed by the world, or by its own grace timer): its worker
        learns of it at once, in its own main process."""
        if process in self.children:
            self.scheduler.at(self.scheduler.now, lambda: self._child_died(process))

    def _pause_a_child(self, seconds: float) -> None:
        alive = [c for c in self.children if c.alive and not c.paused]
        if alive:
            self.scheduler.pause(self.rng.choice(alive), seconds)

    # --- one message, in a child: Celery's side ---------------------------------------

    def _handle(self, message: Message, backend: LinkedStore) -> None:
        config, scheduler = self.config, self.scheduler
        process = scheduler.running_process()
        self.running[process.pid] = message
        self.taken_requeues[message.task_id] = message.requeues
        self.note(f"{process.name} takes {message.task_id} v{message.version} r{message.requeues}")
        if config.acks_late:
            self.unacked[message.task_id] = message
            scheduler.at(
                scheduler.now + config.visibility_timeout,
                lambda: self._deliver_again_if_unacked(message),
            )
        args = (message.key, message.version, message.duration)
        kwargs: dict = {}
        if message.arguments is not None:
            args, kwargs = message.arguments
        call = attempt.Call(
            TASK,
            message.task_id,
            message.key,
            self.settings,
            backend,
            tuple(args),
            dict(kwargs),
            requeues=message.requeues,
            retries=message.retries,
            resumed=message.resumed,
            set_aside=message.set_aside,
            as_of=message.as_of,
            debounced=message.debounced,
            owed_by=message.owed_by,
        )
        handler = SimOutcomes(self, message)
        keeps_mark = False
        try:
            try:
                outcome = attempt.run(call, host_for(config, self._new_task_id), self._body)
                keeps_mark = enqueue.keeps_mark(outcome)
                outcome.carry_out(handler)
            except Retry:
                keeps_mark = True  # the same task id comes again
                self._end(message, "retried")
                self._ack(message)
            except (LeaseLost, ExclusiveError) as exc:
                self._end(message, "failed", type(exc).__name__)
                self._ack_at_end(message)
            if config.scope != "run" and not keeps_mark:
                # As the call leaves its task's __call__ (execution._enter).
                enqueue.clear(backend, message.key, message.task_id)
        finally:
            if process.alive:  # a dead one's call is its worker's to end
                self.running.pop(process.pid, None)

    def _ack_at_end(self, message: Message) -> None:
        if (
            self.config.lost_acks
            and self.rng.random() < self.config.lost_acks
            and self.store.faults_on
        ):
            self.note(f"ack of {message.task_id} lost")
            return  # the broker delivers it again at its visibility timeout
        self._ack(message)

    def _body(self, args: tuple, kwargs: dict) -> Any:
        key, version, duration = args
        lease = attempt.current_lease()
        current = attempt.current()
        task_id = current.call.task_id if current is not None else "?"
        body = Body(
            task_id, key, version, self.scheduler.running_process(), lease, self.scheduler.now
        )
        self._check_window(body)
        self._check_rate(body)
        self._check_replaced(body)
        self.bodies.append(body)
        self.note(
            f"body {task_id} v{version} starts, token {getattr(lease, 'fencing_token', None)}"
        )
        steps = max(1, int(duration / 0.25))
        message = self.running.get(self.scheduler.running_process().pid)
        try:
            for step in range(steps):
                if message is not None and message.retry_at == step and message.retries < 2:
                    self._retry(message)
                if self.config.stubborn:
                    # A body that swallows the interrupt (a broad except): only the kill
                    # after its grace stops it.
                    with contextlib.suppress(LeaseLost):
                        runtime.sleep(duration / steps)
                    continue
                if self.config.checking_bodies or self.config.on_lease_lost != "terminate":
                    lease.ensure_held()
                runtime.sleep(duration / steps)
            body.how = "returned"
            return version
        except BaseException as exc:
            body.how = type(exc).__name__
            raise
        finally:
            body.ended = self.scheduler.now
            self.note(f"body {task_id} v{version} ends: {body.how}")

    def _check_window(self, body: Body) -> None:
        """A body starts no sooner than ``unique_for`` after the end of the key's last run,
        if that run's lease was :meth:`_kept` for its window."""
        window = self.config.unique_for
        if not window or not isinstance(body.lease, HeldLease):
            return
        for before in reversed(self.bodies):
            if before.key != body.key or before.ended is None:
                continue
            if self._kept(before, window=True) and body.started < before.ended + window - 1e-9:
                raise Violation(
                    f"body {body.task_id} starts on {body.key!r} at {body.started:.3f}, "
                    f"within the window of {window}s after {before.task_id}'s run ended at "
                    f"{before.ended:.3f}"
                )
            return

    def _check_replaced(self, body: Body) -> None:
        """Under ``replace``, a body starts only once every run its key's newer calls
        replaced has stopped (unless that run's process was paused during its run, which
        no bound covers: it finds its deadline passed as it resumes, and stops within its
        grace of running, as any holder whose lease lapsed while it was paused; its
        fencing token is the lower one)."""
        if self.config.on_duplicate != "replace" or not isinstance(body.lease, HeldLease):
            return  # a run without a lease (the store down, "run") was said to be one
        for other in self.bodies:
            lease = other.lease
            if (
                other.key != body.key
                or other.ended is not None
                or not other.process.alive
                or any(end > other.started for _, end in other.process.pauses)
                or not isinstance(lease, HeldLease)
            ):
                continue
            by = marks.replaced_by(self.store.memory, other.key, lease.fencing_token)
            if by is not None:
                raise Violation(
                    f"body {body.task_id} starts on {body.key!r} at {body.started:.3f} while "
                    f"{other.task_id} (token {lease.fencing_token}), which {by} replaced, "
                    "still runs"
                )

    def _kept(self, body: Body, window: bool = False) -> bool:
        """Whether the lease of ``body``'s run was kept past its end: as the store said,
        or certainly (a run that returned in a world without faults, where no store call
        can fail); once its process died, if its lease was still held then (its worker
        keeps it as a failed run's: its rate slot, and its window, asked for with
        ``window``, only where a failed run keeps one)."""
        lease = body.lease
        if not isinstance(lease, HeldLease):
            return False
        if not body.process.alive:
            owed = self.held_at_death.get(lease.grant.owner)
            return owed is not None and (owed or not window)
        returned = self.faultless and body.how == "returned" and not lease.lost
        return lease.kept_for is not None or returned

    def _check_rate(self, body: Body) -> None:
        """Under a rate, a grant (as the store applied it) finds fewer than ``limit``
        earlier grants of its key in the period before it whose slots were certainly
        held that long: still running, or ended and :meth:`_kept`."""
        period = self.config.rate_period
        if not period or not isinstance(body.lease, HeldLease):
            return
        granted_at = self.store.granted_at
        at = granted_at.get((body.key, body.lease.fencing_token))
        if at is None:
            return
        held = []
        for before in self.bodies:
            lease = before.lease
            if before.key != body.key or not isinstance(lease, HeldLease):
                continue
            since = granted_at.get((before.key, lease.fencing_token))
            if since is None or not at - period + 1e-9 < since < at:
                continue
            # A run that sent its retry gave its slot back with it (the retry would
            # meet its own slot otherwise).
            running = (
                before.ended is None
                and not before.handed_off
                and not lease.lost
                and before.process.alive
            )
            if running or (before.ended is not None and self._kept(before)):
                held.append(before)
        if len(held) >= self.config.limit:
            raise Violation(
                f"body {body.task_id} granted {body.key!r} at {at:.3f}, with "
                f"{len(held)} grants in the {period}s before it (rate "
                f"{self.config.limit}/{period}s): "
                + ", ".join(
                    f"{b.task_id} at {granted_at[(b.key, b.lease.fencing_token)]:.3f}" for b in held
                )
            )

    def _retry(self, message: Message) -> None:
        """The body calls ``retry()``, as ExclusiveTask's ``retry`` and ``apply_async``
        carry it out: the attempt ends and its lease goes back as the new message (the
        next of its retries, with the pending rerun's arguments if it runs as one) goes
        out through apply_async; then Retry leaves the body."""
        current = attempt.current()
        assert current is not None
        again = Message(**{**message.__dict__})
        again.retries += 1
        if current.arguments is not None:
            again.arguments = decode_call(current.arguments)
        current.handing_off = True
        try:
            body = next(b for b in reversed(self.bodies) if b.task_id == message.task_id)
            body.handed_off = True  # from here: the release is applied before it returns
            handed = attempt.hand_off(message.task_id)
            assert handed is not None
            self._maybe_killed_handing_off("its lease went back")
            self.note(f"{message.task_id} retries (r{again.retries})")
            self._send_again(again, 0.5)  # through apply_async, as the library's sends
            self._maybe_killed_handing_off("its retry went out")
            handed.handed_off()
        finally:
            current.handing_off = False
        raise Retry()

    def _maybe_killed_handing_off(self, step: str) -> None:
        if self.store.faults_on and self.handoff_chance.random() < self.config.handoff_kills:
            process = self.scheduler.running_process()
            self.scheduler.kill(process, f"SIGKILL as it retries: {step}")
            raise Killed

    def _end(self, message: Message, kind: str, detail: Any = None) -> None:
        if kind in TERMINAL or kind == "lost":
            self.live.get(message.key, set()).discard(message.task_id)
        self.ends.setdefault(message.task_id, []).append((self.scheduler.now, kind, detail))
        self.note(f"{message.task_id} ends: {kind} {detail if detail is not None else ''}")

    # --- the worker's main process, when a child dies -------------------------------

    def _child_died(self, child: Any) -> None:
        """What Celery's worker does when a pool child dies: it reports the call lost
        (WorkerLostError), the library frees what the child held, sends again a call
        killed for its lost lease, hands a dead pending rerun's run on; then the pool
        starts a new child."""
        message = self.running.pop(child.pid, None)
        config, store = self.config, self.store
        if message is not None:
            # The world acts as the worker's main process: its store calls take no time.
            note = kill_notes.take_kill_note(message.task_id, child.pid)
            handed_back = config.acks_late and config.reject_on_worker_lost
            direct = _Direct(store)
            key = message.key
            if note is not None and not handed_back:
                rerun = attempt.rerun_of_killed(
                    self.settings, key, message.requeues, note.arguments, message.as_of
                )
                if rerun is not None:
                    self._end(message, "killed, sent again")
                    SimOutcomes(self, message).handle_requeue(rerun)
                    self._ack(message)
                    self._free_left(direct, message, child, comes_back=True)
                    self._replace(child)
                    return
            if handed_back:
                self._end(message, "lost, handed back")
                self._ack(message)
                self._publish(Message(**{**message.__dict__}), 0.0)
            else:
                self._end(message, "lost", "WorkerLostError")
                self._ack(message)
                if config.scope != "run":
                    enqueue.clear(direct, key, message.task_id)
                if config.acks_late:
                    marks.mark_finished(direct, key, message.task_id, message.retries, 3600.0)
                if config.on_duplicate == "rerun":
                    kept = marks.resume_arguments(direct, key, message.task_id)
                    marks.drop_resume(direct, key, message.task_id, kept)
                    owed = attempt.owed_rerun(
                        direct, key, message.task_id, self.settings, self._new_task_id
                    )
                    if owed is not None:
                        self._send_owed(message, owed)
            self._free_left(direct, message, child, comes_back=handed_back)
        self._replace(child)

    def _new_task_id(self) -> str:
        """A task id for a call the library names before it is sent (see ``_ids``)."""
        return uuid.UUID(int=self._ids.getrandbits(128)).hex[:12]

    def _send_owed(self, message: Message, owed: outcomes.OwedRun) -> None:
        """A new call for the run a pending rerun owed, as the host sends it."""
        key, version, duration = owed.args
        # The schedule draws where it drew a new message's id before carriers were named
        # in the mark: a schedule found earlier is still that schedule.
        self.rng.getrandbits(128)
        new = Message(
            task_id=owed.task_id,
            key=key,
            version=version,
            duration=duration,
            as_of=owed.as_of,  # as the host sends it: the change it carries is that old
            owed_by=message.task_id,
        )
        self.owed[new.task_id] = (self.scheduler.now, key, version)
        self.owed_to[message.task_id] = new.task_id
        self.note(f"owed rerun of {message.task_id} goes to {new.task_id}")
        self._send_again(new, 0.0)

    def _send_again(self, message: Message, countdown: float) -> None:
        """A message of a call that goes on (a requeue, a copy set aside, the run a
        pending rerun owed, a retry): through the task's apply_async, as the host sends
        it, which under ``scope="enqueue"``/``"both"`` claims the key's enqueue mark as
        it goes, where the mark is free."""
        if self.config.scope != "run":
            with enqueue.going_on():
                direct = _Direct(self.store)
                queued = enqueue.claim(direct, TASK, message.key, message.task_id, 3600.0)
            if queued is not None:
                self.note(f"send of {message.task_id} refused: {queued} is queued")
                return
            if direct.read_mark(message.key, marks.QUEUED) == message.task_id:
                self.live.setdefault(message.key, set()).add(message.task_id)
        self._publish(message, countdown)

    def _free_left(
        self, direct: Any, message: Message, child: Any, comes_back: bool = False
    ) -> None:
        """Release (or keep, for its window or rate slot) what the dead child held, as
        the worker's main process does once the child is gone: without ``acks_late``,
        twice (as the child exits, as for a call that does not come back; again when
        Celery reports the death); an RQ worker, once."""
        once = self.config.acks_late or self.config.host == "rq"
        for look in [comes_back] if once else [False, comes_back]:
            for left in reaper.leases_on_this_host(
                direct, message.key, message.task_id, self.settings.limit
            ):
                if left.pid == child.pid:
                    window = self.config.unique_after == "end" and not look
                    self.held_at_death[left.lease.owner] = window
                    keep = reaper.kept_after_death(self.settings, left, look)
                    reaper.let_go(direct, left, message.task_id, keep)

    def _replace(self, child: Any) -> None:
        index = self.children.index(child)
        delay = self.rng.uniform(0.1, 1.0)
        self.scheduler.at(self.scheduler.now + delay, lambda: self._respawn(index))

    def _respawn(self, index: int) -> None:
        process = self.scheduler.spawn(f"child{index}.{len(self.children)}", self._child_main)
        self.children[index] = process

    # --- invariants --------------------------------------------------------------------

    def _on_loss(self, sender: Any = None, key: Any = None, task_id: Any = None, **kw: Any) -> None:
        """``lease_lost``, sent in the process that holds the lease (its heartbeat, its
        deadline keeper, its body): the body of that task there is told."""
        process = self.scheduler.running_process()
        for body in self.bodies:
            if (
                body.task_id == task_id
                and body.process is process
                and body.ended is None
                and body.lost_at is None
            ):
                body.lost_at = self.scheduler.now

    def check(self) -> None:
        """After every step: no more than ``limit`` bodies of one key run under leases
        not lost; a body told of its loss stops within its grace."""
        now = self.scheduler.now
        by_key: dict[str, list[Body]] = {}
        for body in self.bodies:
            if body.ended is not None or not body.process.alive or body.process.paused:
                continue
            if body.handed_off:
                continue  # it sent itself again (retry()) and gave its lease back: it ends
            lease = body.lease
            if isinstance(lease, HeldLease) and not lease.lost:
                by_key.setdefault(body.key, []).append(body)
                self._check_deadline(body, lease, now)
            if (
                body.lost_at is not None
                and self.config.on_lease_lost == "terminate"
                and self._ran_since(body, body.lost_at) > self.config.terminate_grace + 1.0
            ):
                raise Violation(
                    f"body {body.task_id} was told of its loss at {body.lost_at:.3f} and "
                    f"still runs at {now:.3f}, past its grace of {self.config.terminate_grace}s"
                )
        for key, running in by_key.items():
            if len(running) > self.config.limit:
                raise Violation(
                    f"{len(running)} bodies of {key!r} run at {now:.3f} under leases not "
                    f"lost (limit {self.config.limit}): "
                    + ", ".join(f"{b.task_id} token {b.lease.fencing_token}" for b in running)
                )

    def _check_deadline(self, body: Body, lease: HeldLease, now: float) -> None:
        """A holder never counts its lease past the store's expiry of it: what keeps
        two bodies from overlapping when the holder cannot reach the store. (Both read
        one virtual monotonic clock; the deadline counts from the send of the last
        grant or renewal the store confirmed, the store's expiry from when it applied.)"""
        if lease.deadline <= now:
            return  # past: the keeper flags it at this instant
        if marks.replaced_by(self.store.memory, body.key, lease.fencing_token):
            return  # freed by a newer call, which runs once this one stopped (checked)
        grant = self.store.memory._store.grants.get(body.key, {}).get(lease.grant.owner)
        kept_until = grant.expires_at if grant is not None else float("-inf")
        if lease.deadline > kept_until + 1e-9:
            kept = "no longer has it" if grant is None else f"keeps it until {kept_until:.3f}"
            raise Violation(
                f"body {body.task_id} counts its lease on {body.key!r} (token "
                f"{lease.fencing_token}) as held until {lease.deadline:.3f}, but the store "
                f"{kept}"
            )

    def _ran_since(self, body: Body, since: float) -> float:
        """Virtual seconds the body's process was not paused, from ``since`` to now (the
        grace counts the time a process runs, as terminate's grace timer does)."""
        now = self.scheduler.now
        paused = sum(
            max(0.0, min(end, now) - max(start, since)) for start, end in body.process.pauses
        )
        return now - since - paused

    def check_ends(self) -> None:
        """At the end: every message reached one defined end; none ran twice unless a
        loss was signalled; under ``rerun`` the last change was seen by a run that
        started after it arrived."""
        for thread, exc in self.scheduler.died:
            raise Violation(f"{thread} died: {type(exc).__name__}: {exc}")
        if self.queue or self.unacked:
            left = [m.task_id for m in self.queue] + list(self.unacked)
            raise Violation(f"messages never ended: {left}")
        ran: dict[str, list[Body]] = {}
        for body in self.bodies:
            if body.how == "returned":
                ran.setdefault(body.task_id, []).append(body)
        for task_id, (_, key, version) in {**self.arrived, **self.owed}.items():
            ends = self.ends.get(task_id, [])
            if not ends:
                raise Violation(f"{task_id} ({key} v{version}) reached no end")
            final = {kind for _, kind, _ in ends if kind in TERMINAL}
            if (
                not final
                and not any(kind == "lost" for _, kind, _ in ends)
                and not self._gave_up_unsaid(task_id)
                and not self._over_unseen(task_id, key)
            ):
                raise Violation(
                    f"{task_id} ({key} v{version}) reached no defined end, and nothing "
                    "of it is queued: "
                    + ", ".join(f"{kind} at {when:.3f}" for when, kind, _ in ends)
                )
            if not final and self._gave_up_unsaid(task_id):
                raise Violation(
                    f"{task_id} ({key} v{version}) gave up, its process died before it "
                    "could say so, and nothing said it: "
                    + ", ".join(f"{kind} at {when:.3f}" for when, kind, _ in ends)
                )
            if len(final) > 1 and not any(task_id in line for line in self.warnings):
                raise Violation(
                    f"{task_id} ({key} v{version}) reached {len(final)} different ends "
                    f"({', '.join(sorted(final))}), nothing said why"
                )
            runs = sorted(
                (b for b in self.bodies if b.task_id == task_id and self._ended(b)),
                key=lambda b: b.started,
            )
            window = host_for(self.config).finished_ttl
            for first, again in zip(runs, runs[1:]):
                lost = (
                    any(
                        b.lost_at is not None or not self._ended(b)
                        for b in self.bodies
                        if b.task_id == task_id and first.started <= b.started < again.started
                    )
                    or any(  # its process died before the end was recorded (at least once):
                        # before the store freed the run's lease, which carries the record
                        kind.startswith("lost")
                        and first.started <= when <= again.started
                        and not self._freed_by(first, when)
                        for when, kind, _ in ends
                    )
                    or any(  # the store took the record of its end late, or never: said
                        f"could not record that {TASK}[{task_id}] ended" in line
                        or ("release arrived after the lease expired" in line and task_id in line)
                        or (f"[{task_id}]" in line and "running WITHOUT a lease" in line)
                        or (line.startswith("lease lost") and f"task_id={task_id}" in line)
                        for line in self.warnings
                    )
                )
                # A copy is dropped for the finished mark's ttl after the end, and no
                # longer (the documented window: docs/how-to/duplicates/redelivery.md).
                if not lost and again.started < (first.ended or 0) + window:
                    raise Violation(
                        f"{task_id} ran to its end at {first.ended:.3f} and again from "
                        f"{again.started:.3f}, within its finished mark's {window:.1f}s, "
                        "no loss signalled"
                    )
        # Unstamped calls (a send_task by name) are ordered by when a worker first tries
        # them, not by when they were sent: the documented limit of "latest".
        unordered = not self.config.stamped
        if self.config.on_duplicate == "rerun" and not unordered:
            last: dict[str, tuple[float, int]] = {}
            for arrived, key, version in self.arrived.values():
                if key not in last or version > last[key][1]:
                    last[key] = (arrived, version)
            for key, (arrived, version) in last.items():
                task_id = next(t for t, a in self.arrived.items() if a[1:] == (key, version))
                if self._failed_on_the_way(task_id, arrived):
                    continue  # a call it counted on failed, with a named error
                if any(
                    f"as the pending rerun of {key!r} and could not hand its run on" in line
                    or (f"on {key!r}" in line and "running WITHOUT a lease" in line)
                    for line in self.warnings
                ):
                    continue  # the store failed the hand-over, or runs went unlocked: said
                seen = [
                    b
                    for b in self.bodies
                    if b.key == key and b.started >= arrived and b.version >= version
                ]
                if not seen:
                    raise Violation(
                        f"under rerun, no run of {key!r} started after v{version} arrived "
                        f"at {arrived:.3f} and saw it"
                    )
        if self.config.debounce and not unordered:
            self._check_debounced()

    def _check_debounced(self) -> None:
        """Under a debounce nothing is lost: every call's change is seen by a run of its
        key that started after the call arrived (the run of its burst, with its latest
        arguments, or a later one), or superseded by a run of a newer change, unless a
        call it counted on failed with a named error, or a run went unlocked, said."""
        for task_id, (arrived, key, version) in self.arrived.items():
            if self._failed_on_the_way(task_id, arrived) or self._run_by_failed(task_id):
                continue
            if any(
                (f"on {key!r}" in line and "running WITHOUT a lease" in line)
                or "gives up after" in line
                for line in self.warnings
            ):
                continue
            # A newer change is sent later: a run that saw one supersedes this change,
            # even one taken before this call came (late: its first try failed).
            seen = [
                b
                for b in self.bodies
                if b.key == key
                and (b.version > version or (b.version == version and b.started >= arrived))
            ]
            if not seen:
                raise Violation(
                    f"under debounce, no run of {key!r} started after v{version} "
                    f"({task_id}) arrived at {arrived:.3f} and saw it"
                )

    def _run_by_failed(self, task_id: str) -> bool:
        """Whether the call ``task_id`` is covered by the run of a call that took its
        burst holding the key (granted after ``task_id`` arrived) and then ended in a
        named error: that run died as any run does."""
        arrived = self.arrived[task_id][0]
        for _, kind, run_by in self.ends.get(task_id, []):
            if kind != "coalesced" or not run_by:
                continue
            failed = any(
                k in ("lost", "failed", "gave up") for _, k, _ in self.ends.get(run_by, [])
            )
            if failed and any(t >= arrived for t in self.store.grants_of.get(run_by, ())):
                return True
        return False

    def _gave_up_unsaid(self, task_id: str) -> bool:
        """Whether the call ``task_id`` reached no end its host saw (its process died
        once its attempt had ended, and each copy found the record and was dropped),
        where that end can only have been a give-up (``requeue`` or ``wait`` at
        ``requeue_max_retries``: a held key is requeued, a free one runs), and nothing
        said so."""
        config, ends = self.config, self.ends.get(task_id, [])
        limit = config.requeue_max_retries
        if config.on_duplicate not in ("requeue", "wait") or limit is None:
            return False
        if config.debounce:
            return False  # its recorded end may be its burst's run covering it
        if any(kind == "lost" for _, kind, _ in ends):  # WorkerLostError: named
            return False
        if any(b.task_id == task_id and self._ended(b) for b in self.bodies):
            return False
        if self.taken_requeues.get(task_id, 0) < limit:
            return False
        return not any(f"[{task_id}] gives up after" in line for line in self.warnings)

    def _over_unseen(self, task_id: str, key: str) -> bool:
        """Whether the call ``task_id`` is over without an end its host saw: its process
        died once its attempt had ended (a run's end recorded, a duplicate's end as
        skipped or coalesced recorded, or a warning said), and each copy found the
        record and was dropped."""
        mark = self.store.memory.read_mark(marks.finished_key(key, task_id), marks.DONE)
        returned = any(b.task_id == task_id and b.how == "returned" for b in self.bodies)
        return (
            (mark is not None and int(mark) < 0)
            # A run's end recorded on its own (its release with the record unanswered).
            or (mark is not None and int(mark) >= 0 and returned)
            or any(f"[{task_id}]" in line for line in self.warnings)
            or any(b.task_id == task_id and self._ended(b) for b in self.bodies)
        )

    def _ended(self, body: Body) -> bool:
        """Whether ``body`` ran to its end and that end was recorded: its call's outcome
        reached the host, or the store applied the release of its lease (which carries
        the record), even if its process died before it could say so."""
        if body.completed or body.how != "returned":
            return body.completed
        if self._freed_by(body, float("inf")):
            return True
        # Under unique_for or a rate the run's lease may be kept, not released: its end
        # is recorded on its own (the finished mark of its task id), before it is kept.
        keeps = self.config.unique_for or self.config.rate_period
        mark = self.store.memory.read_mark(marks.finished_key(body.key, body.task_id), marks.DONE)
        return bool(keeps) and mark is not None and int(mark) >= 0

    def _freed_by(self, body: Body, when: float) -> bool:
        """Whether the store had applied the release of ``body``'s lease by ``when``."""
        lease = body.lease
        if not isinstance(lease, HeldLease):
            return False
        freed = self.store.freed_at.get(lease.grant.owner)
        return freed is not None and freed <= when

    def _failed_on_the_way(self, task_id: str, since: float, depth: int = 0) -> bool:
        """Whether the call ``task_id`` ended in a named error (lost with its process,
        failed, gave up), or the pending rerun it coalesced into did once it had taken
        the change (granted its key after it joined): then its run started and died
        with it, as any run does, and the error says so. A pending rerun that died
        before it took the change owes it a run (the worker hands it on), and the new
        call that run went to is followed the same way."""
        ends = self.ends.get(task_id, [])
        # A call whose process died after it gave up (said in the log first) ends there:
        # the copy delivered again finds the record of its end and is dropped.
        gave_up = any(f"[{task_id}] gives up after" in line for line in self.warnings)
        if gave_up or any(kind in ("lost", "failed", "gave up") for _, kind, _ in ends):
            if depth == 0 or any(t >= since for t in self.store.grants_of.get(task_id, ())):
                return True
            handed = self.owed_to.get(task_id)
            return (
                handed is not None
                and depth < 20
                and (self._failed_on_the_way(handed, since, depth + 1))
            )
        into = [(when, detail) for when, kind, detail in ends if kind == "coalesced"]
        return depth < 20 and any(self._failed_on_the_way(t, when, depth + 1) for when, t in into)


class Retry(Exception):
    """Celery's ``Retry``: raised by ``retry()``, it leaves the body; the call goes on as
    the message it sent."""


class TraceHandler(logging.Handler):
    """The library's log lines, in the trace, at their virtual time."""

    def __init__(self, world: Traced) -> None:
        super().__init__(logging.DEBUG)
        self.world = world

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format is the library's bug, not the run's
            message = record.msg
        self.world.note(f"log {record.levelname}: {message}")
        if record.levelno >= logging.WARNING:
            self.world.warnings.append(message)


class _Direct:
    """The store as the worker's main process reaches it: no faults, no time."""

    def __init__(self, shared: SharedStore) -> None:
        self._memory = shared.memory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._memory, name)


def host_for(config: Config, new_task_id: Callable[[], str] = attempt.new_call_id) -> attempt.Host:
    """What a prefork child of a Celery worker can do, for these task options (as
    ``celery.execution.host_of`` decides it), or an RQ work horse (as
    ``rq.job.ExclusiveJob`` describes it); its new calls' ids from ``new_task_id``."""
    if config.host == "rq":
        return attempt.Host(
            can_requeue=True,
            stop_process=True if config.on_lease_lost == "terminate" else None,
            noun="job",
            setting_prefix="",
            new_call_id=new_task_id,
        )
    return attempt.Host(
        can_requeue=True,
        new_call_id=new_task_id,
        redelivery=config.acks_late,
        redelivered_when_stopped=config.acks_late and config.reject_on_worker_lost,
        stop_process=True if config.on_lease_lost == "terminate" else None,
        finished_ttl=finished_ttl_for(config.visibility_timeout, 2.0, config.lease_ttl)
        if config.acks_late
        else 0.0,
    )


class SimOutcomes(outcomes.OutcomeHandler):
    """An outcome in the simulated broker's terms, as CeleryOutcomes carries it out."""

    def __init__(self, world: World, message: Message) -> None:
        self.world = world
        self.message = message

    def _done(self, kind: str, detail: Any = None) -> None:
        self.world._end(self.message, kind, detail)
        self.world._ack_at_end(self.message) if self.world.config.acks_late else None

    def handle_ran(self, outcome: outcomes.Ran) -> Any:
        if outcome.owed is not None:
            self.world._send_owed(self.message, outcome.owed)
        process = self.world.scheduler.running_process()
        body = next(
            b
            for b in reversed(self.world.bodies)
            if b.task_id == self.message.task_id and b.process is process
        )
        body.completed = True
        self._done("ran", outcome.result)

    def handle_skipped(self, outcome: outcomes.Skipped) -> Any:
        self._not_itself(outcome.holder_task_id)
        if outcome.holder_task_id is None and outcome.holder is None:
            raise Violation(
                f"{self.message.task_id} was ended as a duplicate of nobody: the key came "
                "free between its refused grant and the read of its holders"
            )
        self._done("skipped", outcome.holder_task_id)

    def handle_replaced(self, outcome: outcomes.Replaced) -> Any:
        self._not_itself(outcome.by)
        self._done("replaced", outcome.by)

    def handle_coalesced(self, outcome: outcomes.Coalesced) -> Any:
        self._not_itself(outcome.rerun_task_id)
        self._done("coalesced", outcome.rerun_task_id)

    def _not_itself(self, other: Optional[str]) -> None:
        if other == self.message.task_id:
            raise Violation(
                f"{other} was ended as a duplicate of itself: an earlier attempt of it "
                "still held its key"
            )

    def handle_requeue(self, outcome: outcomes.Requeue) -> Any:
        world, message = self.world, self.message
        again = Message(**{**message.__dict__})
        again.requeues = outcome.requeues
        if outcome.cause == "lost":
            again.resumed = True
        if outcome.cause == "debounce":
            again.debounced = True
        if outcome.args is not None:
            again.arguments = (outcome.args, outcome.kwargs or {})
        if outcome.as_of is not None:  # over the header it came with, as send_again does
            again.as_of = outcome.as_of
        world.note(f"{message.task_id} requeued ({outcome.cause}) in {outcome.countdown:.2f}s")
        world._send_again(again, outcome.countdown)
        world._ack(message)

    def handle_gave_up(self, outcome: outcomes.GaveUp) -> Any:
        if outcome.owed is not None:
            self.world._send_owed(self.message, outcome.owed)
        self._done("gave up", outcome.cause)

    def handle_waited(self, outcome: outcomes.Waited) -> Any:
        raise DuplicateSkipped("waited in vain", outcome.key, None)

    def handle_unanswered(self, outcome: outcomes.Unanswered) -> Any:
        raise outcome.error

    def handle_set_aside(self, outcome: outcomes.SetAside) -> Any:
        world, message = self.world, self.message
        again = Message(**{**message.__dict__})
        again.requeues = outcome.requeues
        if outcome.as_of is not None:
            again.as_of = outcome.as_of
        again.set_aside = True
        world.note(f"copy of {message.task_id} set aside for {outcome.countdown:.2f}s")
        world._send_again(again, outcome.countdown)
        world._ack(message)

    def handle_dropped(self, outcome: outcomes.Dropped) -> Any:
        self.world.note(f"copy of {self.message.task_id} dropped")
        self.world._ack(self.message)

    def handle_redelivered(self, outcome: outcomes.Redelivered) -> Any:
        world, message = self.world, self.message
        world.note(f"{message.task_id} rejected: back to the queue")
        world._ack(message)
        world._publish(Message(**{**message.__dict__}), 0.0)
