"""Waiters are served first come, first served, on every store.

Threads of one process stand in for workers here, so that each waiter is known to
be in line before the next one arrives; the real-worker version of these checks is
in test_coordination.py.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from celery_exclusive.backends import _load
from celery_exclusive.backends.memory import MemoryBackend
from celery_exclusive.core import marks, outcomes, policies
from celery_exclusive.core.config import Settings
from celery_exclusive.core.lease import acquire
from tests.support.cluster import wait_until

KEY = "exclusive:line"


@pytest.fixture
def settings(backend_case) -> Settings:
    return Settings(backend_url=backend_case.url, lease_ttl=3.0, wait_timeout=20.0)


class Waiters:
    """Callers of ``policies.wait_for``, each started once the previous one is in line."""

    def __init__(self, settings: Settings, backend) -> None:
        self.settings, self.backend = settings, backend
        self.served: list[str] = []
        self.threads: list[threading.Thread] = []

    def arrive(self, name: str, priority: bool = False) -> None:
        thread = threading.Thread(target=self._wait, args=(name, priority))
        thread.start()
        self.threads.append(thread)
        assert wait_until(lambda: name in marks.line_of(self.backend, KEY), timeout=10)

    def _wait(self, name: str, priority: bool) -> None:
        lease = policies.wait_for(self.settings, self.backend, KEY, "test", name, priority)
        assert lease is not None, f"{name} timed out in line"
        self.served.append(name)
        time.sleep(0.05)
        lease.release()

    def join(self) -> list[str]:
        for thread in self.threads:
            thread.join(timeout=30)
        return self.served


def test_waiters_get_the_key_in_the_order_they_started_waiting(settings, backend):
    holder = acquire(backend, KEY, settings.lease_ttl)
    waiters = Waiters(settings, backend)
    names = [f"waiter-{i}" for i in range(5)]
    for name in names:
        waiters.arrive(name)
    holder.release()
    assert waiters.join() == names


def test_a_caller_asking_at_the_instant_of_release_does_not_jump_the_line(
    settings, backend, backend_case
):
    other_worker = _load(backend_case.url)  # a store client of its own, like another process
    holder = acquire(backend, KEY, settings.lease_ttl)
    waiters = Waiters(settings, backend)
    names = [f"waiter-{i}" for i in range(3)]
    for name in names:
        waiters.arrive(name)
    jumped, stop = [], threading.Event()

    def ask_without_waiting() -> None:
        while not stop.is_set():
            grant = other_worker.try_acquire(KEY, uuid.uuid4().hex, settings.lease_ttl)
            if grant is not None:
                jumped.append(list(waiters.served))
                other_worker.release(grant)

    asker = threading.Thread(target=ask_without_waiting)
    asker.start()
    holder.release()
    served = waiters.join()
    stop.set()
    asker.join()
    other_worker.close()
    assert served == names
    assert all(seen == names for seen in jumped), "a caller outside the line got in first"


def test_a_priority_caller_is_served_before_earlier_ordinary_waiters(settings, backend):
    if getattr(backend, "first_come_only", False):
        pytest.skip(f"{type(backend).__name__} serves waiters in the order they came")
    holder = acquire(backend, KEY, settings.lease_ttl)
    waiters = Waiters(settings, backend)
    waiters.arrive("ordinary-1")
    waiters.arrive("ordinary-2")
    waiters.arrive("nightly", priority=True)
    holder.release()
    assert waiters.join() == ["nightly", "ordinary-1", "ordinary-2"]


def test_the_line_moves_on_past_a_waiter_that_died(settings, backend):
    holder = acquire(backend, KEY, settings.lease_ttl)
    marks.take_place(backend, KEY, "dead", grace=1.0)  # never renewed again
    waiters = Waiters(settings, backend)
    waiters.arrive("alive")
    holder.release()
    assert waiters.join() == ["alive"]


def test_a_waiter_that_gives_up_leaves_the_line(backend_case, backend):
    settings = Settings(backend_url=backend_case.url, lease_ttl=3.0, wait_timeout=0.5)
    holder = acquire(backend, KEY, settings.lease_ttl)
    try:
        assert policies.wait_for(settings, backend, KEY, "test", "impatient") is None
        assert marks.line_of(backend, KEY) == []
    finally:
        holder.release()


class LockDelayedStore(MemoryBackend):
    """A stand-in, labelled as such: a store whose wait() says the key is free while
    every grant is refused, as Consul answers during a lock delay. The Consul emulator
    answers too slowly (tens of ms a request) to show a waiter spinning on it."""

    grants_asked = 0

    def try_acquire(self, *args, **kwargs):
        self.grants_asked += 1
        return None


def test_a_waiter_let_through_by_wait_but_refused_the_grant_backs_off():
    store = LockDelayedStore(f"memory://{uuid.uuid4().hex}")
    settings = Settings(backend_url=store.url, lease_ttl=30.0, wait_timeout=1.0)
    assert policies.wait_for(settings, store, KEY, "test", "t-1") is None
    # Backing off from 10 ms, doubling: a handful of attempts in the second, not a spin.
    assert store.grants_asked < 50


def test_a_requeued_priority_caller_keeps_its_turn_while_its_message_is_away(backend_case, backend):
    settings = Settings(
        backend_url=backend_case.url,
        lease_ttl=3.0,
        wait_timeout=0.3,
        priority=True,
        requeue_delay=0.05,
        requeue_max_delay=0.1,
    )
    holder = acquire(backend, KEY, settings.lease_ttl)
    outcome = policies.claim(settings, backend, KEY, "test", "nightly-1")
    assert isinstance(outcome, outcomes.Requeue)
    holder.release()
    assert backend.try_acquire(KEY, uuid.uuid4().hex, settings.lease_ttl) is None
    back = policies.claim(settings, backend, KEY, "test", "nightly-1")
    assert isinstance(back, policies.Granted)
    back.lease.release()


def test_the_pending_rerun_waits_in_the_line(backend_case, backend):
    settings = Settings(backend_url=backend_case.url, lease_ttl=3.0, on_duplicate="rerun")
    holder = acquire(backend, KEY, settings.lease_ttl)
    claimed = []
    pending = threading.Thread(
        target=lambda: claimed.append(policies.claim(settings, backend, KEY, "test", "rerun-1"))
    )
    pending.start()
    assert wait_until(lambda: marks.line_of(backend, KEY) == ["rerun-1"], timeout=10)
    holder.release()
    pending.join(timeout=30)
    assert isinstance(claimed[0], policies.Granted)
    claimed[0].lease.release()
