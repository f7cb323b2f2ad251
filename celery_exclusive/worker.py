"""The worker side of ExclusiveTask: what runs in the worker's main process.

- :class:`ExclusiveRequest` frees the lease of a pool child that died holding it.
- :class:`CheckExclusiveSettings`, a worker bootstep, checks every exclusive task's
  settings and key, and every lease store they use, before the first task runs
  (:func:`check_app`; the store checks themselves are :mod:`celery_exclusive.startup`).

The task body itself runs under its lease in :mod:`celery_exclusive.task`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps
from celery.exceptions import Terminated, WorkerLostError
from celery.worker.request import Request

from . import config, marks, reaper, startup
from .errors import ConfigurationError, ExclusiveError, ExclusiveKeyError
from .task import ExclusiveTask

logger = logging.getLogger("celery_exclusive")


class ExclusiveRequest(Request):
    """Runs in the worker's main process: frees the lease of a child that died.

    A SIGKILLed child (OOM killer, hard time limit, ``revoke(terminate=True,
    signal="SIGKILL")``) cannot release its lease; it would expire after
    ``lease_ttl``. The main process sees the death (WorkerLostError, Terminated, or a
    hard timeout) and releases it at once, owner-checked against what the store says
    this task id holds, and only once the holder process is gone: a child that
    survives its signal (one it handles) still runs under the lease and releases it
    itself.
    """

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

    def on_failure(self, exc_info, send_failed_event: bool = True, return_ok: bool = False):
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # Celery wraps it in ExceptionWithTraceback
        if isinstance(exc, WorkerLostError):
            task = self.task
            self._release_dead_holder(
                acknowledged=not (task.acks_late and task.reject_on_worker_lost)
            )
        elif isinstance(exc, Terminated):  # revoke(terminate=True): Celery acks the message
            self._release_dead_holder(acknowledged=True)

    def _release_dead_holder(self, acknowledged: bool) -> None:
        """Free what the dead child held. If Celery acknowledged its message (stored
        the failure rather than requeueing), also record that the attempt ended, so a
        copy of the message set aside meanwhile does not run it again."""
        task = self.task
        if not isinstance(task, ExclusiveTask):
            return
        try:
            key = task.exclusive_key_for(tuple(self.args or ()), dict(self.kwargs or {}))
            backend = task.exclusive_backend
            held = reaper.held_here(backend, key, self.id, task.exclusive_settings.limit)
            if task.exclusive_settings.scope != "run":
                marks.clear_mark(backend, key, marks.QUEUED, self.id)
            if acknowledged and task.acks_late:
                retries = int((self.request_dict or {}).get("retries") or 0)
                marks.mark_finished(backend, key, self.id, retries, task._finished_ttl())
        except (ExclusiveError, TypeError) as exc:  # TypeError: arguments that never bound
            logger.warning("could not free the lease of lost task %s: %s", self.id, exc)
            return
        for lease, pid in held:
            threading.Thread(
                target=reaper.release_when_gone,
                args=(backend, lease, pid, self.id),
                name="celery-exclusive-reaper",
                daemon=True,
            ).start()


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
            check_app(worker.app)
        except (ConfigurationError, ExclusiveKeyError) as exc:
            # The message says what to fix; a traceback through Celery's start-up adds nothing.
            raise SystemExit(f"celery-exclusive: {type(exc).__name__}: {exc}") from None


def check_app(app) -> None:
    """Resolve and check the settings and key of every ExclusiveTask of ``app``, then
    each lease store they use, once per store and key prefix."""
    settings = [
        task.exclusive_settings  # checks the key format too
        for task in app.tasks.values()
        if isinstance(task, ExclusiveTask)
    ]
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
