"""Errors users see. Each names the task and key where there is one, and says what to do.

Every error keeps all of its constructor arguments in ``args``: Celery's JSON
result backend rebuilds an exception as ``cls(*args)``, so a duplicate's stored
``DuplicateSkipped`` comes back from ``AsyncResult.get()`` with its key and holder.
"""

from __future__ import annotations

from typing import Optional


class ExclusiveError(Exception):
    """Base class of every error raised by celery-exclusive."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigurationError(ExclusiveError):
    """A setting has a value celery-exclusive cannot use.

    Raised when the worker starts (or, outside a worker, at the first call), naming
    the setting and the values it accepts.
    """


class ExclusiveKeyError(ExclusiveError):
    """The lease key of a call cannot be built from its arguments."""

    def __init__(self, message: str, task: Optional[str] = None, argument: Optional[str] = None):
        super().__init__(message, task, argument)
        self.task = task
        self.argument = argument


class BackendUnavailable(ExclusiveError):
    """The lease store did not answer (connection refused, timed out, ...)."""

    def __init__(self, message: str, url: Optional[str] = None):
        super().__init__(message, url)
        self.url = url


class LeaseLost(ExclusiveError):
    """The lease expired or was taken away while its holder was still running."""

    def __init__(self, message: str, key: Optional[str] = None, task: Optional[str] = None):
        super().__init__(message, key, task)
        self.key = key
        self.task = task


class DuplicateSkipped(ExclusiveError):
    """The result of a duplicate call under the ``skip`` policy.

    Stored as the duplicate's result, so ``AsyncResult.get()`` raises it promptly
    instead of waiting on a result that never comes. ``key`` is the lease key and
    ``holder_task_id`` the id of the task that held it.
    """

    def __init__(
        self, message: str, key: Optional[str] = None, holder_task_id: Optional[str] = None
    ):
        super().__init__(message, key, holder_task_id)
        self.key = key
        self.holder_task_id = holder_task_id


class DuplicateCoalesced(DuplicateSkipped):
    """The result of a duplicate under the ``rerun`` policy that joined the pending rerun.

    It did not run and is not lost: the pending rerun, task ``holder_task_id``, runs
    once after the current holder, with the latest duplicate's arguments.
    """
