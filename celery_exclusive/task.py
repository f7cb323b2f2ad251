"""ExclusiveTask: the Celery base class that runs a task's body only under its lease.

The lease is taken in ``__call__``, inside Celery's tracer, because a signal
handler cannot skip a task, and ``after_return`` is not called for retried,
ignored or rejected tasks. A ``try/finally`` around the body therefore releases on
every exit path. What a hard kill leaves behind, the worker's main process
releases (:class:`celery_exclusive.worker.ExclusiveRequest`), and the store expires
in any case.

A task with ``acks_late`` may see its message delivered twice (a Redis or SQS
broker's visibility timeout, a connection lost before the ack): the copy is
recognised by its task id. While the first delivery runs, the copy is set aside
without storing a result; once an attempt has ended, copies of it are dropped (see
:meth:`ExclusiveTask._finish_attempt`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any, Optional, Union

from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from kombu.utils.imports import symbol_by_name
from kombu.utils.uuid import uuid

from . import config, marks, policies, signals, terminate
from .backends import Backend, backend_for_url
from .errors import (
    BackendUnavailable,
    DuplicateCoalesced,
    DuplicateSkipped,
    ExclusiveError,
    LeaseLost,
)
from .keys import build_key, check_key_spec
from .lease import HeldLease, UnlockedLease

logger = logging.getLogger("celery_exclusive")

#: Message header counting how often a duplicate was requeued (drives its backoff).
REQUEUES_HEADER = "exclusive_requeues"
#: The request attribute holding the call's finished mark as read when it took its key.
FINISHED_MARK = "exclusive_finished_mark"

#: The broker's visibility timeout when ``broker_transport_options`` sets none
#: (kombu's Redis and SQS transports: one hour).
DEFAULT_VISIBILITY_TIMEOUT = 3600.0

AnyLease = Union[HeldLease, UnlockedLease]


class RedeliveredCopy(Ignore):
    """Ends a second delivery of a task's message without storing any state: the first
    delivery runs, or has run, and its result is the task's."""


class ExclusiveTask(Task):
    """Base class for tasks that must not run twice at once for the same key.

    Every setting ``exclusive_<name>`` of the app (one per field of
    :class:`celery_exclusive.config.Settings`) can be overridden per task::

        @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}",
                  exclusive_on_duplicate="requeue")
        def settle(invoice_id): ...

    Inside the body, ``self.lease`` (with ``bind=True``) gives ``key``,
    ``fencing_token``, ``held``, ``lost`` and ``ensure_held()``.
    """

    # The per-task overrides, exclusive_<name> = None ("use the app setting, then the
    # default"), are set from config.NAMES below the class.

    #: A skipped duplicate is an expected outcome: logged at INFO, no traceback. A
    #: subclass's or ``@app.task(throws=...)``'s own are added to it, never replace it.
    throws = (DuplicateSkipped,)

    _exclusive_settings: Optional[config.Settings] = None
    #: (config.generation(), app.conf) when _exclusive_settings was resolved.
    _exclusive_settings_stamp: Optional[tuple[int, Any]] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Compose with the user's own base class, in either order of bases.

        Celery reads one ``Request`` class and one ``throws`` tuple per task. A subclass
        (``class T(MyBase, ExclusiveTask)``, ``class T(ExclusiveTask, MyBase)``, or the
        class ``@app.task(base=ExclusiveTask, Request=..., throws=...)`` makes) gets
        the ``throws`` of every class it derives from, and a ``Request`` that is the
        user's own with :class:`~celery_exclusive.worker.ExclusiveRequest` mixed in:
        both sets of hooks run.
        """
        super().__init_subclass__(**kwargs)
        throws: list[type] = []
        for klass in cls.__mro__:
            for exc in klass.__dict__.get("throws", ()):
                if exc not in throws:
                    throws.append(exc)
        cls.throws = tuple(throws)
        cls.Request = _ExclusiveRequestOf(_users_request(cls))

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        from .worker import CheckExclusiveSettings  # the worker side builds on this module

        app.steps["worker"].add(CheckExclusiveSettings)

    @property
    def exclusive_settings(self) -> config.Settings:
        """This task's resolved settings and key format, checked again only after a
        setting changed (``app.conf``, an ``exclusive_<name>`` attribute of the task, or
        :func:`celery_exclusive.config.force`): one comparison per call otherwise.

        A misspelt ``exclusive_<name>`` attribute, a bad value or a key that can never
        be built raises here: at worker start, and at the first ``delay()``.
        """
        settings = self._exclusive_settings
        conf = self.app.conf
        stamp = self._exclusive_settings_stamp
        if (
            settings is not None
            and stamp is not None
            and stamp[0] == config.generation()
            and stamp[1] is conf
        ):
            return settings
        stamp = (config.generation(), conf)  # read first: a change from now on is seen
        config.check_names(self.name, _override_names(type(self)))
        settings = config.for_app(
            self.app, self.name, lambda name: getattr(self, config.setting_name(name), None)
        )
        check_key_spec(self.name, self.run, settings.key)
        self._exclusive_settings = settings
        # An app.conf that is not Celery's own cannot be watched: resolve at every call.
        watched = isinstance(conf, config.WatchedSettings)
        self._exclusive_settings_stamp = stamp if watched else None
        return settings

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name.startswith("exclusive_"):  # a per-task setting changed at run time
            config.invalidate()

    @property
    def exclusive_backend(self) -> Backend:
        return backend_for_url(self.exclusive_settings.backend_url)

    @property
    def lease(self) -> Optional[AnyLease]:
        """The lease the current call runs under; None outside a call.

        A call running unlocked (the store was down and
        ``exclusive_on_backend_error="run"``) gets an :class:`UnlockedLease`, whose
        ``held`` is False and ``fencing_token`` None.
        """
        stack = getattr(_leases, "stack", None)
        return stack[-1] if stack else None

    def exclusive_key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The full store key a call with these arguments takes."""
        settings = self.exclusive_settings
        return settings.key_prefix + build_key(self.name, self.run, settings.key, args, kwargs)

    def apply_async(
        self,
        args: Optional[Sequence[Any]] = None,
        kwargs: Optional[dict[str, Any]] = None,
        task_id: Optional[str] = None,
        **options: Any,
    ) -> Any:
        """Check the task's settings and key format (once), then send.

        With ``exclusive_scope="enqueue"``, send nothing for a key already queued or
        running: return that call's AsyncResult instead.
        """
        retrying = getattr(_retrying, "lease", None)
        if retrying is not None and task_id == self.request.id:
            self._retry_sent(retrying)  # the retried message must find the key free
        settings = self.exclusive_settings
        if settings.scope == "run" or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        key = self.exclusive_key_for(tuple(args or ()), dict(kwargs or {}))
        task_id = task_id or uuid()
        try:
            queued = marks.claim_mark(
                self.exclusive_backend, key, marks.QUEUED, task_id, settings.enqueue_ttl
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
        request = self.request_stack.top
        if request is None or _running_here(self, request):
            # A direct call: from outside a worker, or from inside a run of this very task
            # (recursion, a helper calling it). It is a call of its own, with a request of
            # its own: the running message's id, headers and retries are not its.
            self.request_stack.push(Context(args=args, kwargs=kwargs))
            try:
                return self._enter(args, kwargs)
            finally:
                self.request_stack.pop()
        return self._enter(args, kwargs)

    def _enter(self, args: tuple, kwargs: dict) -> Any:
        request = self.request
        running = _running.__dict__.setdefault("calls", [])
        running.append((self, request))
        try:
            key = self.exclusive_key_for(args, kwargs)
            if self.exclusive_settings.scope == "run" or _cannot_requeue(request):
                return self._call_exclusive(key, args, kwargs)
            finished = True
            try:
                return self._call_exclusive(key, args, kwargs)
            except (Retry, RedeliveredCopy):
                finished = False  # the same task id comes back, or still runs: still queued
                raise
            finally:
                if finished:
                    self._clear_enqueue_mark(key)
        finally:
            running.pop()

    def _call_exclusive(self, key: str, args: tuple, kwargs: dict) -> Any:
        settings = self.exclusive_settings
        request = self.request
        if request.called_directly:
            held = _held_here(key)
            if held is not None:
                # Called directly under a lease on its own key (recursion): re-entrant, like
                # an RLock. The caller's lease covers it and is released by the caller.
                return self._run_within(held, args, kwargs)
        redelivery = self._redelivery_possible()
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
                redelivery=redelivery,
            )
        except BackendUnavailable as exc:
            return self._without_store(exc, key, args, kwargs)
        if isinstance(outcome, policies.Run) and redelivery:
            try:
                with outcome.lease.released_on_error():
                    self._drop_if_finished(outcome)
            except BackendUnavailable as exc:
                return self._without_store(exc, key, args, kwargs)

        if isinstance(outcome, policies.Redelivered):
            self._set_aside(key, outcome.countdown)
        if isinstance(outcome, policies.Skip):
            logger.info(
                "duplicate skipped key=%s task_id=%s holder=%s",
                key,
                request.id,
                outcome.holder_task_id,
            )
            return self._duplicate_ends(
                DuplicateSkipped(
                    f"{self.name}[{request.id}] was skipped: its key {key!r} is held by "
                    f"{_describe_holder(outcome.holder_task_id)}. Use exclusive_on_duplicate="
                    "'requeue', 'wait' or 'rerun' to run it later instead.",
                    key,
                    outcome.holder_task_id,
                ),
                {"outcome": "skipped", "key": key, "holder": outcome.holder_task_id},
            )
        if isinstance(outcome, policies.Coalesce):
            logger.info(
                "duplicate coalesced key=%s task_id=%s rerun=%s",
                key,
                request.id,
                outcome.rerun_task_id,
            )
            return self._duplicate_ends(
                DuplicateCoalesced(
                    f"{self.name}[{request.id}] joined the pending rerun of {key!r}, task "
                    f"{outcome.rerun_task_id}, which runs once after the current holder.",
                    key,
                    outcome.rerun_task_id,
                ),
                {"outcome": "coalesced", "key": key, "rerun": outcome.rerun_task_id},
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

    def _duplicate_ends(self, error: DuplicateSkipped, result: dict[str, Any]) -> dict[str, Any]:
        """End a duplicate that does not run, in the state ``exclusive_skip_state``
        chose: FAILURE raising ``error``, or SUCCESS returning ``result``. Both are
        terminal, so ``AsyncResult.get()`` answers at once."""
        if self.exclusive_settings.skip_state == "failure":
            raise error
        return result

    def _clear_enqueue_mark(self, key: str) -> None:
        try:
            marks.clear_mark(self.exclusive_backend, key, marks.QUEUED, self.request.id)
        except BackendUnavailable as exc:
            logger.warning(
                "enqueue mark of %r left to expire (exclusive_enqueue_ttl): %s", key, exc
            )

    # --- running under the lease ---------------------------------------------------

    def _run_under(self, lease: HeldLease, args: tuple, kwargs: dict) -> Any:
        settings = self.exclusive_settings
        stack = _leases.__dict__.setdefault("stack", [])
        stack.append(lease)
        ended = True  # False when the message is to be delivered again
        try:
            with self._holding(lease):
                result = super().__call__(*args, **kwargs)
        except LeaseLost as exc:
            if lease.lost and self._redelivered_when_stopped():
                ended = False
                logger.warning(
                    "%s[%s] was stopped by the loss of its lease on %r; its message goes "
                    "back to the queue (acks_late and reject_on_worker_lost)",
                    self.name,
                    self.request.id,
                    lease.key,
                )
                raise Reject(exc, requeue=True) from None
            raise
        except Reject as exc:
            ended = not exc.requeue
            raise
        finally:
            stack.pop()
            self._finish_attempt(lease, ended)
        if lease.lost and settings.on_lease_lost != "log":
            lease.ensure_held()  # raises LeaseLost: the result is not to be trusted
        return result

    def _run_within(self, lease: HeldLease, args: tuple, kwargs: dict) -> Any:
        stack = _leases.__dict__.setdefault("stack", [])
        stack.append(lease)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            stack.pop()

    def _holding(self, lease: HeldLease) -> contextlib.AbstractContextManager[None]:
        """With ``on_lease_lost="terminate"``, stop the body when its lease is lost.

        Only in a worker: an eager or direct call runs in the caller's process (a web
        server, a test), whose signal handlers are not ours to take. It fails with
        ``LeaseLost`` when its body returns instead.
        """
        settings = self.exclusive_settings
        if settings.on_lease_lost != "terminate" or _cannot_requeue(self.request):
            return contextlib.nullcontext()
        return terminate.stop_on_loss(lease, settings.terminate_grace, _in_pool_child())

    def _finish_attempt(self, lease: HeldLease, ended: bool = True) -> None:
        """Release the lease; first, if the attempt ended, record that it did.

        The record (a finished mark per task id, kept past the broker's visibility
        timeout) is written while the lease is still held, so a copy of the message
        that takes the key after the release always finds it.
        """
        if lease.released:
            return
        if ended and self._redelivery_possible():
            request = self.request
            try:
                if self._record_end_and_release(lease, request):
                    return
            except ExclusiveError as exc:
                logger.warning(
                    "could not record that %s[%s] ended (%s): a copy of its message "
                    "delivered again may run it once more",
                    self.name,
                    request.id,
                    exc,
                )
        lease.release()

    def _record_end_and_release(self, lease: HeldLease, request: Context) -> bool:
        """Write the finished mark of this attempt; True if the lease went back with it.

        The mark as read when the call took its key is what it is swapped from, so
        mark and release go in one round trip where the store can. Should the mark
        have changed meanwhile, it is written the long way, and the caller releases.
        """
        ttl, retries = self._finished_ttl(), request.retries
        if hasattr(request, FINISHED_MARK):
            current = getattr(request, FINISHED_MARK)
            finished = marks.attempt_of(current)
            if finished is None or finished < retries:
                mark = (marks.finished_key(lease.key, request.id), marks.DONE)
                if lease.release_after_mark(mark, current, str(retries), ttl) is not None:
                    return True
        marks.mark_finished(lease.backend, lease.key, request.id, retries, ttl)
        return False

    # --- a message delivered twice -----------------------------------------------------

    def _redelivery_possible(self) -> bool:
        """Whether this call's message may be delivered again while, or after, it runs:
        a worker call of an ``acks_late`` task."""
        return bool(self.acks_late and self.request.id and not _cannot_requeue(self.request))

    def _redelivered_when_stopped(self) -> bool:
        """Whether a call stopped by its lost lease is delivered again, as Celery does
        for a task whose worker died."""
        return bool(
            self.acks_late and self.reject_on_worker_lost and not _cannot_requeue(self.request)
        )

    def _finished_ttl(self) -> float:
        """How long a finished mark lasts: a copy restored just before the first
        delivery was acknowledged arrives within the visibility timeout; a copy set
        aside comes back within one requeue delay."""
        options = self.app.conf.broker_transport_options or {}
        visibility = float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))
        settings = self.exclusive_settings
        return visibility + settings.requeue_max_delay + settings.lease_ttl

    def _drop_if_finished(self, outcome: policies.Run) -> None:
        """A copy of an attempt that has ended took the key: give it back, end quietly.

        The finished mark read here (with the grant, where the store could) is kept on
        the request: at the end of the attempt it is what the mark is swapped from.
        """
        lease, request = outcome.lease, self.request
        if outcome.finished_read:
            mark = outcome.finished
        else:
            mark = marks.finished_mark(lease.backend, lease.key, request.id)
        setattr(request, FINISHED_MARK, mark)
        finished = marks.attempt_of(mark)
        if finished is None or finished < request.retries:
            return
        lease.release()
        logger.info(
            "redelivered copy dropped key=%s task_id=%s: this attempt already ran",
            lease.key,
            request.id,
        )
        raise RedeliveredCopy()

    def _set_aside(self, key: str, countdown: float) -> None:
        """A copy whose first delivery still runs: send it again later, end quietly.

        Acknowledging the copy also drops the broker's record of the first delivery
        (both carry one delivery tag), so the copy stays around, as a new message, in
        case the first delivery dies without finishing. When it comes back after the
        first one ended, it is dropped.
        """
        request = self.request
        headers = dict(request.headers or {})
        headers[REQUEUES_HEADER] = _requeues(request) + 1
        self.signature_from_request(
            request, countdown=countdown, headers=headers, retries=request.retries
        ).apply_async()
        logger.info(
            "redelivered copy set aside key=%s task_id=%s: the first delivery still runs; "
            "the copy comes back in %.2fs in case it dies",
            key,
            request.id,
            countdown,
        )
        raise RedeliveredCopy()

    # --- without the lease -----------------------------------------------------------

    def _without_store(self, exc: BackendUnavailable, key: str, args: tuple, kwargs: dict) -> Any:
        message = f"{self.name}[{self.request.id}]: cannot take the lease on {key!r}: {exc}"
        if self.exclusive_settings.on_backend_error == "run":
            logger.warning(
                "%s -- running WITHOUT a lease (exclusive_on_backend_error='run')", message
            )
            stack = _leases.__dict__.setdefault("stack", [])
            stack.append(UnlockedLease(key, self.name, self.request.id, str(exc)))
            try:
                return super().__call__(*args, **kwargs)
            finally:
                stack.pop()
        if _cannot_requeue(self.request):
            raise BackendUnavailable(message, exc.url) from None
        logger.warning("%s -- requeued (exclusive_on_backend_error='requeue')", message)
        settings = self.exclusive_settings
        delay = policies.requeue_delay(settings, _requeues(self.request))
        self._requeue(key, delay, "the lease store did not answer", duplicate=False)

    def _requeue(self, key: str, countdown: float, reason: str, duplicate: bool = True) -> None:
        """Send this call again after ``countdown`` seconds, then end this attempt.

        Unlike ``retry()``, a requeue does not spend the task's ``max_retries``: those
        belong to the task's own errors. It counts in its own header instead. A
        ``duplicate`` found its key held; otherwise the store did not answer.
        """
        request = self.request
        requeues = _requeues(request)
        limit = self.exclusive_settings.requeue_max_retries
        if limit is not None and requeues >= limit:
            advice = "Raise exclusive_requeue_max_retries (None: no limit)."
            if not duplicate:
                raise BackendUnavailable(
                    f"{self.name}[{request.id}] gave up after {requeues} requeues: "
                    f"{reason} while it tried to take {key!r}. {advice}",
                    self.exclusive_backend.safe_url,
                )
            raise DuplicateSkipped(
                f"{self.name}[{request.id}] gave up after {requeues} requeues: its key {key!r} "
                f"stayed {reason}. {advice}",
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
            "%s key=%s task_id=%s countdown=%.2fs: %s",
            "duplicate requeued" if duplicate else "requeued until the lease store answers",
            key,
            request.id,
            countdown,
            reason,
        )
        raise Retry(f"requeued: {key!r} {reason}", when=countdown, sig=signature)

    def retry(
        self,
        args=None,
        kwargs=None,
        exc=None,
        throw: bool = True,
        eta=None,
        countdown=None,
        max_retries=None,
        **options: Any,
    ):
        """Give the lease up as the retry message is sent, and only then.

        The retried message must not find the lease held, so it is released just
        before the message goes out (in :meth:`apply_async`). When no message goes
        out, the lease stays: the body that catches ``MaxRetriesExceededError`` and
        falls back runs under it, and so does a body that goes on after
        ``retry(throw=False)``, released when it returns.
        """
        _retrying.lease = self.lease if throw else None
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        finally:
            _retrying.lease = None

    def _retry_sent(self, lease: AnyLease) -> None:
        """retry() is sending this call again: end the attempt and release the lease
        first, so the retried message does not find it held (and a copy of this
        attempt's message does not run it again)."""
        if isinstance(lease, HeldLease):
            self._finish_attempt(lease)

    def _wait_inline(self, key: str, reason: str) -> HeldLease:
        settings = self.exclusive_settings
        lease = policies.wait_for(settings, self.exclusive_backend, key, self.name, self.request.id)
        if lease is None:
            raise DuplicateSkipped(
                f"{self.name} called directly or eagerly could not run: its key {key!r} "
                f"stayed {reason} for exclusive_wait_timeout={settings.wait_timeout}s.",
                key,
                None,
            )
        return lease


# One class attribute per setting, derived from the one list: exclusive_<name> = None.
for _name in config.NAMES:
    setattr(ExclusiveTask, config.setting_name(_name), None)
del _name


_leases = threading.local()

#: The lease of a retry() under way in this thread, released when its message is sent.
_retrying = threading.local()

#: The (task, request) of every call ExclusiveTask runs in this thread, outermost first.
_running = threading.local()


def _running_here(task: ExclusiveTask, request: Context) -> bool:
    """Whether ``request`` is that of a call of ``task`` already running in this thread,
    or the copy Celery's ``Task.__call__`` pushes of it: then a new call is a direct
    call made from inside that run. (A marker on the request would not do: Celery sends
    a request's unknown attributes along as message headers, to every retry.)"""
    return any(
        running is task and (entered is request or entered.id == request.id)
        for running, entered in getattr(_running, "calls", ())
    )


def _held_here(key: str) -> Optional[HeldLease]:
    """The lease on ``key`` a call running in this thread holds, if any."""
    for lease in reversed(getattr(_leases, "stack", [])):
        if isinstance(lease, HeldLease) and lease.key == key and not lease.released:
            return lease
    return None


class _ExclusiveRequestOf:
    """``Task.Request`` of an ExclusiveTask subclass: the user's Request class with
    ExclusiveRequest mixed in, built on first use (names resolve lazily, as Celery's do)."""

    def __init__(self, users: Any) -> None:
        self.users = users
        self.combined: Optional[type] = None

    def __get__(self, task: Any, owner: type) -> type:
        if self.combined is None:
            from .worker import ExclusiveRequest  # the worker side builds on this module

            users = symbol_by_name(self.users) if self.users is not None else None
            if users is None or issubclass(ExclusiveRequest, users):
                self.combined = ExclusiveRequest
            elif issubclass(users, ExclusiveRequest):
                self.combined = users
            else:
                self.combined = type(
                    f"Exclusive{users.__name__}",
                    (ExclusiveRequest, users),
                    {"__module__": users.__module__, "__doc__": users.__doc__},
                )
        return self.combined


ExclusiveTask.Request = _ExclusiveRequestOf(None)  # type: ignore[assignment]


def _users_request(cls: type) -> Any:
    """The ``Request`` the user gave a task class: the first one along its MRO that is
    not Celery's default or ours. None if there is none."""
    for klass in cls.__mro__:
        if klass is Task or klass is ExclusiveTask:
            continue
        request = klass.__dict__.get("Request")
        if isinstance(request, _ExclusiveRequestOf):
            request = request.users
        if request is not None:
            return request
    return None


def _override_names(cls: type) -> list[str]:
    """The ``exclusive_<name>`` attributes a task class sets, as setting names; a
    name that is no setting is a typo (``exclusive_lease_tll``)."""
    names = []
    for klass in cls.__mro__:
        if klass is ExclusiveTask or not issubclass(klass, ExclusiveTask):
            continue
        for attribute in vars(klass):
            if attribute.startswith("exclusive_") and not hasattr(ExclusiveTask, attribute):
                names.append(attribute[len("exclusive_") :])
    return names


def _in_pool_child() -> bool:
    """Whether this process is a prefork pool child, which may be killed (the pool
    replaces it) rather than the worker itself."""
    from billiard.process import current_process

    return getattr(current_process(), "_parent_pid", None) is not None


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
