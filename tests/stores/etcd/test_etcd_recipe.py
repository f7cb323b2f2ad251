"""``?recipe=mutex``: the store and etcd's own concurrency mutex exclude each other,
both ways, with Debian's ``etcdctl lock`` (etcd-client 3.4) as the foreign client.

``etcdctl lock NAME`` holds the mutex ``NAME/`` until it is signalled;
``etcdctl lock NAME CMD...`` runs CMD while it holds it, then releases. The store URL
``etcd://host/<root>?recipe=mutex`` puts the key ``K`` at the mutex ``<root>/K``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid

import pytest

from celery_exclusive import ConfigurationError, ExclusiveLock, LockHeld, backend_for_url
from celery_exclusive.backends import _load
from celery_exclusive.backends.etcd.recipe import MutexBackend
from celery_exclusive.core import outcomes, policies
from celery_exclusive.core.config import Settings
from celery_exclusive.core.lease import acquire
from tests.support.cluster import wait_until

KEY = "exclusive:invoice:7"


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def root():
    return f"m-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def recipe_url(etcd_server, root):
    return f"{etcd_server.url}/{root}?recipe=mutex"


@pytest.fixture
def store(recipe_url):
    store = _load(recipe_url)
    yield store
    store.close()


class Etcdctl:
    """``etcdctl lock`` processes of one test, stopped after it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.processes = endpoint, []

    def lock(self, name: str, *command: str) -> subprocess.Popen:
        process = subprocess.Popen(
            ["etcdctl", "--endpoints", self.endpoint, "lock", "--ttl", "5", name, *command],
            env={**os.environ, "ETCDCTL_API": "3"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(10)


@pytest.fixture
def etcdctl(etcd_server):
    tool = Etcdctl(etcd_server.endpoint)
    yield tool
    tool.stop()


def held_by_foreign(store, key: str) -> bool:
    infos = store.holders_of(key)
    return bool(infos) and infos[0].fencing_token is None


def task_call(url: str, task_id: str):
    settings = Settings(backend_url=url, lease_ttl=10.0)
    return policies.claim(settings, backend_for_url(url), KEY, "billing.settle", task_id)


# --- a foreign holder -------------------------------------------------------------------


def test_the_recipe_url_makes_a_store_that_speaks_it(store):
    assert isinstance(store, MutexBackend)


def test_an_etcdctl_lock_held_makes_a_task_call_skip_and_name_it(recipe_url, store, root, etcdctl):
    etcdctl.lock(f"{root}/{KEY}")
    assert wait_until(lambda: held_by_foreign(store, KEY), timeout=10)
    outcome = task_call(recipe_url, "task-1")
    assert isinstance(outcome, outcomes.Skipped)
    assert "etcd concurrency mutex" in outcome.holder
    assert f"{root}/{KEY}/" in outcome.holder
    with pytest.raises(LockHeld, match="etcd concurrency mutex"), ExclusiveLock(KEY, recipe_url):
        pytest.fail("the block ran beside etcdctl lock")


def test_a_waiting_lock_takes_the_key_as_soon_as_etcdctl_releases(
    recipe_url, store, root, etcdctl, tmp_path
):
    script = tmp_path / "hold.sh"
    script.write_text("sleep 1; date +%s.%N\n")  # the last thing before etcdctl unlocks
    holder = etcdctl.lock(f"{root}/{KEY}", "sh", str(script))
    assert wait_until(lambda: held_by_foreign(store, KEY), timeout=10)
    with ExclusiveLock(KEY, recipe_url, wait=20):
        taken_at = time.time()
    output, _ = holder.communicate(timeout=10)
    ended_at = float(output.split()[-1])
    assert ended_at <= taken_at < ended_at + 0.5  # woken by its release, not a poll


def test_our_holder_makes_etcdctl_lock_wait_for_our_release(recipe_url, root, etcdctl):
    with ExclusiveLock(KEY, recipe_url) as lease:
        waiter = etcdctl.lock(f"{root}/{KEY}", "date", "+%s.%N")
        time.sleep(1.0)
        assert waiter.poll() is None  # still waiting behind our key
        released_at = time.time()
    output, _ = waiter.communicate(timeout=10)
    taken_at = float(output.strip().splitlines()[-1])
    assert released_at <= taken_at < released_at + 1.0
    assert lease.released


def test_an_etcdctl_waiter_queued_behind_us_keeps_its_turn(recipe_url, store, root, etcdctl):
    with ExclusiveLock(KEY, recipe_url):
        waiter = etcdctl.lock(f"{root}/{KEY}", "sleep", "1")
        time.sleep(0.5)  # its key is in line behind ours
    # Our next grant finds the foreign waiter first in line, holding the key.
    assert wait_until(lambda: held_by_foreign(store, KEY), timeout=5)
    assert store.try_acquire(KEY, owner(), 10) is None
    waiter.wait(10)
    assert wait_until(lambda: store.try_acquire(KEY, owner(), 10), timeout=5)


def test_force_release_frees_ours_and_leaves_a_foreign_waiter(store, root, etcdctl):
    ours = store.try_acquire(KEY, owner(), 10)
    waiter = etcdctl.lock(f"{root}/{KEY}", "date", "+%s.%N")
    time.sleep(0.5)
    assert store.force_release(KEY) == 1  # ours; the waiter's key is not ours to delete
    output, _ = waiter.communicate(timeout=10)
    assert waiter.returncode == 0 and output.strip()
    assert store.renew([ours]) == {ours}


def test_force_release_leaves_a_foreign_holder(store, root, etcdctl):
    holder = etcdctl.lock(f"{root}/{KEY}")
    assert wait_until(lambda: held_by_foreign(store, KEY), timeout=10)
    assert store.force_release(KEY) == 0
    assert held_by_foreign(store, KEY)
    holder.send_signal(signal.SIGINT)
    holder.wait(10)
    assert wait_until(lambda: not store.holders_of(KEY), timeout=10)


def test_our_line_and_marks_live_apart_from_the_mutex_prefix(etcd_server, store, root):
    lease = store.try_acquire(KEY, owner(), 10)
    assert store.swap_mark(KEY, "line", None, "[]", 10)
    import requests

    from celery_exclusive.backends.etcd.kv import b64, unb64

    prefix = f"{root}/{KEY}/".encode()
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    answer = requests.post(
        f"http://{etcd_server.endpoint}/v3/kv/range",
        json={"key": b64(prefix), "range_end": b64(end)},
        timeout=5,
    ).json()
    names = [unb64(kv["key"]).decode() for kv in answer.get("kvs", [])]
    assert names == [f"{root}/{KEY}/{lease.owner}"]


def test_a_limit_and_a_key_naming_the_store_s_own_entries_are_refused(store):
    with pytest.raises(ConfigurationError, match="does not offer limits"):
        acquire(store, KEY, 10, limit=2)
    with pytest.raises(ConfigurationError, match="not start with '.celery-exclusive/'"):
        store.try_acquire(".celery-exclusive/k/x", owner(), 10)


def test_an_unknown_recipe_is_refused_naming_the_one_there_is(etcd_server):
    with pytest.raises(ConfigurationError, match="its recipes: mutex"):
        _load(f"{etcd_server.url}/x?recipe=lease")


def test_tasks_and_etcdctl_on_one_key_never_overlap(recipe_url, root, etcdctl, tmp_path):
    """Threads of ours (the lease a task takes) and etcdctl processes contend for one
    mutex; each notes when it held it."""
    spans, lock = [], ExclusiveLock(KEY, recipe_url, wait=60)

    def ours() -> None:
        with lock:
            start = time.time()
            time.sleep(0.1)
            spans.append((start, time.time()))

    threads = [threading.Thread(target=ours) for _ in range(4)]
    script = tmp_path / "hold.sh"  # etcdctl would read a "-c" as its own flag
    script.write_text("date +%s.%N; sleep 0.1; date +%s.%N\n")
    foreign = [etcdctl.lock(f"{root}/{KEY}", "sh", str(script)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    for process in foreign:
        output, _ = process.communicate(timeout=90)
        start, end = (float(line) for line in output.split())
        spans.append((start, end))
    spans.sort()
    assert len(spans) == 8
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
