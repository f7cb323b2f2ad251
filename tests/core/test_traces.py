"""Traces and OpenTelemetry metrics in this process, read with the SDK's in-memory
exporter and reader: a lock's spans, keys kept private, late renewals, and a tracer
that fails never failing a call."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
from opentelemetry import trace

from celery_exclusive import ConfigurationError, ExclusiveLock, LockHeld, backend_for_url, telemetry
from celery_exclusive.backends import versions
from celery_exclusive.core import config
from celery_exclusive.core.heartbeat import _Renewal, heartbeat
from tests.support import otel


@pytest.fixture(autouse=True)
def spans():
    exporter = otel.install()
    yield exporter
    exporter.clear()


def named(finished, name):
    found = [span for span in finished if span.name == name]
    assert len(found) == 1, [span.name for span in finished]
    return found[0]


def events(span) -> list[str]:
    return [event.name for event in span.events if event.name.startswith("exclusive.")]


def test_a_lock_entered_under_a_span_is_an_acquire_span_beneath_it_and_its_release_an_event(
    sqlite_url, spans
):
    lock = ExclusiveLock("exclusive:invoice:7", sqlite_url, ttl=5, name="settle")
    # The process's first lease on a store reads its layout version first: done here.
    versions.ensure(backend_for_url(sqlite_url), "")
    with trace.get_tracer("app").start_as_current_span("request"), lock as lease:
        pass
    finished = spans.get_finished_spans()
    request, acquire = named(finished, "request"), named(finished, "exclusive.acquire")
    assert acquire.parent.span_id == request.context.span_id
    assert acquire.attributes["exclusive.outcome"] == "granted"
    assert acquire.attributes["exclusive.fencing_token"] == lease.fencing_token
    assert acquire.attributes["exclusive.task"] == "settle"
    assert events(request) == ["exclusive.lease.released"]
    round_trips = [
        s.name for s in finished if s.parent and s.parent.span_id == acquire.context.span_id
    ]
    assert round_trips == ["exclusive.store try_acquire"]


def test_a_lock_entered_where_no_span_is_current_gets_one_of_its_own(sqlite_url, spans):
    with ExclusiveLock("exclusive:invoice:8", sqlite_url, ttl=5, name="settle"):
        pass
    finished = spans.get_finished_spans()
    own, acquire = named(finished, "exclusive.lock"), named(finished, "exclusive.acquire")
    assert own.parent is None and acquire.parent.span_id == own.context.span_id
    assert events(own) == ["exclusive.lease.released"]


def test_a_lock_that_waited_and_stayed_held_records_its_wait_and_the_error(sqlite_url, spans):
    holder = ExclusiveLock("exclusive:busy", sqlite_url, ttl=5).acquire()
    with pytest.raises(LockHeld), ExclusiveLock("exclusive:busy", sqlite_url, ttl=5).waiting(0.3):
        pass
    holder.release()
    finished = spans.get_finished_spans()
    refused = [s for s in finished if s.attributes.get("exclusive.outcome") == "held"]
    assert len(refused) == 1
    acquire = refused[0]
    wait = next(s for s in finished if s.name == "exclusive.wait")
    assert wait.parent.span_id == acquire.context.span_id
    assert wait.attributes["exclusive.granted"] is False
    assert acquire.attributes["exclusive.time_in_line"] >= 0.3
    assert acquire.status.status_code == trace.StatusCode.ERROR
    assert [e.attributes["exception.type"] for e in acquire.events] == [
        "celery_exclusive.errors.LockHeld"
    ]


@pytest.mark.parametrize(
    ("mode", "shown"),
    [
        ("hash", telemetry.shown_key("exclusive:user:42", "exclusive:", "hash")),
        ("prefix", "exclusive:user:"),
        ("key", "exclusive:user:42"),
    ],
)
def test_a_span_shows_of_a_key_what_trace_keys_allows(sqlite_url, spans, mode, shown):
    lock = ExclusiveLock(
        "exclusive:user:42", sqlite_url, ttl=5, trace_keys=mode, key_prefix="exclusive:"
    )
    with lock:
        pass
    acquire = named(spans.get_finished_spans(), "exclusive.acquire")
    assert acquire.attributes["exclusive.key"] == shown
    texts = [v for s in spans.get_finished_spans() for v in s.attributes.values() if str(v) == v]
    assert mode == "key" or not any("42" in text for text in texts)


def test_keys_are_hashed_by_default():
    assert config.Settings(backend_url="memory://").trace_keys == "hash"
    assert telemetry.shown_key("exclusive:user:42", "exclusive:", "hash").startswith("sha256:")
    assert telemetry.shown_key("exclusive:user:42", "exclusive:", "hash") != (
        telemetry.shown_key("exclusive:user:43", "exclusive:", "hash")
    )


def test_an_unknown_trace_keys_is_refused_naming_the_choices():
    with pytest.raises(ConfigurationError, match="exclusive_trace_keys='name'.*'hash'"):
        config.resolve("tasks.settle", {"trace_keys": "name"}.get, lambda name: None)


def test_a_store_url_in_a_span_has_no_password_user_or_path():
    label = telemetry.store_label("redis://alice:s3cret@cache.internal:6379/2?x=1")
    assert label == "redis://cache.internal:6379"
    assert telemetry.store_label("sqlite:////home/alice/leases.db") == "sqlite"


def test_a_late_renewal_is_an_event_on_the_span_of_its_call(sqlite_url, spans):
    lock = ExclusiveLock("exclusive:late", sqlite_url, ttl=3)
    with trace.get_tracer("app").start_as_current_span("request"), lock as lease:
        since = lease.renewed_at
        # The store confirms a renewal sent two thirds of a ttl after the last one.
        confirm_renewal(lease, sent_at=since + 2.0)
        confirm_renewal(lease, sent_at=since + 2.5)  # on time: no event
    request = named(spans.get_finished_spans(), "request")
    assert events(request) == ["exclusive.renewal.late", "exclusive.lease.released"]
    late = request.events[0].attributes
    assert late["exclusive.renewal.since_last"] == pytest.approx(2.0)


def confirm_renewal(lease, sent_at: float) -> None:
    """The store answers a renewal of ``lease`` sent at ``sent_at`` (monotonic)."""
    renewal = _Renewal(heartbeat(), lease.backend, [lease])
    renewal.started = sent_at
    heartbeat()._confirmed(renewal, set())


def test_a_tracer_that_raises_fails_no_lock(sqlite_url, monkeypatch, caplog):
    class Broken:
        def start_span(self, *args, **kwargs):
            raise RuntimeError("exporter down")

    otel = telemetry.api()
    monkeypatch.setattr(otel, "tracer", Broken())
    with ExclusiveLock("exclusive:broken", sqlite_url, ttl=5) as lease:
        assert lease.held
    assert lease.released
    assert "OpenTelemetry tracing failed" in caplog.text or telemetry._warned


def test_a_failing_exporter_fails_no_lock(sqlite_url, monkeypatch):
    monkeypatch.setattr(otel.EXPORTER, "failing", True)
    lock = ExclusiveLock("exclusive:failing", sqlite_url, ttl=5)
    with trace.get_tracer("app").start_as_current_span("request"), lock as lease:
        assert lease.held
    assert lease.released


def test_the_metrics_have_the_names_and_labels_of_the_prometheus_ones(sqlite_url):
    lock = ExclusiveLock("exclusive:metered", sqlite_url, ttl=5, name="billing.settle")
    holder = lock.acquire()
    threading.Timer(0.2, holder.release).start()
    with lock.waiting(5):
        pass
    data = otel.READER.get_metrics_data()
    points = {
        metric.name: [dict(point.attributes) for point in metric.data.data_points]
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        if scope.scope.name == "celery_exclusive"
        for metric in scope.metrics
    }
    assert {"task": "billing.settle"} in points["exclusive_lease_acquisitions"]
    assert {"task": "billing.settle"} in points["exclusive_lease_hold_seconds"]
    assert {"task": "billing.settle"} in points["exclusive_wait_seconds"]


def test_the_package_imports_and_runs_without_the_api(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["opentelemetry"] = None  # as if not installed
        from celery_exclusive import ExclusiveLock, telemetry
        with ExclusiveLock("exclusive:plain", "sqlite:///{tmp_path}/leases.db") as lease:
            assert lease.trace is telemetry.NO_TRACE
        assert telemetry.api() is None
        print("ran")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.strip() == "ran", done.stderr


def test_a_meter_provider_set_before_the_first_lock_is_fed(tmp_path):
    # The common order: the SDK is set up at start, before any lock is taken.
    script = textwrap.dedent(
        f"""
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        from celery_exclusive import ExclusiveLock
        with ExclusiveLock("exclusive:first", "sqlite:///{tmp_path}/leases.db", name="t"):
            pass
        data = reader.get_metrics_data()
        print(sorted(
            metric.name
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        ))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "exclusive_lease_acquisitions" in done.stdout, done.stderr
