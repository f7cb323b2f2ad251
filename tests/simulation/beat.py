"""One simulated world of leader-elected beat: several ``celery beat`` processes, each
running the real :class:`~celery_exclusive.beat.LeaderScheduler` (its lease, records
and fenced writes) over Celery's own ``Scheduler.tick()`` and entries, on the simulated
clock and store, with beats killed (and started again), stopped and started again,
paused past the lease's ttl, and cut off from the store, faults drawn from a seed.

Only the send is simulated: the wrapped scheduler (Celery's in-memory
``celery.beat.Scheduler``) hands each due tick to :meth:`BeatWorld.sent` instead of a
broker. Checked: no entry is sent twice for one tick or out of its turn (each send's
run, as its record gives it, is later than the last one sent, and an interval before
the send at least) and the sends' fencing tokens never go back; once the faults end,
every due tick is sent.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery
from celery.beat import ScheduleEntry
from celery.beat import Scheduler as CeleryScheduler

from celery_exclusive import runtime
from celery_exclusive.backends import memory as memory_module
from celery_exclusive.beat.records import SentRun
from celery_exclusive.beat.scheduler import LeaderScheduler, beat_settings, lease_key
from celery_exclusive.core.deadline import keeper
from celery_exclusive.core.feed import feed
from celery_exclusive.core.heartbeat import heartbeat

from .scheduler import EPOCH
from .store import LinkedStore, LinkFaults, SharedStore, Violation
from .world import Traced, TraceHandler

#: The entries every world schedules: name -> interval (seconds).
ENTRIES = {"every-second": 1.0, "every-few": 2.5}
#: The least time one pass of beat's loop takes.
TICK = 0.001
#: How late a due tick may be sent once the faults are over (a tick's own drift, a
#: follower's wait for the lease before it tries again).
LATE = 0.5


@dataclass
class BeatConfig:
    """One schedule's beats and faults (all drawn from its seed)."""

    beats: int = 2
    lease_ttl: float = 3.0
    link: LinkFaults = field(default_factory=LinkFaults)
    kills: int = 0
    #: Graceful stops (SIGTERM: the leader hands the lease over), each started again.
    stops: int = 0
    pauses: int = 0
    outages: int = 0
    partitions: int = 0
    #: Times a beat's scheduler reloads its entries from a stale copy (a database row,
    #: a schedule file synced before the last sends): their last runs go back.
    stale_reloads: int = 0
    window: float = 30.0
    settle: float = 20.0


def draw_beat_config(rng: random.Random) -> BeatConfig:
    ttl = rng.choice([2.0, 3.0, 6.0])
    faulty = rng.random() < 0.85
    link = LinkFaults()
    if faulty:
        link = LinkFaults.draw(rng, ttl)
    return BeatConfig(
        beats=rng.choice([1, 2, 2, 3]),
        lease_ttl=ttl,
        link=link,
        kills=rng.choice([0, 1, 2, 3]) if faulty else 0,
        stops=rng.choice([0, 0, 1, 2]) if faulty else 0,
        pauses=rng.choice([0, 1, 2, 3]) if faulty else 0,
        outages=rng.choice([0, 0, 1]) if faulty else 0,
        partitions=rng.choice([0, 1, 2]) if faulty else 0,
        window=rng.choice([20.0, 30.0]),
        stale_reloads=rng.choice([0, 1, 3]) if faulty else 0,
    )


@dataclass(frozen=True)
class Send:
    """One tick sent: when, by which beat, and what its record says of it."""

    at: float
    entry: str
    beat: str
    ran_at: datetime
    token: int


class BeatWorld(Traced):
    def __init__(self, seed: int, trace_lines: int = 400) -> None:
        super().__init__(seed, trace_lines)
        self.config = draw_beat_config(self.rng)
        self.sends: list[Send] = []
        self.beats: list[Any] = []
        #: Beats asked to stop (SIGTERM), by process id.
        self.stopping: set[int] = set()
        self.violations: list[Violation] = []
        #: Each beat process's scheduler, by process id.
        self.leaders: dict[int, _Leader] = {}
        #: Each beat process's client of the store, by process id.
        self.links: dict[int, _BeatLink] = {}

    # --- the run -----------------------------------------------------------------------

    def run(self) -> None:
        name = f"sim-beat-{self.seed}"
        saved_random = random.getstate()
        random.seed(self.seed)
        try:
            self._run_installed(name)
        finally:
            random.setstate(saved_random)

    def _run_installed(self, name: str) -> None:
        scheduler, config = self.scheduler, self.config
        with scheduler.installed():
            self.store = SharedStore(scheduler, name)
            self.store.faults = config.link
            self.store.faults_on = True
            self.app = self._app(name)
            self.lease_key = lease_key(self.app, beat_settings(self.app))
            library = logging.getLogger("celery_exclusive")
            handler = TraceHandler(self)
            library.addHandler(handler)
            propagate, library.propagate = library.propagate, False
            try:
                self._plan()
                scheduler.after_step = self._raise_violations
                scheduler.run(until=config.window)
                self.store.faults_on = False
                self.note("faults end")
                scheduler.run(until=config.window + config.settle)
                for thread, exc in scheduler.died:
                    raise Violation(f"{thread} died: {type(exc).__name__}: {exc}")
                self.check_sent_on_time()
            finally:
                library.removeHandler(handler)
                library.propagate = propagate
                memory_module._stores.pop(name, None)
                for per_process in (heartbeat, keeper, feed):
                    per_process.forget()

    def _app(self, name: str) -> Celery:
        world = self

        class SentHere(CeleryScheduler):
            """Celery's in-memory scheduler, whose sends reach the world, not a broker."""

            Entry = _ByName

            def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kw):
                world.sent(entry)

        app = Celery("sim-beat", set_as_current=False)
        app.conf.update(
            timezone="UTC",
            beat_schedule={
                entry: {"task": "sim.tick", "schedule": timedelta(seconds=every)}
                for entry, every in ENTRIES.items()
            },
            exclusive_backend_url=f"memory://{name}",
            exclusive_lease_ttl=self.config.lease_ttl,
            exclusive_beat_scheduler=SentHere,
        )
        app.now = lambda: datetime.fromtimestamp(runtime.wall(), timezone.utc)  # type: ignore[method-assign]
        return app

    def _plan(self) -> None:
        config, rng, scheduler = self.config, self.rng, self.scheduler
        for index in range(config.beats):
            self._spawn(index)
        window = config.window
        for _ in range(config.kills):
            scheduler.at(rng.uniform(0, window), self._kill_a_beat)
        for _ in range(config.stops):
            scheduler.at(rng.uniform(0, window), self._stop_a_beat)
        for _ in range(config.pauses):
            seconds = rng.choice([0.3, config.lease_ttl * 0.5, config.lease_ttl * 2])
            scheduler.at(rng.uniform(0, window), lambda s=seconds: self._pause_a_beat(s))
        for _ in range(config.outages):
            start = rng.uniform(0, window)
            length = rng.uniform(config.lease_ttl / 2, config.lease_ttl * 2)
            scheduler.at(start, lambda: self._outage(True))
            scheduler.at(min(start + length, window), lambda: self._outage(False))
        for _ in range(config.partitions):
            start = rng.uniform(0, window)
            length = rng.uniform(config.lease_ttl / 2, config.lease_ttl * 2)
            pick = rng.random()
            scheduler.at(start, lambda n=length, r=pick: self._partition(n, r))
        for _ in range(config.stale_reloads):
            back = rng.choice([1, 2, 5])
            scheduler.at(rng.uniform(0, window), lambda b=back: self._reload_stale(b))

    # --- beats -------------------------------------------------------------------------

    def _spawn(self, index: int) -> None:
        name = f"beat{index}.{len(self.beats)}"
        process = self.scheduler.spawn(name, lambda: self._beat_main(name))
        if index < len(self.beats):
            self.beats[index] = process
        else:
            self.beats.append(process)

    def _beat_main(self, name: str) -> None:
        """What ``celery beat`` does: build the scheduler, then tick and sleep."""
        leader = _Leader(self.app, lazy=False)
        pid = self.scheduler.running_process().pid
        self.leaders[pid] = leader
        leader.backend = self.links[pid] = _BeatLink(self.store, self.rng, name)
        while pid not in self.stopping:
            interval = leader.tick()
            # Celery's loop sleeps only a positive interval; a tick takes some time of its
            # own, which the virtual clock would not count (else a tick a few ms early
            # spins in no time).
            runtime.sleep(max(interval or 0.0, TICK))
        leader.close()  # SIGTERM: Celery's beat closes its scheduler as it exits
        self.note(f"{name} stopped")
        self._respawn_later(name)

    def _live_beats(self) -> list[Any]:
        return [b for b in self.beats if b.alive and b.pid not in self.stopping]

    def _kill_a_beat(self) -> None:
        alive = self._live_beats()
        if alive:
            beat = self.rng.choice(alive)
            self.scheduler.kill(beat, "SIGKILL by the world")
            self._respawn_later(beat.name)

    def _stop_a_beat(self) -> None:
        alive = self._live_beats()
        if alive:
            beat = self.rng.choice(alive)
            self.note(f"SIGTERM to {beat.name}")
            self.stopping.add(beat.pid)

    def _respawn_later(self, name: str) -> None:
        """The process manager starts the beat again (systemd's ``Restart=always``)."""
        index = int(name[len("beat") :].split(".")[0])
        delay = self.rng.uniform(0.2, 2.0)
        self.scheduler.at(self.scheduler.now + delay, lambda: self._spawn(index))

    def _pause_a_beat(self, seconds: float) -> None:
        alive = [b for b in self._live_beats() if not b.paused]
        if alive:
            self.scheduler.pause(self.rng.choice(alive), seconds)

    def _reload_stale(self, periods: int) -> None:
        """A beat's scheduler reloads its entries from a copy ``periods`` intervals old,
        as a database scheduler does after an edit (Celery orders its heap afresh)."""
        alive = [b for b in self._live_beats() if self.leaders[b.pid].inner_ready]
        if not alive:
            return
        leader = self.leaders[self.rng.choice(alive).pid]
        schedule = leader.inner.schedule
        for name, entry in list(schedule.items()):  # new entries, as a reload builds them
            older = entry.last_run_at - timedelta(seconds=periods * ENTRIES[name])
            schedule[name] = entry.__class__(**dict(entry, last_run_at=older))
        leader._heap = None
        self.note(f"a beat's scheduler reloads entries {periods} intervals stale")

    def _partition(self, seconds: float, pick: float) -> None:
        alive = self._live_beats()
        if not alive:
            return
        beat = alive[int(pick * len(alive))]
        until = min(self.scheduler.now + seconds, self.config.window)
        self.store.partitioned[beat.pid] = until
        self.note(f"{beat.name}'s link to the store is cut until {until:.3f}")

    # --- what is checked ---------------------------------------------------------------

    def sent(self, entry: Any) -> None:
        """A beat sends ``entry``'s tick (what the wrapped scheduler's send reaches).
        Celery's ``apply_entry`` logs whatever a send raises and goes on: a violation is
        kept, and raised after the step."""
        try:
            self._check_send(entry)
        except Violation as exc:
            self.violations.append(exc)

    def _raise_violations(self) -> None:
        if self.violations:
            raise self.violations[0]

    def _check_send(self, entry: Any) -> None:
        """The send of ``entry``'s tick: its record was just written by this beat (a
        fenced write, under its lease). Checked against the entry's previous send."""
        process = self.scheduler.running_process()
        value = self.links[process.pid].written.get(entry.name)
        if value is None:
            raise Violation(f"{process.name} sent {entry.name} with no record of it written")
        run = SentRun.decode(value)
        send = Send(
            self.scheduler.now, entry.name, process.name, run.last_run_at, run.fencing_token
        )
        self.note(
            f"{process.name} sends {entry.name} (ran at {run.last_run_at:%H:%M:%S.%f}, "
            f"token {run.fencing_token})"
        )
        earlier = [s for s in self.sends if s.entry == entry.name]
        self.sends.append(send)
        if not earlier:
            return
        last = earlier[-1]
        every = ENTRIES[entry.name]
        # A run is the tick the scheduler reserved (its time is the tick's identity);
        # the record admits the next one once the entry's interval has passed since.
        sent_at = EPOCH + send.at
        if send.ran_at <= last.ran_at or sent_at - last.ran_at.timestamp() < every - 1e-3:
            said = "twice for one tick" if send.ran_at == last.ran_at else "out of its turn"
            raise Violation(
                f"{entry.name} sent {said}: by {last.beat} at {last.at:.3f} (its run of "
                f"{last.ran_at:%H:%M:%S.%f}, token {last.token}), then by {send.beat} at "
                f"{send.at:.3f} (its run of {send.ran_at:%H:%M:%S.%f}, token {send.token}): "
                f"a run is sent after the last one, and {every:g}s after it at least"
            )
        if send.token < last.token:
            raise Violation(
                f"{entry.name} sent under token {send.token} after a send under {last.token}"
            )

    def check_sent_on_time(self) -> None:
        """Once the faults are over (and a lease left by a killed or paused leader has
        lapsed), every due tick of every entry is sent, each no later than ``LATE``."""
        config = self.config
        since = config.window + 2 * config.lease_ttl + 2.0
        end = config.window + config.settle
        for entry, every in ENTRIES.items():
            times = [s.at for s in self.sends if s.entry == entry and s.at >= since]
            if not times or times[0] > since + every + LATE:
                raise Violation(
                    f"{entry} not sent from {since:.3f} until "
                    f"{times[0] if times else end:.3f}, every {every:g}s once the faults ended"
                )
            for before, after in zip(times, times[1:]):
                if after - before > every + LATE:
                    raise Violation(
                        f"{entry} sent at {before:.3f} and next at {after:.3f}: a due tick "
                        f"was not sent (every {every:g}s) once the faults ended"
                    )
            if end - times[-1] > every + LATE:
                raise Violation(f"{entry} last sent at {times[-1]:.3f}, not since")


class _BeatLink(LinkedStore):
    """A beat's client of the store, which remembers the records it wrote: what a send
    of its own is checked by."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.written: dict[str, str] = {}

    def write_record(self, lease: Any, name: str, value: str) -> bool:
        written = super().write_record(lease, name, value)
        if written:
            self.written[name] = value
        return written


class _ByName(ScheduleEntry):
    """Celery's entry, ordered by name where the heap's times tie (Celery orders them by
    ``id()``, "as well random": a schedule must not depend on memory addresses)."""

    def __lt__(self, other: Any) -> bool:
        return self.name < other.name if isinstance(other, ScheduleEntry) else NotImplemented


class _Leader(LeaderScheduler):
    #: Celery's beat connects its producer to the broker; the world needs none.
    producer = None
