"""How one attempt of a call ended: the one closed set of answers, and the host methods
that carry each out.

The duplicate policies (:mod:`.policies`) answer with these, and the attempt engine
(:mod:`celery_exclusive.engine.attempt`) adds what only it can decide (the body ran,
the host cannot requeue, the store did not answer). Each host (a Celery task, an RQ
job, a direct call) implements :class:`OutcomeHandler`'s one method per outcome, and the engine
calls the one that fits (:meth:`Outcome.carry_out`), as Celery's tracer calls
``TraceInfo.handle_*`` per state: the decision is made once, in the engine, so the
same scenario ends the same way on every host, and no host switches on a type.

=============  ==========================================================================
outcome        what happened
=============  ==========================================================================
Ran            the body ran to its end under the lease (or unlocked, by the setting)
Skipped        a duplicate under ``skip``: it does not run, naming the holder
Coalesced      a duplicate under ``rerun`` joined the pending rerun, which runs for it
Requeue        send the call again after a countdown (a duplicate, the store did not
               answer, the body was stopped by the loss of its lease)
GaveUp         requeued ``requeue_max_retries`` times already: it ends without running
Waited         no queue to go back to: it waited ``wait_timeout`` in line, in vain
Unanswered     no queue to go back to, and the store did not answer
SetAside       a copy of a call whose first delivery still runs (``acks_late``)
Dropped        a copy of an attempt that already ended
Redelivered    stopped by the loss of its lease; its message comes back by itself
=============  ==========================================================================
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..errors import BackendUnavailable, LeaseLost


class OutcomeHandler(abc.ABC):
    """What carries a call's outcome out in a host's own terms: one method per outcome
    (the engine calls the one that fits), each returning what the call returns (or
    raising what the host raises to end it that way)."""

    @abc.abstractmethod
    def handle_ran(self, outcome: Ran) -> Any: ...

    @abc.abstractmethod
    def handle_skipped(self, outcome: Skipped) -> Any: ...

    @abc.abstractmethod
    def handle_coalesced(self, outcome: Coalesced) -> Any: ...

    @abc.abstractmethod
    def handle_replaced(self, outcome: Replaced) -> Any: ...

    @abc.abstractmethod
    def handle_requeue(self, outcome: Requeue) -> Any: ...

    @abc.abstractmethod
    def handle_gave_up(self, outcome: GaveUp) -> Any: ...

    @abc.abstractmethod
    def handle_waited(self, outcome: Waited) -> Any: ...

    @abc.abstractmethod
    def handle_unanswered(self, outcome: Unanswered) -> Any: ...

    @abc.abstractmethod
    def handle_set_aside(self, outcome: SetAside) -> Any: ...

    @abc.abstractmethod
    def handle_dropped(self, outcome: Dropped) -> Any: ...

    @abc.abstractmethod
    def handle_redelivered(self, outcome: Redelivered) -> Any: ...


@dataclass(frozen=True)
class OwedRun:
    """The run a pending rerun that ends without running owed the duplicates that
    joined it (it died, or gave up): a new call the host sends with these arguments,
    whose change ``as_of`` stamped (0: unknown, older than any other), so that it never
    replaces a newer change when it joins a later pending rerun."""

    args: tuple
    kwargs: dict
    #: The id the host sends the new call under: the rerun mark names it already, as
    #: the pending rerun that carries the run on (``marks.hand_on_rerun``).
    task_id: str
    as_of: Optional[float] = None


@dataclass(frozen=True)
class Ran:
    """The body ran to its end under the lease (or unlocked, by the setting's choice);
    ``result`` is what it returned. ``written``: the result was stored with the release
    of the lease (the host's result write), and the host stores it no more."""

    result: Any
    written: bool = False
    #: Ran without its lease as the pending rerun of its key, whose mark still named it
    #: after the run: the run owed to the duplicates that joined it since.
    owed: Optional[OwedRun] = None

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_ran(self)


@dataclass(frozen=True)
class Skipped:
    """A duplicate that does not run (``on_duplicate="skip"``): the key is held by the
    task ``holder_task_id`` or, when that is no task, by ``holder`` in words (a lock, a
    foreign client: :mod:`.holders`)."""

    key: str
    holder_task_id: Optional[str]
    holder: Optional[str] = None

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_skipped(self)


@dataclass(frozen=True)
class Coalesced:
    """A duplicate under ``rerun`` that joined the pending rerun ``rerun_task_id``, which
    runs once after the current holder, with the latest arguments, instead of it; or,
    ``debounced``, a call of a burst (:mod:`.debounce`) covered by the run of the call
    ``rerun_task_id`` that took the burst, with its latest call's arguments."""

    key: str
    rerun_task_id: str
    debounced: bool = False

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_coalesced(self)


@dataclass(frozen=True)
class Replaced:
    """A run stopped because the newer call ``by`` replaced it (``on_duplicate=
    "replace"``), which runs instead: the call ends here, never sent again."""

    key: str
    by: str

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_replaced(self)


@dataclass(frozen=True)
class Requeue:
    """Send the call again after ``countdown`` seconds and end this attempt.

    ``cause`` says why: ``"held"`` (a duplicate), ``"unanswered"`` (the store did not
    answer), ``"lost"`` (the body was stopped by the loss of its lease) or
    ``"debounce"`` (it waits for later calls of its burst: :mod:`.debounce`; it comes
    back marked as debounced, and the requeue is no duplicate's, counted in none).
    ``requeues`` is the count the call carries from now on; ``reason`` says why in
    words, for logs and messages. A duplicate yields to the task ``holder_task_id`` or,
    when that is no task, to ``holder`` in words (a lock, a foreign client).

    ``args`` and ``kwargs`` are what the call is sent again with: a body stopped by the
    loss of its lease while it ran as the pending rerun of its key ran with the
    arguments of the newest duplicate, not those of its own message, and the run
    that resumes it runs with them too. None: the call's own.
    """

    key: str
    countdown: float
    reason: str
    cause: str
    requeues: int
    holder_task_id: Optional[str] = None
    args: Optional[tuple] = None
    kwargs: Optional[dict] = None
    #: When the change the call's arguments carry first reached the library (under
    #: ``rerun``): sent along, so that it never replaces a newer change when it comes back.
    as_of: Optional[float] = None
    #: The holder in words, when it is no task (a lock, a foreign client).
    holder: Optional[str] = None

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_requeue(self)


#: How a requeue is logged, by its cause.
REQUEUED_AS = {
    "held": "duplicate requeued",
    "unanswered": "requeued until the lease store answers",
    "lost": "requeued after its lease was lost",
    "debounce": "debounced: requeued until its burst is over",
}


@dataclass(frozen=True)
class GaveUp:
    """The call was requeued ``requeues`` times (``requeue_max_retries``) and would be
    again: it ends without running, with ``cause`` as for :class:`Requeue`. If it was
    the pending rerun of its key, the host sends a new call for the run it ``owed``."""

    key: str
    requeues: int
    reason: str
    cause: str
    holder_task_id: Optional[str] = None
    owed: Optional[OwedRun] = None

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_gave_up(self)


@dataclass(frozen=True)
class Waited:
    """A call with no queue to go back to (a direct or eager call, a synchronous
    queue) waited ``wait_timeout`` seconds in the key's line, and the key stayed held."""

    key: str
    reason: str
    wait_timeout: float
    holder_task_id: Optional[str] = None

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_waited(self)


@dataclass(frozen=True)
class Unanswered:
    """The store did not answer and the call has no queue to go back to: it fails
    with ``error`` (``on_backend_error="run"`` would have run it unlocked)."""

    key: str
    error: BackendUnavailable

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_unanswered(self)


@dataclass(frozen=True)
class SetAside:
    """A second delivery of a call whose first delivery still runs (``acks_late``):
    send it again after ``countdown`` in case the first dies, and end without a trace."""

    key: str
    countdown: float
    requeues: int
    #: As for :class:`Requeue`.
    as_of: Optional[float] = None

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_set_aside(self)


@dataclass(frozen=True)
class Dropped:
    """A second delivery of an attempt that already ran to its end: end without a trace."""

    key: str

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_dropped(self)


@dataclass(frozen=True)
class Redelivered:
    """The body was stopped by the loss of its lease, and its host delivers the same
    message again by itself (Celery's ``acks_late`` with ``reject_on_worker_lost``)."""

    key: str
    error: LeaseLost

    def carry_out(self, host: OutcomeHandler) -> Any:
        return host.handle_redelivered(self)


Outcome = Union[
    Ran,
    Skipped,
    Coalesced,
    Replaced,
    Requeue,
    GaveUp,
    Waited,
    Unanswered,
    SetAside,
    Dropped,
    Redelivered,
]
