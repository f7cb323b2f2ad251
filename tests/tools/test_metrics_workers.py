"""The README's metrics recipe on real workers of every pool: after real duplicates and
a real lost lease, a scrape of the worker shows each one, counted once.

On prefork the tasks run in child processes, which the worker's main process serves
through Prometheus' multiprocess mode; elsewhere the worker's own process does."""

from __future__ import annotations

import time
import urllib.request

import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from celery_exclusive.backends import backend_for_url
from tests.conftest import fresh_redis_db
from tests.support.cluster import wait_until
from tests.support.servers import free_port
from tests.support.workers import Worker

TASK = "metered.hold"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.parametrize("pool", ["prefork", "solo", "threads", "gevent"])
def test_a_scrape_counts_every_duplicate_and_every_lost_lease(redis_server, pool):
    url = fresh_redis_db(redis_server)
    port = free_port()
    concurrency = 1 if pool == "solo" else 2
    worker = Worker(
        "tests.support.apps.metered",
        {"EXCLUSIVE_TEST_BROKER": url, "EXCLUSIVE_TEST_METRICS": str(port)},
        pool=pool,
        concurrency=concurrency,
        name=f"metrics-{pool}",
    )
    client = Celery("client", broker=url, backend=url, set_as_current=False)
    backend = backend_for_url(url)
    with worker:
        # Three duplicates of a held key, each skipped: the holder is another worker's.
        holder = backend.try_acquire("exclusive:dup", "elsewhere", 60)
        results = [client.send_task(TASK, ("dup", 0)) for _ in range(3)]
        for result in results:
            result.get(timeout=30, propagate=False)
        backend.release(holder)
        # A lease freed under its running holder: it is lost. Prefork and solo stop the
        # body; a thread or greenlet runs on to its end and fails then (8 s here).
        lost = client.send_task(TASK, ("lost", 8))
        assert wait_until(lambda: backend.holders_of("exclusive:lost"), timeout=30)
        backend.force_release("exclusive:lost")
        lost.get(timeout=60, propagate=False)
        assert lost.state == "FAILURE" and type(lost.result).__name__ == "LeaseLost"
        deadline = time.monotonic() + 20
        while True:
            samples = scrape(port)
            if value(samples, "exclusive_leases_lost_total", task=TASK) >= 1:
                break
            assert time.monotonic() < deadline, samples
            time.sleep(0.2)
    assert all(r.state == "FAILURE" for r in results)
    assert value(samples, "exclusive_duplicates_total", task=TASK, policy="skip") == 3
    assert value(samples, "exclusive_leases_lost_total", task=TASK) == 1
    assert value(samples, "exclusive_lease_acquisitions_total", task=TASK) == 1
    assert "Address already in use" not in worker.output()


def test_prefork_workers_sharing_one_multiprocess_folder_keep_each_their_own_counts(
    redis_server, tmp_path
):
    """``PROMETHEUS_MULTIPROC_DIR`` set once for a host: the second worker's start
    neither wipes the first one's samples nor serves them as its own."""
    url = fresh_redis_db(redis_server)
    shared = tmp_path / "metrics"
    shared.mkdir()
    ports = [free_port(), free_port()]

    def worker(number: int) -> Worker:
        env = {
            "EXCLUSIVE_TEST_BROKER": url,
            "EXCLUSIVE_TEST_METRICS": str(ports[number]),
            "PROMETHEUS_MULTIPROC_DIR": str(shared),
        }
        name = f"shared-{number}"
        return Worker("tests.support.apps.metered", env, pool="prefork", concurrency=1, name=name)

    client = Celery("client", broker=url, backend=url, set_as_current=False)
    backend = backend_for_url(url)
    skipped = ("exclusive_duplicates_total", {"task": TASK, "policy": "skip"})
    with worker(0):
        holder = backend.try_acquire("exclusive:dup", "elsewhere", 60)
        for result in [client.send_task(TASK, ("dup", 0)) for _ in range(2)]:
            result.get(timeout=30, propagate=False)
        backend.release(holder)
        assert wait_until(lambda: value(scrape(ports[0]), skipped[0], **skipped[1]) == 2, 20)
        with worker(1):
            assert value(scrape(ports[1]), skipped[0], **skipped[1]) == 0
            assert value(scrape(ports[0]), skipped[0], **skipped[1]) == 2
