"""A holder stops, or is at least told, before the store can give its key to anyone
else, whatever the store does: hang, vanish, or freeze the holder itself.

One holder process (tests/support/deadline_holder.py) reaches its store through our
fault proxy; the test makes the fault, then takes the key directly, as the next holder.
Both sides write down when things happened on the host's monotonic clock, which every
process of a Linux host shares: the holder when it was told (``lease_lost``) and each
step of its body, the next holder when it asked for the grant it got. No step of the
body may come after that, and the loss must be told before it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from celery_exclusive import lease_lost
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.lease import acquire
from tests.support.deadlines import read_ledger, take_over
from tests.support.proxy import Proxy
from tests.support.servers import kill_tree

ROOT = Path(__file__).resolve().parents[2]
KEY = "exclusive:deadline"
TTL = 3.0
STORES = ["redis", "postgresql", "etcd", "consul", "mongodb"]


@pytest.fixture(params=STORES)
def store_url(request) -> str:
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def proxy(store_url):
    proxy = Proxy(urlsplit(store_url).port)
    yield proxy
    proxy.close()


class Holder:
    """The holder process and its ledger."""

    def __init__(self, url: str, ledger: Path, ttl: float = TTL) -> None:
        self.ledger = ledger
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.deadline_holder", url, KEY, str(ttl), ledger],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )

    def entries(self, event: str) -> list[tuple[float, list[str]]]:
        return [(at, rest) for name, at, rest in read_ledger(self.ledger) if name == event]

    def wait_for(self, event: str, timeout: float) -> float:
        """When ``event`` was first noted."""
        deadline = time.monotonic() + timeout
        while not self.entries(event):
            assert self.process.poll() is None or self.entries(event), "the holder died"
            assert time.monotonic() < deadline, f"no {event!r} within {timeout}s"
            time.sleep(0.01)
        return self.entries(event)[0][0]

    def stop(self) -> None:
        kill_tree(self.process, signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def holders(tmp_path):
    started: list[Holder] = []

    def start(url: str, ttl: float = TTL) -> Holder:
        holder = Holder(url, tmp_path / f"ledger-{len(started)}", ttl)
        started.append(holder)
        holder.wait_for("step", timeout=30)
        return holder

    yield start
    for holder in started:
        holder.stop()


def assert_nothing_ran_beside(holder: Holder, granted_at: float, token: int) -> None:
    lost_at = holder.wait_for("lost", timeout=30)
    late_steps = [at for at, _ in holder.entries("step") if at >= granted_at]
    last_step = max(at for at, _ in holder.entries("step"))
    print(f"told {granted_at - lost_at:.3f}s, last step {granted_at - last_step:.3f}s before")
    assert lost_at <= granted_at, f"told {lost_at - granted_at:.3f}s after the next grant"
    assert late_steps == [], f"{len(late_steps)} step(s) beside the next holder"
    # Fenced writes: the next holder's token is above every token the body wrote under.
    assert all(int(rest[0]) < token for _, rest in holder.entries("step"))


def test_a_holder_behind_a_black_hole_is_told_before_its_key_is_free_again(
    store_url, proxy, holders
):
    holder = holders(proxy.url_for(store_url))
    proxy.black_hole()
    granted_at, token = take_over(store_url, KEY, TTL)
    assert_nothing_ran_beside(holder, granted_at, token)


def test_a_holder_whose_store_resets_its_connections_is_told_before_its_key_is_free(
    store_url, proxy, holders
):
    holder = holders(proxy.url_for(store_url))
    time.sleep(0.5)  # a renewal or two through the proxy
    proxy.reset()
    granted_at, token = take_over(store_url, KEY, TTL)
    assert_nothing_ran_beside(holder, granted_at, token)


@pytest.mark.parametrize("frozen_store", ["redis", "sqlite"])
def test_a_holder_frozen_past_its_deadline_takes_no_step_once_resumed(
    frozen_store, request, holders
):
    url = request.getfixturevalue(f"{frozen_store}_url")
    holder = holders(url)
    os.kill(holder.process.pid, signal.SIGSTOP)
    try:
        granted_at, token = take_over(url, KEY, TTL)
    finally:
        os.kill(holder.process.pid, signal.SIGCONT)
    stopped_at = holder.wait_for("stopped", timeout=10)
    late_steps = [at for at, _ in holder.entries("step") if at >= granted_at]
    assert late_steps == [], f"{len(late_steps)} step(s) after the process resumed"
    assert stopped_at >= granted_at  # it could only be told once it ran again
    assert all(int(rest[0]) < token for _, rest in holder.entries("step"))


def test_a_release_that_reaches_the_store_after_expiry_for_a_body_that_ended_in_time_is_no_loss(
    redis_server, redis_url
):
    proxy = Proxy(redis_server.port)
    losses = []

    def note_loss(sender, **kwargs) -> None:
        losses.append(kwargs["reason"])

    lease_lost.connect(note_loss)
    try:
        lease = acquire(backend_for_url(proxy.url_for(redis_url)), KEY, 1.0)
        time.sleep(0.5)  # renewed through the proxy
        proxy.delay(1.5)  # the release arrives a whole ttl after the last renewal
        # Well before the deadline: the last confirmed renewal + ttl - the margin.
        assert time.monotonic() < lease.renewed_at + lease.ttl - 0.2
        assert lease.release() is False  # the store had let it expire meanwhile
    finally:
        lease_lost.disconnect(note_loss)
        proxy.close()
    assert time.monotonic() > lease.renewed_at + lease.ttl  # answered after the deadline
    assert not lease.lost and losses == []


def test_a_release_on_a_black_holed_redis_gives_up_after_one_socket_timeout(
    redis_server, redis_url
):
    proxy = Proxy(redis_server.port)
    url = proxy.url_for(redis_url) + "?socket_timeout=2"
    try:
        lease = acquire(backend_for_url(url), KEY, 30)
        proxy.black_hole()
        started = time.monotonic()
        assert lease.release() is False  # logged: it expires by itself
        waited = time.monotonic() - started
    finally:
        proxy.close()
    assert 2.0 <= waited < 3.5  # one try, not two or three
