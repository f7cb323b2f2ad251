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
from typing import Any, Callable, NoReturn, Optional, TypeVar, Union, overload

from rq import get_current_job

from ..backends import backend_for_url
from ..core import holders, outcomes
from ..core.config import (
    OnBackendError,
    OnDuplicate,
    OnLeaseLost,
    RerunArgs,
    TraceKeys,
    UniqueAfter,
    unanswered_in_process,
)
from ..core.keys import KeySpec, build_key, check_key_spec
from ..core.lease import HeldLease, UnlockedLease
from ..core.lock import ExclusiveLock
from ..core.policies import Granted
from ..engine import attempt
from ..errors import ConfigurationError, DuplicateCoalesced, DuplicateReplaced, DuplicateSkipped
from . import checks
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

#: A function called directly runs in its caller's process: no queue to go back to, and
#: no process of ours to stop (see :class:`celery_exclusive.engine.attempt.Host`).
DIRECT = attempt.Host(can_requeue=False, noun="job", setting_prefix="")


@overload
def exclusive(function: F, /) -> F: ...


@overload
def exclusive(
    *,
    backend_url: Optional[str] = None,
    key: KeySpec = None,
    key_prefix: Optional[str] = None,
    lease_ttl: Optional[float] = None,
    limit: Optional[int] = None,
    on_duplicate: Optional[OnDuplicate] = None,
    wait_timeout: Optional[float] = None,
    on_backend_error: Optional[OnBackendError] = None,
    on_lease_lost: Optional[OnLeaseLost] = None,
    terminate_grace: Optional[float] = None,
    requeue_lost: Optional[bool] = None,
    requeue_delay: Optional[float] = None,
    requeue_max_delay: Optional[float] = None,
    requeue_max_retries: Optional[int] = None,
    rerun_args: Optional[RerunArgs] = None,
    priority: Optional[bool] = None,
    trace_keys: Optional[TraceKeys] = None,
    unique_for: Optional[float] = None,
    unique_after: Optional[UniqueAfter] = None,
    rate: Optional[str] = None,
    debounce: Optional[float] = None,
    debounce_max_wait: Optional[float] = None,
) -> Callable[[F], F]: ...


def exclusive(function: Optional[F] = None, /, **options: Any) -> Union[F, Callable[[F], F]]:
    """Mark an RQ job function as exclusive; ``ExclusiveJob`` runs it under its lease.

    ``@exclusive`` bare, or ``@exclusive(<options>)``: either way the function keeps its
    own type. The options (the second overload, for type checkers) are the settings
    RQ uses, as ``options.OPTION_TYPES`` lists them; a test keeps the two the same.

    The options are the settings of :class:`celery_exclusive.core.config.Settings` (the
    signature below lists them); left out, each comes from ``EXCLUSIVE_<NAME>`` in the
    environment, then the default. They and the key are checked here, when the module
    is imported, so a mistake stops the enqueuing process and the worker at start
    rather than failing each job later.
    """

    def mark(target: F) -> F:
        name = f"{target.__module__}.{target.__qualname__}"
        if exclusive_options(target) is not None:
            raise ConfigurationError(f"{name} is marked @exclusive twice.")
        given = checks.check_options(name, options)
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
    :class:`~celery_exclusive.core.lease.UnlockedLease` when it runs without one (store
    down, ``on_backend_error="run"``). None outside.
    """
    return attempt.current_lease()


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
    guard.exclusive_lock = functools.partial(_lock_of, target, name, options)  # type: ignore[attr-defined]
    return guard  # type: ignore[return-value]


def _lock_of(
    target: Callable[..., Any], name: str, options: Mapping[str, Any], *args: Any, **kwargs: Any
) -> ExclusiveLock:
    """``function.exclusive_lock(*args, **kwargs)``: the lock of the job
    ``queue.enqueue(function, *args, **kwargs)``, the lease its call takes, for a ``with``
    or ``async with`` block of any code. Outside a job its store is ``backend_url`` (or
    ``EXCLUSIVE_BACKEND_URL``), as for a direct call."""
    job = get_current_job()
    settings = rq_options.settings_for(name, options, None if job is None else job.connection)
    key = settings.key_prefix + build_key(name, target, settings.key, args, kwargs)
    return ExclusiveLock(
        key,
        settings.backend_url,
        settings.lease_ttl,
        settings.limit,
        name=name,
        trace_keys=settings.trace_keys,
        key_prefix=settings.key_prefix,
    )


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
    """A direct call takes its lease itself, as a Celery task called directly does:
    with no queue to go back to, a duplicate under any policy but ``skip`` waits."""
    settings = rq_options.settings_for(name, options, None if job is None else job.connection)
    key = settings.key_prefix + build_key(name, target, settings.key, args, kwargs)
    the_call = attempt.Call(name, None, key, settings, backend_for_url(settings.backend_url))
    direct = attempt.Attempt(the_call, DIRECT)
    with direct.trace:
        claimed = direct.claim()
        if not isinstance(claimed, (Granted, attempt.Unlocked)):
            direct.trace.ended(claimed)
            claimed.carry_out(_DirectCall(name, key, settings.wait_timeout))  # raises
            return
        with direct.holding(claimed.lease):
            yield


class _DirectCall(outcomes.OutcomeHandler):
    """What a function marked ``@exclusive`` and called directly gets when it cannot
    run: the error its caller sees. It has no queue to go back to, and its call is never
    delivered twice, so it only ever meets a held key (skipped, or waited in vain) or a
    store that does not answer; each other outcome still ends it as its name says."""

    def __init__(self, name: str, key: str, wait_timeout: float) -> None:
        self.name = name
        self.call = f"{name} (called directly)"
        self.key = key
        self.wait_timeout = wait_timeout

    def _not_run(self, why: str, holder: Optional[str] = None) -> DuplicateSkipped:
        return DuplicateSkipped(f"{self.call} {why}", self.key, holder)

    def handle_ran(self, outcome: outcomes.Ran) -> Any:
        return outcome.result

    def handle_skipped(self, outcome: outcomes.Skipped) -> NoReturn:
        holder = holders.named(outcome.holder_task_id, outcome.holder or "another call", "job")
        raise self._not_run(
            f"was skipped: its key {self.key!r} is held by {holder}.", outcome.holder_task_id
        )

    def handle_coalesced(self, outcome: outcomes.Coalesced) -> NoReturn:
        raise DuplicateCoalesced(
            f"{self.call} joined the pending rerun of {self.key!r}, job "
            f"{outcome.rerun_task_id}, which runs once after the current holder.",
            self.key,
            outcome.rerun_task_id,
        )

    def handle_replaced(self, outcome: outcomes.Replaced) -> NoReturn:
        raise DuplicateReplaced(
            f"{self.call} was stopped: a newer call of {self.key!r}, job {outcome.by}, "
            "replaced it and runs instead.",
            self.key,
            outcome.by,
        )

    def handle_requeue(self, outcome: outcomes.Requeue) -> NoReturn:
        raise self._not_run(f"could not run: its key {self.key!r} is {outcome.reason}.")

    def handle_gave_up(self, outcome: outcomes.GaveUp) -> NoReturn:
        raise self._not_run(f"gave up: its key {self.key!r} stayed {outcome.reason}.")

    def handle_waited(self, outcome: outcomes.Waited) -> NoReturn:
        raise self._not_run(
            f"could not run: its key {self.key!r} stayed held for "
            f"wait_timeout={self.wait_timeout:g}s."
        )

    def handle_unanswered(self, outcome: outcomes.Unanswered) -> NoReturn:
        memory = "@exclusive(backend_url='memory://') or EXCLUSIVE_BACKEND_URL=memory://"
        call = f"{self.name}, called directly,"
        raise unanswered_in_process(call, self.key, outcome.error, memory) from None

    def handle_set_aside(self, outcome: outcomes.SetAside) -> NoReturn:
        raise self._not_run(f"could not run: another delivery of it holds {self.key!r}.")

    def handle_dropped(self, outcome: outcomes.Dropped) -> NoReturn:
        raise self._not_run(f"did not run: it already ran under {self.key!r}.")

    def handle_redelivered(self, outcome: outcomes.Redelivered) -> NoReturn:
        raise outcome.error


def _unbound(function: Any) -> Any:
    """The function itself, for a job whose function is a bound method."""
    return getattr(function, "__func__", function)
