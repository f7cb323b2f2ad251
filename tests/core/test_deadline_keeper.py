"""The deadline keeper: each held lease is lost at its deadline (the send time of its last
confirmed renewal + ttl − a safety margin), told by a thread of its own, whatever the
renewing thread is doing."""

from __future__ import annotations

import time

import pytest

from celery_exclusive import lease_lost
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.deadline import keeper, safety_margin
from celery_exclusive.core.lease import acquire, heartbeat


@pytest.fixture
def store(memory_url):
    yield backend_for_url(memory_url)
    for lease in heartbeat().held():
        lease.release()


@pytest.fixture
def losses():
    """(monotonic time, key, cause) of every ``lease_lost`` sent during the test."""
    seen: list[tuple[float, str, str]] = []

    def receiver(sender, key, cause, **kwargs):
        seen.append((time.monotonic(), key, cause))

    lease_lost.connect(receiver)
    yield seen
    lease_lost.disconnect(receiver)


def test_the_safety_margin_is_two_percent_of_the_ttl_and_at_least_150_ms():
    assert safety_margin(30) == pytest.approx(0.6)
    assert safety_margin(1) == pytest.approx(0.15)
    assert safety_margin(0.2) == pytest.approx(0.1)  # never more than half the ttl


def test_a_lease_nobody_renews_is_told_lost_at_its_deadline_without_anyone_asking(store, losses):
    sent_at = time.monotonic()
    lease = acquire(store, "k", ttl=1.0, name="t")
    heartbeat().discard(lease)  # a renewal that never comes back
    time.sleep(1.3)
    [(told_at, key, cause)] = losses
    assert key == "k" and cause == "expired"
    # The deadline, before the ttl ran out.
    assert sent_at + 1.0 - safety_margin(1.0) <= told_at < sent_at + 1.0


def test_lost_is_a_plain_read_that_flags_and_sends_nothing(store, losses):
    lease = acquire(store, "k", ttl=0.5, name="t")
    heartbeat().discard(lease)
    keeper().forget(lease)
    time.sleep(0.5)
    assert lease.lost
    assert lease.lost_reason is None and losses == []


def test_a_lease_taken_just_after_the_last_was_released_does_not_wake_the_keeper(store):
    """Short tasks leave a process without a lease between two of them; the keeper, even
    woken by an old deadline, naps on as if it held one, and the next lease's deadline
    falls after the nap (no thread switch per task)."""
    acquire(store, "a", ttl=30, name="t").release()
    deadlines = keeper()
    until = time.monotonic() + 5
    while time.monotonic() < until and (deadlines._sleeping_until or 0) < time.monotonic() + 5:
        time.sleep(0.01)  # until the thread naps
    notified = []
    original = deadlines._changed.notify
    deadlines._changed.notify = lambda *args: notified.append(args) or original(*args)
    try:
        acquire(store, "b", ttl=30, name="t")
    finally:
        del deadlines._changed.notify
    assert notified == []


def test_a_lease_confirmed_just_as_its_deadline_came_is_kept_to_its_new_deadline(store, losses):
    """Renewals answer in threads of their own: one may land between the keeper finding
    the deadline due and flagging the loss. The lease is then not lost, and the keeper
    keeps it to its new deadline."""
    sent_at = time.monotonic()
    lease = acquire(store, "k", ttl=1.0, name="t")
    heartbeat().discard(lease)  # no renewal but the one below
    flag = lease.expire

    def confirmed_first() -> None:
        lease.renewed_at = time.monotonic()  # the answer to a renewal sent just now
        del lease.expire
        flag()

    lease.expire = confirmed_first  # type: ignore[method-assign]
    time.sleep(1.4)  # past the first deadline (1 s less the margin)
    assert losses == [] and not lease.lost
    time.sleep(1.2)  # past the new one (twice that)
    [(told_at, key, cause)] = losses
    assert key == "k" and cause == "expired"
    assert sent_at + 2 * (1.0 - safety_margin(1.0)) <= told_at < sent_at + 2.4
