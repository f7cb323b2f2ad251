"""ExclusiveJob: the RQ job class that runs ``@exclusive`` functions under their lease.

The lease is taken in the work horse, in ``Job.perform()`` (public on RQ 2.x and
3.x, unlike the worker's methods, whose signatures changed in 3.0). Everything else
the integration needs from RQ also goes through the job, never through a ``Worker``
subclass: the worker hands the job how its attempt ended through ``set_status()``,
``retry()``, ``success_callback``, ``finished_job_registry`` and ``send_webhooks()``,
on both major versions.

- **Skipped or coalesced** (the call did not run): the job ends ``canceled``, RQ's
  status for a job that did not run. It is written at once, so RQ moves none of its
  dependents (RQ reads a parent's status back before enqueueing its dependents); the
  success callback and "finished" webhooks are not called; the worker's success
  handling keeps the status ``canceled`` and files the job in the
  ``CanceledJobRegistry``, not the finished or failed one. ``return_value()`` and
  ``meta["exclusive"]`` are the record of what happened.
- **Requeued** (RQ's ``Retry``): not counted as a failed job in the worker's
  statistics, which RQ does for every returned ``Retry``.
- **The horse died** (SIGKILL, OOM, ``send_stop_job_command``): the worker process,
  which sees it, frees the lease the horse held at once (owner-checked, only once
  the horse is gone) instead of leaving it to expire after ``lease_ttl``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Optional, Union

from rq.job import Job, JobStatus, Retry
from rq.registry import CanceledJobRegistry
from rq.scheduler import RQScheduler
from rq.worker import Worker

from .. import config, policies, reaper
from ..backends import Backend, backend_for_url
from ..errors import BackendUnavailable, ExclusiveKeyError
from ..keys import build_key
from ..lease import HeldLease, UnlockedLease
from .calls import admitted, exclusive_options, holding
from .options import job_timeout, settings_for, within_timeout

logger = logging.getLogger("celery_exclusive")

#: ``job.meta[META_KEY]`` records what celery-exclusive did with the job's last attempt.
META_KEY = "exclusive"

#: How an attempt that did not run ends (see the module docstring).
UNRUN = JobStatus.CANCELED
#: An attempt that returned ``Retry`` to be requeued.
REQUEUED = "requeued"
#: The worker name RQ gives a job run by a synchronous queue: it has no queue to go back to.
SYNCHRONOUS = "sync"


class ExclusiveJob(Job):
    """RQ ``Job`` that runs ``@exclusive`` functions only while holding their lease.

    Start workers with ``rq worker --job-class celery_exclusive.rq.ExclusiveJob``
    (``--with-scheduler`` lets a work horse go while its requeued job waits).
    Unmarked functions run exactly as with RQ's own ``Job``.
    """

    #: Whether ``perform()`` ran in this process: the work horse, a SimpleWorker or a
    #: synchronous queue, but not the worker process that watches a horse.
    _exclusive_performed = False
    #: How this attempt ends, for the worker's handling after ``perform()``: UNRUN,
    #: REQUEUED, or None (as RQ decides).
    _exclusive_ending: Optional[str] = None

    def perform(self) -> Any:
        self._exclusive_performed = True
        options = exclusive_options(self.func)
        if options is None:
            return super().perform()
        # Job.perform() keeps the result for a synchronous queue's success handling;
        # an attempt that did not run returns its record the same way.
        self._result = self._perform_exclusive(options)
        return self._result

    def _perform_exclusive(self, options: dict[str, Any]) -> Any:
        settings = settings_for(self.func_name, options, self.connection)
        settings = within_timeout(settings, self.timeout)
        if settings.on_duplicate == "skip" and self._retrying():
            # A retry of an attempt that ran (and failed, or was killed) is not a
            # duplicate: it meets a holder only because it comes back later.
            settings = dataclasses.replace(settings, on_duplicate="requeue")
        key = self._exclusive_key(settings)
        backend = backend_for_url(settings.backend_url)
        try:
            outcome = policies.claim(
                settings,
                backend,
                key,
                self.func_name,
                self.id,
                requeues=self._exclusive_requeues(),
                arguments=policies.encode_call(self.func_name, self.args, self.kwargs)
                if settings.on_duplicate == "rerun"
                else None,
            )
        except BackendUnavailable as exc:
            return self._without_store(settings, backend, key, exc)
        if isinstance(outcome, policies.Skip):
            return self._skip(key, outcome.holder_task_id)
        if isinstance(outcome, policies.Coalesce):
            logger.info(
                "duplicate coalesced key=%s job_id=%s rerun=%s", key, self.id, outcome.rerun_task_id
            )
            return self._end_unrun("coalesced", key, rerun=outcome.rerun_task_id)
        if isinstance(outcome, policies.Requeue):
            holder = outcome.holder_task_id
            reason = f"held by job {holder}" if holder else "held by another job"
            return self._requeue(settings, backend, key, outcome.countdown, holder, reason)
        if outcome.arguments:
            # The pending rerun runs with the latest duplicate's arguments (saved with
            # the job, so its record says what it ran with).
            self.args, self.kwargs = policies.decode_call(outcome.arguments)
        return self._run_under(settings, outcome.lease)

    # --- how the worker ends the attempt ------------------------------------------------

    def set_status(self, status: JobStatus, pipeline: Any = None) -> None:
        ending = self._exclusive_ending
        if ending == UNRUN and status == JobStatus.FINISHED:
            status = UNRUN  # the worker's success handling: the body did not run
        super().set_status(status, pipeline=pipeline)
        if ending == REQUEUED and status in (JobStatus.SCHEDULED, JobStatus.QUEUED):
            self._exclusive_ending = None
            self._uncount_failure(pipeline)
        elif status in (JobStatus.FAILED, JobStatus.STOPPED) and not self._exclusive_performed:
            self._free_dead_horse()

    def retry(self, queue: Any, pipeline: Any) -> None:
        super().retry(queue, pipeline)
        if not self._exclusive_performed:
            self._free_dead_horse()  # a killed horse whose job has retries left

    @property
    def success_callback(self) -> Any:
        return None if self._exclusive_ending == UNRUN else super().success_callback

    @property
    def finished_job_registry(self) -> Any:
        if self._exclusive_ending == UNRUN:
            return CanceledJobRegistry(
                self.origin,
                connection=self.connection,
                job_class=type(self),
                serializer=self.serializer,
            )
        return super().finished_job_registry

    def send_webhooks(self, status: Any, **kwargs: Any) -> None:
        if self._exclusive_ending == UNRUN and status == JobStatus.FINISHED:
            return
        super().send_webhooks(status, **kwargs)

    # --- outcomes -----------------------------------------------------------------------

    @property
    def _exclusive_label(self) -> str:
        return f"{self.func_name}[{self.id}]"

    def _exclusive_key(self, settings: config.Settings) -> str:
        try:
            key = build_key(self.func_name, self.func, settings.key, self.args, self.kwargs)
        except ExclusiveKeyError as exc:
            raise ExclusiveKeyError(f"job {self.id}: {exc}", exc.task, exc.argument) from None
        return settings.key_prefix + key

    def _exclusive_meta(self) -> dict[str, Any]:
        return self.meta.get(META_KEY) or {}

    def _exclusive_requeues(self) -> int:
        try:
            return int(self._exclusive_meta().get("requeues", 0))
        except (TypeError, ValueError):
            return 0

    def _retrying(self) -> bool:
        """Whether an earlier attempt of this job got its lease and started the body
        (RQ's ``Retry`` of a failed attempt, a ``Repeat``, a requeue of a failed job)."""
        record = self._exclusive_meta()
        return record.get("outcome") == "ran" or record.get("retry") is True

    @property
    def _synchronous(self) -> bool:
        return self.worker_name == SYNCHRONOUS

    def _in_work_horse(self) -> bool:
        """Whether this process is a work horse forked or spawned for this job, which may
        be killed (the worker starts the next one), rather than the worker itself (a
        SimpleWorker). RQ 2 and 3 name the job in the horse's ``RQ_JOB_ID``."""
        return os.environ.get("RQ_JOB_ID") == self.id

    def _exclusive_record(self, outcome: str, key: str, **details: Any) -> dict[str, Any]:
        """Write what happened to ``job.meta["exclusive"]`` (saved at once) and return it.

        The count of requeues, and whether this is a retry, carry over from the
        record of the attempt before.
        """
        record = {"outcome": outcome, "key": key, "requeues": self._exclusive_requeues()}
        if self._retrying():
            record["retry"] = True
        record.update(details)
        self.meta[META_KEY] = record
        self.save_meta()
        return dict(record)

    def _run_under(self, settings: config.Settings, lease: Union[HeldLease, UnlockedLease]) -> Any:
        if isinstance(lease, HeldLease):
            self._exclusive_record("ran", lease.key, fencing_token=lease.fencing_token)
        kill_process = None if self._synchronous else self._in_work_horse()
        with holding(lease, settings, kill_process), admitted(self.func):
            return super().perform()

    def _skip(self, key: str, holder: Optional[str], **details: Any) -> dict[str, Any]:
        logger.info(
            "duplicate skipped key=%s job_id=%s holder=%s", key, self.id, holder or "unknown"
        )
        return self._end_unrun("skipped", key, holder=holder, **details)

    def _end_unrun(self, outcome: str, key: str, **details: Any) -> dict[str, Any]:
        """End without running: ``canceled``, the record as meta and return value."""
        record = self._exclusive_record(outcome, key, **details)
        self._exclusive_ending = UNRUN
        # Stored now, before the worker looks at the dependents: RQ reads the status
        # back, and moves no dependent of a canceled job.
        self.set_status(UNRUN)
        return record

    def _requeue(
        self,
        settings: config.Settings,
        backend: Backend,
        key: str,
        countdown: float,
        holder: Optional[str],
        reason: str,
    ) -> Any:
        """Have RQ run this same job again after ``countdown`` seconds.

        Counted in the meta, not in RQ's retries: those belong to the job's own errors.
        """
        requeues = self._exclusive_requeues()
        limit = settings.requeue_max_retries
        if limit is not None and requeues >= limit:
            logger.warning(
                "duplicate gave up key=%s job_id=%s after %d requeues", key, self.id, requeues
            )
            return self._skip(key, holder, reason=f"gave up after {requeues} requeues: {reason}")
        if self._synchronous:
            # A synchronous queue has no queue to go back to: wait instead.
            lease = policies.wait_for(settings, backend, key, self.func_name, self.id)
            if lease is not None:
                return self._run_under(settings, lease)
            waited = f"{reason}; waited wait_timeout={settings.wait_timeout:g}s, synchronously"
            return self._skip(key, holder, reason=waited)
        interval = max(1, math.ceil(countdown))  # RQ schedules whole seconds; 0 means "now"
        scheduled = self._scheduler_runs()
        if not scheduled:
            # No scheduler holds this queue's lock (none started, or a --burst worker's,
            # held for one pass only): wait out the backoff here, then go straight back on
            # the queue, which needs no scheduler.
            interval = 0
            time.sleep(min(countdown, job_timeout(self.timeout) / 2))
        self._exclusive_record(
            "requeued", key, holder=holder, reason=reason, requeues=requeues + 1, delay=countdown
        )
        logger.info(
            "duplicate requeued key=%s job_id=%s in %.1fs%s: %s",
            key,
            self.id,
            countdown,
            "" if scheduled else " (waited out here: no scheduler runs for the queue)",
            reason,
        )
        self._exclusive_ending = REQUEUED
        # max is always one more than RQ's count, so RQ never fails the job for it.
        return Retry(max=(self.number_of_retries or 0) + 1, interval=interval)

    def _uncount_failure(self, pipeline: Any) -> None:
        """RQ counts every returned ``Retry`` as a failed job in the worker's
        statistics; a requeue is not one."""
        if self.worker_name:
            connection = pipeline if pipeline is not None else self.connection
            worker_key = Worker.redis_worker_namespace_prefix + self.worker_name
            connection.hincrby(worker_key, "failed_job_count", -1)

    def _scheduler_runs(self) -> bool:
        return bool(self.connection.exists(RQScheduler.get_locking_key(self.origin)))

    def _without_store(
        self, settings: config.Settings, backend: Backend, key: str, exc: BackendUnavailable
    ) -> Any:
        message = f"{self._exclusive_label}: cannot take the lease on {key!r}: {exc}"
        if settings.on_backend_error == "run":
            logger.warning("%s -- running WITHOUT a lease (on_backend_error='run')", message)
            self._exclusive_record("ran_without_lease", key, reason=str(exc))
            return self._run_under(settings, UnlockedLease(key, self.func_name, self.id, str(exc)))
        if self._synchronous:
            raise BackendUnavailable(message, exc.url) from None
        logger.warning("%s -- requeued (on_backend_error='requeue')", message)
        delay = policies.requeue_delay(settings, self._exclusive_requeues())
        return self._requeue(settings, backend, key, delay, None, "the lease store did not answer")

    # --- in the worker process, which watches the horse ------------------------------------

    def _free_dead_horse(self) -> None:
        """The worker process saw this job's attempt end without the horse ending it
        (killed, stopped, out of memory): free the lease the horse held, now."""
        try:
            options = exclusive_options(self.func)
            if options is None:
                return
            settings = settings_for(self.func_name, options, self.connection)
            key = self._exclusive_key(settings)
            backend = backend_for_url(settings.backend_url)
            for lease, pid in reaper.held_here(backend, key, self.id, settings.limit):
                # The worker has waited for its horse: a process still running is not it.
                reaper.release_when_gone(backend, lease, pid, self.id, patience=0)
        except Exception as exc:  # never in the way of RQ's own failure handling
            logger.warning("could not free the lease of lost job %s: %s", self.id, exc)
