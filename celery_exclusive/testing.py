"""Fixtures for testing your own exclusive tasks with pytest.

Installed with the package and loaded by pytest on its own (entry point ``pytest11``;
``-p no:celery_exclusive`` turns it off). Nothing here runs unless a test asks for it.

``exclusive_store``
    Every exclusive task (and RQ job) of the test process takes its leases in a fresh
    in-process store, ``memory://<unique>``, whatever its ``exclusive_backend_url`` or
    broker says: a test never reaches for Redis or Consul, and starts with no key held
    and no marks left by another test. Settings are resolved again at the start and the
    end of the test, so a setting a test changes is seen and does not leak.

``exclusive_store.hold(task, *args, **kwargs)``
    Holds the key that ``task(*args, **kwargs)`` would take, as another worker running
    that call would, so a test can assert what a duplicate gets::

        def test_a_second_settlement_is_skipped(exclusive_store):
            with exclusive_store.hold(settle, 7):
                with pytest.raises(DuplicateSkipped):
                    settle.delay(7).get()

Works in eager mode (``task_always_eager``), with direct calls, and with
``celery.contrib.pytest``'s ``celery_app`` and in-process ``celery_worker``, which run
in the test's process and so see its in-process store. A worker in another process
does not: point such workers at a real store instead.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any, Optional

import pytest

from .backends import Backend, LeaseInfo, backend_for_url
from .celery.task import ExclusiveTask
from .core import config
from .core.lease import HeldLease, acquire
from .errors import ExclusiveError

__all__ = ["ExclusiveStore", "exclusive_store"]


class ExclusiveStore:
    """A private in-process lease store that every exclusive task uses while it is
    active (see the module docstring)."""

    def __init__(self, url: Optional[str] = None) -> None:
        self.url = url or f"memory://test-{uuid.uuid4().hex}"
        self._held: list[HeldLease] = []

    @property
    def backend(self) -> Backend:
        return backend_for_url(self.url)

    @contextlib.contextmanager
    def active(self) -> Iterator[ExclusiveStore]:
        """Force this store on every task and job of the process until the block ends."""
        try:
            with config.force(backend_url=self.url):
                yield self
        finally:
            self.release_all()

    def key_of(self, task: Any, *args: Any, **kwargs: Any) -> str:
        """The full key ``task(*args, **kwargs)`` takes (prefix included)."""
        return _task_of(task).exclusive_key_for(args, kwargs)

    @contextlib.contextmanager
    def hold(
        self, task: Any, *args: Any, task_id: str = "held-in-test", **kwargs: Any
    ) -> Iterator[HeldLease]:
        """Hold the key of ``task(*args, **kwargs)`` as a worker running it as task
        ``task_id`` would, until the block ends. With ``exclusive_limit=N``, hold it N
        times to leave no slot free."""
        task = _task_of(task)
        settings = task.exclusive_settings
        key = task.exclusive_key_for(args, kwargs)
        lease = self._take(key, settings.lease_ttl, settings.limit, task.name, task_id)
        try:
            yield lease
        finally:
            self._release(lease)

    @contextlib.contextmanager
    def hold_key(
        self,
        key: str,
        task_id: str = "held-in-test",
        name: str = "",
        ttl: float = 30.0,
        limit: int = 1,
    ) -> Iterator[HeldLease]:
        """Hold ``key`` (the full key, prefix included) until the block ends."""
        lease = self._take(key, ttl, limit, name, task_id)
        try:
            yield lease
        finally:
            self._release(lease)

    def holders(self, task: Any, *args: Any, **kwargs: Any) -> list[LeaseInfo]:
        """Who holds the key of ``task(*args, **kwargs)`` now."""
        return self.backend.holders_of(self.key_of(task, *args, **kwargs))

    def release_all(self) -> None:
        """Release every lease :meth:`hold` and :meth:`hold_key` took and still hold."""
        while self._held:
            self._release(self._held[-1])

    def _take(self, key: str, ttl: float, limit: int, name: str, task_id: str) -> HeldLease:
        lease = acquire(self.backend, key, ttl, limit, name=name, task_id=task_id)
        if lease is None:
            holders = ", ".join(str(i.task_id) for i in self.backend.holders_of(key))
            raise ExclusiveError(f"cannot hold {key!r} for the test: it is held by {holders}")
        self._held.append(lease)
        return lease

    def _release(self, lease: HeldLease) -> None:
        if lease in self._held:
            self._held.remove(lease)
        lease.release()


def _task_of(task: Any) -> ExclusiveTask:
    """The registered task behind ``task`` (a module-level ``@app.task`` proxy is
    resolved), checked to be exclusive."""
    real = getattr(task, "_get_current_object", lambda: task)()
    if not isinstance(real, ExclusiveTask):
        raise TypeError(f"{task!r} is not an ExclusiveTask: it takes no lease to hold")
    return real


@pytest.fixture
def exclusive_store() -> Iterator[ExclusiveStore]:
    """A fresh in-process lease store, forced on every exclusive task for one test."""
    with ExclusiveStore().active() as store:
        yield store
