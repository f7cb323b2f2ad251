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
  the horse is gone) instead of leaving it to expire after ``lease_ttl``. A horse killed
  because its body did not stop after losing its lease (it leaves a kill note,
  :mod:`celery_exclusive.core.kill_notes`) has its job put back on the queue, under
  ``requeue_lost``, as a body that stopped has.
"""

from __future__ import annotations

import logging
import math
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

from rq.job import Job, JobStatus, Retry
from rq.queue import Queue
from rq.registry import CanceledJobRegistry
from rq.scheduler import RQScheduler
from rq.utils import as_text
from rq.worker import Worker

from .. import runtime
from ..backends import backend_for_url
from ..core import config, kill_notes, marks, outcomes, reaper
from ..core.keys import build_key
from ..core.lease import HeldLease
from ..engine import attempt, enqueue
from ..errors import BackendUnavailable, ExclusiveKeyError
from .calls import admitted, exclusive_options
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


def log_beside_the_worker() -> None:
    """Under ``rq worker``, the library's lines go where the worker's own go, at its level.

    RQ sets up its ``rq.worker`` logger only; with no handler on the library's logger or
    above it, its INFO lines (a duplicate skipped, coalesced, requeued) would reach nobody,
    and a skipped job would read only as RQ's "Job OK". An application that set up logging
    itself (a handler on the root or the library's logger) keeps its own set-up.
    """
    ours, workers = logger, logging.getLogger("rq.worker")
    if ours.hasHandlers() or not workers.handlers:
        return
    for handler in workers.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(workers.level)
    ours.propagate = False  # as RQ's own: no double line once an ancestor gets a handler


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
    #: The job's own arguments as the attempt was started with them.
    _exclusive_arguments: tuple[tuple, dict] = ((), {})
    #: In the worker process: whether the horse's kill note was looked for, and the
    #: requeue it earned (see :meth:`_rerun_after_kill`).
    _exclusive_kill_read = False
    _exclusive_kill_rerun: Optional[outcomes.Requeue] = None

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> ExclusiveJob:
        """A new job, stamped with when its change was sent (``as_of`` in its record):
        under ``rerun`` it orders the changes that join a pending rerun, whatever
        retries and requeues do to the order in which they reach a worker."""
        job = super().create(*args, **kwargs)
        record = job.meta.setdefault(META_KEY, {})
        if isinstance(record, dict):
            record.setdefault("as_of", runtime.wall())
        return job

    def perform(self) -> Any:
        self._exclusive_performed = True
        options = exclusive_options(self.func)
        if options is None:
            return super().perform()
        log_beside_the_worker()
        # Job.perform() keeps the result for a synchronous queue's success handling;
        # an attempt that did not run returns its record the same way.
        self._result = self._perform_exclusive(options)
        return self._result

    def _perform_exclusive(self, options: dict[str, Any]) -> Any:
        settings = settings_for(self.func_name, options, self.connection)
        settings = within_timeout(settings, self.timeout)
        key = self._exclusive_key(settings)
        self._exclusive_arguments = (tuple(self.args), dict(self.kwargs))
        backend = backend_for_url(settings.backend_url)
        the_call = attempt.Call(
            self.func_name,
            self.id,
            key,
            settings,
            backend,
            *self._exclusive_arguments,
            requeues=self._exclusive_requeues(),
            # A retry of an attempt that ran (and failed, was killed or lost its lease) is
            # no duplicate: it meets a holder only because it comes back later.
            resumed=self._retrying(),
            as_of=self._exclusive_as_of(),
            debounced=self._exclusive_meta().get("debounced") is True,
            owed_by=self._exclusive_owed_by(),
        )
        synchronous = self._synchronous
        host = attempt.Host(
            # A synchronous queue has no queue to go back to: it waits instead.
            can_requeue=not synchronous,
            stop_process=None if synchronous else self._in_work_horse(),
            # A job that fails with retries left is run again by RQ under its id.
            comes_back=lambda exc: bool(getattr(self, "retries_left", None)),
            noun="job",
            setting_prefix="",
        )
        self._hand_on_canceled_rerun(backend, key, settings)
        try:
            return attempt.run(the_call, host, self._run_body).carry_out(
                JobOutcomes(self, settings)
            )
        finally:
            self._hand_on_canceled_rerun(backend, key, settings)

    def _hand_on_canceled_rerun(self, backend: Any, key: str, settings: config.Settings) -> None:
        """Hand on the run owed by a pending rerun of ``key`` that RQ canceled.

        RQ's ``cancel_job`` fetches a plain ``Job``, so a pending rerun canceled while
        away on its requeue never tells this class; the run its coalesced duplicates
        joined would wait for a later duplicate. Each job of the key looks as it starts
        and as it ends (the holder's end is when the rerun was due), and where RQ says
        the pending job was canceled, and it is not under way (RQ's cancel does not stop
        a job already running: one waiting in the key's line, or granted the key as it
        was canceled, still runs), a new job of its function takes its place. Never
        raises: the job goes on, and the next job of the key looks again."""
        if settings.on_duplicate != "rerun":
            return
        try:
            pending = marks.pending_rerun(backend, key)
            if pending is None or pending == self.id:
                return
            status = self.connection.hget(type(self).key_for(pending), "status")
            if status is None or as_text(status) != JobStatus.CANCELED.value:
                return  # running, queued, or no RQ job of this connection
            if enqueue.under_way(backend, key, pending):
                return  # waiting in the key's line, or granted the key as it was canceled
            canceled = Job.fetch(pending, connection=self.connection, serializer=self.serializer)
            owed = attempt.owed_rerun(backend, key, pending, settings)
            if owed is not None:
                self._send_owed_rerun(owed, canceled, "was canceled")
        except Exception as exc:  # never in the way of the job's own end
            logger.warning("could not hand on the run of the canceled rerun of %s: %s", key, exc)

    def _run_body(self, args: tuple, kwargs: dict) -> Any:
        """The body, under the lease the engine took: the function, let through once."""
        if args is not self._exclusive_arguments[0]:
            # The pending rerun runs with the latest duplicate's arguments (saved with
            # the job, so its record says what it ran with).
            self.args, self.kwargs = list(args), kwargs
        lease = attempt.current_lease()
        if isinstance(lease, HeldLease):
            self._exclusive_record("ran", lease.key, fencing_token=lease.fencing_token)
        else:
            self._exclusive_record("ran_without_lease", lease.key, reason=_why(lease))
        with admitted(self.func):
            return super().perform()

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

    @property
    def should_retry(self) -> bool:
        """RQ's "does the job go again?" after a failed attempt; yes, too, when the work
        horse was killed because the job's lease was lost (see :meth:`retry`)."""
        return self._rerun_after_kill() is not None or super().should_retry

    def retry(self, queue: Any, pipeline: Any) -> None:
        rerun = self._rerun_after_kill()
        if rerun is not None:
            self._send_killed_again(queue, pipeline, rerun)
            return
        super().retry(queue, pipeline)
        if not self._exclusive_performed:
            self._free_dead_horse(comes_back=True)  # a killed horse whose job has retries left

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

    def _exclusive_as_of(self) -> Optional[float]:
        """When the change this job's arguments carry first reached the library, as an
        earlier attempt stamped it (``attempt.Call.as_of``)."""
        stamp = self._exclusive_meta().get("as_of")
        return float(stamp) if isinstance(stamp, (int, float)) else None

    def _exclusive_owed_by(self) -> Optional[str]:
        """The pending rerun whose owed run this job carries, if it is such a job
        (``attempt.Call.owed_by``)."""
        owed_by = self._exclusive_meta().get("owed_by")
        return owed_by if isinstance(owed_by, str) else None

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

        The count of requeues, whether this is a retry and when its change was sent
        carry over from the record of the attempt before.
        """
        record = {"outcome": outcome, "key": key, "requeues": self._exclusive_requeues()}
        if self._retrying():
            record["retry"] = True
        if self._exclusive_as_of() is not None:
            record["as_of"] = self._exclusive_as_of()
        if self._exclusive_meta().get("debounced") is True:
            record["debounced"] = True
        record.update(details)
        self.meta[META_KEY] = record
        self.save_meta()
        return dict(record)

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

    def _requeue(self, settings: config.Settings, outcome: outcomes.Requeue) -> Any:
        """Have RQ run this same job again after the outcome's countdown.

        Counted in the meta, not in RQ's retries: those belong to the job's own errors.
        """
        key, countdown = outcome.key, outcome.countdown
        interval = max(1, math.ceil(countdown))  # RQ schedules whole seconds; 0 means "now"
        scheduled = self._scheduler_runs()
        if not scheduled:
            # No scheduler holds this queue's lock (none started, or a --burst worker's,
            # held for one pass only): wait out the backoff here, then go straight back on
            # the queue, which needs no scheduler.
            interval = 0
            time.sleep(min(countdown, job_timeout(self.timeout) / 2))
        self._exclusive_record(
            "requeued",
            key,
            holder=outcome.holder_task_id,
            reason=outcome.reason,
            requeues=outcome.requeues,
            delay=countdown,
            as_of=outcome.as_of,
            **({"debounced": True} if outcome.cause == "debounce" else {}),
        )
        logger.info(
            "%s key=%s job_id=%s in %.1fs%s: %s",
            outcomes.REQUEUED_AS[outcome.cause],
            key,
            self.id,
            countdown,
            "" if scheduled else " (waited out here: no scheduler runs for the queue)",
            outcome.reason,
        )
        self._exclusive_ending = REQUEUED
        self._resume_with(outcome)
        # max is always one more than RQ's count, so RQ never fails the job for it.
        return Retry(max=(self.number_of_retries or 0) + 1, interval=interval)

    def _resume_with(self, outcome: outcomes.Requeue) -> None:
        """A job stopped while it ran as the pending rerun of its key ran with the
        newest duplicate's arguments: it goes again with them (RQ saves the job's
        arguments as it puts it back on the queue or schedules it)."""
        if outcome.args is not None:
            # RQ rebuilds the job's data from these and the parts it read already
            # (the function, read by now on every path that gets here).
            self.args, self.kwargs = list(outcome.args), dict(outcome.kwargs or {})

    def _uncount_failure(self, pipeline: Any) -> None:
        """RQ counts every returned ``Retry`` as a failed job in the worker's
        statistics; a requeue is not one."""
        if self.worker_name:
            connection = pipeline if pipeline is not None else self.connection
            worker_key = Worker.redis_worker_namespace_prefix + self.worker_name
            connection.hincrby(worker_key, "failed_job_count", -1)

    def _scheduler_runs(self) -> bool:
        return bool(self.connection.exists(RQScheduler.get_locking_key(self.origin)))

    # --- in the worker process, which watches the horse ------------------------------------

    def _rerun_after_kill(self) -> Optional[outcomes.Requeue]:
        """In the worker process: the requeue owed to this job if its horse was killed
        because its body did not stop after losing its lease (the horse left a kill
        note), or None. Decided once per attempt: the note is taken as it is read."""
        if self._exclusive_performed:
            return None
        if not self._exclusive_kill_read:
            self._exclusive_kill_read = True
            try:
                options = exclusive_options(self.func)
                note = None if options is None else kill_notes.take_kill_note(self.id)
                if options is not None and note is not None:
                    settings = settings_for(self.func_name, options, self.connection)
                    key = self._exclusive_key(settings)
                    requeues = self._exclusive_requeues()
                    self._exclusive_kill_rerun = attempt.rerun_of_killed(
                        settings, key, requeues, note.arguments
                    )
            except Exception as exc:  # never in the way of RQ's own failure handling
                logger.error(
                    "could not send job %s again after its horse was killed: %s", self.id, exc
                )
        return self._exclusive_kill_rerun

    def _send_killed_again(self, queue: Any, pipeline: Any, rerun: outcomes.Requeue) -> None:
        """Put the job back on its queue (after the requeue's countdown, when a scheduler
        runs), as a run that resumes: it takes a fresh lease under its duplicate policy,
        and has the arguments of the pending rerun the killed horse ran, if it ran one."""
        self._free_dead_horse(comes_back=True)
        self._resume_with(rerun)
        self._exclusive_record(
            "requeued", rerun.key, reason=rerun.reason, requeues=rerun.requeues, retry=True
        )
        logger.warning(
            "%s key=%s job_id=%s: %s",
            outcomes.REQUEUED_AS[rerun.cause],
            rerun.key,
            self.id,
            rerun.reason,
        )
        self._exclusive_ending = REQUEUED
        if self._scheduler_runs():
            interval = max(1, math.ceil(rerun.countdown))
            self.set_status(JobStatus.SCHEDULED)
            queue.schedule_job(self, now() + timedelta(seconds=interval), pipeline=pipeline)
        else:
            queue.enqueue_job(self, pipeline=pipeline)

    def _send_owed_rerun(
        self, owed: outcomes.OwedRun, dead: Optional[Job] = None, how: str = "died"
    ) -> None:
        """This job (or the job ``dead``) ended as the pending rerun of its key without
        running: the duplicates coalesced into it are owed a run, which a new job of the
        same function, on the same queue, does."""
        dead = dead or self
        queue = Queue(dead.origin, connection=self.connection, job_class=type(self))
        # It carries when its change was sent: no newer change is replaced.
        job = queue.enqueue_call(
            dead.func_name,
            args=owed.args,
            kwargs=owed.kwargs,
            timeout=dead.timeout,
            meta={META_KEY: {"owed_by": dead.id, **_stamp(owed.as_of)}},
            job_id=owed.task_id,  # the id the rerun mark names as its pending rerun now
        )
        logger.warning(
            "pending rerun job %s %s; its run goes to job %s (its duplicates are owed it)",
            dead.id,
            how,
            job.id,
        )

    def _free_dead_horse(self, comes_back: bool = False) -> None:
        """The worker process saw this job's attempt end without the horse ending it
        (killed, stopped, out of memory): free the lease the horse held, now; and unless
        the job ``comes_back`` (RQ retries it), hand on the run it owed as a pending
        rerun."""
        try:
            options = exclusive_options(self.func)
            if options is None:
                return
            settings = settings_for(self.func_name, options, self.connection)
            key = self._exclusive_key(settings)
            backend = backend_for_url(settings.backend_url)
            for left in reaper.leases_on_this_host(backend, key, self.id, settings.limit):
                # The worker has waited for its horse: a process still running is not it.
                keep = reaper.kept_after_death(settings, left, comes_back)
                reaper.release_when_gone(backend, left, self.id, patience=0, keep=keep)
            owed = None if comes_back else attempt.owed_rerun(backend, key, self.id, settings)
            if owed is not None:
                self._send_owed_rerun(owed)
        except Exception as exc:  # never in the way of RQ's own failure handling
            logger.warning("could not free the lease of lost job %s: %s", self.id, exc)


def now() -> datetime:
    return datetime.now(timezone.utc)


def _why(lease: Any) -> str:
    """Why a call runs without a lease (the store's error), for its record."""
    return str(getattr(lease, "reason", ""))


class JobOutcomes(outcomes.OutcomeHandler):
    """The engine's outcome of one job, in RQ's terms (see the module docstring): what
    the job returns, ending it ``finished``, ``canceled`` with its record, or scheduled
    again."""

    def __init__(self, job: ExclusiveJob, settings: config.Settings) -> None:
        self.job = job
        self.settings = settings

    def handle_ran(self, outcome: outcomes.Ran) -> Any:
        if outcome.owed is not None:
            self.job._send_owed_rerun(outcome.owed)
        return outcome.result

    def handle_skipped(self, outcome: outcomes.Skipped) -> Any:
        return self.job._skip(outcome.key, outcome.holder_task_id or outcome.holder)

    def handle_coalesced(self, outcome: outcomes.Coalesced) -> Any:
        key, rerun = outcome.key, outcome.rerun_task_id
        if outcome.debounced:
            logger.info("debounced job coalesced key=%s job_id=%s into=%s", key, self.job.id, rerun)
        else:
            logger.info("duplicate coalesced key=%s job_id=%s rerun=%s", key, self.job.id, rerun)
        return self.job._end_unrun("coalesced", key, rerun=rerun)

    def handle_replaced(self, outcome: outcomes.Replaced) -> Any:
        key, by = outcome.key, outcome.by
        logger.info("run replaced key=%s job_id=%s by=%s", key, self.job.id, by)
        return self.job._end_unrun("replaced", key, by=by)

    def handle_requeue(self, outcome: outcomes.Requeue) -> Any:
        return self.job._requeue(self.settings, outcome)

    def handle_gave_up(self, outcome: outcomes.GaveUp) -> Any:
        if outcome.owed is not None:
            self.job._send_owed_rerun(outcome.owed)
        reason = f"gave up after {outcome.requeues} requeues: {outcome.reason}"
        return self.job._skip(outcome.key, outcome.holder_task_id, reason=reason)

    def handle_waited(self, outcome: outcomes.Waited) -> Any:
        waited = f"{outcome.reason}; waited wait_timeout={outcome.wait_timeout:g}s, synchronously"
        return self.job._skip(outcome.key, outcome.holder_task_id, reason=waited)

    def handle_unanswered(self, outcome: outcomes.Unanswered) -> Any:
        message = (
            f"{self.job._exclusive_label}: cannot take the lease on {outcome.key!r}: "
            f"{outcome.error}"
        )
        raise BackendUnavailable(message, outcome.error.url) from None

    # An RQ job's message is never delivered twice (its host says so: no redelivery), so
    # the engine gives these none; each still ends the job as its name says.

    def handle_set_aside(self, outcome: outcomes.SetAside) -> Any:
        requeue = outcomes.Requeue(
            outcome.key, outcome.countdown, "its first run still runs", "held", outcome.requeues
        )
        return self.job._requeue(self.settings, requeue)

    def handle_dropped(self, outcome: outcomes.Dropped) -> Any:
        return self.job._end_unrun("dropped", outcome.key)

    def handle_redelivered(self, outcome: outcomes.Redelivered) -> Any:
        raise outcome.error


def _stamp(as_of: Optional[float]) -> dict[str, float]:
    """A record's ``as_of``, where there is one to give."""
    return {} if as_of is None else {"as_of": as_of}
