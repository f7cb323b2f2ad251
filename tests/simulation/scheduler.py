"""A virtual clock and a scheduler of greenlets: the threads and processes the real
lease layer runs on, in the simulation.

:mod:`celery_exclusive.runtime` is the package's seam; :meth:`Scheduler.installed` puts
this module's clock, sleep, events, locks, conditions, threads, process ids and signals
in its place. Every thread the engine starts (the heartbeat, a renewal, the deadline
keeper, a grace timer) becomes a greenlet of the simulated process that started it,
and the scheduler runs one greenlet at a time until it waits; which ready greenlet runs
next is drawn from the seed. Time moves only when no greenlet is ready: running code
takes no virtual time, waiting takes exactly what it waits. So one seed is one
schedule, replayed identically.

A process can be paused (its greenlets are not run; a paused holder misses its
deadline as a SIGSTOPped or frozen one does) and resumed (its main greenlet gets
SIGCONT, as the real one does), signalled (the handler the process installed runs in
its main greenlet, at the point it waits) and killed (its greenlets never run again as
themselves: :class:`Killed` is thrown into them, and every effect they still try, on
the clock, the store or the broker, raises it again, so no cleanup of a dead process
reaches anything).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import signal as os_signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import greenlet

from celery_exclusive import runtime

#: The epoch the virtual wall clock starts at (so that store times look real).
EPOCH = 1_800_000_000.0
#: The least a timed wait takes (a real one always takes some time: code that waits
#: out what is left of a period, to the last float, must see the clock move).
TICK = 1e-6


def later(now: float, seconds: float) -> float:
    """When a wait of ``seconds`` from ``now`` ends: never at ``now`` itself."""
    return now + max(seconds, TICK) if seconds > 0 else now


class Killed(BaseException):
    """Thrown into the greenlets of a killed process, and raised by every effect one of
    them still tries: nothing a dead process does reaches the world."""


class Deadlock(Exception):
    """No greenlet can ever run again, yet some wait with no timeout on what nothing
    will set: a bug of the simulated code or of the simulation."""


class Livelock(Exception):
    """Greenlets run on and on while the clock stands still: something spins."""


#: Steps at one instant of virtual time before the schedule counts as spinning.
SPIN_LIMIT = 20_000


class SimProcess:
    """A simulated OS process: its pid, its greenlets, whether it lives or is paused."""

    def __init__(self, scheduler: Scheduler, pid: int, name: str, parent: int) -> None:
        self.scheduler = scheduler
        self.pid = pid
        self.name = name
        self.parent = parent
        self.alive = True
        self.paused_until: Optional[float] = None
        self.threads: list[SimThread] = []
        self.main: Optional[SimThread] = None
        #: Signals sent to the process, delivered to its main greenlet when it runs.
        self.pending: list[int] = []
        #: When it was paused: (from, to) in virtual time.
        self.pauses: list[tuple[float, float]] = []

    @property
    def paused(self) -> bool:
        return self.paused_until is not None

    def __repr__(self) -> str:
        return f"{self.name}(pid {self.pid})"


class SimThread:
    """One greenlet of a simulated process, as ``runtime.Thread`` makes it."""

    _ids = itertools.count(1)

    def __init__(
        self,
        target: Optional[Callable[..., Any]] = None,
        name: Optional[str] = None,
        args: tuple = (),
        kwargs: Optional[dict] = None,
        daemon: Optional[bool] = None,
        process: Optional[SimProcess] = None,
    ) -> None:
        scheduler = Scheduler.current
        self.scheduler = scheduler
        self.ident = next(SimThread._ids)
        self.name = name or f"thread-{self.ident}"
        self.target, self.args, self.kwargs = target, args, kwargs or {}
        self.daemon = daemon
        self.process = process or scheduler.running_process()
        self.greenlet: Optional[greenlet.greenlet] = None
        self.started = self.finished = False
        #: When a timed wait ends (virtual monotonic time); None: no timeout.
        self.wake_at: Optional[float] = None
        #: What it waits on (an event, a lock, a condition), if anything.
        self.waiting_on: Any = None
        #: Set by whoever wakes it before its timeout.
        self.woken = False
        #: Ready to run at once (new, woken, or signalled).
        self.ready = False

    # threading.Thread's interface, as far as the lease layer uses it
    def start(self) -> None:
        if self.started:
            raise RuntimeError("threads can only be started once")
        self.started = self.ready = True
        self.greenlet = greenlet.greenlet(self._run, parent=self.scheduler.root)
        self.process.threads.append(self)
        self.scheduler.threads.append(self)

    def is_alive(self) -> bool:
        return self.started and not self.finished

    def _run(self) -> None:
        try:
            if self.target is not None:
                self.target(*self.args, **self.kwargs)
        except Killed:
            pass
        except BaseException as exc:  # a real thread would print it and die
            self.scheduler.thread_died(self, exc)
        finally:
            self.finished = True

    def __repr__(self) -> str:
        return f"{self.process.name}/{self.name}"


class Scheduler:
    """The clock and the run queue of one schedule."""

    #: The scheduler whose runtime is installed now.
    current: Scheduler

    def __init__(self, seed: int, trace: Optional[Callable[[str], None]] = None) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.root = greenlet.getcurrent()
        self.threads: list[SimThread] = []
        self.processes: dict[int, SimProcess] = {}
        self._pids = itertools.count(40_001)
        self._running: Optional[SimThread] = None
        #: Timed callbacks of the world (a message due, a fault): (time, seq, fn).
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.trace = trace or (lambda line: None)
        self.died: list[tuple[SimThread, BaseException]] = []
        #: Called after every step (a greenlet ran until it waited).
        self.after_step: Callable[[], None] = lambda: None
        #: Called with a process once it was killed.
        self.on_death: Callable[[SimProcess], None] = lambda process: None
        self.steps = 0

    # --- processes -----------------------------------------------------------------

    def spawn(self, name: str, main: Callable[[], None], parent: int = 1) -> SimProcess:
        """Start a process whose main greenlet runs ``main``."""
        process = SimProcess(self, next(self._pids), name, parent)
        self.processes[process.pid] = process
        thread = SimThread(main, name="main", process=process)
        process.main = thread
        thread.start()
        self.trace(f"{self.now:9.3f} spawn {process}")
        return process

    def running_process(self) -> SimProcess:
        if self._running is None:
            raise RuntimeError("no simulated process is running (called from the world?)")
        return self._running.process

    def running_thread(self) -> SimThread:
        if self._running is None:
            raise RuntimeError("no simulated thread is running")
        return self._running

    def kill(self, process: SimProcess, why: str = "SIGKILL") -> None:
        """SIGKILL: the process never runs again; what its greenlets still try is inert."""
        if not process.alive:
            return
        process.alive = False
        self.trace(f"{self.now:9.3f} kill {process} ({why})")
        if self._running is not None and self._running.process is process:
            # Killed from its own greenlet (the grace timer's kill): the rest unwinds
            # when this greenlet next waits or touches the world.
            pass
        for thread in list(process.threads):
            if thread.greenlet is not None and not thread.finished and thread is not self._running:
                self._unwind(thread)
        self.on_death(process)

    def _unwind(self, thread: SimThread) -> None:
        """Throw Killed into a dead process's greenlet (its cleanup is inert)."""
        previous = self._running
        self._running = thread
        try:
            glet = thread.greenlet
            if glet:  # started and not dead: an unstarted one simply never runs
                # Back here when it has unwound, whoever asked (not to the root).
                glet.parent = greenlet.getcurrent()
                with contextlib.suppress(Killed):
                    glet.throw(Killed)
        finally:
            self._running = previous
            thread.finished = True

    def pause(self, process: SimProcess, seconds: float) -> None:
        """SIGSTOP for ``seconds`` of virtual time, then SIGCONT."""
        if not process.alive or process.paused:
            return
        process.paused_until = self.now + seconds
        process.pauses.append((self.now, self.now + seconds))
        self.trace(f"{self.now:9.3f} pause {process} for {seconds:.3f}s")

    def signal(self, process: SimProcess, signum: int) -> None:
        """Deliver ``signum`` to the process's main greenlet: at once if it waits (the
        wait is interrupted, as a real one is), else when it next waits."""
        if signum == os_signal.SIGKILL:
            self.kill(process)
            return
        if not process.alive:
            return
        process.pending.append(signum)
        main = process.main
        if main is not None and not main.finished and main is not self._running:
            main.ready = True

    # --- timers of the world -------------------------------------------------------------

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in the world, not in a process) at virtual time ``when``."""
        self._timers.append((when, next(self._seq), callback))

    # --- waiting, from a greenlet ----------------------------------------------------------

    def block(self, until: Optional[float], on: Any = None) -> bool:
        """Wait until woken or ``until`` (virtual time; None: only when woken). Returns
        whether it was woken rather than timed out. Signals for the process are handled
        here, in its main greenlet, as Python handles them between two instructions."""
        thread = self.running_thread()
        while True:
            self._check_alive(thread)
            self._handle_signals(thread)
            thread.wake_at, thread.waiting_on, thread.woken = until, on, False
            thread.ready = False
            if on is not None:
                on._waiters.append(thread)
            self.root.switch()
            if on is not None and thread in on._waiters:
                on._waiters.remove(thread)
            thread.waiting_on = None
            self._check_alive(thread)
            if thread.woken:
                self._handle_signals(thread)
                return True
            if until is not None and self.now >= until:
                self._handle_signals(thread)
                return False
            # Woken only to take a signal: its handler runs, then it waits on.

    def yield_now(self) -> None:
        """Let every other ready greenlet run first (a point where a real thread could
        be preempted: every store call goes through one)."""
        self.block(self.now)

    def _check_alive(self, thread: SimThread) -> None:
        if not thread.process.alive:
            raise Killed

    def _handle_signals(self, thread: SimThread) -> None:
        process = thread.process
        if thread is not process.main:
            return
        while process.pending:
            signum = process.pending.pop(0)
            handler = os_signal.getsignal(signum)
            if callable(handler):
                self.trace(f"{self.now:9.3f} {process} takes signal {signum}")
                handler(signum, None)

    def wake(self, thread: SimThread) -> None:
        thread.woken = thread.ready = True

    # --- running -------------------------------------------------------------------------

    def thread_died(self, thread: SimThread, exc: BaseException) -> None:
        self.died.append((thread, exc))
        self.trace(f"{self.now:9.3f} {thread} died: {type(exc).__name__}: {exc}")

    def _runnable(self) -> list[SimThread]:
        now = self.now
        return [
            t
            for t in self.threads
            if not t.finished
            and t.process.alive
            and not t.process.paused
            and (t.ready or (t.wake_at is not None and t.wake_at <= now))
        ]

    def run(self, until: float) -> None:
        """Run greenlets and the world's timers until nothing is left to do or the
        virtual clock reaches ``until``."""
        instant, at_instant = self.now, 0
        while True:
            self._resume_paused()
            runnable = self._runnable()
            if runnable:
                thread = runnable[self.rng.randrange(len(runnable))]
                self._step(thread)
                if self.now != instant:
                    instant, at_instant = self.now, 0
                at_instant += 1
                if at_instant > SPIN_LIMIT:
                    raise Livelock(f"{SPIN_LIMIT} steps at {self.now:.6f}, the last of {thread}")
                continue
            due = self._due_timers()
            if due:
                for _, _, callback in due:
                    callback()
                    self.after_step()
                continue
            upcoming = [
                t.wake_at
                for t in self.threads
                if not t.finished
                and t.process.alive
                and not t.process.paused
                and t.wake_at is not None
            ]
            upcoming += [p.paused_until for p in self.processes.values() if p.paused_until]
            upcoming += [when for when, _, _ in self._timers]
            upcoming = [when for when in upcoming if when is not None]
            if not upcoming:
                return
            nxt = max(self.now, min(upcoming))
            if nxt > until:
                self.now = until
                return
            self.now = nxt

    def _step(self, thread: SimThread) -> None:
        thread.ready = False
        self._running = thread
        try:
            thread.greenlet.switch()
        finally:
            self._running = None
        self.steps += 1
        if thread.finished:
            thread.process.threads.remove(thread)
            self.threads.remove(thread)
        self.after_step()

    def _due_timers(self) -> list[tuple[float, int, Callable[[], None]]]:
        due = sorted(t for t in self._timers if t[0] <= self.now)
        if due:
            self._timers = [t for t in self._timers if t[0] > self.now]
        return due

    def _resume_paused(self) -> None:
        for process in self.processes.values():
            if process.paused_until is not None and process.paused_until <= self.now:
                process.paused_until = None
                self.trace(f"{self.now:9.3f} resume {process}")
                if process.alive:
                    self.signal(process, os_signal.SIGCONT)

    def finish(self) -> None:
        """Unwind every greenlet left (as dead), inside the installed runtime."""
        for process in self.processes.values():
            process.alive = False
        for thread in list(self.threads):
            if not thread.finished and thread.greenlet is not None:
                self._unwind(thread)
        self.threads.clear()

    # --- the runtime seam ----------------------------------------------------------------

    @contextmanager
    def installed(self) -> Iterator[Scheduler]:
        """This scheduler's clock, threads and processes in place of the real ones."""
        Scheduler.current = self
        sim = self

        def sleep(seconds: float) -> None:
            sim.block(later(sim.now, seconds))

        def getpid() -> int:
            return sim.running_process().pid if sim._running is not None else 1

        def getppid() -> int:
            return sim.running_process().parent if sim._running is not None else 0

        def get_ident() -> int:
            return sim._running.ident if sim._running is not None else 0

        def kill(pid: int, signum: int) -> None:
            process = sim.processes.get(pid)
            if process is None:
                raise ProcessLookupError(pid)
            sim.signal(process, signum)
            running = sim._running
            if signum == os_signal.SIGKILL and running is not None and running.process is process:
                raise Killed

        def in_main_thread() -> bool:
            return sim._running is not None and sim._running is sim._running.process.main

        with runtime.install(
            monotonic=lambda: sim.now,
            wall=lambda: EPOCH + sim.now,
            process_time=lambda: sim.now,
            sleep=sleep,
            Event=SimEvent,
            Lock=SimLock,
            Condition=SimCondition,
            Thread=SimThread,
            get_ident=get_ident,
            getpid=getpid,
            getppid=getppid,
            kill=kill,
            in_main_thread=in_main_thread,
        ):
            try:
                yield self
            finally:
                self.finish()


class _Waitable:
    def __init__(self) -> None:
        self._waiters: list[SimThread] = []

    def _wake_all(self) -> None:
        scheduler = Scheduler.current
        for thread in list(self._waiters):
            scheduler.wake(thread)

    def _wake_one(self) -> None:
        if self._waiters:
            Scheduler.current.wake(self._waiters[0])


class SimEvent(_Waitable):
    def __init__(self) -> None:
        super().__init__()
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        self._wake_all()

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._flag:
            return True
        scheduler = Scheduler.current
        until = None if timeout is None else later(scheduler.now, timeout)
        while not self._flag:
            if not scheduler.block(until, self) and until is not None and scheduler.now >= until:
                break
        return self._flag


class SimLock(_Waitable):
    """A lock (re-entrant when asked: Condition's default lock is an RLock)."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self._owner: Optional[SimThread] = None
        self._count = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        scheduler = Scheduler.current
        me = scheduler._running
        until = None if timeout < 0 else later(scheduler.now, timeout)
        while True:
            if self._owner is None:
                self._owner, self._count = me, 1
                return True
            if self.reentrant and self._owner is me:
                self._count += 1
                return True
            if not blocking:
                return False
            if me is None:
                raise Deadlock("the world would wait for a lock a greenlet holds")
            if not scheduler.block(until, self) and until is not None and scheduler.now >= until:
                return False

    def release(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._owner = None
            self._wake_one()

    def locked(self) -> bool:
        return self._owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class SimCondition(_Waitable):
    def __init__(self, lock: Optional[SimLock] = None) -> None:
        super().__init__()
        self._lock = lock if lock is not None else SimLock(reentrant=True)

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        scheduler = Scheduler.current
        lock = self._lock
        count, lock._count = lock._count, 1
        lock.release()
        until = None if timeout is None else later(scheduler.now, timeout)
        try:
            woken = scheduler.block(until, self)
        finally:
            lock.acquire()
            lock._count = count
        return woken

    def notify(self, n: int = 1) -> None:
        for thread in list(self._waiters)[:n]:
            Scheduler.current.wake(thread)

    def notify_all(self) -> None:
        self._wake_all()
