"""How one attempt of a call ended: the closed set of answers the attempt engine gives.

:func:`celery_exclusive.engine.attempt.run` returns exactly one of these, and each
host (a Celery task, an RQ job, a direct call) carries it out in its own terms: a
result stored or a job finished, a terminal "skipped" record, a message sent again
after a countdown. The decision itself is made once, in the engine, so the same
scenario ends the same way on every host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ..core.policies import Coalesce, Skip
from ..errors import BackendUnavailable, LeaseLost


@dataclass(frozen=True)
class Ran:
    """The body ran to its end under the lease (or unlocked, by the setting's choice);
    ``result`` is what it returned. ``written``: the result was stored with the release
    of the lease (:attr:`.attempt.Host.result_write`), and the host stores it no more."""

    result: Any
    written: bool = False


#: A duplicate that does not run (``on_duplicate="skip"``): the key is held by
#: ``holder_task_id`` (or, when that is no task, by ``holder`` in words). The claim's
#: own decision, passed on as it is.
Skipped = Skip

#: A duplicate under ``rerun`` that joined the pending rerun ``rerun_task_id``: the
#: claim's own decision, passed on as it is.
Coalesced = Coalesce


@dataclass(frozen=True)
class Requeue:
    """Send the call again after ``countdown`` seconds and end this attempt.

    ``cause`` says why: ``"held"`` (a duplicate), ``"unanswered"`` (the store did not
    answer) or ``"lost"`` (the body was stopped by the loss of its lease).
    ``requeues`` is the count the call carries from now on.

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


@dataclass(frozen=True)
class GaveUp:
    """The call was requeued ``requeues`` times (``requeue_max_retries``) and would be
    again: it ends without running, with ``cause`` as for :class:`Requeue`."""

    key: str
    requeues: int
    reason: str
    cause: str
    holder_task_id: Optional[str] = None


@dataclass(frozen=True)
class Waited:
    """A call with no queue to go back to (a direct or eager call, a synchronous
    queue) waited ``wait_timeout`` seconds in the key's line, and the key stayed held."""

    key: str
    reason: str
    wait_timeout: float
    holder_task_id: Optional[str] = None


@dataclass(frozen=True)
class Unanswered:
    """The store did not answer and the call has no queue to go back to: it fails
    with ``error`` (``on_backend_error="run"`` would have run it unlocked)."""

    key: str
    error: BackendUnavailable


@dataclass(frozen=True)
class SetAside:
    """A second delivery of a call whose first delivery still runs (``acks_late``):
    send it again after ``countdown`` in case the first dies, and end without a trace."""

    key: str
    countdown: float
    requeues: int


@dataclass(frozen=True)
class Dropped:
    """A second delivery of an attempt that already ran to its end: end without a trace."""

    key: str


@dataclass(frozen=True)
class Redelivered:
    """The body was stopped by the loss of its lease, and its host delivers the same
    message again by itself (Celery's ``acks_late`` with ``reject_on_worker_lost``)."""

    key: str
    error: LeaseLost


Outcome = Union[
    Ran, Skipped, Coalesced, Requeue, GaveUp, Waited, Unanswered, SetAside, Dropped, Redelivered
]
