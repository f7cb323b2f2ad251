"""Stopping the holder of a lost lease: ``on_lease_lost="terminate"``.

A body whose lease is gone must not go on beside the next holder. Like ``consul
lock``, which sends its child SIGTERM when the lock is lost and SIGKILL after a
grace period (5 s there, ``lockKillGracePeriod`` in hashicorp/consul
``command/lock/lock.go``), :func:`stop_on_loss` interrupts the body as soon as the
loss is known and kills its process if it does not stop::

    with stop_on_loss(lease, grace=5.0, kill_process=True):
        run_the_body()

Integrations call it around the body, in the thread that runs the body, with
``kill_process`` True only where that process exists for this one call: a Celery
prefork child (the pool replaces it), an RQ work horse (the worker forks the next
one). Never in a worker's own process: Celery's solo, threads and gevent pools and
RQ's ``SimpleWorker`` run bodies in the worker itself.

What happens on loss depends on where the body runs:

- **In the main thread of its process** (prefork child, work horse, solo pool): the
  process sends itself :data:`INTERRUPT_SIGNAL`, whose handler raises
  :class:`~celery_exclusive.errors.LeaseLost` in the body, wherever it is (a sleep,
  a socket read, a lock wait all return with it). If the body has not left the
  ``with`` block ``grace`` seconds later (it caught the error, or sits in C code that
  does not return to Python), its process is killed with SIGKILL when
  ``kill_process``, after leaving a note for the parent that watches it, which sends
  the call again (:mod:`.kill_notes`); otherwise an ERROR says that it runs on. A
  process stopped past
  its lease's deadline and resumed by SIGCONT raises LeaseLost in the body before it
  takes another step: the same handler runs on SIGCONT, in the body's thread, ahead of
  anything else it does. A body is told once: the interrupt the loss sends after that
  SIGCONT (or a SIGCONT after the interrupt) raises nothing more, so that the
  ``except`` and ``finally`` blocks the first LeaseLost runs get to end within the
  grace.
- **In another thread** (Celery's threads pool) or a greenlet (gevent, eventlet): a
  thread cannot be stopped from outside without risking the whole process (an
  exception injected at an arbitrary point can leave locks of the worker itself held),
  and a signal would land in whichever greenlet happens to run. The loss is logged at
  ERROR, ``lease_lost`` is sent, ``ensure_held()`` raises and the call fails with
  ``LeaseLost`` when its body returns. Bodies there should call
  ``self.lease.ensure_held()`` between steps.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from typing import Any, Callable, Optional

from .. import runtime
from . import holders, kill_notes
from .lease import HeldLease
from .per_process import PerProcess

__all__ = ["INTERRUPT_SIGNAL", "DEFAULT_GRACE", "stop_on_loss", "can_interrupt"]

logger = logging.getLogger("celery_exclusive")

#: The signal a process sends itself to interrupt a body whose lease was lost.
#: SIGUSR2: Celery's pool children use SIGUSR1 for soft time limits and SIGTERM to
#: die; RQ's work horse takes SIGTERM as "die" and SIGALRM for its job timeout.
INTERRUPT_SIGNAL = signal.SIGUSR2

#: Signals whose handler raises LeaseLost in a body whose lease is lost: our own
#: interrupt, and the SIGCONT that resumes a stopped process (whose deadline may have
#: passed while it was stopped, before any thread of it could say so).
HANDLED_SIGNALS = (INTERRUPT_SIGNAL, signal.SIGCONT)

#: Seconds a body has to stop after its lease was lost, as ``consul lock`` gives.
DEFAULT_GRACE = 5.0


class _Stopper:
    """Stops one body if its lease is lost while it runs."""

    def __init__(
        self,
        lease: HeldLease,
        grace: float,
        kill_process: bool,
        interrupt: bool,
        arguments: Optional[str] = None,
    ):
        self.lease = lease
        self.grace = grace
        self.kill_process = kill_process
        self.interrupt = interrupt
        #: What the kill note carries for the parent, which sends the call again: the
        #: arguments (JSON) of the pending rerun the body runs as, if it does.
        self.arguments = arguments
        self.pid = runtime.getpid()
        #: True from the start of the body to its end; the signal handler and the
        #: grace timer act only while it is.
        self.running = True
        #: Set once LeaseLost was raised in the body: it is raised there once, and the
        #: body's own cleanup is left to run.
        self.told = False
        self.timer: Optional[_GraceTimer] = None

    @property
    def label(self) -> str:
        return holders.holding(self.lease.name, self.lease.task_id)

    def lost(self, lease: HeldLease) -> None:
        """The lease is gone: interrupt the body (called in the thread that found it)."""
        if not self.running:
            return
        if not self.interrupt:
            logger.error(
                "%s lost its lease on %r and cannot be stopped: its body runs in a thread "
                "or greenlet. It fails with LeaseLost when it returns; call "
                "self.lease.ensure_held() between steps to stop sooner.",
                self.label,
                lease.key,
            )
            return
        logger.error(
            "stopping %s: its lease on %r was lost; interrupting its body with LeaseLost, "
            "%s if it has not stopped within %.1fs",
            self.label,
            lease.key,
            f"then killing process {self.pid}" if self.kill_process else "then reporting it",
            self.grace,
        )
        self.timer = _GraceTimer(self.grace, self.overdue)
        self.timer.start()
        runtime.kill(self.pid, INTERRUPT_SIGNAL)

    def overdue(self) -> None:
        """The grace period ended: kill the process if the body is still running."""
        if not self.running:
            return
        if self.kill_process:
            logger.error(
                "%s did not stop within %.1fs of losing its lease on %r: killing its "
                "process %d (SIGKILL)",
                self.label,
                self.grace,
                self.lease.key,
                self.pid,
            )
            # The parent that sees the process die sends the call again; not one that
            # a newer call replaced (it runs instead).
            if self.lease.lost_cause != "replaced":
                kill_notes.note_kill(self.lease.task_id, self.arguments)
            for handler in logging.getLogger().handlers + logger.handlers:
                with contextlib.suppress(Exception):
                    handler.flush()
            runtime.kill(self.pid, signal.SIGKILL)
        else:
            logger.error(
                "%s did not stop within %.1fs of losing its lease on %r and runs in the "
                "worker's own process, which is not killed: it goes on beside the new "
                "holder until it returns",
                self.label,
                self.grace,
                self.lease.key,
            )

    def finish(self) -> None:
        self.running = False
        if self.timer is not None:
            self.timer.cancel()

    # A class rather than a generator-based context manager: it is entered once per call.
    def __enter__(self) -> None:
        lease = self.lease
        lease.ensure_held()
        try:
            if self.interrupt:
                _install_handler()
                _running().append(self)
            lease.on_loss(self.lost)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info: Any) -> bool:
        try:
            # From here on the handler raises nothing in this body. Should the interrupt
            # land before, its LeaseLost leaves from here, and the grace timer is still
            # cancelled: the process must not be killed later, under another task.
            self.running = False
        finally:
            self.finish()
            self.lease.remove_loss_listener(self.lost)
            running = _running()
            if self in running:
                running.remove(self)
        return False


class _GraceTimer:
    """Calls ``overdue`` once the process has *run* for ``grace`` seconds; ``cancel()``
    stops it.

    A plain timer counts the time a process spends stopped (SIGSTOP, a frozen VM): a
    body that was cleaning up when its process was stopped would be killed the moment
    it resumed, with its cleanup cut short. This one waits in short steps; a step that
    ends more than :attr:`PAUSE` late while the process used next to no CPU time was a
    pause, and counts as its own length only. A step that ends late because the body
    holds the interpreter (C code that keeps the GIL: the stubborn body the kill is for)
    uses CPU time all along, and counts in full.
    """

    #: The longest wait between two looks at the clock.
    STEP = 0.1
    #: How late a step may end before it can be a pause of the process.
    PAUSE = 0.25

    def __init__(self, grace: float, overdue: Callable[[], None]) -> None:
        self.grace = grace
        self.overdue = overdue
        self.cancelled = runtime.Event()
        self._thread = runtime.Thread(target=self.run, name="celery-exclusive-grace", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        self.cancelled.set()

    def run(self) -> None:
        ran = 0.0
        while ran < self.grace:
            wait = min(self.STEP, self.grace - ran)
            started, cpu = runtime.monotonic(), runtime.process_time()
            if self.cancelled.wait(wait):
                return
            took = runtime.monotonic() - started
            late = took - wait
            paused = late > self.PAUSE and runtime.process_time() - cpu < late / 2
            ran += wait if paused else took
        if not self.cancelled.is_set():
            self.overdue()


#: Bodies of this process's main thread under stop_on_loss, innermost last.
_running: PerProcess[list[_Stopper]] = PerProcess(list)
#: The handlers HANDLED_SIGNALS had before ours, for signals that are not ours.
_previous_handlers: dict[int, Any] = {}
_installed_in: Optional[int] = None


def _on_interrupt(signum: int, frame: Any) -> None:
    ours = False
    for stopper in reversed(_running()):
        # A plain read, and an error built without the lease's lock, which the
        # interrupted code could hold; the keeper thread flags and signals the loss.
        if stopper.running and stopper.lease.lost:
            if not stopper.told:
                stopper.told = True
                raise stopper.lease.loss_error()  # in the body
            # Told already (a SIGCONT raised it, then the loss's interrupt came, or the
            # other way round): raising again would cut short the cleanup the first
            # LeaseLost runs (a ``finally``, a rollback), which has its grace to end.
            ours = True
    if ours:
        return
    # Not for a body of ours (sent by someone else, or after the body ended).
    previous = _previous_handlers.get(signum)
    if callable(previous):
        previous(signum, frame)


def _install_handler() -> None:
    """Install the interrupt handler once per process, and keep it.

    Restoring the previous handler after each body would race with a signal already
    on its way: under the default disposition, SIGUSR2 terminates the process.
    """
    global _installed_in
    if _installed_in == runtime.getpid():
        return
    for signum in HANDLED_SIGNALS:
        previous = signal.getsignal(signum)
        _previous_handlers[signum] = None if previous is _on_interrupt else previous
        signal.signal(signum, _on_interrupt)
    _installed_in = runtime.getpid()


def can_interrupt() -> bool:
    """Whether a body running in the calling thread can be interrupted by a signal:
    the main thread of a process that does not run greenlets."""
    return runtime.in_main_thread() and not _green()


def _green() -> bool:
    """Whether gevent or eventlet patched threading: their "threads" are greenlets."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    return bool(eventlet_patcher is not None and eventlet_patcher.is_monkey_patched("thread"))


def stop_on_loss(
    lease: HeldLease,
    grace: float = DEFAULT_GRACE,
    kill_process: bool = False,
    arguments: Optional[str] = None,
) -> contextlib.AbstractContextManager[None]:
    """Run the ``with`` block as the holder of ``lease``; stop it if the lease is lost.

    Call it in the thread that runs the body. See the module docstring for what
    happens where. A lease already lost on entry raises ``LeaseLost`` at once.
    ``arguments``: those of the pending rerun the body runs as (JSON), if it does; a
    process killed for not stopping leaves them in its kill note, for the parent to
    send the call again with.
    """
    return _Stopper(lease, grace, kill_process, interrupt=can_interrupt(), arguments=arguments)
