"""Optional Prometheus metrics, fed by celery-exclusive's signals.

Install the ``metrics`` extra, and expose a worker's metrics from its ``worker_init``
signal, whatever its pool::

    from celery.signals import worker_init
    from celery_exclusive import metrics

    @worker_init.connect
    def expose_metrics(sender, **kwargs):
        metrics.serve_worker(sender, port=9808)

A prefork worker (Celery's default pool) runs tasks in child processes, each with
metrics of its own: there :func:`serve_worker` uses Prometheus' multiprocess mode
(every child writes its samples to files in ``PROMETHEUS_MULTIPROC_DIR``, which it
creates if unset, and the worker's main process serves their sum). Solo, threads,
gevent and eventlet run tasks in the worker's own process, which serves them directly.
:func:`install` alone feeds the metrics of one process into a registry, for a process
that serves them itself (an RQ worker, a test).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from . import signals
from .core.lease import heartbeat

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
    wait_seconds: Histogram
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
        wait_seconds=Histogram(
            "exclusive_wait_seconds",
            "How long calls stood in their key's line.",
            ["task"],
            registry=registry,
        ),
        heartbeat_lag=Gauge(
            "exclusive_heartbeat_lag_seconds",
            "How late the last lease renewal started; a starved heartbeat shows here.",
            registry=registry,
            # Across a prefork worker's children: the worst of those alive.
            multiprocess_mode="livemax",
        ),
    )
    multiprocess = _multiprocess_dir() is not None
    if not multiprocess:
        metrics.heartbeat_lag.set_function(lambda: heartbeat().lag)

    def acquired(sender: Any, **kwargs: Any) -> None:
        metrics.acquisitions.labels(task=sender).inc()
        if multiprocess:  # a function gauge is not seen across processes: set it
            metrics.heartbeat_lag.set(heartbeat().lag)

    def duplicate(sender: Any, policy: str, **kwargs: Any) -> None:
        metrics.duplicates.labels(task=sender, policy=policy).inc()

    def lost(sender: Any, **kwargs: Any) -> None:
        metrics.leases_lost.labels(task=sender).inc()

    def released(sender: Any, held_for: float, **kwargs: Any) -> None:
        metrics.hold_seconds.labels(task=sender).observe(held_for)
        if multiprocess:
            metrics.heartbeat_lag.set(heartbeat().lag)

    def waited(sender: Any, waited: float, **kwargs: Any) -> None:
        metrics.wait_seconds.labels(task=sender).observe(waited)

    signals.lease_acquired.connect(acquired, weak=False)
    signals.lease_waited.connect(waited, weak=False)
    signals.duplicate_detected.connect(duplicate, weak=False)
    signals.lease_lost.connect(lost, weak=False)
    signals.lease_released.connect(released, weak=False)
    return metrics


def serve_worker(worker: Any, port: int, addr: str = "0.0.0.0") -> None:
    """Serve the metrics of a Celery worker on ``port``: call it from ``worker_init``
    (``sender`` is the worker), in the worker's main process, before its pool starts.

    On a prefork pool every child feeds its own metrics, written to files in
    ``PROMETHEUS_MULTIPROC_DIR`` (a fresh temporary directory unless it is set; where
    it is set, a folder ``worker-<host>-<pid>`` of the worker's own inside it), and the main
    process serves their sum: a child's counts survive it being replaced. On other
    pools the worker's own process feeds and serves them.
    """
    from celery import concurrency
    from celery.signals import worker_process_init, worker_process_shutdown
    from prometheus_client import multiprocess, start_http_server, values

    if not _forks_children(worker, concurrency):
        install()
        _serve(start_http_server, port, addr, REGISTRY)
        return
    directory = _worker_dir(_multiprocess_dir())
    os.environ[MULTIPROC_DIR] = directory  # where the children, forked later, write
    # Chosen by prometheus_client when it was imported, before the variable was set:
    # the children, forked later, write their samples to files.
    values.ValueClass = values.get_value_class()
    worker_process_init.connect(_install_in_child, weak=False)
    worker_process_shutdown.connect(_child_gone, weak=False)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    _serve(start_http_server, port, addr, registry)


def _serve(start: Any, port: int, addr: str, registry: CollectorRegistry) -> None:
    """Start serving, or stop the worker saying why: an exception raised in a
    ``worker_init`` receiver is dropped before Celery's logging is set up."""
    try:
        start(port, addr, registry=registry)
    except OSError as exc:
        raise SystemExit(
            f"celery-exclusive: cannot serve metrics on {addr}:{port} ({exc}); give "
            "serve_worker() a free port"
        ) from None


#: The environment variable of Prometheus' multiprocess mode.
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


def _multiprocess_dir() -> Optional[str]:
    return os.environ.get(MULTIPROC_DIR) or os.environ.get(MULTIPROC_DIR.lower()) or None


def _worker_dir(base: Optional[str]) -> str:
    """The folder this worker's children write their samples to, empty: a fresh
    temporary one, or one of the worker's own inside ``base`` (the user's
    ``PROMETHEUS_MULTIPROC_DIR``, which several workers of a host may share: none may
    wipe or add up another's samples). Folders of workers no longer running are
    removed."""
    if base is None:
        return tempfile.mkdtemp(prefix="celery-exclusive-metrics-")
    # Named by host too: containers sharing one volume often run their workers as pid 1.
    # Only this host's folders are looked at: another host's pids mean nothing here.
    here = f"worker-{socket.gethostname()}-"
    for folder in glob.glob(os.path.join(glob.escape(base), glob.escape(here) + "*")):
        pid = os.path.basename(folder)[len(here) :]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    directory = os.path.join(base, f"{here}{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(directory, "*.db")):  # a previous run's samples
        os.remove(stale)
    return directory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _forks_children(worker: Any, concurrency: Any) -> bool:
    """Whether the worker's pool runs tasks in forked child processes (prefork)."""
    from celery.concurrency.prefork import TaskPool

    pool = concurrency.get_implementation(getattr(worker, "pool_cls", None) or "prefork")
    return isinstance(pool, type) and issubclass(pool, TaskPool)


def _install_in_child(**kwargs: Any) -> None:
    install()


def _child_gone(**kwargs: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(os.getpid())
