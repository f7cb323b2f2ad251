"""What every benchmark shares: its own Redis servers, real workers, and statistics."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import redis

from tests.support.servers import EtcdServer, PostgresServer, RedisServer
from tests.support.workers import Worker


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    """A fresh ``redis-server`` of the benchmark's own, removed afterwards."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@contextlib.contextmanager
def other_stores() -> Iterator[dict[str, str]]:
    """The other lease stores, each on a server of the benchmark's own: store -> URL.

    PostgreSQL and etcd are Debian's servers; MongoDB only when MONGODB_URL names a
    real server (its CI stand-in runs inside the test process: its speed says nothing
    about MongoDB's).
    """
    postgres, etcd = PostgresServer(), EtcdServer()
    try:
        postgres.start()
        etcd.start()
        urls = {"postgresql": postgres.url, "etcd": etcd.url}
        if os.environ.get("MONGODB_URL"):
            urls["mongodb"] = os.environ["MONGODB_URL"].rstrip("/") + "/bench"
        yield urls
    finally:
        postgres.cleanup()
        etcd.cleanup()


def bench_env(broker: str, store: str, ledger: str, ttl: float = 30.0, **extra) -> dict:
    env = {"BENCH_BROKER": broker, "BENCH_STORE": store, "BENCH_LEDGER": ledger}
    env["BENCH_TTL"] = str(ttl)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def worker(env: dict, name: str, pool: str = "solo", concurrency: int = 1, queues: str = "b"):
    """A real ``celery worker`` of benchmarks.app (not started yet)."""
    return Worker(
        "benchmarks.app", env, pool=pool, concurrency=concurrency, name=name, extra=("-Q", queues)
    )


@contextlib.contextmanager
def running(*workers: Worker) -> Iterator[tuple[Worker, ...]]:
    """Start workers, and SIGKILL whatever is left of them afterwards."""
    try:
        for w in workers:
            w.start()
        yield workers
    finally:
        for w in workers:
            w.stop(signal.SIGKILL, timeout=5)
            with contextlib.suppress(OSError):
                w.log.unlink()


def configure_client(app, env: dict) -> None:
    """Point this process's copy of the bench app at the benchmark's servers."""
    app.conf.update(
        broker_url=env["BENCH_BROKER"],
        result_backend=env["BENCH_BROKER"],
        exclusive_backend_url=env["BENCH_STORE"],
        singleton_backend_url=env["BENCH_STORE"],
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": env["BENCH_STORE"]}},
        exclusive_lease_ttl=float(env["BENCH_TTL"]),
    )
    for task in app.tasks.values():
        if hasattr(task, "_exclusive_settings"):
            task._exclusive_settings = None
        for attr in ("_singleton_config", "_singleton_backend"):
            if attr in vars(task) or hasattr(type(task), attr):
                setattr(task, attr, None)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


median = statistics.median


def wait_until(predicate, timeout: float, step: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def machine() -> dict:
    """Where and when the figures were taken."""
    import celery

    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    server = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.split()
    version = next((p.split("=")[1] for p in server if p.startswith("v=")), "?")
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "celery": celery.__version__,
        "redis-py": redis.__version__,
        "redis-server": version,
    }


def main_json(run) -> None:
    """Call ``run(**kwargs)`` with kwargs given as JSON in argv[1]; print its result as JSON.

    Each benchmark runs in a process of its own: a Celery client keeps its broker and
    result connections for life, and every benchmark has servers of its own.
    """
    import json
    import sys

    kwargs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    print(json.dumps(run(**kwargs)))
