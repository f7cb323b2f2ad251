"""A lost lease says why it was lost, and its LeaseLost gives the advice that fits: it
expired, another holder took it, an operator released it, or the store forgot it."""

from __future__ import annotations

import threading
import time

import pytest
from click.testing import CliRunner

from celery_exclusive import LeaseLost, lease_lost
from celery_exclusive.backends import backend_for_url
from celery_exclusive.cli.commands import exclusive
from celery_exclusive.core.lease import acquire, heartbeat
from celery_exclusive.errors import LOSS_ADVICE

KEY = "exclusive:invoice:7"


@pytest.fixture(params=["redis", "sqlite"])
def store(request):
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def causes():
    """The ``cause`` of every ``lease_lost`` signal sent during the test."""
    seen: list[str] = []

    def receiver(sender, cause, **kwargs):
        seen.append(cause)

    lease_lost.connect(receiver)
    yield seen
    lease_lost.disconnect(receiver)


def lost_with(lease) -> LeaseLost:
    with pytest.raises(LeaseLost) as raised:
        lease.ensure_held()
    return raised.value


def test_a_lease_released_by_an_operator_says_so_and_asks_for_no_tuning(store, causes):
    lease = acquire(backend_for_url(store), KEY, 30, name="billing.settle", task_id="t-1")
    result = CliRunner().invoke(exclusive, ["--backend", store, "release", KEY, "--yes"])
    assert result.exit_code == 0, result.output
    heartbeat().beat()
    error = lost_with(lease)
    assert error.cause == "released" and causes == ["released"]
    assert "An operator freed the key (celery exclusive release)" in str(error)
    assert "lease_ttl" not in str(error)


def test_a_lease_whose_renewals_stopped_expires_and_advises_a_longer_ttl(store, causes):
    lease = acquire(backend_for_url(store), KEY, 0.5, name="billing.settle", task_id="t-1")
    heartbeat().discard(lease)  # a heartbeat that cannot run (a paused process)
    time.sleep(0.6)
    error = lost_with(lease)
    assert error.cause == "expired" and causes == ["expired"]
    assert "Raise lease_ttl above the longest pause" in str(error)


def test_a_lease_another_holder_took_says_so(store, causes):
    backend = backend_for_url(store)
    lease = acquire(backend, KEY, 30, name="billing.settle", task_id="t-1")
    backend.force_release(KEY)  # gone without an operator's word, as a store that forgot it
    other = acquire(backend, KEY, 30, name="billing.settle", task_id="t-2")
    try:
        heartbeat().beat()
        error = lost_with(lease)
    finally:
        other.release()
    assert error.cause == "taken" and causes == ["taken"]
    assert "Another holder has the key" in str(error)


def test_a_lease_the_store_forgot_says_the_store_lost_its_data(redis_server, redis_url, causes):
    lease = acquire(backend_for_url(redis_url), KEY, 30, name="billing.settle", task_id="t-1")
    db = int(redis_url.rsplit("/", 1)[1])
    redis_server.client(db).flushdb()  # what a restart without persistence leaves
    heartbeat().beat()
    error = lost_with(lease)
    assert error.cause == "reset" and causes == ["reset"]
    assert "appendonly yes" in str(error)


def test_a_loss_found_at_release_is_diagnosed_too(store, causes):
    lease = acquire(backend_for_url(store), KEY, 30, name="billing.settle", task_id="t-1")
    CliRunner().invoke(exclusive, ["--backend", store, "release", KEY, "--yes"])
    lease.release()
    assert lease.lost_cause == "released" and causes == ["released"]


def test_every_cause_has_its_advice():
    assert set(LOSS_ADVICE) == {"expired", "taken", "released", "replaced", "reset", "unknown"}


def test_a_loss_another_thread_is_announcing_is_signalled_before_the_holder_raises(store):
    """The heartbeat's thread and the holder's own may find one loss at once: the holder
    raises LeaseLost only after ``lease_lost`` was sent, whichever thread sends it."""
    lease = acquire(backend_for_url(store), KEY, 30, name="billing.settle", task_id="t-1")
    heartbeat().discard(lease)
    signalled = []
    entered = threading.Event()

    def slow_receiver(sender, cause, **kwargs):
        entered.set()
        time.sleep(0.5)  # a receiver that takes its time (a log shipper, a metric push)
        signalled.append(cause)

    lease_lost.connect(slow_receiver)
    try:
        other = threading.Thread(target=lease.mark_lost, args=("found by the heartbeat",))
        other.start()
        assert entered.wait(5)
        with pytest.raises(LeaseLost):
            lease.ensure_held()
        assert signalled, "LeaseLost was raised before lease_lost was sent"
        other.join()
    finally:
        lease_lost.disconnect(slow_receiver)
        lease.release()
