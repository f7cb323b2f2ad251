"""Revoking a call frees what it reserved: its enqueue mark, at once.

A call sent under ``exclusive_scope="enqueue"`` (or ``"both"``) holds its key's enqueue
mark until it is over, so that every other send of the key is answered with it. A
revoked call never runs: if its mark stayed until a worker reached its message (or,
with no worker, until ``exclusive_enqueue_ttl``), the sends in between would be
answered with a call that is never to run, and the key's newest work lost with it.

So the result a send returns (:class:`ExclusiveResult`) knows its key, and its
:meth:`~ExclusiveResult.revoke` clears the mark (only if it is still this call's, and
the call neither holds a lease nor waits in line: a revoke does not stop a call that
started) as soon as the
revoke is broadcast. A revoke that knows only the id (``celery control
revoke``, ``AsyncResult(id).revoke()`` elsewhere) frees it when a worker reaches the
message and drops it (:class:`~.worker.ExclusiveRequest`), as does a message that
expired. A running call revoked with ``terminate=True`` frees its lease as its process
dies (also there).
"""

from __future__ import annotations

from typing import Any, Optional

from celery.result import AsyncResult

from ..engine import enqueue
from ..errors import BackendUnavailable


class ExclusiveResult(AsyncResult):  # type: ignore[misc]  # Celery ships no types
    """The result of an exclusive call sent with an enqueue mark: revoking it frees the
    mark too."""

    #: The call's lease key, and the task that sent it (None: a result made from an id).
    exclusive_key: Optional[str] = None
    exclusive_task: Any = None

    def revoke(self, *args: Any, **kwargs: Any) -> None:
        super().revoke(*args, **kwargs)
        if self.exclusive_key is None:
            return
        backend, key = self.exclusive_task.exclusive_backend, self.exclusive_key
        try:
            started = enqueue.under_way(backend, key, self.id)
        except BackendUnavailable:
            return  # the mark is freed when a worker drops the message
        if not started:  # a revoke stops no call that started: its mark stays its own
            enqueue.clear(backend, key, self.id)


def keyed(result: AsyncResult, task: Any, key: str) -> AsyncResult:
    """``result`` (the task's :class:`ExclusiveResult`), told the call's key."""
    if isinstance(result, ExclusiveResult):
        result.exclusive_key, result.exclusive_task = key, task
    return result
