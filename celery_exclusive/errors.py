"""Errors users see. Each names the task and key where there is one, and says what to do.

They are stored as task results, and read back by clients that may not have this
library installed, so each travels in a form both kinds of client can read:

- JSON results: Celery stores the class name, its module and ``args``, and rebuilds
  ``cls(*args)``. Every error keeps all its constructor arguments in ``args``, so a
  stored ``DuplicateSkipped`` comes back with its key and holder. Where this module
  is not imported, Celery makes up an ``Exception`` subclass of the same name whose
  ``args`` (and so its text) still hold the message, key and holder.
- Pickled results: an error pickles as "this library's class if it can be imported,
  else ``Exception``" (resolved by kombu's ``symbol_by_name``, which every Celery
  client has), called with the message alone, its fields restored as attributes.
  Without this library a client gets a plain ``Exception`` whose message names the
  key and holder, not an unpicklable result.
"""

from __future__ import annotations

from typing import Any, Optional

from kombu.utils.imports import symbol_by_name


class ExclusiveError(Exception):
    """Base class of every error raised by celery-exclusive."""

    #: The constructor's arguments after the message, kept as attributes of these names.
    fields: tuple[str, ...] = ()

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        state = {name: getattr(self, name, None) for name in self.fields}
        return _ClassOrException(type(self)), (str(self),), state

    def __setstate__(self, state: Optional[dict[str, Any]]) -> None:
        for name, value in (state or {}).items():
            setattr(self, name, value)
        self.args = (*self.args[:1], *(getattr(self, name, None) for name in self.fields))


class _ClassOrException:
    """Builds an ExclusiveError; pickles as "its class, or Exception where this library
    cannot be imported", so unpickling never needs this library."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, *args: Any) -> BaseException:
        error: BaseException = self.cls(*args)
        return error

    def __reduce__(self) -> tuple[Any, ...]:
        name = f"{self.cls.__module__}:{self.cls.__qualname__}"
        # symbol_by_name(name, aliases, imp, package, sep, default)
        return symbol_by_name, (name, None, None, None, ":", Exception)


class ConfigurationError(ExclusiveError):
    """A setting has a value celery-exclusive cannot use.

    Raised when the worker starts (or, outside a worker, at the first call), naming
    the setting and the values it accepts.
    """


class LayoutMismatch(ConfigurationError):
    """The store holds a layout version this process cannot share (an upgrade half
    done): the message names both versions and the step that ends it.

    ``layout`` is the layout's name, ``found`` the version the store holds and
    ``version`` this process's.
    """

    fields = ("layout", "found", "version")

    def __init__(
        self,
        message: str,
        layout: Optional[str] = None,
        found: Optional[int] = None,
        version: Optional[int] = None,
    ):
        super().__init__(message, layout, found, version)
        self.layout = layout
        self.found = found
        self.version = version


class ExclusiveKeyError(ExclusiveError):
    """The lease key of a call cannot be built from its arguments."""

    fields = ("task", "argument")

    def __init__(self, message: str, task: Optional[str] = None, argument: Optional[str] = None):
        super().__init__(message, task, argument)
        self.task = task
        self.argument = argument


class BackendUnavailable(ExclusiveError):
    """The lease store did not answer (connection refused, timed out, ...)."""

    fields = ("url",)

    def __init__(self, message: str, url: Optional[str] = None):
        super().__init__(message, url)
        self.url = url


class LeaseLost(ExclusiveError):
    """The lease expired or was taken away while its holder was still running.

    ``cause`` says why, as the lease found it: one of :data:`LOSS_ADVICE`'s keys. The
    message ends with the advice that fits it.
    """

    fields = ("key", "task", "cause")

    def __init__(
        self,
        message: str,
        key: Optional[str] = None,
        task: Optional[str] = None,
        cause: Optional[str] = None,
    ):
        super().__init__(message, key, task, cause)
        self.key = key
        self.task = task
        self.cause = cause


#: Why a held lease is lost, and what its holder's error advises. The lease decides the
#: cause when it finds the loss (:mod:`celery_exclusive.core.losses`).
LOSS_ADVICE = {
    "expired": (
        "Its renewals did not reach the store within lease_ttl: the process was paused, "
        "its heartbeat starved (a CPU-bound body under gevent), or the store did not answer "
        "that long. Raise lease_ttl above the longest pause and watch the heartbeat lag."
    ),
    "taken": (
        "Another holder has the key although this lease had time left by its own clock: "
        "the store expired it early (its clock jumped) or forgot it and granted the key "
        "again. That holder's fencing token is higher, so storage that checks tokens refuses "
        "this one's writes; keep the store's clock steady and its data persistent."
    ),
    "replaced": (
        "A newer call of the key replaced this run (exclusive_on_duplicate='replace'): "
        "it was meant to stop, and no setting needs changing."
    ),
    "released": (
        "An operator freed the key (celery exclusive release): this run was meant to stop, "
        "and no setting needs changing."
    ),
    "reset": (
        "The store no longer knows it although it had time left: the store lost what it had "
        "acknowledged (a restart without persistence, an eviction, a failover to a replica "
        "that missed the grant). Make it keep its data: for Redis, appendonly yes and "
        "maxmemory-policy noeviction, and min_replicas=1 behind Sentinel."
    ),
    "unknown": "The store no longer has it; why could not be read back from the store.",
}


class DuplicateSkipped(ExclusiveError):
    """The result of a duplicate call under the ``skip`` policy.

    Stored as the duplicate's result, so ``AsyncResult.get()`` raises it promptly
    instead of waiting on a result that never comes. ``key`` is the lease key and
    ``holder_task_id`` the id of the task that held it.
    """

    fields: tuple[str, ...] = ("key", "holder_task_id")

    def __init__(
        self, message: str, key: Optional[str] = None, holder_task_id: Optional[str] = None
    ):
        super().__init__(message, key, holder_task_id)
        self.key = key
        self.holder_task_id = holder_task_id


class DuplicateCoalesced(DuplicateSkipped):
    """The result of a duplicate under the ``rerun`` policy that joined the pending rerun,
    or of a debounced call that a later call of its burst covers.

    It did not run and is not lost: the pending rerun, task ``holder_task_id``, runs
    once after the current holder, with the latest duplicate's arguments; or, debounced,
    the call ``holder_task_id`` took the burst and runs it, with its latest arguments.
    """


class DuplicateReplaced(DuplicateSkipped):
    """The result of a run stopped because a newer call of its key replaced it
    (``exclusive_on_duplicate="replace"``): the call ``holder_task_id`` runs instead.
    """


class LockHeld(DuplicateSkipped):
    """An exclusive lock (:func:`celery_exclusive.exclusive_lock`, a task's
    ``exclusive_lock()``) found its key held, and did not wait or waited in vain.

    ``holder`` says who holds the key, in words: a task, another lock, or a client
    of the store's own lock recipe; ``holder_task_id`` is the holder's task id when
    it is a task.
    """

    fields = ("key", "holder_task_id", "holder")

    def __init__(
        self,
        message: str,
        key: Optional[str] = None,
        holder_task_id: Optional[str] = None,
        holder: Optional[str] = None,
    ):
        ExclusiveError.__init__(self, message, key, holder_task_id, holder)
        self.key = key
        self.holder_task_id = holder_task_id
        self.holder = holder
