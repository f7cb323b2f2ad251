"""What a marked function does when it is called: run under the lease its job took,
take the lease itself, or refuse.

``@exclusive`` puts a guard in place of the function, with its name, module and
signature, so RQ enqueues and pickles it by dotted name as before. The guard lets
the body run in two ways only:

- **Admitted.** :class:`~celery_exclusive.rq.ExclusiveJob` took the call's lease and
  calls the function: the guard lets exactly that one call through, so the lease is
  taken once.
- **Under its own lease.** Called directly, outside any job or from inside another
  job's body, the guard takes the lease itself, as a Celery task called directly
  does: a duplicate under ``skip`` raises :class:`DuplicateSkipped`; under any other
  policy it waits up to ``wait_timeout`` for the key, there being no queue to go back
  to, then raises :class:`DuplicateSkipped`.

It refuses, with a :class:`ConfigurationError` naming ``--job-class``, where neither
can be: as the function of an RQ job that is not an ``ExclusiveJob`` (a worker
started without ``--job-class``, RQ 2's ``SpawnWorker``, whose work horse ignores it,
a synchronous ``Queue(is_async=False)`` made without ``job_class``). The lease was
the job's to take; running the body there would run it unlocked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any, Callable, Optional, TypeVar, Union

from rq import get_current_job

from .. import policies, terminate
from ..backends import backend_for_url
from ..config import Settings
from ..errors import BackendUnavailable, ConfigurationError, DuplicateSkipped
from ..keys import build_key, check_key_spec
from ..lease import HeldLease, UnlockedLease
from . import options as rq_options

logger = logging.getLogger("celery_exclusive")

F = TypeVar("F", bound=Callable[..., Any])

#: The job class that takes leases for marked functions, as workers are told to use it.
JOB_CLASS = "celery_exclusive.rq.ExclusiveJob"


AnyLease = Union[HeldLease, UnlockedLease]


@dataclasses.dataclass
class _Admission:
    """The one call of ``guard`` that an ExclusiveJob, holding its lease, lets through."""

    guard: Callable[..., Any]
    used: bool = False


_admission: ContextVar[Optional[_Admission]] = ContextVar("exclusive_rq_admission", default=None)
_lease: ContextVar[Optional[AnyLease]] = ContextVar("exclusive_rq_lease", default=None)


def exclusive(function: Optional[F] = None, /, **options: Any) -> Union[F, Callable[[F], F]]:
    """Mark an RQ job function as exclusive; ``ExclusiveJob`` runs it under its lease.

    The options are the settings of :class:`celery_exclusive.config.Settings` (the
    signature below lists them); left out, each comes from ``EXCLUSIVE_<NAME>`` in the
    environment, then the default. They and the key are checked here, when the module
    is imported, so a mistake stops the enqueuing process and the worker at start
    rather than failing each job later.
    """

    def mark(target: F) -> F:
        name = f"{target.__module__}.{target.__qualname__}"
        if exclusive_options(target) is not None:
            raise ConfigurationError(f"{name} is marked @exclusive twice.")
        given = rq_options.check_options(name, options)
        # The job's own Redis URL is only known in the worker; any Redis URL checks the rest.
        settings = rq_options.resolve(name, given, connection_url="redis://localhost")
        check_key_spec(name, target, settings.key)
        return _guard(target, name, given)

    return mark(function) if function is not None else mark


exclusive.__signature__ = rq_options.signature()  # type: ignore[attr-defined]


def exclusive_options(function: Any) -> Optional[dict[str, Any]]:
    """The options ``@exclusive`` gave ``function``; None for an unmarked function."""
    return getattr(function, "__exclusive__", None)


def current_lease() -> Optional[AnyLease]:
    """The lease the running marked function holds: ``key``, ``fencing_token``, ``held``,
    ``lost``, ``ensure_held()``.

    Never None inside a marked function: an
    :class:`~celery_exclusive.lease.UnlockedLease` when it runs without one (store
    down, ``on_backend_error="run"``). None outside.
    """
    return _lease.get()


@contextlib.contextmanager
def holding(
    lease: AnyLease, settings: Settings, kill_process: Optional[bool] = None
) -> Iterator[AnyLease]:
    """Run the body under ``lease`` (``current_lease()`` inside) and release it on
    every exit.

    With ``on_lease_lost="terminate"``, a body whose lease is lost is stopped at once
    (:func:`celery_exclusive.terminate.stop_on_loss`), and its process killed after
    ``terminate_grace`` if ``kill_process``: a work horse, which the worker replaces.
    ``kill_process=None`` stops nothing: the body runs in a process that is not the
    worker's (a direct call, a synchronous queue), whose signals are not ours to take.
    Under ``terminate`` and ``abort`` a body whose lease was lost fails with
    ``LeaseLost`` when it returns: its result is not to be trusted.
    """
    stop = (
        terminate.stop_on_loss(lease, settings.terminate_grace, kill_process)
        if settings.on_lease_lost == "terminate"
        and kill_process is not None
        and isinstance(lease, HeldLease)
        else contextlib.nullcontext()
    )
    token = _lease.set(lease)
    try:
        with stop:
            yield lease
    finally:
        _lease.reset(token)
        lease.release()
    if lease.lost and settings.on_lease_lost != "log":
        lease.ensure_held()


@contextlib.contextmanager
def admitted(function: Callable[..., Any]) -> Iterator[None]:
    """Let the next call of marked ``function`` through: its job holds the lease."""
    token = _admission.set(_Admission(_unbound(function)))
    try:
        yield
    finally:
        _admission.reset(token)


def _guard(target: F, name: str, options: Mapping[str, Any]) -> F:
    if inspect.iscoroutinefunction(target):

        @functools.wraps(target)
        async def guard(*args: Any, **kwargs: Any) -> Any:
            with _entered(guard, target, name, options, args, kwargs):
                return await target(*args, **kwargs)

    else:

        @functools.wraps(target)
        def guard(*args: Any, **kwargs: Any) -> Any:
            with _entered(guard, target, name, options, args, kwargs):
                return target(*args, **kwargs)

    guard.__exclusive__ = dict(options)  # type: ignore[attr-defined]
    return guard  # type: ignore[return-value]


@contextlib.contextmanager
def _entered(
    guard: Callable[..., Any],
    target: Callable[..., Any],
    name: str,
    options: Mapping[str, Any],
    args: tuple,
    kwargs: dict,
) -> Iterator[None]:
    admission = _admission.get()
    if admission is not None and admission.guard is guard and not admission.used:
        admission.used = True  # a call the body makes to itself is a new call
        yield
        return
    job = get_current_job()
    if admission is None and job is not None and _unbound(job.func) is guard:
        raise ConfigurationError(
            f"{name}[job {job.id}] is marked @exclusive but runs as a plain "
            f"{type(job).__module__}.{type(job).__qualname__}, which takes no lease: refused "
            f"rather than run unlocked. Start the workers with `rq worker --job-class "
            f"{JOB_CLASS}` (RQ 2's SpawnWorker ignores --job-class: use the default "
            "Worker), and make a synchronous queue with Queue(..., is_async=False, "
            "job_class=ExclusiveJob)."
        )
    with _own_lease(target, name, options, args, kwargs, job):
        yield


@contextlib.contextmanager
def _own_lease(
    target: Callable[..., Any],
    name: str,
    options: Mapping[str, Any],
    args: tuple,
    kwargs: dict,
    job: Any,
) -> Iterator[None]:
    """A direct call takes its lease itself, as a Celery task called directly does."""
    settings = rq_options.settings_for(name, options, None if job is None else job.connection)
    key = settings.key_prefix + build_key(name, target, settings.key, args, kwargs)
    backend = backend_for_url(settings.backend_url)
    try:
        outcome = policies.claim(settings, backend, key, name, None)
    except BackendUnavailable as exc:
        message = f"{name} (called directly): cannot take the lease on {key!r}: {exc}"
        if settings.on_backend_error != "run":
            raise BackendUnavailable(message, exc.url) from None
        logger.warning("%s -- running WITHOUT a lease (on_backend_error='run')", message)
        with holding(UnlockedLease(key, name, None, str(exc)), settings):
            yield
        return
    if isinstance(outcome, policies.Run):
        lease = outcome.lease
    elif isinstance(outcome, policies.Skip):
        raise DuplicateSkipped(
            f"{name} (called directly) was skipped: its key {key!r} is held by "
            f"{'job ' + outcome.holder_task_id if outcome.holder_task_id else 'another call'}.",
            key,
            outcome.holder_task_id,
        )
    else:
        # Direct calls have no queue to go back to: they wait instead.
        found = policies.wait_for(settings, backend, key, name, None)
        if found is None:
            raise DuplicateSkipped(
                f"{name} (called directly) could not run: its key {key!r} stayed held for "
                f"wait_timeout={settings.wait_timeout:g}s.",
                key,
                None,
            )
        lease = found
    with holding(lease, settings):
        yield


def _unbound(function: Any) -> Any:
    """The function itself, for a job whose function is a bound method."""
    return getattr(function, "__func__", function)
