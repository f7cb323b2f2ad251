"""Running one call of an ExclusiveTask: Celery as a host of the attempt engine.

:mod:`celery_exclusive.celery.task` declares the task class; this module executes its
calls, as Celery's ``app/trace.py`` does for ``app/task.py``. The lease is taken in
``__call__``, inside Celery's tracer, because a signal handler cannot skip a task, and
``after_return`` is not called for retried, ignored or rejected tasks: the engine's
``try/finally`` around the body therefore releases on every exit path. What a hard
kill leaves behind, the worker's main process releases
(:class:`celery_exclusive.celery.worker.ExclusiveRequest`), and the store expires in
any case.

The engine (:mod:`celery_exclusive.engine.attempt`) decides; this module tells it what
a Celery call can do (:func:`host_of`) and carries its outcome out in Celery's terms
(:class:`CeleryOutcomes`, one method per outcome): a result, a terminal "skipped"
state, a message sent again (``Retry``), a redelivered copy ended without a trace
(``Ignore``), a message handed back to the broker (``Reject``).

A task with ``acks_late`` may see its message delivered twice (a Redis or SQS
broker's visibility timeout, a connection lost before the ack): the copy is
recognised by its task id. While the first delivery runs, the copy is set aside
without storing a result; once an attempt has ended, copies of it are dropped.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Callable, NoReturn, Optional

from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from celery.worker.request import Request as CeleryRequest

from ..backends import backend_for_url
from ..core import config, holders, outcomes
from ..engine import attempt, enqueue
from ..errors import BackendUnavailable, DuplicateCoalesced, DuplicateReplaced, DuplicateSkipped
from . import results

logger = logging.getLogger("celery_exclusive")

#: Message header counting how often a call was requeued (drives its backoff).
REQUEUES_HEADER = "exclusive_requeues"
#: Message header set on a call sent again after its lease was lost: it resumes a run
#: that started, and is no duplicate of the holder it meets.
RESUMED_HEADER = "exclusive_resumed"
#: Message header of a copy set aside while another delivery of its call ran.
SET_ASIDE_HEADER = "exclusive_set_aside"
#: Message header of a call sent again under ``rerun``: when the change its arguments
#: carry first reached the library (``attempt.Call.as_of``).
AS_OF_HEADER = "exclusive_as_of"
#: Message header of a call sent again under ``debounce``: it joined its key's burst,
#: and runs when it comes back if it is still the burst's latest call.
DEBOUNCED_HEADER = "exclusive_debounced"
#: Message header of a call carrying the run a pending rerun owed its duplicates: the
#: task id of that pending rerun (``attempt.Call.owed_by``).
OWED_BY_HEADER = "exclusive_owed_by"

#: The broker's visibility timeout when ``broker_transport_options`` sets none
#: (kombu's Redis and SQS transports: one hour).
DEFAULT_VISIBILITY_TIMEOUT = 3600.0

#: The task's own ``Task.__call__`` (the next one along its class's MRO): runs the body.
Body = Callable[..., Any]


class RedeliveredCopy(Ignore):
    """Ends a second delivery of a task's message without storing any state: the first
    delivery runs, or has run, and its result is the task's."""


#: The (task, request) of every call ExclusiveTask runs in this thread, outermost first.
_running = threading.local()


def call(task: Any, args: tuple, kwargs: dict, body: Body) -> Any:
    """Run one call of ``task`` (``task(*args, **kwargs)``, from the tracer or directly)."""
    request = task.request_stack.top
    if request is None or _running_here(task, request):
        # A direct call: from outside a worker, or from inside a run of this very task
        # (recursion, a helper calling it). It is a call of its own, with a request of
        # its own: the running message's id, headers and retries are not its.
        task.request_stack.push(Context(args=args, kwargs=kwargs))
        try:
            return _enter(task, args, kwargs, body)
        finally:
            task.request_stack.pop()
    return _enter(task, args, kwargs, body)


def _enter(task: Any, args: tuple, kwargs: dict, body: Body) -> Any:
    request = task.request
    running = _running.__dict__.setdefault("calls", [])
    running.append((task, request))
    try:
        settings = task.exclusive_settings
        key = task.exclusive_key_for(args, kwargs)
        if settings.scope == "run" or _cannot_requeue(request):
            return _call_exclusive(task, request, settings, key, args, kwargs, body)[0]
        mark = _EnqueueMark()  # cleared by the release (with the result), or below
        try:
            value, mark.settled = _call_exclusive(
                task, request, settings, key, args, kwargs, body, mark
            )
            return value
        except BaseException as exc:
            # The same task id comes back (a retry from the body, a message it handed back)
            # or the outcome says the mark is another delivery's: still queued. Not a
            # retry sent for another key: its mark there is the retry's, this one nobody's.
            retried = isinstance(exc, Retry) and not results.retry_moved(request, key)
            mark.settled = mark.settled or retried or _comes_back(exc)
            raise
        finally:
            # A retry sent from a body that went on (``retry(throw=False)``) comes again
            # under this id as well: the mark is its message's.
            if not (mark.settled or results.retry_sent(request, key)):
                enqueue.clear(task.exclusive_backend, key, request.id)
    finally:
        running.pop()


class _EnqueueMark:
    """What is left to do with a call's enqueue mark as the call leaves: ``settled``
    once its release cleared it, or once its message comes again under its id (then
    the mark is that message's)."""

    __slots__ = ("settled",)

    def __init__(self) -> None:
        self.settled = False


def _call_exclusive(
    task: Any,
    request: Context,
    settings: config.Settings,
    key: str,
    args: tuple,
    kwargs: dict,
    body: Body,
    mark: Optional[_EnqueueMark] = None,
) -> tuple[Any, bool]:
    """Run the call: what it returns, and whether its result was stored with the
    release of its lease (which cleared its enqueue mark too). ``mark`` learns, once the
    outcome was carried out, whether it keeps the call's enqueue mark."""
    if request.called_directly:
        holding = attempt.held_here(key)
        if holding is not None:
            # Called directly under a lease on its own key (recursion): re-entrant, like
            # an RLock. The caller's lease covers it and is released by the caller.
            with attempt.entered(holding):
                return body(*args, **kwargs), False
    the_call = attempt.Call(
        task.name,
        request.id,
        key,
        settings,
        backend_for_url(settings.backend_url),  # task.exclusive_backend, settings read once
        args,
        kwargs,
        requeues=requeues_of(request),
        retries=request.retries or 0,
        resumed=bool(_header(request, RESUMED_HEADER, False)),
        set_aside=bool(_header(request, SET_ASIDE_HEADER, False)),
        as_of=stamp_of(request),
        debounced=bool(_header(request, DEBOUNCED_HEADER, False)),
        owed_by=_owed_by(request),
    )
    outcome = attempt.run(the_call, host_of(task, request, settings), lambda a, k: body(*a, **k))
    handler = CeleryOutcomes(task, request)
    try:
        return outcome.carry_out(handler), handler.result_written
    except (Retry, Ignore, Reject):
        # Carried out: the message comes again under its id where the outcome says so
        # (a send that failed instead leaves the mark to be cleared: nothing comes).
        if mark is not None:
            mark.settled = enqueue.keeps_mark(outcome)
        raise


def host_of(task: Any, request: Any = None, settings: Any = None) -> attempt.Host:
    """What the current call of ``task`` can do: a worker's call can be sent again; an
    eager or direct call runs in the caller's process (a web server, a test), whose
    signal handlers are not ours to take and which has no queue to go back to.

    A call whose message cannot come twice gets a Host made once per task, process and
    settings (the same few facts every call): only a redelivered call's reads the
    broker's visibility timeout, which the app's configuration may change.
    """
    request = task.request if request is None else request
    settings = task.exclusive_settings if settings is None else settings
    direct = _cannot_requeue(request)
    acks_late = bool(task.acks_late)
    if acks_late and request.id and not direct:
        return _host(task, settings, direct, redelivery=True)
    facts = (
        settings,
        os.getpid(),
        direct,
        acks_late,
        bool(task.reject_on_worker_lost),
        retried_when_lost(task),
    )
    made = task.__dict__.get("_exclusive_host")
    if made is None or made[0] != facts:
        made = (facts, _host(task, settings, direct, redelivery=False))
        task.__dict__["_exclusive_host"] = made
    return made[1]


def _host(task: Any, settings: config.Settings, direct: bool, redelivery: bool) -> attempt.Host:
    return attempt.Host(
        can_requeue=not direct,
        redelivery=redelivery,
        redelivered_when_stopped=bool(task.acks_late and task.reject_on_worker_lost) and not direct,
        retried_when_lost=not direct and retried_when_lost(task),
        stop_process=None if direct or settings.on_lease_lost != "terminate" else _in_pool_child(),
        finished_ttl=finished_ttl(task) if redelivery else 0.0,
        comes_back=_comes_back,
        result_write=None if direct else functools.partial(results.result_write, task),
    )


#: Whether this Celery retries the call of a lost process (``retry_on_worker_lost``).
_CELERY_RETRIES_WHEN_LOST = hasattr(CeleryRequest, "_retry_worker_lost")


def retried_when_lost(task: Any) -> bool:
    """Whether Celery sends a call whose process was lost again, as a retry of it with
    its message's arguments, while it has retries left (``retry_on_worker_lost``: Celery
    5.7 and later; an earlier Celery ignores the option)."""
    return bool(getattr(task, "retry_on_worker_lost", False)) and _CELERY_RETRIES_WHEN_LOST


def _comes_back(exc: BaseException) -> bool:
    """A body that rejects its message with ``requeue=True`` has not ended its attempt."""
    return isinstance(exc, Reject) and bool(exc.requeue)


#: The least a finished mark lasts: a copy the broker restored may wait behind a backlog
#: of messages before a worker takes it, however short the visibility timeout.
FINISHED_TTL_FLOOR = 3600.0


def finished_ttl(task: Any) -> float:
    """How long the finished mark of a call of ``task`` lasts (:func:`finished_ttl_for`)."""
    options = task.app.conf.broker_transport_options or {}
    visibility = float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))
    settings = task.exclusive_settings
    return finished_ttl_for(visibility, settings.requeue_max_delay, settings.lease_ttl)


def finished_ttl_for(
    visibility_timeout: float, requeue_max_delay: float, lease_ttl: float
) -> float:
    """How long a finished mark lasts: a copy restored just before the first delivery
    was acknowledged arrives within the visibility timeout, a copy set aside comes back
    within one requeue delay, and either may then wait in the queue, for an hour at
    least (:data:`FINISHED_TTL_FLOOR`)."""
    return max(FINISHED_TTL_FLOOR, visibility_timeout + requeue_max_delay + lease_ttl)


# --- the outcome, in Celery's terms ------------------------------------------------------


class CeleryOutcomes(outcomes.OutcomeHandler):
    """The engine's outcome of one call of ``task``, in Celery's terms: what the task
    returns, or the exception that ends it in the state it must end in."""

    def __init__(self, task: Any, request: Any = None) -> None:
        self.task = task
        self.request = task.request if request is None else request
        #: Whether the result was stored with the release of the lease (which cleared
        #: the call's enqueue mark too).
        self.result_written = False

    def handle_ran(self, outcome: outcomes.Ran) -> Any:
        if outcome.owed is not None:
            send_owed_run(self.task, self.request.id, outcome.owed, "ran unlocked")
        self.result_written = outcome.written
        if outcome.written:
            # Stored with the release of the lease: Celery's tracer, which reads this
            # when it would store the result, leaves it as it is.
            self.request.ignore_result = True
        return outcome.result

    def handle_skipped(self, outcome: outcomes.Skipped) -> Any:
        key, task_id = outcome.key, self.request.id
        holder = holders.named(outcome.holder_task_id, outcome.holder)
        logger.info("duplicate skipped key=%s task_id=%s holder=%s", key, task_id, holder)
        return _duplicate_ends(
            self.task,
            DuplicateSkipped(
                f"{self.task.name}[{task_id}] was skipped: its key {key!r} is held by "
                f"{holder}. Use exclusive_on_duplicate='requeue', 'wait' or 'rerun' to run "
                "it later instead.",
                key,
                outcome.holder_task_id,
            ),
            {"outcome": "skipped", "key": key, "holder": outcome.holder_task_id},
        )

    def handle_coalesced(self, outcome: outcomes.Coalesced) -> Any:
        key, task_id, rerun = outcome.key, self.request.id, outcome.rerun_task_id
        if outcome.debounced:
            logger.info("debounced call coalesced key=%s task_id=%s into=%s", key, task_id, rerun)
            said = (
                f"{self.task.name}[{task_id}] was debounced: task {rerun} runs its burst "
                f"of {key!r} instead, once with the latest call's arguments."
            )
        else:
            logger.info("duplicate coalesced key=%s task_id=%s rerun=%s", key, task_id, rerun)
            said = (
                f"{self.task.name}[{task_id}] joined the pending rerun of {key!r}, task "
                f"{rerun}, which runs once after the current holder."
            )
        result = {"outcome": "coalesced", "key": key, "rerun": rerun}
        if outcome.debounced:
            result["debounced"] = True
        return _duplicate_ends(self.task, DuplicateCoalesced(said, key, rerun), result)

    def handle_replaced(self, outcome: outcomes.Replaced) -> Any:
        key, task_id, by = outcome.key, self.request.id, outcome.by
        logger.info("run replaced key=%s task_id=%s by=%s", key, task_id, by)
        return _duplicate_ends(
            self.task,
            DuplicateReplaced(
                f"{self.task.name}[{task_id}] was stopped: a newer call of {key!r}, task "
                f"{by}, replaced it and runs instead.",
                key,
                by,
            ),
            {"outcome": "replaced", "key": key, "by": by},
        )

    def handle_requeue(self, outcome: outcomes.Requeue) -> NoReturn:
        """Send this call again after the countdown, then end this attempt."""
        signature = send_again(self.task, self.request, outcome)
        raise Retry(
            f"requeued: {outcome.key!r} {outcome.reason}", when=outcome.countdown, sig=signature
        )

    def handle_gave_up(self, outcome: outcomes.GaveUp) -> NoReturn:
        name, task_id, key = self.task.name, self.request.id, outcome.key
        if outcome.owed is not None:
            send_owed_run(self.task, task_id, outcome.owed, "gave up")
        advice = "Raise exclusive_requeue_max_retries (None: no limit)."
        if outcome.cause == "unanswered":
            raise BackendUnavailable(
                f"{name}[{task_id}] gave up after {outcome.requeues} requeues: "
                f"{outcome.reason} while it tried to take {key!r}. {advice}",
                self.task.exclusive_backend.safe_url,
            )
        raise DuplicateSkipped(
            f"{name}[{task_id}] gave up after {outcome.requeues} requeues: its key {key!r} "
            f"stayed {outcome.reason}. {advice}",
            key,
            None,
        )

    def handle_waited(self, outcome: outcomes.Waited) -> NoReturn:
        raise DuplicateSkipped(
            f"{self.task.name} called directly or eagerly could not run: its key "
            f"{outcome.key!r} stayed {outcome.reason} for "
            f"exclusive_wait_timeout={outcome.wait_timeout}s.",
            outcome.key,
            None,
        )

    def handle_unanswered(self, outcome: outcomes.Unanswered) -> NoReturn:
        how = "eagerly" if self.request.is_eager else "directly"
        raise config.unanswered_in_process(
            f"{self.task.name}[{self.request.id}], called {how},", outcome.key, outcome.error
        ) from None

    def handle_set_aside(self, outcome: outcomes.SetAside) -> NoReturn:
        """A copy whose first delivery still runs: send it again later, end quietly.

        Acknowledging the copy also drops the broker's record of the first delivery
        (both carry one delivery tag), so the copy stays around, as a new message, in
        case the first delivery dies without finishing. When it comes back after the
        first one ended, it is dropped.
        """
        request = self.request
        headers = dict(request.headers or {})
        headers[REQUEUES_HEADER] = outcome.requeues
        headers[SET_ASIDE_HEADER] = True
        if outcome.as_of is not None:
            headers[AS_OF_HEADER] = outcome.as_of
        with enqueue.going_on():
            self.task.signature_from_request(
                request, countdown=outcome.countdown, headers=headers, retries=request.retries
            ).apply_async()
        logger.info(
            "redelivered copy set aside key=%s task_id=%s: the first delivery still runs; "
            "the copy comes back in %.2fs in case it dies",
            outcome.key,
            request.id,
            outcome.countdown,
        )
        raise RedeliveredCopy()

    def handle_dropped(self, outcome: outcomes.Dropped) -> NoReturn:
        logger.info(
            "redelivered copy dropped key=%s task_id=%s: this attempt already ran",
            outcome.key,
            self.request.id,
        )
        raise RedeliveredCopy()

    def handle_redelivered(self, outcome: outcomes.Redelivered) -> NoReturn:
        logger.warning(
            "%s[%s] was stopped by the loss of its lease on %r; its message goes "
            "back to the queue (acks_late and reject_on_worker_lost)",
            self.task.name,
            self.request.id,
            outcome.key,
        )
        raise Reject(outcome.error, requeue=True) from None


def _duplicate_ends(task: Any, error: DuplicateSkipped, result: dict[str, Any]) -> dict[str, Any]:
    """End a duplicate that does not run, in the state ``exclusive_skip_state`` chose:
    FAILURE raising ``error``, or SUCCESS returning ``result``. Both are terminal, so
    ``AsyncResult.get()`` answers at once."""
    if task.exclusive_settings.skip_state == "failure":
        raise error
    return result


def send_again(task: Any, request: Any, outcome: outcomes.Requeue) -> Any:
    """Send the call of ``request`` again after the outcome's countdown, with the same
    task id; return the signature sent.

    It goes with the outcome's arguments where it has them (a call stopped while it ran
    as the pending rerun of its key resumes with the rerun's), else with its own.
    Unlike ``retry()``, a requeue does not spend the task's ``max_retries``: those
    belong to the task's own errors. It counts in its own header instead.
    """
    headers = dict(request.headers or {})
    headers[REQUEUES_HEADER] = outcome.requeues
    if outcome.cause == "lost":
        headers[RESUMED_HEADER] = True
    if outcome.cause == "debounce":
        headers[DEBOUNCED_HEADER] = True
    if outcome.as_of is not None:
        headers[AS_OF_HEADER] = outcome.as_of
    signature = task.signature_from_request(
        request,
        args=outcome.args,  # None: the request's own
        kwargs=outcome.kwargs,
        countdown=outcome.countdown,
        headers=headers,
        retries=request.retries,
    )
    with enqueue.going_on():
        signature.apply_async()
    logger.info(
        "%s key=%s task_id=%s countdown=%.2fs: %s",
        outcomes.REQUEUED_AS[outcome.cause],
        outcome.key,
        request.id,
        outcome.countdown,
        outcome.reason,
    )
    return signature


def send_owed_run(task: Any, task_id: Optional[str], owed: outcomes.OwedRun, why: str) -> None:
    """Send a new call of ``task`` for the run the pending rerun ``task_id`` owed the
    duplicates that joined it, as it ``why`` (died, gave up) without running. It carries
    when that change was sent: no newer change is replaced when it joins a later one."""
    headers: dict[str, Any] = {}
    if owed.as_of is not None:
        headers[AS_OF_HEADER] = owed.as_of
    if task_id:
        headers[OWED_BY_HEADER] = task_id
    with enqueue.going_on():
        sent = task.apply_async(owed.args, owed.kwargs, task_id=owed.task_id, headers=headers)
    logger.warning(
        "pending rerun %s[%s] %s; its run goes to %s (its duplicates are owed it)",
        task.name,
        task_id,
        why,
        sent.id,
    )


# --- the call in its thread ----------------------------------------------------------------


def _running_here(task: Any, request: Context) -> bool:
    """Whether ``request`` is that of a call of ``task`` already running in this thread,
    or the copy Celery's ``Task.__call__`` pushes of it: then a new call is a direct
    call made from inside that run. (A marker on the request would not do: Celery sends
    a request's unknown attributes along as message headers, to every retry.)"""
    return any(
        running is task and (entered is request or entered.id == request.id)
        for running, entered in getattr(_running, "calls", ())
    )


def _in_pool_child() -> bool:
    """Whether this process is a prefork pool child, which may be killed (the pool
    replaces it) rather than the worker itself."""
    from billiard.process import current_process

    return getattr(current_process(), "_parent_pid", None) is not None


def requeues_of(request: Any) -> int:
    """How often the call of ``request`` was requeued already."""
    try:
        return int(_header(request, REQUEUES_HEADER, 0))
    except (TypeError, ValueError):
        return 0


def stamp_of(request: Any) -> Optional[float]:
    """The call's :data:`AS_OF_HEADER`, if it has a readable one."""
    value = _header(request, AS_OF_HEADER, None)
    return float(value) if isinstance(value, (int, float)) else None


def _owed_by(request: Any) -> Optional[str]:
    """The call's :data:`OWED_BY_HEADER`, if it has a readable one."""
    value = _header(request, OWED_BY_HEADER, None)
    return value if isinstance(value, str) else None


def _header(request: Any, name: str, default: Any) -> Any:
    """A header of the call's message: Celery makes the ones it does not know request
    attributes (in the request's ``__dict__``: no lookup that raises when, as nearly
    always, the header is absent), or keeps them in ``request.headers``."""
    value = getattr(request, "__dict__", _NO_HEADERS).get(name)
    if value is None:
        value = (getattr(request, "headers", None) or _NO_HEADERS).get(name, default)
    return value


_NO_HEADERS: dict = {}


def _cannot_requeue(request: Any) -> bool:
    return bool(request.called_directly or request.is_eager)
