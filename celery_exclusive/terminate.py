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
  ``kill_process``; otherwise an ERROR says that it runs on.
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
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, Optional

from .lease import HeldLease

__all__ = ["INTERRUPT_SIGNAL", "DEFAULT_GRACE", "stop_on_loss", "can_interrupt"]

logger = logging.getLogger("celery_exclusive")

#: The signal a process sends itself to interrupt a body whose lease was lost.
#: SIGUSR2: Celery's pool children use SIGUSR1 for soft time limits and SIGTERM to
#: die; RQ's work horse takes SIGTERM as "die" and SIGALRM for its job timeout.
INTERRUPT_SIGNAL = signal.SIGUSR2

#: Seconds a body has to stop after its lease was lost, as ``consul lock`` gives.
DEFAULT_GRACE = 5.0


class _Stopper:
    """Stops one body if its lease is lost while it runs."""

    def __init__(self, lease: HeldLease, grace: float, kill_process: bool, interrupt: bool):
        self.lease = lease
        self.grace = grace
        self.kill_process = kill_process
        self.interrupt = interrupt
        self.pid = os.getpid()
        #: True from the start of the body to its end; the signal handler and the
        #: grace timer act only while it is.
        self.running = True
        self.timer: Optional[threading.Timer] = None

    @property
    def label(self) -> str:
        return f"{self.lease.name}[{self.lease.task_id}]"

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
        self.timer = threading.Timer(self.grace, self.overdue)
        self.timer.daemon = True
        self.timer.start()
        os.kill(self.pid, INTERRUPT_SIGNAL)

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
            for handler in logging.getLogger().handlers + logger.handlers:
                with contextlib.suppress(Exception):
                    handler.flush()
            os.kill(self.pid, signal.SIGKILL)
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


#: Bodies of this process's main thread under stop_on_loss, innermost last.
_running: list[_Stopper] = []
#: The handler INTERRUPT_SIGNAL had before ours, for signals that are not ours.
_previous_handler: Any = None
_installed_in: Optional[int] = None


def _on_interrupt(signum: int, frame: Any) -> None:
    for stopper in reversed(_running):
        # lost_reason, not lost: the property may take the lease's lock, which the
        # interrupted code could hold.
        if stopper.running and stopper.lease.lost_reason is not None:
            stopper.lease.ensure_held()  # raises LeaseLost in the body
    # Not for a body of ours (sent by someone else, or after the body ended).
    if callable(_previous_handler):
        _previous_handler(signum, frame)


def _install_handler() -> None:
    """Install the interrupt handler once per process, and keep it.

    Restoring the previous handler after each body would race with a signal already
    on its way: under the default disposition, SIGUSR2 terminates the process.
    """
    global _previous_handler, _installed_in
    if _installed_in == os.getpid():
        return
    previous = signal.getsignal(INTERRUPT_SIGNAL)
    _previous_handler = None if previous is _on_interrupt else previous
    signal.signal(INTERRUPT_SIGNAL, _on_interrupt)
    _installed_in = os.getpid()


def can_interrupt() -> bool:
    """Whether a body running in the calling thread can be interrupted by a signal:
    the main thread of a process that does not run greenlets."""
    return threading.current_thread() is threading.main_thread() and not _green()


def _green() -> bool:
    """Whether gevent or eventlet patched threading: their "threads" are greenlets."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    return bool(eventlet_patcher is not None and eventlet_patcher.is_monkey_patched("thread"))


@contextlib.contextmanager
def stop_on_loss(
    lease: HeldLease, grace: float = DEFAULT_GRACE, kill_process: bool = False
) -> Iterator[None]:
    """Run the ``with`` block as the holder of ``lease``; stop it if the lease is lost.

    Call it in the thread that runs the body. See the module docstring for what
    happens where. A lease already lost on entry raises ``LeaseLost`` at once.
    """
    lease.ensure_held()
    stopper = _Stopper(lease, grace, kill_process, interrupt=can_interrupt())
    if stopper.interrupt:
        _install_handler()
    try:
        if stopper.interrupt:
            _running.append(stopper)
        lease.on_loss(stopper.lost)
        yield
    finally:
        stopper.finish()
        lease.remove_loss_listener(stopper.lost)
        if stopper in _running:
            _running.remove(stopper)
