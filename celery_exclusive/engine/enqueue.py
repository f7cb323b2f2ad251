"""Deduplication at send (``scope="enqueue"``/``"both"``): one call of a key queued or
running at a time.

The producer claims the key's *enqueue mark* for the call it is about to send
(:func:`claim`); a send that finds the mark held by another call sends nothing and
hands back that call's id. The call clears the mark when it is over for good
(:func:`clear`), and only then: not when its message goes back to the queue under its
own id (requeued, retried, set aside, handed back to the broker), which
:func:`keeps_mark` decides from the attempt's outcome. A mark whose call was lost
without a word lapses after ``enqueue_ttl``.

The run-time lease is taken as well, always: producers that bypass the mark (a
``send_task`` by name, beat) stay excluded at run time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Optional

from ..backends import Backend, versions
from ..core import marks, outcomes
from ..errors import BackendUnavailable

logger = logging.getLogger("celery_exclusive")

#: The outcomes after which the call's message comes again under its id (or is a copy
#: of a delivery that goes on, or went on, elsewhere): its mark stays for that one.
_COMES_AGAIN = (outcomes.Requeue, outcomes.SetAside, outcomes.Dropped, outcomes.Redelivered)


_going_on: ContextVar[bool] = ContextVar("exclusive_going_on", default=False)


@contextlib.contextmanager
def going_on() -> Iterator[None]:
    """Sends made inside are of calls that go on (the library's own: a requeue, a copy
    set aside, the run a pending rerun owed; a retry): never refused, they take the
    mark only where it is free."""
    token = _going_on.set(True)
    try:
        yield
    finally:
        _going_on.reset(token)


def claim(
    backend: Backend,
    name: str,
    key: str,
    task_id: str,
    ttl: float,
    key_prefix: Optional[str] = None,
) -> Optional[str]:
    """Claim the enqueue mark of ``key`` for the call ``task_id`` about to be sent.

    A producer meets the layout the store holds under ``key_prefix`` before its first
    mark there (:func:`~celery_exclusive.backends.versions.ensure`), as a worker does.

    Returns None to send it (the mark is its own now; the call goes on, see
    :func:`going_on`; or the store did not answer: the run-time lease still applies,
    and a WARNING says so), or the id of the call already queued or running for
    ``key``: send nothing.
    """
    going_on = _going_on.get()
    try:
        if key_prefix is not None:
            versions.ensure(backend, key_prefix)
        queued = marks.claim_mark(backend, key, marks.QUEUED, task_id, ttl)
    except BackendUnavailable as exc:
        logger.warning(
            "%s: cannot check whether %r is already queued, sending it (the run-time "
            "lease still applies): %s",
            name,
            key,
            exc,
        )
        return None
    return None if queued == task_id or going_on else queued


def keeps_mark(outcome: outcomes.Outcome) -> bool:
    """Whether the call's enqueue mark stays after its attempt ended in ``outcome``:
    its message comes again under its id (a requeue, a copy set aside, a message handed
    back to the broker), or was a copy of a delivery the mark is the other's to clear."""
    return isinstance(outcome, _COMES_AGAIN)


def under_way(backend: Backend, key: str, task_id: str) -> bool:
    """Whether a delivery of the call ``task_id`` holds a lease on ``key`` or waits in its
    line: it started, so it is not over for a revoke (which stops no call that started)
    nor for a copy of its message dropped elsewhere."""
    return any(info.task_id == task_id for info in backend.holders_of(key)) or marks.waiting(
        backend, key, task_id
    )


def clear(backend: Backend, key: str, task_id: str) -> None:
    """The call ``task_id`` is over: clear the enqueue mark of ``key`` if it is its own."""
    try:
        marks.clear_mark(backend, key, marks.QUEUED, task_id)
    except BackendUnavailable as exc:
        logger.warning("enqueue mark of %r left to expire (exclusive_enqueue_ttl): %s", key, exc)
