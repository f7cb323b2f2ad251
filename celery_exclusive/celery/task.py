"""ExclusiveTask: the Celery base class that runs a task's body only under its lease.

This module declares the task: its settings, its key, its lock, what ``apply_async``
sends. Its calls are executed by :mod:`celery_exclusive.celery.execution` over the
attempt engine (:mod:`celery_exclusive.engine.attempt`), as Celery's ``app/trace.py``
executes what ``app/task.py`` declares.
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Sequence
from typing import Any, Optional, Union

from celery import Task
from celery.app.task import Context
from celery.exceptions import Retry
from kombu.utils.imports import symbol_by_name
from kombu.utils.uuid import uuid

from .. import runtime, signals
from ..backends import Backend, backend_for_url
from ..core import config, keys
from ..core.keys import KeyBinder, KeySpec, check_key_spec
from ..core.lease import HeldLease, UnlockedLease
from ..core.lock import ExclusiveLock
from ..engine import attempt, enqueue
from ..engine.arguments import decode_call
from ..errors import DuplicateSkipped, ExclusiveError
from . import checks, execution, results, revoked, worker
from . import settings as app_settings
from .execution import REQUEUES_HEADER, RedeliveredCopy  # noqa: F401 - where they were

# A new-style errback is called with its failed task's request (``errback(request, exc,
# traceback)``): its key names that task, as ``request("<task id>")``.
keys.tag_type(Context, "request", lambda request: json.dumps(request.id))

logger = logging.getLogger("celery_exclusive")

AnyLease = Union[HeldLease, UnlockedLease]


class ExclusiveTask(Task):
    """Base class for tasks that must not run twice at once for the same key.

    Every setting ``exclusive_<name>`` of the app (one per field of
    :class:`celery_exclusive.core.config.Settings`) can be overridden per task::

        @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}",
                  exclusive_on_duplicate="requeue")
        def settle(invoice_id): ...

    Inside the body, ``self.lease`` (with ``bind=True``) gives ``key``,
    ``fencing_token``, ``held``, ``lost`` and ``ensure_held()``.
    """

    # The per-task overrides, one per field of config.Settings: None means "use the app
    # setting, then the default". Written out (and typed) for type checkers and editors;
    # a test keeps them the same as the fields.
    exclusive_backend_url: Optional[str] = None
    exclusive_key: KeySpec = None
    exclusive_key_prefix: Optional[str] = None
    exclusive_lease_ttl: Optional[float] = None
    exclusive_limit: Optional[int] = None
    exclusive_on_duplicate: Optional[config.OnDuplicate] = None
    exclusive_wait_timeout: Optional[float] = None
    exclusive_on_backend_error: Optional[config.OnBackendError] = None
    exclusive_on_lease_lost: Optional[config.OnLeaseLost] = None
    exclusive_terminate_grace: Optional[float] = None
    exclusive_requeue_lost: Optional[bool] = None
    exclusive_requeue_delay: Optional[float] = None
    exclusive_requeue_max_delay: Optional[float] = None
    exclusive_requeue_max_retries: Optional[int] = None
    exclusive_rerun_args: Optional[config.RerunArgs] = None
    exclusive_priority: Optional[bool] = None
    exclusive_scope: Optional[config.Scope] = None
    exclusive_enqueue_ttl: Optional[float] = None
    exclusive_skip_state: Optional[config.SkipState] = None
    exclusive_trace_keys: Optional[config.TraceKeys] = None
    exclusive_unique_for: Optional[float] = None
    exclusive_unique_after: Optional[config.UniqueAfter] = None
    exclusive_rate: Optional[str] = None
    exclusive_debounce: Optional[float] = None
    exclusive_debounce_max_wait: Optional[float] = None

    #: A skipped duplicate is an expected outcome: logged at INFO, no traceback. A
    #: subclass's or ``@app.task(throws=...)``'s own are added to it, never replace it.
    throws: tuple[type[Exception], ...] = (DuplicateSkipped,)

    _exclusive_settings: Optional[config.Settings] = None
    #: (config.generation(), app.conf) when _exclusive_settings was resolved.
    _exclusive_settings_stamp: Optional[tuple[int, Any]] = None
    #: The key binder of the settings it was made for: made again when they change.
    _exclusive_binder: Optional[tuple[config.Settings, KeyBinder]] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Compose with the user's own base class, in either order of bases.

        Celery reads one ``Request`` class and one ``throws`` tuple per task. A subclass
        (``class T(MyBase, ExclusiveTask)``, ``class T(ExclusiveTask, MyBase)``, or the
        class ``@app.task(base=ExclusiveTask, Request=..., throws=...)`` makes) gets
        the ``throws`` of every class it derives from, and a ``Request`` that is the
        user's own with :class:`~celery_exclusive.celery.worker.ExclusiveRequest` mixed in:
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
        checks.check_task_class(cls)  # an option nothing reads stops the import

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        app.steps["worker"].add(worker.CheckExclusiveSettings)

    @property
    def exclusive_settings(self) -> config.Settings:
        """This task's resolved settings and key format, checked again only after a
        setting changed (``app.conf``, an ``exclusive_<name>`` attribute of the task, or
        :func:`celery_exclusive.core.config.force`): one comparison per call otherwise.

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
        checks.check_task(self)
        settings = app_settings.for_app(
            self.app, self.name, lambda name: _task_option(self, config.setting_name(name))
        )
        check_key_spec(self.name, self.run, settings.key)
        self._exclusive_settings = settings
        # An app.conf that is not Celery's own cannot be watched: resolve at every call.
        watched = isinstance(conf, app_settings.WatchedSettings)
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
    def lease(self) -> AnyLease:
        """The lease the current call runs under (inside the body, with ``bind=True``).

        A call running unlocked (the store was down and
        ``exclusive_on_backend_error="run"``) gets an :class:`UnlockedLease`, whose
        ``held`` is False and ``fencing_token`` None. Outside a call there is none, and
        asking is an error rather than a None every body would have to check.
        """
        lease = attempt.current_lease()
        if lease is None:
            raise ExclusiveError(
                f"{self.name}: self.lease exists only while a call of the task runs (inside "
                "its body, with bind=True)."
            )
        return lease

    def exclusive_key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The full store key a call with these arguments takes."""
        settings = self.exclusive_settings
        made = self._exclusive_binder
        if made is None or made[0] is not settings:
            made = self._exclusive_binder = (settings, KeyBinder(self.name, self.run, settings.key))
        return settings.key_prefix + made[1](args, kwargs)

    def exclusive_lock(self, *args: Any, **kwargs: Any) -> ExclusiveLock:
        """The lock of the call ``self.delay(*args, **kwargs)``: the lease that call takes
        (its key, store, ttl and limit), for a ``with`` or ``async with`` block of any code.
        Entering raises :class:`~celery_exclusive.errors.LockHeld` if the key is held;
        ``.waiting(seconds)`` waits for it first."""
        settings = self.exclusive_settings
        key = self.exclusive_key_for(args, kwargs)
        return ExclusiveLock(
            key,
            settings.backend_url,
            settings.lease_ttl,
            settings.limit,
            name=self.name,
            trace_keys=settings.trace_keys,
            key_prefix=settings.key_prefix,
        )

    def apply_async(
        self,
        args: Optional[Sequence[Any]] = None,
        kwargs: Optional[dict[str, Any]] = None,
        task_id: Optional[str] = None,
        **options: Any,
    ) -> Any:
        """Check the task's settings and key format (once), then send.

        With ``exclusive_scope="enqueue"``, send nothing for a key already queued or
        running: return that call's AsyncResult instead. A retry sent from the body is
        sent whatever the key's enqueue mark holds: it is the same call going on.
        """
        if options:
            checks.check_call_options(self.name, options)
        # retry() is sending this call again: its lease goes back first, and its
        # attempt is recorded as ended once the message went out.
        handed = attempt.hand_off(task_id)
        if handed is None:
            return self._send(args, kwargs, task_id, options)
        with enqueue.going_on():  # the same call going on: never refused at enqueue
            result = self._send(args, kwargs, task_id, options)
        handed.handed_off()
        return result

    def _send(
        self,
        args: Optional[Sequence[Any]],
        kwargs: Optional[dict[str, Any]],
        task_id: Optional[str],
        options: dict[str, Any],
    ) -> Any:
        settings = self.exclusive_settings
        if settings.on_duplicate == "rerun" or settings.debounce:
            options = stamped(options)
        if settings.scope == "run" or self.app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        key = self.exclusive_key_for(tuple(args or ()), dict(kwargs or {}))
        task_id = task_id or uuid()
        queued = enqueue.claim(
            self.exclusive_backend,
            self.name,
            key,
            task_id,
            settings.enqueue_ttl,
            settings.key_prefix,
        )
        if queued is not None:
            logger.info("enqueue deduplicated key=%s: %s is already queued", key, queued)
            signals.duplicate_detected.send(
                sender=self.name,
                key=key,
                task_id=task_id,
                policy="enqueue",
                holder_task_id=queued,
            )
            return revoked.keyed(self.AsyncResult(queued), self, key)
        sent = super().apply_async(args, kwargs, task_id=task_id, **options)
        return revoked.keyed(sent, self, key)

    def AsyncResult(self, task_id: str, **kwargs: Any) -> Any:  # noqa: N802 - Celery's name
        """The result of call ``task_id``, as Celery's: one whose :meth:`revoke` also
        frees the call's enqueue mark where the send that made it knows the key
        (:mod:`.revoked`)."""
        return revoked.ExclusiveResult(
            task_id, backend=self.backend, task_name=self.name, app=self._get_app(), **kwargs
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return execution.call(self, args, kwargs, super().__call__)

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

        A body running as the pending rerun of its key (``exclusive_on_duplicate=
        "rerun"``) runs with the newest duplicate's arguments, not its message's
        (``self.request.args`` and ``kwargs``); a retry is sent with those, for
        whichever of ``args`` and ``kwargs`` it is not given.
        """
        current = attempt.current()
        if (
            current is not None
            and current.arguments is not None
            and current.call.task_id == self.request.id
        ):
            # The body runs as the pending rerun of its key, with the newest duplicate's
            # arguments rather than its message's (``self.request.args``): the retry
            # goes with them, where it is not given its own.
            pending_args, pending_kwargs = decode_call(current.arguments)
            args = pending_args if args is None else args
            kwargs = pending_kwargs if kwargs is None else kwargs
        handing_off = current is not None and throw
        if handing_off:
            current.handing_off = True
        try:
            sent = super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Retry as retry:
            self._retry_went_out(retry)
            raise
        finally:
            if handing_off:
                current.handing_off = False
        # Sent, and the body goes on (throw=False).
        self._retry_went_out(sent)
        return sent

    def _retry_went_out(self, retry: Retry) -> None:
        """Note the key the retry was sent for: the call comes again under its id there,
        so its enqueue mark of that key stays when this run ends, and a mark of another
        key (the retry's arguments changed it) is cleared (:mod:`.results`)."""
        current = attempt.current()
        if current is not None and current.call.task_id == self.request.id:
            current.retry_sent = True  # the call goes on: its run keeps no window
        signature = retry.sig
        if signature is None or self.exclusive_settings.scope == "run":
            return
        try:
            key = self.exclusive_key_for(tuple(signature.args or ()), dict(signature.kwargs or {}))
        except (ExclusiveError, TypeError):  # its run names the error; the mark here expires
            return
        setattr(self.request, results.RETRY_SENT, key)


class _ExclusiveRequestOf:
    """``Task.Request`` of an ExclusiveTask subclass: the user's Request class with
    ExclusiveRequest mixed in, built on first use (names resolve lazily, as Celery's do)."""

    def __init__(self, users: Any) -> None:
        self.users = users
        self.combined: Optional[type] = None

    def __get__(self, task: Any, owner: type) -> type:
        if self.combined is None:
            users = symbol_by_name(self.users) if self.users is not None else None
            if users is None or issubclass(worker.ExclusiveRequest, users):
                self.combined = worker.ExclusiveRequest
            elif issubclass(users, worker.ExclusiveRequest):
                self.combined = users
            else:
                self.combined = type(
                    f"Exclusive{users.__name__}",
                    (worker.ExclusiveRequest, users),
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


def _task_option(task: ExclusiveTask, attribute: str) -> Any:
    """The task's ``attribute`` as it was given. ``@app.task(exclusive_key=func)`` makes
    ``func`` an attribute of the task's class, where Python would bind it as a method;
    a function given that way is returned as it is, not bound to the task (a method
    written in a class body, ``Class.method``, stays bound)."""
    value = getattr(task, attribute, None)
    if isinstance(value, types.MethodType) and value.__self__ is task:
        function = value.__func__
        written_in = {klass.__qualname__ + "." for klass in type(task).__mro__}
        if not any(function.__qualname__.startswith(prefix) for prefix in written_in):
            return function
    return value


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


def stamped(options: dict[str, Any]) -> dict[str, Any]:
    """``apply_async``'s options, with the header that says when the change the call
    carries was sent (``execution.AS_OF_HEADER``, this host's clock), unless it has one:
    under ``rerun`` it orders the changes that join a pending rerun (under ``debounce``,
    a burst), whatever redeliveries and requeues do to the order in which they reach
    a worker."""
    headers = dict(options.get("headers") or {})
    if execution.AS_OF_HEADER in headers:
        return options
    headers[execution.AS_OF_HEADER] = runtime.wall()
    return {**options, "headers": headers}
