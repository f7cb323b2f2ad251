"""The worker side of ExclusiveTask: what runs in the worker's main process.

- :class:`ExclusiveRequest` frees the lease of a pool child that died holding it (as
  soon as the child has exited: :mod:`celery_exclusive.celery.children` watches it),
  and sends again the call of a child killed because its lease was lost.
- :class:`CheckExclusiveSettings`, a worker bootstep, checks every exclusive task's
  settings and key, and every lease store they use, before the first task runs
  (:func:`check_tasks_and_stores`; the store checks themselves are
  :mod:`celery_exclusive.celery.startup`).

The task body itself runs under its lease in :mod:`celery_exclusive.celery.task`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from celery import bootsteps
from celery.exceptions import Terminated, WorkerLostError
from celery.worker.request import Request
from celery.worker.state import active_requests, task_ready
from kombu.utils.encoding import safe_repr, safe_str

from ..backends import backend_for_url
from ..backends.base import require
from ..core import config, kill_notes, marks, reaper
from ..engine import attempt, enqueue
from ..errors import ConfigurationError, ExclusiveError, ExclusiveKeyError
from . import children, execution, startup
from .checks import is_exclusive_task
from .execution import finished_ttl

logger = logging.getLogger("celery_exclusive")


class ExclusiveRequest(Request):
    """Runs in the worker's main process: frees the lease of a child that died.

    A SIGKILLed child (OOM killer, hard time limit, ``revoke(terminate=True,
    signal="SIGKILL")``) cannot release its lease; it would expire after
    ``lease_ttl``. The main process watches the child that runs each call
    (:mod:`.children`) and, as soon as it has exited, releases what the store says this
    task id holds from that process, owner-checked. Celery reports the death later
    (WorkerLostError, Terminated, or a hard timeout; seconds later at times), and the
    rest is done then: the call's marks, the run owed to its coalesced duplicates, the
    resend of a call killed for its lost lease, and the release of a lease still held
    (where children are not watched), once the holder process is gone: a child that
    survives its signal (one it handles) still runs under the lease and releases it
    itself.
    """

    def _exclusive_key(self) -> str:
        """The lease key of this call, from its message's arguments (raises TypeError
        for arguments that never bound, ExclusiveError for a key that cannot be built)."""
        return self.task.exclusive_key_for(tuple(self.args or ()), dict(self.kwargs or {}))

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        super().on_accepted(pid, time_accepted)
        # Not for acks_late: Celery's report first records that the attempt ended (a
        # copy of the message delivered again must find that before the free key).
        if not self.task.acks_late:
            children.watch(pid, self, self._child_exited)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:
            task = self.task
            self._release_dead_holder(acknowledged=bool(task.acks_on_failure_or_timeout))

    def terminate(self, pool, signal=None) -> None:
        """``revoke(terminate=True)``: free the lease as soon as the signalled child is
        gone, without waiting for the pool to report the job (it may take seconds)."""
        super().terminate(pool, signal)
        if self.time_start:  # running: the signal went to its process now
            self._release_dead_holder(acknowledged=True)  # Celery acks a terminated task

    def _announce_revoked(self, reason, terminated, signum, expired) -> None:
        """A call revoked (or expired) before it ran, dropped here: it is over, so what
        it reserved goes now: its enqueue mark, what a delivery would have resumed
        with, and the run it owed a pending rerun (:mod:`.revoked`)."""
        super()._announce_revoked(reason, terminated, signum, expired)
        if not self.time_start and is_exclusive_task(self.task):
            # (One that ran here ends through on_failure: Terminated.) In a thread: the
            # store may be slow, and this is the consumer's loop.
            threading.Thread(
                target=self._free_revoked, name="celery-exclusive-revoked", daemon=True
            ).start()

    def _free_revoked(self) -> None:
        """Free what a call dropped before it ran reserved, unless a delivery of it runs
        or waits elsewhere (its message delivered again while the first delivery runs,
        the copy expired or revoked here): then the call is not over."""
        task = self.task
        try:
            key = self._exclusive_key()
            if enqueue.under_way(task.exclusive_backend, key, self.id):
                return
        except (ExclusiveError, TypeError) as exc:  # TypeError: arguments that never bound
            logger.warning("could not free what revoked task %s reserved: %s", self.id, exc)
            return
        self._release_dead_holder(acknowledged=True)

    def on_failure(self, exc_info, send_failed_event: bool = True, return_ok: bool = False):
        # Every reported end but a success comes here (a retry too: Celery hands it on to
        # on_retry); a success ends the call for Celery (_child_exited reads that).
        children.unwatch(self.worker_pid, self)
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # Celery wraps it in ExceptionWithTraceback
        if isinstance(exc, WorkerLostError) and self._send_killed_again(exc, exc_info):
            self._let_go_for_the_call_sent_again()
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # Celery wraps it in ExceptionWithTraceback
        if isinstance(exc, WorkerLostError):
            retried = self.__dict__.get("_exclusive_retried")
            self._release_dead_holder(*when_lost(self.task, retried))
        elif isinstance(exc, Terminated):  # revoke(terminate=True): Celery acks the message
            self._release_dead_holder(acknowledged=True)

    def _send_killed_again(self, exc: BaseException, exc_info: Any) -> bool:
        """The child was killed because its body did not stop after losing its lease
        (it left a kill note): send the call again, as a body that stopped is, and end
        this attempt as a retry. False: the death is handled as any other.

        A body that ran as the pending rerun of its key ran with the newest duplicate's
        arguments, which its note carries: the call is sent again with them.

        Not when Celery hands the message back itself (``acks_late`` with
        ``reject_on_worker_lost``): the call must not be sent twice. (Sent here, the
        call is not retried by Celery as well: its report of the death stops here.)
        """
        task = self.task
        if not is_exclusive_task(task):
            return False
        note = kill_notes.take_kill_note(self.id, self.worker_pid)
        if note is None or (task.acks_late and task.reject_on_worker_lost):
            return False
        request = self._context
        try:
            key = self._exclusive_key()
            outcome = attempt.rerun_of_killed(
                task.exclusive_settings,
                key,
                execution.requeues_of(request),
                note.arguments,
                execution.stamp_of(request),
            )
            if outcome is None:
                return False
            execution.send_again(task, request, outcome)
        except Exception as exc_sending:  # the death is then reported as usual
            logger.error(
                "could not send %s[%s] again after its process was killed for its lost lease: %r",
                self.task_name,
                self.id,
                exc_sending,
            )
            return False
        task_ready(self)
        if self.store_errors:
            task.backend.mark_as_retry(self.id, exc, exc_info.traceback, request=request)
        if task.acks_late:
            self.acknowledge()
        self.send_event(
            "task-retried", exception=safe_repr(exc), traceback=safe_str(exc_info.traceback)
        )
        return True

    def _retry_worker_lost(self, exc: BaseException, exc_info: Any) -> bool:
        # Celery 5.7's retry of a call whose process was lost (retry_on_worker_lost):
        # whether it was sent decides what the death leaves to do (see when_lost).
        retried = super()._retry_worker_lost(exc, exc_info)  # type: ignore[misc]
        self.__dict__["_exclusive_retried"] = bool(retried)
        return retried

    def _child_exited(self, pid: int) -> None:
        """In the watcher's thread: the child running this call exited. Unless Celery has
        ended the call already (it succeeded: the child released its lease itself), free
        what the child held, in a thread of its own (the store may be slow to answer)."""
        if self not in active_requests or not is_exclusive_task(self.task):
            return
        threading.Thread(
            target=self._free_leases_left_by,
            args=(pid,),
            name="celery-exclusive-reaper",
            daemon=True,
        ).start()

    def _free_leases_left_by(self, pid: int) -> None:
        """Release the leases this call holds from process ``pid``, which has exited (or
        keep them, for a rate's slot or a window: :func:`~.reaper.kept_after_death`).
        Celery's report of the death, later, finds them gone, or kept, and keeps them
        as its outcome says (a call that comes back has no window yet)."""
        task = self.task
        settings = task.exclusive_settings
        try:
            key = self._exclusive_key()
            backend = task.exclusive_backend
        except (ExclusiveError, TypeError) as exc:  # TypeError: arguments that never bound
            logger.warning("could not free the lease of lost task %s: %s", self.id, exc)
            return
        # Kept as for a call that does not come back; Celery's report says later whether
        # it does, and then a window kept for it ends (_release_dead_holder).
        reaper.release_left_by(backend, key, self.id, settings, pid, comes_back=False)

    def _release_dead_holder(self, acknowledged: bool, comes_back: Optional[bool] = None) -> None:
        """Free what the dead child held, and unless the call comes back, its place in
        its key's line. If Celery acknowledged its message (stored the failure, or sent
        a retry, rather than requeueing), also record that the attempt ended, so a copy
        of the message set aside meanwhile does not run it again. Unless the call comes
        back (``comes_back``; by default, when its message was not acknowledged), the run
        its coalesced duplicates are owed goes to a new call, and what a delivery would
        have resumed with goes."""
        if comes_back is None:
            comes_back = not acknowledged
        task = self.task
        if not is_exclusive_task(task):
            return
        try:
            key = self._exclusive_key()
            backend = task.exclusive_backend
            held = reaper.leases_on_this_host(backend, key, self.id, task.exclusive_settings.limit)
            if not comes_back:
                # A call that died waiting (revoked with terminate=True, killed) leaves
                # its key's line now, rather than after its place lapses (a lease ttl).
                marks.leave_line(backend, key, self.id)
            if task.exclusive_settings.scope != "run" and not comes_back:
                marks.clear_mark(backend, key, marks.QUEUED, self.id)
            if acknowledged and task.acks_late:
                retries = int((self.request_dict or {}).get("retries") or 0)
                marks.mark_finished(backend, key, self.id, retries, finished_ttl(task))
            if not comes_back and task.exclusive_settings.on_duplicate == "rerun":
                # The call is over: what a delivery would have resumed with goes (the
                # run it had is lost with the process, as any run is).
                kept = marks.resume_arguments(backend, key, self.id)
                marks.drop_resume(backend, key, self.id, kept)  # none kept: nothing sent
        except (ExclusiveError, TypeError) as exc:  # TypeError: arguments that never bound
            logger.warning("could not free the lease of lost task %s: %s", self.id, exc)
            return
        if not comes_back:
            self._send_owed_rerun(task, key)
        self._let_go(backend, held, comes_back)

    def _let_go_for_the_call_sent_again(self) -> None:
        """The child was killed for its lost lease and the call sent again: what the
        child's early free kept for a call that does not come back goes (a window: its
        run is still to come), but for a rate's slot."""
        task = self.task
        try:
            key = self._exclusive_key()
            backend = task.exclusive_backend
            held = reaper.leases_on_this_host(backend, key, self.id, task.exclusive_settings.limit)
        except (ExclusiveError, TypeError) as exc:  # TypeError: arguments that never bound
            logger.warning("could not free the lease of lost task %s: %s", self.id, exc)
            return
        self._let_go(backend, held, comes_back=True)

    def _let_go(self, backend: Any, held: list[reaper.Left], comes_back: bool) -> None:
        """Release, or keep (reaper.kept_after_death), each lease ``held`` once its dead
        process is gone, in threads of their own (the store may be slow to answer)."""
        settings = self.task.exclusive_settings
        for left in held:
            keep = reaper.kept_after_death(settings, left, comes_back)
            threading.Thread(
                target=reaper.release_when_gone,
                args=(backend, left, self.id),
                kwargs={"keep": keep},
                name="celery-exclusive-reaper",
                daemon=True,
            ).start()

    def _send_owed_rerun(self, task: Any, key: str) -> None:
        """The dead child ran the pending rerun of its key, and its message is not
        delivered again: the duplicates coalesced into it are owed a run, which a new
        call of the task does."""
        try:
            settings = task.exclusive_settings
            backend = task.exclusive_backend
            owed = attempt.owed_rerun(backend, key, self.id, settings)
            if owed is not None:
                execution.send_owed_run(task, self.id, owed, "died")
        except ExclusiveError as exc:
            logger.warning("could not hand on the pending rerun of lost task %s: %s", self.id, exc)


def when_lost(task: Any, retried: Optional[bool]) -> tuple[bool, bool]:
    """What Celery did with the message of a call whose process was lost, as
    ``(acknowledged, comes_back)``; ``retried``: whether Celery sent a retry of it
    (``retry_on_worker_lost``), None if it did not try.

    A retry sent: the message is acknowledged, and the call comes back (Celery 5.7's
    ``Request.on_failure``). Otherwise, with ``acks_late`` and ``reject_on_worker_lost``
    the message goes back to the broker, unless ``retry_on_worker_lost`` found the
    retries spent; anything else stores the failure and acknowledges the message.
    """
    if retried:
        return True, True
    spent = retried is None and execution.retried_when_lost(task)
    handed_back = bool(task.acks_late and task.reject_on_worker_lost) and not spent
    return not handed_back, handed_back


class CheckExclusiveSettings(bootsteps.Step):
    """Worker bootstep: check every exclusive task's settings and stores before any
    task runs.

    A bad setting, or a store that can never work (permissions, a path that is no
    database), stops the worker at start with one line naming the setting, instead of
    failing each task later. A store that does not answer is said once, at start.
    """

    name = "celery-exclusive settings check"

    def __init__(self, worker, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        try:
            check_tasks_and_stores(worker.app)
        except (ConfigurationError, ExclusiveKeyError) as exc:
            # The message says what to fix; a traceback through Celery's start-up adds nothing.
            raise SystemExit(f"celery-exclusive: {type(exc).__name__}: {exc}") from None


def check_tasks_and_stores(app) -> None:
    """Resolve and check the settings and key of every ExclusiveTask of ``app``, then
    each lease store they use, once per store and key prefix."""
    # By name: a refusal names the same task whatever order the app registered them in.
    tasks = sorted(
        (task for task in app.tasks.values() if is_exclusive_task(task)), key=lambda t: t.name
    )
    settings = [task.exclusive_settings for task in tasks]  # checks the key format too
    for task, one in zip(tasks, settings):
        needs = ["windows"] if one.keeps_lease else []
        needs += ["limits"] if one.rate is not None and one.limit > 1 else []
        for capability in needs:
            try:
                require(backend_for_url(one.backend_url), capability)
            except ConfigurationError as exc:
                raise ConfigurationError(f"task {task.name}: {exc}") from None
    startup.check_stores(app, settings, _meanwhile)


def _meanwhile(group: list[config.Settings]) -> str:
    """What the tasks using one store do while it does not answer."""
    run = any(settings.on_backend_error == "run" for settings in group)
    requeue = any(settings.on_backend_error == "requeue" for settings in group)
    parts = []
    if requeue:
        parts.append("tasks are requeued, not run, until it answers")
    if run:
        parts.append("tasks with exclusive_on_backend_error='run' run WITHOUT a lease meanwhile")
    return "; ".join(parts)
