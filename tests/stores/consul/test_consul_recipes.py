"""``?recipe=``: the Consul store speaks Consul's own lock recipes, both ways, with
HashiCorp's client (tests/support/consul_api.py, a transcription of api/lock.go and
api/semaphore.go) on the same agent: its holder makes ours a duplicate that names it,
ours makes it wait exactly as another of its kind would, and neither side's entries are
deleted by the other."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from celery_exclusive.backends import Backend, _load
from celery_exclusive.core import marks
from celery_exclusive.core.lease import acquire
from celery_exclusive.core.lock import ExclusiveLock
from celery_exclusive.errors import ConfigurationError
from tests.support import consul_api as api
from tests.support.cluster import wait_until
from tests.support.consul_emulator import ConsulEmulator, EmulatedConsul
from tests.support.workers import ROOT


@pytest.fixture
def emulator(consul_server) -> ConsulEmulator:
    if not isinstance(consul_server, EmulatedConsul):
        pytest.skip("looks inside the emulator")
    return consul_server.emulator


@pytest.fixture
def go(consul_server) -> api.Client:
    parts = urlsplit(consul_server.url)
    return api.Client(f"http://{parts.hostname}:{parts.port}")


@pytest.fixture
def store(consul_url, consul_server):
    """A backend speaking ``recipe`` with no KV folder of its own, so a lease key is the
    path Go names (test keys are random); closed after the test."""
    made = []

    def make(recipe: str, folder: str = "") -> Backend:
        made.append(_load(f"{consul_server.url}/{folder}?lock_delay=0&recipe={recipe}"))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def path() -> str:
    return f"service/billing/{uuid.uuid4().hex[:8]}"


def owner() -> str:
    return uuid.uuid4().hex


def go_lock(go: api.Client, key: str, wait: float = 0.0) -> api.Lock:
    options = api.LockOptions(Key=key, Value=b"go worker")
    if wait:
        options.LockTryOnce, options.LockWaitTime = True, wait
    return api.Lock(go, options)


# --- api.Lock --------------------------------------------------------------------------


def test_our_lease_is_an_api_lock_that_go_waits_for_and_takes_after_our_release(
    store, go, emulator
):
    backend, key = store("api"), path()
    lease = backend.try_acquire(key, owner(), 10.0, holder={"task_id": "t-1"})
    entry = emulator.kv[key]
    assert entry["Flags"] == api.LOCK_FLAG_VALUE and entry["Session"]

    assert go_lock(go, key, wait=0.5).Lock() is None  # waited its LockWaitTime, not failed

    taken = threading.Event()
    waiter = go_lock(go, key)
    threading.Thread(target=lambda: waiter.Lock() and taken.set(), daemon=True).start()
    time.sleep(0.3)
    assert not taken.is_set()
    released_at = time.monotonic()
    assert backend.release(lease)
    assert taken.wait(5) and time.monotonic() - released_at < 2
    waiter.Unlock()
    assert emulator.kv[key]["Flags"] == api.LOCK_FLAG_VALUE  # the key stays, as Go's does


def test_a_go_holder_makes_ours_a_duplicate_that_names_its_session(store, go):
    backend, key = store("api"), path()
    lock = go_lock(go, key)
    lock.Lock()
    assert backend.try_acquire(key, owner(), 10.0) is None
    [info] = backend.holders_of(key)
    assert "Consul API Lock" in info.holder["foreign"] and info.task_id is None
    lock.Unlock()
    assert backend.try_acquire(key, owner(), 10.0) is not None


def test_waiting_on_a_go_holder_wakes_when_it_unlocks(store, go):
    backend, key = store("api"), path()
    lock = go_lock(go, key)
    lock.Lock()
    threading.Timer(0.4, lock.Unlock).start()
    started = time.monotonic()
    backend.wait(key, 10.0)
    assert 0.3 < time.monotonic() - started < 5.0
    assert backend.try_acquire(key, owner(), 10.0) is not None


#: How long each Go client below holds the key before the next one locks it.
HOLD = 0.5


@contextlib.contextmanager
def go_relay(consul_server, key: str, count: int) -> Iterator[list[float]]:
    """``count`` Go clients locking ``key`` back to back, in turn, each holding it HOLD
    seconds and each calling Lock again as soon as the one before unlocked, in a process
    of their own (``tests/support/consul_relay.py`` says why) until the block ends; the
    list receives when each of their locks was taken (``time.monotonic()``)."""
    parts = urlsplit(consul_server.url)
    relay = subprocess.Popen(
        [sys.executable, "-m", "tests.support.consul_relay"]
        + [f"http://{parts.hostname}:{parts.port}", key, str(count), str(HOLD)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    taken: list[float] = []

    def read() -> None:
        for line in relay.stdout:
            taken.append(float(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield taken
    finally:
        relay.stdin.close()  # the relay's last holder unlocks, and it ends
        try:
            relay.wait(10)
        finally:
            relay.kill()
        reader.join(10)


def test_a_waiter_among_go_clients_relocking_back_to_back_is_served_at_the_next_release(
    store, consul_server, go
):
    """Go's waiter, woken with the key unlocked, locks it at once (api/lock.go Lock):
    ours does too, so it is served at the next release, before a Go client that only
    then starts to lock (a session to create, a read, the acquire)."""
    key = path()
    lock = ExclusiveLock(key, f"{consul_server.url}/?lock_delay=0&recipe=api", 10.0, wait=9.0)
    went_before = []
    with go_relay(consul_server, key, 3) as taken:
        assert wait_until(lambda: taken, 10), "the Go clients never took the key"
        for _ in range(5):
            time.sleep(1.5 * HOLD)  # into a Go client's hold
            started = time.monotonic()
            lock.acquire().release()
            went_before.append(sum(1 for at in taken if at > started))
    assert went_before == [0] * 5, f"Go locks taken while ours waited: {went_before}"


def test_a_waiter_woken_by_a_go_unlock_locks_the_key_in_one_request(store, go, emulator):
    """api/lock.go Lock: the blocking query returns with the key's session empty, and
    the acquire follows at once; ours too, with the line read before the wake."""
    backend, key = store("api"), path()
    lock = go_lock(go, key)
    lock.Lock()
    marks.take_place(backend, key, "waiter", 10.0)
    assert backend.try_acquire(key, owner(), 10.0, claimant="waiter") is None  # a session
    granted = []

    def waiter() -> None:
        backend.wait(key, 10.0, "waiter")
        granted.append(backend.try_acquire(key, owner(), 10.0, claimant="waiter"))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)  # in its blocking query
    before = len(emulator.requests)
    lock.Unlock()
    thread.join(10)
    ours = [r for r in emulator.requests[before:] if r[1] != f"/v1/kv/{key}"]
    assert granted[0] is not None
    assert [r for r in ours if not r[1].startswith("/v1/session/")] == [("PUT", "/v1/txn")]


def test_a_waiter_woken_into_a_lock_delay_tries_again_after_gos_retry_time(
    store, consul_server, go, emulator
):
    """Consul refuses a lock in the delay after its holder's session died; Go's waiter,
    refused though the key was free, waits DefaultLockRetryTime before it tries again
    (api/lock.go Lock), and so does ours: once, not in a loop."""
    key = path()
    holder = api.Lock(go, api.LockOptions(Key=key, LockDelay=1.0))
    holder.Lock()
    lock = ExclusiveLock(key, f"{consul_server.url}/?lock_delay=0&recipe=api", 10.0, wait=9.0)
    threading.Timer(0.5, emulator.invalidate, [emulator.kv[key]["Session"]]).start()
    before = len(emulator.requests)
    started = time.monotonic()
    lock.acquire().release()
    assert 1.5 < time.monotonic() - started < 9.0
    # Each try is a transaction or two, and the release one: not one every few ms.
    transactions = emulator.requests[before:].count(("PUT", "/v1/txn"))
    assert transactions < 10, f"{transactions} transactions"


def test_fencing_tokens_rise_across_go_holders(store, go):
    backend, key = store("api"), path()
    tokens = []
    for _ in range(3):
        lease = backend.try_acquire(key, owner(), 10.0)
        tokens.append(lease.fencing_token)
        backend.release(lease)
        lock = go_lock(go, key)
        lock.Lock()
        lock.Unlock()
    assert tokens == sorted(set(tokens))


def test_a_key_with_other_flags_is_refused_by_name_and_left_as_it_is(store, go, emulator):
    backend, key = store("api"), path()
    go.kv().Put(api.KVPair(Key=key, Value=b"a setting", Flags=7))
    with pytest.raises(ConfigurationError, match="not an api.Lock") as info:
        backend.try_acquire(key, owner(), 10.0)
    assert key in str(info.value)
    assert (emulator.kv[key]["Value"], emulator.kv[key]["Flags"]) == (b"a setting", 7)


@pytest.mark.parametrize("key", ["", "/lead", "a//b", "a/./b", "a/../b", "a/"])
def test_a_key_that_is_no_clean_kv_path_is_refused(store, key):
    with pytest.raises(ConfigurationError, match="clean path"):
        store("api").try_acquire(key, owner(), 10.0)


def test_a_second_lease_of_one_process_on_a_held_key_is_refused_and_the_first_kept(store):
    backend, key = store("api"), path()
    first = backend.try_acquire(key, owner(), 10.0)
    assert backend.try_acquire(key, owner(), 10.0) is None
    assert backend.connection.process().held[key] == (first.owner, first.fencing_token)


def test_a_lost_lock_is_reported_by_renew(store, emulator):
    backend, key = store("api"), path()
    lease = backend.try_acquire(key, owner(), 10.0)
    emulator.invalidate(emulator.kv[key]["Session"])
    assert backend.renew([lease]) == {lease}


# --- api.Semaphore -----------------------------------------------------------------------


def test_our_slot_joins_a_go_semaphores_record_and_go_waits_for_a_free_slot(store, go, emulator):
    backend, where = store("api"), path()
    first = api.Semaphore(go, api.SemaphoreOptions(Prefix=where, Limit=2))
    first_lost = first.Acquire()
    lease = backend.try_acquire(where, owner(), 10.0, limit=2, holder={"task_id": "t-2"})
    assert lease is not None
    record = json.loads(emulator.kv[f"{where}/.lock"]["Value"])
    assert record["Limit"] == 2 and len(record["Holders"]) == 2
    assert emulator.kv[f"{where}/.lock"]["Flags"] == api.SEMAPHORE_FLAG_VALUE

    options = api.SemaphoreOptions(Prefix=where, Limit=2, SemaphoreTryOnce=True)
    options.SemaphoreWaitTime = 0.5
    second = api.Semaphore(go, options)
    assert second.Acquire() is None  # full: it waited
    assert backend.try_acquire(where, owner(), 10.0, limit=2) is None  # full for us too

    assert backend.release(lease)
    assert second.Acquire() is not None
    assert not first_lost.is_set()  # nobody pruned or deleted Go's holder
    assert f"{where}/.lock" in emulator.kv


def test_a_slot_holders_by_session_name_ours_and_theirs(store, go):
    backend, where = store("api"), path()
    theirs = api.Semaphore(go, api.SemaphoreOptions(Prefix=where, Limit=3))
    theirs.Acquire()
    backend.try_acquire(where, owner(), 10.0, limit=3, holder={"task_id": "t-3"})
    infos = backend.holders_of(where)
    assert sorted(str(i.task_id) for i in infos) == ["None", "t-3"]
    assert any("Consul API Semaphore" in i.holder.get("foreign", "") for i in infos)


def test_two_slots_of_one_process_hold_two_sessions(store, emulator):
    backend, where = store("api"), path()
    leases = [backend.try_acquire(where, owner(), 10.0, limit=2) for _ in range(2)]
    assert all(leases)
    assert len(json.loads(emulator.kv[f"{where}/.lock"]["Value"])["Holders"]) == 2
    assert backend.renew(leases) == set()


def test_another_limit_than_the_records_is_refused(store, go):
    backend, where = store("api"), path()
    api.Semaphore(go, api.SemaphoreOptions(Prefix=where, Limit=3)).Acquire()
    with pytest.raises(ConfigurationError, match="exclusive_limit=3"):
        backend.try_acquire(where, owner(), 10.0, limit=2)


def test_a_slot_whose_session_dies_is_lost_and_pruned_by_go(store, go, emulator):
    backend, where = store("api"), path()
    lease = backend.try_acquire(where, owner(), 10.0, limit=1 + 1)
    slot = backend.connection.process().slot_sessions[lease.owner]
    emulator.invalidate(slot)
    assert backend.renew([lease]) == {lease}
    taking = [api.Semaphore(go, api.SemaphoreOptions(Prefix=where, Limit=2)) for _ in "ab"]
    assert all(semaphore.Acquire() is not None for semaphore in taking)


# --- consul lock ---------------------------------------------------------------------------


def test_consul_lock_recipe_locks_prefix_dot_lock_and_consul_lock_waits_for_it(store, go, emulator):
    backend, where = store("consul-lock"), path()
    lease = backend.try_acquire(where, owner(), 10.0)
    assert emulator.kv[f"{where}/.lock"]["Flags"] == api.LOCK_FLAG_VALUE
    refused = api.consul_lock(go, where, lambda lost: "ran", timeout=0.5)
    assert refused == {
        "acquired": False,
        "lost": False,
        "result": None,
        "error": "Shutdown triggered or timeout during lock acquisition",
    }
    backend.release(lease)
    assert api.consul_lock(go, where, lambda lost: "ran")["result"] == "ran"


def test_consul_lock_n_and_our_slots_share_one_semaphore(store, go):
    backend, where = store("consul-lock"), path()
    ours = backend.try_acquire(where, owner(), 10.0, limit=2)

    def inside(lost):
        return backend.try_acquire(where, owner(), 10.0, limit=2)

    outcome = api.consul_lock(go, where, inside, limit=2)
    assert outcome["acquired"] and outcome["result"] is None  # the second slot was Go's
    backend.release(ours)


def test_a_consul_lock_holder_is_named_in_the_duplicate(store, go):
    backend, where = store("consul-lock"), path()
    seen = {}

    def child(lost):
        seen["infos"] = backend.holders_of(where)
        return backend.try_acquire(where, owner(), 10.0)

    outcome = api.consul_lock(go, where, child, child_name="./rebuild-index")
    assert outcome["result"] is None
    assert "Consul lock for './rebuild-index'" in seen["infos"][0].holder["foreign"]


# --- the leader-election guide's plain acquire ------------------------------------------------


def test_plain_acquire_excludes_both_ways_and_leaves_the_key(store, go, emulator):
    backend, key = store("acquire"), path()
    session = go.session().Create(api.SessionEntry(Name="service/leader", TTL="10s"))
    assert go.kv().Acquire(api.KVPair(Key=key, Value=b"node-a", Session=session))
    assert backend.try_acquire(key, owner(), 10.0) is None
    assert go.kv().Release(api.KVPair(Key=key, Session=session))
    lease = backend.try_acquire(key, owner(), 10.0)
    assert lease is not None and emulator.kv[key]["Flags"] == 0
    assert not go.kv().Acquire(api.KVPair(Key=key, Value=b"node-a", Session=session))
    backend.release(lease)
    assert go.kv().Acquire(api.KVPair(Key=key, Value=b"node-a", Session=session))


def test_plain_acquire_refuses_a_limit(store):
    with pytest.raises(ConfigurationError, match="recipe=acquire"):
        acquire(store("acquire"), path(), 10.0, limit=2)


def test_the_urls_folder_comes_before_the_key(store, go, emulator):
    backend, key = store("api", folder="team/locks"), path()
    lease = backend.try_acquire(key, owner(), 10.0)
    assert emulator.kv[f"team/locks/{key}"]["Session"]
    assert go_lock(go, f"team/locks/{key}", wait=0.3).Lock() is None
    assert [info.key for info in backend.holders("service/")] == [key]
    backend.release(lease)


def test_the_stores_own_entries_stay_out_of_the_recipes_paths(store, emulator):
    backend, key = store("consul-lock"), path()
    backend.swap_mark(key, "line", None, "someone", 10.0)
    own = [k for k in emulator.kv if k.startswith(".celery-exclusive/")]
    assert own and not [k for k in emulator.kv if k.startswith(key)]


def test_an_unknown_recipe_is_refused_at_once(consul_url):
    with pytest.raises(ConfigurationError, match="recipe='lock'"):
        _load(consul_url + "&recipe=lock")


def test_the_start_up_check_leaves_nothing_behind(store, emulator):
    backend = store("api")
    prefix = path() + "/"
    backend.check(prefix + "celery-exclusive:start-up-check")
    assert not [k for k in emulator.kv if k.startswith(prefix)]
