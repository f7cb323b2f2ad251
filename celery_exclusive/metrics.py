"""Optional Prometheus metrics, fed by celery-exclusive's signals.

Install the ``metrics`` extra and call :func:`install` once per worker process, e.g.
from Celery's ``worker_process_init`` signal, then expose the registry as usual
(``prometheus_client.start_http_server``)::

    from celery.signals import worker_process_init
    from celery_exclusive import metrics

    worker_process_init.connect(lambda **kw: metrics.install())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from . import signals
from .lease import heartbeat

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "celery_exclusive.metrics needs prometheus-client: pip install 'celery-exclusive[metrics]'"
    ) from exc


@dataclass
class Metrics:
    acquisitions: Counter
    duplicates: Counter
    leases_lost: Counter
    hold_seconds: Histogram
    heartbeat_lag: Gauge


def install(registry: Optional[CollectorRegistry] = None) -> Metrics:
    """Create the metrics in ``registry`` and keep them up to date from the signals."""
    registry = REGISTRY if registry is None else registry
    metrics = Metrics(
        acquisitions=Counter(
            "exclusive_lease_acquisitions", "Leases granted.", ["task"], registry=registry
        ),
        duplicates=Counter(
            "exclusive_duplicates",
            "Calls that found their key held, by the policy applied.",
            ["task", "policy"],
            registry=registry,
        ),
        leases_lost=Counter(
            "exclusive_leases_lost",
            "Leases found gone while their holder ran.",
            ["task"],
            registry=registry,
        ),
        hold_seconds=Histogram(
            "exclusive_lease_hold_seconds",
            "How long leases were held.",
            ["task"],
            registry=registry,
        ),
        heartbeat_lag=Gauge(
            "exclusive_heartbeat_lag_seconds",
            "How late the last lease renewal started; a starved heartbeat shows here.",
            registry=registry,
        ),
    )
    metrics.heartbeat_lag.set_function(lambda: heartbeat().lag)

    def acquired(sender: Any, **kwargs: Any) -> None:
        metrics.acquisitions.labels(task=sender).inc()

    def duplicate(sender: Any, policy: str, **kwargs: Any) -> None:
        metrics.duplicates.labels(task=sender, policy=policy).inc()

    def lost(sender: Any, **kwargs: Any) -> None:
        metrics.leases_lost.labels(task=sender).inc()

    def released(sender: Any, held_for: float, **kwargs: Any) -> None:
        metrics.hold_seconds.labels(task=sender).observe(held_for)

    signals.lease_acquired.connect(acquired, weak=False)
    signals.duplicate_detected.connect(duplicate, weak=False)
    signals.lease_lost.connect(lost, weak=False)
    signals.lease_released.connect(released, weak=False)
    return metrics
