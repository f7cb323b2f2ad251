"""``?recipe=mutex``: the store and etcd's own concurrency mutex exclude each other,
both ways, with Debian's ``etcdctl lock`` (etcd-client 3.4) as the foreign client.

``etcdctl lock NAME`` holds the mutex ``NAME/`` until it is signalled;
``etcdctl lock NAME CMD...`` runs CMD while it holds it, then releases. The store URL
``etcd://host/<root>?recipe=mutex`` puts the key ``K`` at the mutex ``<root>/K``.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import threading
import time
import uuid

import pytest
import requests

from celery_exclusive import ConfigurationError, ExclusiveLock, LockHeld, backend_for_url
from celery_exclusive.backends import _load
from celery_exclusive.backends.etcd.kv import b64, unb64
from celery_exclusive.backends.etcd.recipe import MutexBackend
from celery_exclusive.core import marks, outcomes, policies
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
        return self._start(self._command(name, *command), subprocess.STDOUT)

    def relock(self, name: str, script) -> subprocess.Popen:
        """A client that takes ``name`` again as soon as it has let it go, running
        ``sh script`` under each hold, until the test stops it."""
        loop = f"while true; do {shlex.join(self._command(name, 'sh', str(script)))}; done"
        return self._start(["sh", "-c", loop], subprocess.DEVNULL)

    def _command(self, name: str, *command: str) -> list[str]:
        return ["etcdctl", "--endpoints", self.endpoint, "lock", "--ttl", "5", name, *command]

    def _start(self, command: list[str], stderr) -> subprocess.Popen:
        process = subprocess.Popen(
            command,
            env={**os.environ, "ETCDCTL_API": "3"},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # and the etcdctl a loop runs
            process.wait(10)


@pytest.fixture
def etcdctl(etcd_server):
    tool = Etcdctl(etcd_server.endpoint)
    yield tool
    tool.stop()


def held_by_foreign(store, key: str) -> bool:
    infos = store.holders_of(key)
    return bool(infos) and infos[0].fencing_token is None


def keys_under(etcd_server, prefix: str) -> list[str]:
    """The names of etcd's keys under ``prefix``, as any client reads them."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    answer = requests.post(
        f"http://{etcd_server.endpoint}/v3/kv/range",
        json={"key": b64(prefix.encode()), "range_end": b64(end.encode())},
        timeout=5,
    ).json()
    return [unb64(kv["key"]).decode() for kv in answer.get("kvs", [])]


def spans_of(*clients: subprocess.Popen) -> list[tuple[float, float]]:
    """The holds of stopped re-locking clients, (start, end) as their script noted them;
    a hold cut short by the stop ends never."""
    spans = []
    for client in clients:
        words = client.communicate(timeout=10)[0].split()
        stamps = [float(word) for word in words if word.replace(".", "", 1).isdigit()]
        spans += zip(stamps[::2], [*stamps[1::2], math.inf])
    return spans


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


def test_a_foreign_holder_is_named_by_its_key_and_its_etcd_lease(store, root, etcdctl, etcd_server):
    etcdctl.lock(f"{root}/{KEY}")
    assert wait_until(lambda: held_by_foreign(store, KEY), timeout=10)
    [name] = keys_under(etcd_server, f"{root}/{KEY}/")
    lease = name.rsplit("/", 1)[1]  # concurrency.Mutex names its key after its lease, in hex
    [info] = store.holders_of(KEY)
    assert f"the key {name!r} on the etcd lease {lease}" in info.holder["foreign"]


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


# --- etcd's first-come queue, which our waiters join --------------------------------------


def test_a_waiting_lock_gets_its_turn_among_etcdctl_clients_relocking_back_to_back(
    recipe_url, store, root, etcdctl, tmp_path
):
    hold = 0.5
    script = tmp_path / "hold.sh"
    script.write_text(f"date +%s.%N; sleep {hold}; date +%s.%N\n")
    clients = [etcdctl.relock(f"{root}/{KEY}", script) for _ in range(3)]
    assert wait_until(lambda: held_by_foreign(store, KEY), timeout=10)
    time.sleep(2 * hold)  # each client holds, or stands in etcd's queue
    asked_at = time.time()
    with ExclusiveLock(KEY, recipe_url, wait=9):
        taken_at = time.time()
        time.sleep(hold)
        released_at = time.time()
    etcdctl.stop()
    spans = spans_of(*clients)
    # Ahead of it, at most one turn of each client: those already in the queue.
    assert len([start for start, _ in spans if asked_at < start < taken_at]) <= len(clients)
    # Its turn came as the hold before it ended, and nobody held the mutex beside it.
    assert taken_at - max(end for _, end in spans if end <= taken_at) < hold
    assert all(end <= taken_at or start >= released_at for start, end in spans)


def test_a_waiting_lock_stands_in_etcds_queue_and_leaves_it_when_it_gives_up(
    recipe_url, store, root, etcdctl, etcd_server
):
    etcdctl.lock(f"{root}/{KEY}")
    assert wait_until(lambda: held_by_foreign(store, KEY), timeout=10)
    outcome = []

    def wait() -> None:
        with pytest.raises(LockHeld), ExclusiveLock(KEY, recipe_url, wait=2):
            pytest.fail("the block ran beside etcdctl lock")
        outcome.append("gave up")

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert wait_until(lambda: len(keys_under(etcd_server, f"{root}/{KEY}/")) == 2, timeout=5)
    waiter.join(10)
    assert outcome == ["gave up"]
    [left] = keys_under(etcd_server, f"{root}/{KEY}/")  # the foreign holder's; ours is gone
    assert left == store.holders_of(KEY)[0].owner


def test_an_etcdctl_lock_queued_behind_our_holder_goes_before_a_later_waiter_of_ours(
    recipe_url, store, root, etcdctl, etcd_server, tmp_path
):
    script = tmp_path / "hold.sh"
    script.write_text("date +%s.%N; sleep 0.5; date +%s.%N\n")
    taken = []

    def wait() -> None:
        with ExclusiveLock(KEY, recipe_url, wait=20):
            taken.append(time.time())

    waiter = threading.Thread(target=wait)
    with ExclusiveLock(KEY, recipe_url):
        foreign = etcdctl.lock(f"{root}/{KEY}", "sh", str(script))
        assert wait_until(lambda: len(keys_under(etcd_server, f"{root}/{KEY}/")) == 2, timeout=10)
        waiter.start()
        assert wait_until(lambda: marks.line_of(store, KEY), timeout=10)
    [(start, end)] = spans_of(foreign)
    waiter.join(30)
    assert end <= taken[0]


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
    assert keys_under(etcd_server, f"{root}/{KEY}/") == [f"{root}/{KEY}/{lease.owner}"]


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
