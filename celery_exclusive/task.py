"""ExclusiveTask: the Celery base class that runs a task's body only under its lease.

The lease is taken in ``__call__``, inside Celery's tracer, because a signal
handler cannot skip a task, and ``after_return`` is not called for retried,
ignored or rejected tasks. A ``try/finally`` around the body therefore releases on
every exit path. What a hard kill leaves behind, the worker's main process
releases (:class:`ExclusiveRequest`), and the store expires in any case.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

from celery import Task, bootsteps
from celery.exceptions import Retry, WorkerLostError
from celery.worker.request import Request
from kombu.utils.uuid import uuid

from . import config, marks, policies, signals
from .backends import Backend, Lease, backend_for_url
from .errors import (
    BackendUnavailable,
    ConfigurationError,
    DuplicateCoalesced,
    DuplicateSkipped,
    ExclusiveKeyError,
)
from .keys import build_key, check_key_spec
from .lease import HeldLease

logger = logging.getLogger("celery_exclusive")

#: Message header counting how often a duplicate was requeued (drives its backoff).
REQUEUES_HEADER = "exclusive_requeues"


class ExclusiveTask(Task):
    """Base class for tasks that must not run twice at once for the same key.

    Every setting ``exclusive_<name>`` of the app can be overridden per task::

        @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}",
                  exclusive_on_duplicate="requeue")
        def settle(invoice_id): ...

    Inside the body, ``self.lease`` (with ``bind=True``) gives ``key``,
    ``fencing_token``, ``lost`` and ``ensure_held()``.
    """

    # Per-task overrides; None means "use the app setting, then the default".
    exclusive_backend_url: Optional[str] = None
    exclusive_key: Any = None
    exclusive_key_prefix: Optional[str] = None
    exclusive_lease_ttl: Optional[float] = None
    exclusive_limit: Optional[int] = None
    exclusive_on_duplicate: Optional[str] = None
    exclusive_wait_timeout: Optional[float] = None
    exclusive_on_backend_error: Optional[str] = None
    exclusive_on_lease_lost: Optional[str] = None
    exclusive_requeue_delay: Optional[float] = None
    exclusive_requeue_max_delay: Optional[float] = None
    exclusive_requeue_max_retries: Optional[int] = None

    #: A skipped duplicate is an expected outcome: logged at INFO, no traceback.
    throws = (DuplicateSkipped,)

    Request = "celery_exclusive.task:ExclusiveRequest"

    _exclusive_settings: Optional[config.Settings] = None

    @classmethod
    def on_bound(cls, app) -> None:
        super().on_bound(app)
        app.steps["worker"].add(CheckExclusiveSettings)

    @property
    def exclusive_settings(self) -> config.Settings:
        """This task's resolved settings, checked once per process."""
        if self._exclusive_settings is None:
            conf = self.app.conf
            self._exclusive_settings = config.resolve(
                self.name,
                lambda name: getattr(self, config.setting_name(name), None),
                lambda name: conf.get(config.setting_name(name)),
                broker_url=conf.broker_url,
            )
        return self._exclusive_settings

    @property
    def exclusive_backend(self) -> Backend:
        return backend_for_url(self.exclusive_settings.backend_url)

    @property
    def lease(self) -> Optional[HeldLease]:
        """The lease the current call runs under; None outside a call, or if it runs
        unlocked because the store was down and ``exclusive_on_backend_error="run"``."""
        stack = getattr(_leases, "stack", None)
        return stack[-1] if stack else None

    def exclusive_key_for(self, args: tuple, kwargs: dict) -> str:
        """The full store key a call with these arguments takes."""
        settings = self.exclusive_settings
        return settings.key_prefix + build_key(self.name, self.run, settings.key, args, kwargs)

    def apply_async(self, args=None, kwargs=None, task_id=None, **options: Any):
        """With ``exclusive_scope="enqueue"``, send nothing for a key already queued or
        running: return that call's AsyncResult instead."""
        settings = self.exclusive_settings
        if settings.scope == "run" or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        key = self.exclusive_key_for(tuple(args or ()), dict(kwargs or {}))
        task_id = task_id or uuid()
        try:
            queued = marks.claim_mark(
                self.exclusive_backend, key + marks.QUEUED, task_id, settings.enqueue_ttl
            )
        except BackendUnavailable as exc:
            logger.warning(
                "%s: cannot check whether %r is already queued, sending it (the run-time "
                "lease still applies): %s",
                self.name,
                key,
                exc,
            )
            queued = task_id
        if queued != task_id:
            logger.info("enqueue deduplicated key=%s: %s is already queued", key, queued)
            signals.duplicate_detected.send(
                sender=self.name,
                key=key,
                task_id=task_id,
                policy="enqueue",
                holder_task_id=queued,
            )
            return self.AsyncResult(queued)
        return super().apply_async(args, kwargs, task_id=task_id, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self.exclusive_key_for(args, kwargs)
        if self.exclusive_settings.scope == "run" or _cannot_requeue(self.request):
            return self._call_exclusive(key, args, kwargs)
        finished = True
        try:
            return self._call_exclusive(key, args, kwargs)
        except Retry:
            finished = False  # the same task id comes back: it stays the queued one
            raise
        finally:
            if finished:
                self._clear_enqueue_mark(key)

    def _call_exclusive(self, key: str, args: tuple, kwargs: dict) -> Any:
        settings = self.exclusive_settings
        request = self.request
        try:
            outcome = policies.claim(
                settings,
                self.exclusive_backend,
                key,
                self.name,
                request.id,
                requeues=_requeues(request),
                arguments=policies.encode_call(self.name, args, kwargs)
                if settings.on_duplicate == "rerun"
                else None,
            )
        except BackendUnavailable as exc:
            return self._without_store(exc, key, args, kwargs)

        if isinstance(outcome, policies.Skip):
            logger.info(
                "duplicate skipped key=%s task_id=%s holder=%s",
                key,
                request.id,
                outcome.holder_task_id,
            )
            raise DuplicateSkipped(
                f"{self.name}[{request.id}] was skipped: its key {key!r} is held by "
                f"{_describe_holder(outcome.holder_task_id)}. Use exclusive_on_duplicate="
                "'requeue', 'wait' or 'rerun' to run it later instead.",
                key,
                outcome.holder_task_id,
            )
        if isinstance(outcome, policies.Coalesce):
            logger.info(
                "duplicate coalesced key=%s task_id=%s rerun=%s",
                key,
                request.id,
                outcome.rerun_task_id,
            )
            raise DuplicateCoalesced(
                f"{self.name}[{request.id}] joined the pending rerun of {key!r}, task "
                f"{outcome.rerun_task_id}, which runs once after the current holder.",
                key,
                outcome.rerun_task_id,
            )
        if isinstance(outcome, policies.Requeue):
            reason = f"held by {_describe_holder(outcome.holder_task_id)}"
            if not _cannot_requeue(request):
                self._requeue(key, outcome.countdown, reason)
            # Eager and direct calls have no queue to go back to: they wait instead.
            return self._run_under(self._wait_inline(key, reason), args, kwargs)

        if outcome.arguments:
            args, kwargs = policies.decode_call(outcome.arguments)
        return self._run_under(outcome.lease, args, kwargs)

    def _clear_enqueue_mark(self, key: str) -> None:
        try:
            marks.clear_mark(self.exclusive_backend, key + marks.QUEUED, self.request.id)
        except BackendUnavailable as exc:
            logger.warning(
                "enqueue mark of %r left to expire (exclusive_enqueue_ttl): %s", key, exc
            )

    def _run_under(self, lease: HeldLease, args: tuple, kwargs: dict) -> Any:
        stack = _leases.__dict__.setdefault("stack", [])
        stack.append(lease)
        try:
            result = super().__call__(*args, **kwargs)
        finally:
            stack.pop()
            lease.release()
        if lease.lost and self.exclusive_settings.on_lease_lost == "abort":
            lease.ensure_held()  # raises LeaseLost: the result is not to be trusted
        return result

    def _without_store(self, exc: BackendUnavailable, key: str, args: tuple, kwargs: dict) -> Any:
        message = f"{self.name}[{self.request.id}]: cannot take the lease on {key!r}: {exc}"
        if self.exclusive_settings.on_backend_error == "run":
            logger.warning(
                "%s -- running WITHOUT a lease (exclusive_on_backend_error='run')", message
            )
            return super().__call__(*args, **kwargs)
        if _cannot_requeue(self.request):
            raise BackendUnavailable(message, exc.url) from None
        logger.warning("%s -- requeued (exclusive_on_backend_error='requeue')", message)
        settings = self.exclusive_settings
        self._requeue(key, policies.requeue_delay(settings, _requeues(self.request)), str(exc))

    def _requeue(self, key: str, countdown: float, reason: str) -> None:
        """Send this call again after ``countdown`` seconds, then end this attempt.

        Unlike ``retry()``, a requeue does not spend the task's ``max_retries``: those
        belong to the task's own errors. It counts in its own header instead.
        """
        request = self.request
        requeues = _requeues(request)
        limit = self.exclusive_settings.requeue_max_retries
        if limit is not None and requeues >= limit:
            raise DuplicateSkipped(
                f"{self.name}[{request.id}] gave up after {requeues} requeues: its key {key!r} "
                f"stayed {reason}. Raise exclusive_requeue_max_retries (None: no limit).",
                key,
                None,
            )
        headers = dict(request.headers or {})
        headers[REQUEUES_HEADER] = requeues + 1
        signature = self.signature_from_request(
            request, countdown=countdown, headers=headers, retries=request.retries
        )
        signature.apply_async()
        logger.info(
            "duplicate requeued key=%s task_id=%s countdown=%.2fs: %s",
            key,
            request.id,
            countdown,
            reason,
        )
        raise Retry(f"requeued: {key!r} {reason}", when=countdown, sig=signature)

    def retry(self, *args: Any, **kwargs: Any):
        """Release the lease first, so the retried message does not find it held."""
        lease = self.lease
        if lease is not None:
            lease.release()
        return super().retry(*args, **kwargs)

    def _wait_inline(self, key: str, reason: str) -> HeldLease:
        settings = self.exclusive_settings
        lease = policies.wait_for(settings, self.exclusive_backend, key, self.name, self.request.id)
        if lease is None:
            raise DuplicateSkipped(
                f"{self.name} called eagerly could not run: its key {key!r} stayed {reason} "
                f"for exclusive_wait_timeout={settings.wait_timeout}s.",
                key,
                None,
            )
        return lease


_leases = threading.local()


def _requeues(request) -> int:
    value = getattr(request, REQUEUES_HEADER, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(REQUEUES_HEADER, 0)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _describe_holder(task_id: Optional[str]) -> str:
    return f"task {task_id}" if task_id else "another task (which has just released it)"


def _cannot_requeue(request) -> bool:
    return bool(request.called_directly or request.is_eager)


class ExclusiveRequest(Request):
    """Runs in the worker's main process: frees the lease of a child that died.

    A SIGKILLed child (OOM killer, hard time limit) cannot release its lease; it would
    expire after ``lease_ttl``. The main process sees the death (WorkerLostError, or a
    hard timeout) and releases it at once, owner-checked against what the store says
    this task id holds, and only once the holder process is gone.
    """

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:
            self._release_dead_holder()

    def on_failure(self, exc_info, send_failed_event: bool = True, return_ok: bool = False):
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # Celery wraps it in ExceptionWithTraceback
        if isinstance(exc, WorkerLostError):
            self._release_dead_holder()

    def _release_dead_holder(self) -> None:
        task = self.task
        if not isinstance(task, ExclusiveTask):
            return
        try:
            key = task.exclusive_key_for(tuple(self.args or ()), dict(self.kwargs or {}))
            backend = task.exclusive_backend
            held = [i for i in backend.holders_of(key) if i.task_id == self.id]
            if task.exclusive_settings.scope != "run":
                marks.clear_mark(backend, key + marks.QUEUED, self.id)
        except (BackendUnavailable, ExclusiveKeyError) as exc:
            logger.warning("could not free the lease of lost task %s: %s", self.id, exc)
            return
        for info in held:
            lease = Lease(
                key, info.owner, info.fencing_token or 0, 0.0, task.exclusive_settings.limit
            )
            threading.Thread(
                target=_release_when_gone,
                args=(backend, lease, info.holder.get("pid"), self.id),
                name="celery-exclusive-reaper",
                daemon=True,
            ).start()


#: How long the main process waits for a killed child to be gone before leaving its
#: lease to expire instead (a hard time limit sends SIGKILL 0.1 s after SIGTERM).
REAP_PATIENCE = 3.0


def _release_when_gone(backend: Backend, lease: Lease, pid: Optional[int], task_id: str) -> None:
    deadline = time.monotonic() + REAP_PATIENCE
    while pid and _alive(pid):
        if time.monotonic() > deadline:
            logger.warning(
                "lease of lost task %s on %s left to expire: process %s still running",
                task_id,
                lease.key,
                pid,
            )
            return
        time.sleep(0.02)
    try:
        if backend.release(lease):
            logger.warning("released lease key=%s of lost task_id=%s", lease.key, task_id)
    except BackendUnavailable as exc:
        logger.warning("lease of lost task %s on %s left to expire: %s", task_id, lease.key, exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child stays a zombie until the pool reaps it; a zombie runs no code.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class CheckExclusiveSettings(bootsteps.Step):
    """Worker bootstep: check every exclusive task's settings before any task runs.

    A bad setting stops the worker at start with a ConfigurationError naming the
    setting, instead of failing each task later.
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
    """Resolve and check the settings and key of every ExclusiveTask of ``app``."""
    stores = set()
    for task in app.tasks.values():
        if isinstance(task, ExclusiveTask):
            settings = task.exclusive_settings
            check_key_spec(task.name, task.run, settings.key)
            stores.add(settings.backend_url)
    for url in sorted(stores):
        if url.startswith("sqlite:"):
            logger.info(
                "celery-exclusive: leases live in %s, which coordinates only the workers of "
                "this host; set exclusive_backend_url to a redis:// or consul:// URL to "
                "coordinate several hosts",
                url,
            )
        elif url.startswith("memory:"):
            logger.warning(
                "celery-exclusive: leases live in %s, which coordinates only one process; "
                "use it for eager mode and tests",
                url,
            )
