"""Prometheus metrics follow what the lease layer does."""

from __future__ import annotations

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from celery_exclusive import DuplicateSkipped, ExclusiveTask
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.lease import acquire, heartbeat
from celery_exclusive.metrics import install


@pytest.fixture(scope="module")
def registry():
    registry = CollectorRegistry()
    install(registry)
    return registry


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_acquisitions_duplicates_and_hold_time_are_counted(registry, memory_url):
    app = Celery("metrics", set_as_current=False)
    app.conf.update(task_always_eager=True, exclusive_backend_url=memory_url)

    @app.task(base=ExclusiveTask, exclusive_key="k", name="metered")
    def inner():
        pass

    @app.task(base=ExclusiveTask, exclusive_key="k", name="metered_outer")
    def outer():
        with pytest.raises(DuplicateSkipped):
            inner.delay().get(disable_sync_subtasks=False)

    outer.delay()
    assert value(registry, "exclusive_lease_acquisitions_total", task="metered_outer") == 1
    assert value(registry, "exclusive_duplicates_total", task="metered", policy="skip") == 1
    assert value(registry, "exclusive_lease_hold_seconds_count", task="metered_outer") == 1


def test_lost_leases_are_counted(registry, memory_url):
    backend = backend_for_url(memory_url)
    acquire(backend, "k", 30, name="metered_lost")
    backend.force_release("k")
    heartbeat().beat()
    assert value(registry, "exclusive_leases_lost_total", task="metered_lost") == 1


def test_heartbeat_lag_is_exported(registry):
    assert registry.get_sample_value("exclusive_heartbeat_lag_seconds") is not None
