"""A real ``celery worker`` whose lease store hangs or slows down: its task is stopped
before the store can give its key to anyone else, and a task whose body ended in time
never fails for a release the store received late.

The worker reaches its store through our fault proxy (its broker directly); the test
takes the key directly, as the next holder. Times are the host's monotonic clock,
shared by every process (tests/support/deadlines.py).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from urllib.parse import urlsplit

import pytest
from celery import Celery

from tests.support.apps.deadline_app import CLEANUP, GRACE
from tests.support.deadlines import read_ledger, take_over
from tests.support.proxy import Proxy
from tests.support.workers import Worker

APP = "tests.support.apps.deadline_app"
TTL = 3.0


@pytest.fixture(params=["redis", "postgresql"])
def store_url(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")


def worker(store: str, broker: str, ledger, concurrency: int = 1) -> Worker:
    env = {
        "EXCLUSIVE_TEST_BROKER": broker,
        "EXCLUSIVE_TEST_STORE": store,
        "EXCLUSIVE_TEST_TTL": str(TTL),
        "EXCLUSIVE_TEST_LEDGER_FILE": str(ledger),
    }
    return Worker(APP, env, concurrency=concurrency)


def send_steps(broker: str, key: str, seconds: float, task: str = "steps") -> None:
    with Celery(broker=broker) as producer:
        producer.send_task(f"{APP}.{task}", args=(key, seconds))


def events(ledger, name: str) -> list[tuple[float, list[str]]]:
    return [(at, rest) for event, at, rest in read_ledger(ledger) if event == name]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(ledger, name: str, count: int = 1, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(events(ledger, name)) < count:
        assert time.monotonic() < deadline, f"{count} {name!r} not noted within {timeout}s"
        time.sleep(0.02)


def test_a_task_whose_store_hangs_is_stopped_before_its_key_is_free_again(
    store_url, redis_url, tmp_path
):
    ledger = tmp_path / "ledger"
    proxy = Proxy(urlsplit(store_url).port)
    key = f"hang-{uuid.uuid4().hex[:8]}"
    try:
        with worker(proxy.url_for(store_url), redis_url, ledger):
            send_steps(redis_url, key, 120)
            wait_for(ledger, "step")
            proxy.black_hole()
            granted_at, token = take_over(store_url, f"exclusive:{key}", TTL)
            wait_for(ledger, "lost")
            wait_for(ledger, "outcome")
    finally:
        proxy.close()
    lost_at = events(ledger, "lost")[0][0]
    late_steps = [at for at, _ in events(ledger, "step") if at >= granted_at]
    assert lost_at <= granted_at, f"told {lost_at - granted_at:.3f}s after the next grant"
    assert late_steps == [], f"{len(late_steps)} step(s) beside the next holder"
    assert all(int(rest[0]) < token for _, rest in events(ledger, "step"))
    assert events(ledger, "outcome")[0][1][1:] == ["FAILURE", "LeaseLost"]


def test_tasks_whose_bodies_end_in_time_on_a_slow_store_never_fail_with_lease_lost(
    redis_server, redis_url, tmp_path
):
    ledger = tmp_path / "ledger"
    proxy = Proxy(redis_server.port)
    proxy.delay(0.2, 0.8)
    count = 24
    try:
        with worker(proxy.url_for(redis_url), redis_url, ledger, 4):
            for i in range(count):
                send_steps(redis_url, f"slow-{uuid.uuid4().hex[:8]}", 0.5 + (i % 5) * 0.5)
            wait_for(ledger, "outcome", count, timeout=240)
    finally:
        proxy.close()
    outcomes = {rest[0]: rest[1:] for _, rest in events(ledger, "outcome")}
    ended_in_time = {rest[1] for at, rest in events(ledger, "ended") if at < float(rest[2])}
    failed = {task: how for task, how in outcomes.items() if how != ["SUCCESS", "-"]}
    assert ended_in_time, "no body ended in time: the store is too slow for the test"
    assert not [task for task in ended_in_time if task in failed], failed


def test_a_task_stopped_past_its_deadline_runs_its_cleanup_to_the_end_once_resumed(
    redis_url, tmp_path
):
    ledger = tmp_path / "ledger"
    key = f"frozen-{uuid.uuid4().hex[:8]}"
    with worker(redis_url, redis_url, ledger):
        send_steps(redis_url, key, 120, task="steps_then_clean_up")
        wait_for(ledger, "step")
        [(_, [pid, _])] = events(ledger, "started")
        child = int(pid)
        os.kill(child, signal.SIGSTOP)
        try:
            # Past its deadline, and past a grace that would count from that deadline.
            time.sleep(TTL + GRACE + 1.0)
            resumed = time.monotonic()
        finally:
            os.kill(child, signal.SIGCONT)
        wait_for(ledger, "outcome", timeout=GRACE + 10)
        assert alive(child), "the pool child was killed, not interrupted"
    [(cleaning, _)] = events(ledger, "cleaning")
    assert cleaning >= resumed  # told once it ran again...
    assert events(ledger, "cleaned"), "its cleanup was cut short"
    [(cleaned, _)] = events(ledger, "cleaned")
    assert cleaned >= cleaning + CLEANUP  # ...and its cleanup ran to its end
    assert events(ledger, "outcome")[0][1][1:] == ["FAILURE", "LeaseLost"]
