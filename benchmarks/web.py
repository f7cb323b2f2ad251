"""The web view with 10,000 held leases: store reads and time per refresh, per store.

One refresh of a page is what the web view reads every ``refresh`` seconds for all
its viewers of that page: the page of held keys with their lines, pending reruns
and enqueue marks (``Backend.holders_page``), the beat leaders (a page under
``<prefix>beat:``) and the feed (``read_events``). Reads are counted where each store
makes its round trips (one statement on SQLite, one ``_call`` elsewhere: a script, a
query, a request, a pipeline), and compared with the protocol's default page, which
lists every holder and reads each key's marks on its own.

    python -m benchmarks web                 # 10,000 leases, every store here
    python -m benchmarks.web '{"leases": 1000}'

PostgreSQL and etcd are Debian's servers; MongoDB only when MONGODB_URL names a real
server. Leases are taken straight from the store in threads (no workers needed), with
the holder records the library writes.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from benchmarks.common import other_stores, redis_server
from celery_exclusive.backends import Backend, backend_for_url
from celery_exclusive.web import views

PREFIX = "exclusive:"


class Counted:
    """Counts the round trips a store makes while the block runs."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.count = 0

    def __enter__(self) -> Counted:
        backend = self.backend
        if hasattr(backend, "path") and hasattr(backend, "_connection"):  # SQLite
            backend._connection().set_trace_callback(self._statement)
        elif hasattr(backend, "_call"):
            original = backend._call

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.count += 1
                return original(*args, **kwargs)

            backend._call = counted
        return self

    def _statement(self, sql: str) -> None:
        if sql.lstrip().upper().startswith(("SELECT", "WITH")):
            self.count += 1

    def __exit__(self, *exc: Any) -> None:
        backend = self.backend
        if hasattr(backend, "path") and hasattr(backend, "_connection"):
            backend._connection().set_trace_callback(None)
        else:
            backend.__dict__.pop("_call", None)


def hold(backend: Backend, leases: int) -> None:
    """``leases`` held keys, one in ten a semaphore with two holders and a line."""

    def take(i: int) -> None:
        key = f"{PREFIX}bench:{i:06d}"
        record = {"task": "bench.work", "task_id": str(i), "hostname": "h", "pid": 1}
        record.update(acquired_at=time.time(), ttl=600.0)
        limit = 3 if i % 10 == 0 else 1
        for _ in range(2 if limit > 1 else 1):
            backend.try_acquire(key, uuid.uuid4().hex, 600, limit, record)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(take, range(leases)))


def refresh(backend: Backend, default: bool = False) -> Callable[[], None]:
    def once() -> None:
        if default:
            Backend.holders_page(backend, PREFIX, None, 100, views.KINDS)
        else:
            views.page(backend, PREFIX, None, 100)
        views.beat(backend, PREFIX, ())
        views.events(backend, PREFIX)

    return once


def measure(backend: Backend, once: Callable[[], None], rounds: int) -> dict:
    once()  # warm: connections, scripts, the store clock
    times, reads = [], []
    for _ in range(rounds):
        with Counted(backend) as counted:
            started = time.perf_counter()
            once()
            times.append((time.perf_counter() - started) * 1000)
        reads.append(counted.count)
    return {"reads": max(reads), "ms": round(statistics.median(times), 1)}


def run(leases: int = 10_000, rounds: int = 5, stores: tuple = ()) -> dict:
    table: dict[str, dict] = {}
    with redis_server() as server, other_stores() as others:
        urls = {
            "memory": f"memory://{uuid.uuid4().hex}",
            "sqlite": f"sqlite:///{tempfile.mkdtemp()}/bench.db",
            "redis": server.url_for_db(5),
            **others,
        }
        for name, url in urls.items():
            if stores and name not in stores:
                continue
            backend = backend_for_url(url)
            started = time.monotonic()
            hold(backend, leases)
            row = {"hold_s": round(time.monotonic() - started, 1)}
            row["page"] = measure(backend, refresh(backend), rounds)
            default_rounds = 1 if leases > 2000 else rounds
            row["default_page"] = measure(backend, refresh(backend, True), default_rounds)
            table[name] = row
    return {"leases": leases, "page_size": 100, "per_refresh": table, "pid": os.getpid()}


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
