"""A task's result stored with the release of its lease, in one step.

Celery stores a task's result after its ``__call__`` returns, so the lease (given back
inside ``__call__``) is free before the result can be read, and a holder that lost its
lease stores ``LeaseLost``, never its success. Where the result backend is Celery's
Redis backend on the lease store's server (any database, the same user), one script
does both: it frees the lease and, only if the lease was still held, stores and
publishes the result exactly as the backend would have. One round trip instead of
three (the release; Celery's read of the stored state; its write and publish), and the
two steps become one: nobody sees the key free without the result, or the reverse.

Under ``exclusive_scope="both"`` the same script clears the call's enqueue mark, which
would otherwise take a round trip of its own after the run.

Celery is then told the result is stored (the request's ``ignore_result``, which its
tracer reads when it would store it). Everything else keeps Celery's own way: another
result backend or server, a serializer other than JSON or compressed results (the
script reads a stored state as JSON, to leave a stored success as Celery does),
ignored results, eager and direct calls, and calls with callbacks, a chain or a chord,
whose links Celery sends before it stores the result.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from celery import states

from ..backends import Backend, FinalWrite
from ..core import marks
from ..errors import ExclusiveError

logger = logging.getLogger("celery_exclusive")

#: Where the verdict for a result backend is kept, on the backend (its ``__dict__``):
#: ``(lease store, database or None)``.
_VERDICT = "_exclusive_result_database"


#: The request attribute that holds the key a retry of the call was sent for, once its
#: body sent one (:meth:`~celery_exclusive.ExclusiveTask.retry`).
RETRY_SENT = "exclusive_retry_sent"


def retry_sent(request: Any, key: str) -> bool:
    """Whether the body of ``request``'s call sent a retry of it for ``key``: that
    message comes again under its id, so the call's enqueue mark of ``key`` is the
    retry's (a body that goes on after ``retry(throw=False)`` leaves it too)."""
    return getattr(request, RETRY_SENT, None) == key


def retry_moved(request: Any, key: str) -> bool:
    """Whether the body of ``request``'s call sent its retry for another key than
    ``key`` (its arguments changed the key): the mark of ``key`` is nobody's then."""
    sent = getattr(request, RETRY_SENT, None)
    return sent is not None and sent != key


def result_write(task: Any, key: str, result: Any) -> Optional[FinalWrite]:
    """The write that stores ``result`` as the SUCCESS of the running call of ``task``,
    made with the release of its lease on ``key`` (and, under ``exclusive_scope="both"``,
    the clearing of its enqueue mark); None where Celery must store it its own way.

    Whatever goes wrong here leaves the result to Celery: a shortcut must never fail a
    call that ran."""
    try:
        return _result_write(task, key, result)
    except Exception:
        logger.debug("result of %s left to Celery's store", task.name, exc_info=True)
        return None


def _result_write(task: Any, key: str, result: Any) -> Optional[FinalWrite]:
    request = task.request
    if (
        request.callbacks
        or request.chain
        or request.chord
        or request.is_eager
        or request.called_directly
        or task.ignore_result
        or request.ignore_result
    ):
        return None
    backend = task.backend
    database = _database_for(backend, task.exclusive_backend)
    if database is None:
        return None
    try:
        meta = backend._get_result_meta(
            result=backend.encode_result(result, states.SUCCESS),
            state=states.SUCCESS,
            traceback=None,
            request=request,
        )
        meta["task_id"] = request.id
        value = backend.encode(meta)
    except Exception:  # Celery's own store raises it again, as EncodeError where it is one
        return None
    if len(value) > backend._MAX_STR_VALUE_SIZE:
        return None
    result_key = backend.get_key_for_task(request.id)
    return FinalWrite(
        key=result_key.decode() if isinstance(result_key, bytes) else result_key,
        value=value,
        database=database,
        ttl=float(backend.expires) if backend.expires else None,
        publish=True,
        keep_status=states.SUCCESS,
        clear_mark=None
        if task.exclusive_settings.scope == "run" or retry_sent(request, key)
        else (key, marks.QUEUED, request.id),
    )


def _database_for(backend: Any, store: Backend) -> Optional[int]:
    """The database of ``store``'s server that Celery's result ``backend`` writes in, or
    None if the store cannot write there with a release. Decided once per backend
    object and store (a store that does not answer is asked again next time)."""
    verdict = backend.__dict__.get(_VERDICT)
    if verdict is not None and verdict[0] is store:
        return verdict[1]
    database = None
    kind = type(backend)
    if (
        store.capabilities.final_writes
        and (kind.__module__, kind.__name__) == ("celery.backends.redis", "RedisBackend")
        and backend.serializer == "json"
        and not getattr(backend, "compression", None)
    ):
        from redis.connection import SSLConnection

        address = dict(backend.connparams)
        address["ssl"] = issubclass(address.get("connection_class", object), SSLConnection)
        try:
            database = store.connection.database_for(address)
        except ExclusiveError:
            return None
    backend.__dict__[_VERDICT] = (store, database)
    return database
