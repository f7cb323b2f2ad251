"""RQ integration: a job class that runs marked job functions only under their lease.

Mark the functions that must not run twice at once, and start the workers with the
job class::

    from celery_exclusive.rq import exclusive

    @exclusive(key="invoice:{invoice_id}", on_duplicate="requeue")
    def settle(invoice_id): ...

    $ rq worker --with-scheduler --job-class celery_exclusive.rq.ExclusiveJob

Unmarked functions run exactly as they would with RQ's own ``Job``.

The lease is taken in the work horse, in ``Job.perform()`` (public on RQ 2.x and
3.x, unlike the worker's methods, whose signatures changed in 3.0). A
``try/finally`` there releases it on every exit, including RQ's job timeout; a horse
killed with SIGKILL cannot release, and its lease expires after ``lease_ttl``.

What a duplicate gets, readable in ``job.meta["exclusive"]``:

- ``skip``: the job *finishes* (status ``finished``) without running; its return
  value and meta are ``{"outcome": "skipped", "key": ..., "holder": <job id>}``.
  Finishing rather than failing keeps an expected outcome out of the failed job
  registry and away from RQ's own ``Retry`` of failed jobs, which would otherwise
  turn a skip into a retry.
- ``requeue``: the job returns RQ's ``Retry`` with a backoff interval (whole
  seconds, at least 1), so RQ schedules the *same* job id again. This needs a
  scheduler (``rq worker --with-scheduler``) on the job's queue; without one the
  job fails with a :class:`ConfigurationError` that says so rather than wait in
  the scheduled registry forever. Needs RQ 2.1 or later.
- ``wait``: the horse blocks up to ``wait_timeout`` (kept under half the job's
  timeout), woken by the holder's release, then falls back to ``requeue``.
- ``rerun``: coalesced. The first duplicate becomes the key's pending rerun and waits
  (then requeues) for the key; later duplicates finish at once with
  ``{"outcome": "coalesced", "rerun": <pending job id>}``. The pending job runs once
  after the current holder, with the latest duplicate's arguments (``rerun_args``).
- ``priority=True``: a job that finds its key held takes the next turn and waits
  for it; ordinary jobs stop getting the key meanwhile.

Settings: every setting ``<name>`` comes from the decorator argument, else the
environment variable ``EXCLUSIVE_<NAME>`` of the process (``EXCLUSIVE_LEASE_TTL=60``),
else the package default. ``key`` is never read from the environment: one key for
every job would silently serialise them all. Leases live, unless ``backend_url``
says otherwise, in the Redis database the job itself came from.

Compared with RQ's own tools: ``unique=True`` with a ``job_id`` refuses a second
*enqueue* of an id whose job hash still exists, finished or not; it says nothing
about two different jobs for one record running at once. RQ 3.0's
``RateLimit(key, concurrency)`` holds jobs beyond ``concurrency`` back at dispatch
and promotes them as slots free, much like ``on_duplicate="requeue"`` with
``limit=concurrency``, but it has no skip, no fencing token, and its key is chosen
by whoever enqueues. Either can be combined with ``@exclusive``; the lease is what
guarantees the body never runs twice at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Callable, Optional, TypeVar, Union
from urllib.parse import quote

import redis
from rq import get_current_job
from rq.job import Job, Retry
from rq.queue import Queue
from rq.scheduler import RQScheduler
from rq.version import VERSION as RQ_VERSION

from . import config, policies
from .backends import backend_for_url
from .errors import BackendUnavailable, ConfigurationError, ExclusiveKeyError
from .keys import KeySpec, build_key, check_key_spec
from .lease import HeldLease

__all__ = ["ENV_PREFIX", "META_KEY", "ExclusiveJob", "current_lease", "exclusive"]

logger = logging.getLogger("celery_exclusive")

#: Environment variables ``EXCLUSIVE_<NAME>`` supply settings no decorator gives.
ENV_PREFIX = "EXCLUSIVE_"
#: ``job.meta[META_KEY]`` records what celery-exclusive did with the job's last attempt.
META_KEY = "exclusive"

#: Settings that are whole numbers, parsed as such from the environment.
_INTEGER_SETTINGS = ("limit", "requeue_max_retries")
#: Jobs return ``Retry`` to be scheduled again since RQ 2.1; before, it was a result.
_RETURNED_RETRY = tuple(int(part) for part in RQ_VERSION.split(".")[:2]) >= (2, 1)

F = TypeVar("F", bound=Callable[..., Any])


def exclusive(
    function: Optional[F] = None,
    *,
    key: KeySpec = None,
    on_duplicate: Optional[str] = None,
    lease_ttl: Optional[float] = None,
    limit: Optional[int] = None,
    backend_url: Optional[str] = None,
    wait_timeout: Optional[float] = None,
    key_prefix: Optional[str] = None,
    on_backend_error: Optional[str] = None,
    on_lease_lost: Optional[str] = None,
    requeue_delay: Optional[float] = None,
    requeue_max_delay: Optional[float] = None,
    requeue_max_retries: Optional[int] = None,
    rerun_args: Optional[str] = None,
    priority: Optional[bool] = None,
) -> Union[F, Callable[[F], F]]:
    """Mark an RQ job function as exclusive; ``ExclusiveJob`` runs it under its lease.

    Arguments left as None fall back to ``EXCLUSIVE_<NAME>`` in the environment, then
    to the package defaults (see the module docstring). The function itself is
    returned unchanged, with the options in its ``__exclusive__`` attribute, so RQ
    imports and pickles it as before.

    The options and key are checked here, when the module is imported, so that a
    mistake stops the enqueuing process and the worker at start rather than failing
    each job later.
    """
    options = {
        name: value
        for name, value in (
            ("key", key),
            ("on_duplicate", on_duplicate),
            ("lease_ttl", lease_ttl),
            ("limit", limit),
            ("backend_url", backend_url),
            ("wait_timeout", wait_timeout),
            ("key_prefix", key_prefix),
            ("on_backend_error", on_backend_error),
            ("on_lease_lost", on_lease_lost),
            ("requeue_delay", requeue_delay),
            ("requeue_max_delay", requeue_max_delay),
            ("requeue_max_retries", requeue_max_retries),
            ("rerun_args", rerun_args),
            ("priority", priority),
        )
        if value is not None
    }

    def mark(target: F) -> F:
        name = f"{target.__module__}.{target.__qualname__}"
        # The job's own Redis URL is only known in the worker; any Redis URL checks the rest.
        settings = resolve_settings(name, options, connection_url="redis://localhost")
        check_key_spec(name, target, settings.key)
        target.__exclusive__ = options  # type: ignore[attr-defined]
        return target

    return mark(function) if function is not None else mark


def exclusive_options(function: Any) -> Optional[dict[str, Any]]:
    """The options ``@exclusive`` gave ``function``; None for an unmarked function."""
    return getattr(function, "__exclusive__", None)


def resolve_settings(
    name: str, options: dict[str, Any], connection_url: Optional[str]
) -> config.Settings:
    """Decorator options, then ``EXCLUSIVE_<NAME>``, then defaults; checked.

    ``connection_url`` (the job's Redis) is the default lease store.
    """
    return config.resolve(name, options.get, setting_from_environment, connection_url)


def setting_from_environment(name: str) -> Any:
    """``EXCLUSIVE_<NAME>`` as a value ``config.resolve`` checks; None when unset or empty."""
    if name == "key":
        return None  # a process-wide key would turn every per-record lock into one global lock
    raw = os.environ.get(ENV_PREFIX + name.upper(), "").strip()
    if not raw:
        return None
    if name in _INTEGER_SETTINGS:
        try:
            return int(raw)
        except ValueError:
            return raw  # config.resolve names the setting and what it accepts
    return raw


def connection_url(connection: redis.Redis) -> Optional[str]:
    """The ``redis://`` URL of a client's database, or None if it has no plain URL.

    A Sentinel pool or a Unix socket has none: such setups name ``backend_url``.
    """
    pool = connection.connection_pool
    kwargs = pool.connection_kwargs
    if "path" in kwargs or "host" not in kwargs or "Sentinel" in type(pool).__name__:
        return None
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    auth = ""
    if kwargs.get("password") is not None:
        auth = f"{quote(kwargs.get('username') or '', safe='')}:"
        auth += f"{quote(kwargs['password'], safe='')}@"
    elif kwargs.get("username"):
        auth = f"{quote(kwargs['username'], safe='')}@"
    return f"{scheme}://{auth}{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


def current_lease() -> Optional[HeldLease]:
    """The lease the running RQ job holds (``key``, ``fencing_token``, ``ensure_held()``).

    None outside an exclusive job, or while it runs without a lease because the store
    was down and ``on_backend_error="run"``.
    """
    return getattr(get_current_job(), "exclusive_lease", None)


class ExclusiveJob(Job):
    """RQ ``Job`` that runs ``@exclusive`` functions only while holding their lease.

    Start workers with ``rq worker --job-class celery_exclusive.rq.ExclusiveJob``
    (and ``--with-scheduler`` where duplicates are requeued or waited for).
    """

    #: The lease of the running call, also reachable through :func:`current_lease`.
    exclusive_lease: Optional[HeldLease] = None

    def perform(self) -> Any:
        options = exclusive_options(self.func)
        if options is None:
            return super().perform()
        settings = self._exclusive_settings(options)
        key = self._exclusive_key(settings)
        try:
            outcome = policies.claim(
                settings,
                backend_for_url(settings.backend_url),
                key,
                self.func_name,
                self.id,
                requeues=self._exclusive_requeues(),
                arguments=policies.encode_call(self.func_name, self.args, self.kwargs)
                if settings.on_duplicate == "rerun"
                else None,
            )
        except BackendUnavailable as exc:
            return self._without_store(settings, key, exc)
        if isinstance(outcome, policies.Skip):
            return self._skip(key, outcome.holder_task_id)
        if isinstance(outcome, policies.Coalesce):
            logger.info(
                "duplicate coalesced key=%s job_id=%s rerun=%s",
                key,
                self.id,
                outcome.rerun_task_id,
            )
            return self._exclusive_record("coalesced", key, rerun=outcome.rerun_task_id)
        if isinstance(outcome, policies.Requeue):
            return self._requeue(
                settings, key, outcome.countdown, outcome.holder_task_id, "held by another job"
            )
        if outcome.arguments:
            # The pending rerun runs with the latest duplicate's arguments (saved with
            # the job, so its record says what it ran with).
            self.args, self.kwargs = policies.decode_call(outcome.arguments)
        return self._run_under(settings, outcome.lease)

    @property
    def _exclusive_label(self) -> str:
        return f"{self.func_name}[{self.id}]"

    def _exclusive_settings(self, options: dict[str, Any]) -> config.Settings:
        """Resolved per call: the default store is the connection this job came from."""
        default_url = None
        if not (options.get("backend_url") or setting_from_environment("backend_url")):
            default_url = connection_url(self.connection)
            if default_url is None:
                raise ConfigurationError(
                    f"{self._exclusive_label}: cannot tell the URL of the job's Redis "
                    "connection (Sentinel or Unix socket); give @exclusive(backend_url=...) "
                    "or set EXCLUSIVE_BACKEND_URL."
                )
        settings = resolve_settings(self.func_name, options, connection_url=default_url)
        return _wait_within_timeout(settings, self.timeout)

    def _exclusive_key(self, settings: config.Settings) -> str:
        try:
            key = build_key(self.func_name, self.func, settings.key, self.args, self.kwargs)
        except ExclusiveKeyError as exc:
            raise ExclusiveKeyError(f"job {self.id}: {exc}", exc.task, exc.argument) from None
        return settings.key_prefix + key

    def _exclusive_requeues(self) -> int:
        record = self.meta.get(META_KEY) or {}
        try:
            return int(record.get("requeues", 0))
        except (TypeError, ValueError):
            return 0

    def _exclusive_record(self, outcome: str, key: str, **details: Any) -> dict[str, Any]:
        """Write what happened to ``job.meta["exclusive"]`` (saved at once) and return it."""
        record = {"outcome": outcome, "key": key, "requeues": self._exclusive_requeues()}
        record.update(details)
        self.meta[META_KEY] = record
        self.save_meta()
        return dict(record)

    def _run_under(self, settings: config.Settings, lease: HeldLease) -> Any:
        try:
            self._exclusive_record("ran", lease.key, fencing_token=lease.fencing_token)
            self.exclusive_lease = lease
            result = super().perform()
        finally:
            self.exclusive_lease = None
            lease.release()
        if lease.lost and settings.on_lease_lost == "abort":
            lease.ensure_held()  # raises LeaseLost: the result is not to be trusted
        return result

    def _skip(self, key: str, holder: Optional[str], **details: Any) -> dict[str, Any]:
        """Finish without running; the record is both the meta and the return value."""
        logger.info(
            "duplicate skipped key=%s job_id=%s holder=%s", key, self.id, holder or "unknown"
        )
        return self._exclusive_record("skipped", key, holder=holder, **details)

    def _requeue(
        self,
        settings: config.Settings,
        key: str,
        countdown: float,
        holder: Optional[str],
        reason: str,
    ) -> Union[Retry, dict[str, Any]]:
        """Have RQ schedule this same job again after ``countdown`` (at least 1 s).

        Counted in the meta, not in RQ's retries: those belong to the job's own errors.
        """
        requeues = self._exclusive_requeues()
        limit = settings.requeue_max_retries
        if limit is not None and requeues >= limit:
            logger.warning(
                "duplicate gave up key=%s job_id=%s after %d requeues", key, self.id, requeues
            )
            return self._skip(key, holder, reason=f"gave up after {requeues} requeues: {reason}")
        self._require_scheduler(key)
        interval = max(1, math.ceil(countdown))  # RQ schedules whole seconds; 0 means "now"
        self._exclusive_record(
            "requeued", key, holder=holder, reason=reason, requeues=requeues + 1, delay=interval
        )
        logger.info(
            "duplicate requeued key=%s job_id=%s in %ds: %s", key, self.id, interval, reason
        )
        # max is always one more than RQ's count, so RQ never fails the job for it.
        return Retry(max=(self.number_of_retries or 0) + 1, interval=interval)

    def _require_scheduler(self, key: str) -> None:
        """Refuse to requeue where the job would sit in the scheduled registry forever."""
        problem = None
        if not _RETURNED_RETRY:
            problem = f"RQ {RQ_VERSION} cannot reschedule a job that returns Retry (2.1+ can)"
        elif not self.connection.exists(RQScheduler.get_locking_key(self.origin)):
            problem = f"no RQ scheduler runs for the queue {self.origin!r}"
        if problem:
            raise ConfigurationError(
                f"{self._exclusive_label} cannot be requeued while its key {key!r} is "
                f"unavailable: {problem}, so it would never run again. Start the workers "
                "with `rq worker --with-scheduler`, or use on_duplicate='skip'."
            )

    def _without_store(self, settings: config.Settings, key: str, exc: BackendUnavailable) -> Any:
        message = f"{self._exclusive_label}: cannot take the lease on {key!r}: {exc}"
        if settings.on_backend_error == "run":
            logger.warning("%s -- running WITHOUT a lease (on_backend_error='run')", message)
            self._exclusive_record("ran_without_lease", key, reason=str(exc))
            return super().perform()
        logger.warning("%s -- requeued (on_backend_error='requeue')", message)
        delay = policies.requeue_delay(settings, self._exclusive_requeues())
        return self._requeue(settings, key, delay, None, "the lease store did not answer")


def _wait_within_timeout(settings: config.Settings, timeout: Optional[float]) -> config.Settings:
    """Keep a ``wait`` well inside the job timeout: RQ kills a horse that overruns it."""
    if timeout is None:
        timeout = Queue.DEFAULT_TIMEOUT  # what the worker applies to a job without one
    if settings.on_duplicate != "wait" or timeout <= 0:
        return settings
    if settings.wait_timeout <= timeout / 2:
        return settings
    return dataclasses.replace(settings, wait_timeout=timeout / 2)
