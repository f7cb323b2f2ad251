"""``?recipe=set-nx``: the store and Redis's own lock clients exclude each other, both ways.

Real Redis, real redis-py ``Lock`` and python-redis-lock in this process; a task call
is what ``ExclusiveTask`` makes of one (:func:`policies.claim`). Real workers:
test_redis_recipe_workers.py; the store's contract: the ``redis-set-nx`` case of
tests/contract.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis
import redis_lock
from redis.crc import key_slot
from redis.exceptions import LockNotOwnedError

from celery_exclusive import (
    ConfigurationError,
    ExclusiveLock,
    LeaseLost,
    LockHeld,
    backend_for_url,
)
from celery_exclusive.backends import _load
from celery_exclusive.backends.base import Lease
from celery_exclusive.backends.redis import layout, recipe
from celery_exclusive.backends.redis.recipe import RecipeLayout, SetNxBackend, beside
from celery_exclusive.core import outcomes, policies
from celery_exclusive.core.config import Settings
from celery_exclusive.core.heartbeat import heartbeat
from celery_exclusive.core.lease import acquire

KEY = "exclusive:invoice:7"


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def recipe_url(redis_url):
    return redis_url + "?recipe=set-nx"


@pytest.fixture
def client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def store(recipe_url):
    store = _load(recipe_url)
    yield store
    store.close()


def task_call(url: str, task_id: str, policy: str = "skip"):
    settings = Settings(backend_url=url, lease_ttl=10.0, on_duplicate=policy)
    return policies.claim(settings, backend_for_url(url), KEY, "billing.settle", task_id)


# --- a foreign holder -------------------------------------------------------------------


def test_the_recipe_url_makes_a_store_that_speaks_it(store):
    assert isinstance(store, SetNxBackend)


def test_a_redis_py_lock_held_makes_a_task_call_skip_and_name_it(recipe_url, client):
    theirs = client.lock(KEY, timeout=10)
    assert theirs.acquire(blocking=False)
    outcome = task_call(recipe_url, "task-1")
    assert isinstance(outcome, outcomes.Skipped)
    assert outcome.holder_task_id is None
    assert "SET NX lock recipe" in outcome.holder
    assert theirs.local.token.decode() in outcome.holder
    assert client.get(KEY) == theirs.local.token  # untouched
    theirs.release()


def test_a_redis_py_lock_held_makes_a_lock_block_raise_naming_it(recipe_url, client):
    theirs = client.lock(KEY, timeout=10)
    theirs.acquire(blocking=False)
    refused = pytest.raises(LockHeld, match="not taken by celery-exclusive")
    with refused, ExclusiveLock(KEY, recipe_url):
        pytest.fail("the block ran beside the redis-py Lock")
    theirs.release()


def test_a_waiting_call_takes_the_key_soon_after_the_foreign_release(recipe_url, client):
    theirs = client.lock(KEY, timeout=10, thread_local=False)
    theirs.acquire(blocking=False)
    released_at = []

    def release() -> None:
        # Noted as the release is sent: the waiter may take the key before this thread
        # runs again after it.
        released_at.append(time.monotonic())
        theirs.release()

    threading.Timer(0.5, release).start()
    with ExclusiveLock(KEY, recipe_url, wait=10):
        taken_at = time.monotonic()
    assert 0 <= taken_at - released_at[0] < 3.0  # a poll, not the wait of 10 s


def test_a_foreign_holder_is_never_deleted_extended_or_overwritten(recipe_url, store, client):
    mine = store.try_acquire(KEY, owner(), 0.5)
    time.sleep(0.6)  # ours expired...
    client.set(KEY, "theirs", px=5000)  # ...and a foreign client took the key
    assert store.try_acquire(KEY, owner(), 10) is None
    assert store.renew([mine]) == {mine}
    assert store.release(mine) is False
    assert store.force_release(KEY) == 0
    assert store.swap_mark(KEY, "line", None, "[]", 10)  # beside it, not on it
    assert client.get(KEY) == b"theirs"
    assert 4000 < client.pttl(KEY) <= 5000


# --- our holder, as the foreign clients see it -------------------------------------------


def test_our_holder_makes_a_redis_py_lock_fail_then_wait_for_our_release(recipe_url, client):
    with ExclusiveLock(KEY, recipe_url) as lease:
        assert client.lock(KEY, timeout=5).acquire(blocking=False) is False
        threading.Timer(0.3, lease.release).start()
        started = time.monotonic()
        theirs = client.lock(KEY, timeout=5, blocking_timeout=10)
        assert theirs.acquire()
        assert 0.25 < time.monotonic() - started < 5.0  # its poll, not its timeout
    theirs.release()


def test_a_redis_py_release_or_extend_cannot_touch_our_lease(recipe_url, client):
    with ExclusiveLock(KEY, recipe_url) as lease:
        impostor = client.lock(KEY, timeout=5)
        impostor.local.token = b"not-ours"
        with pytest.raises(LockNotOwnedError):
            impostor.extend(100)
        with pytest.raises(LockNotOwnedError):
            impostor.release()
        assert lease.held
        assert backend_for_url(recipe_url).holders_of(KEY)[0].owner == lease.grant.owner


def test_our_renewals_extend_the_key_with_a_compare_and_pexpire(recipe_url, client):
    with ExclusiveLock(KEY, recipe_url, ttl=1.0) as lease:
        time.sleep(2.5)
        assert lease.held
        assert 0 < client.pttl(KEY) <= 1000
        assert client.get(KEY).startswith(f"{len(lease.grant.owner)}:{lease.grant.owner} ".encode())


def test_a_python_redis_lock_waiter_wakes_at_our_release(recipe_url, client):
    """python-redis-lock blocks on ``lock-signal:<name>`` (forever, without a timeout):
    only a release that pushes there, as its own does, wakes it before that."""
    taken = []
    with ExclusiveLock("lock:invoice:7", recipe_url):
        theirs = redis_lock.Lock(client, "invoice:7")
        waiter = threading.Thread(
            target=lambda: taken.append((theirs.acquire(timeout=10), time.monotonic()))
        )
        waiter.start()
        time.sleep(0.5)
        assert taken == []
        released_at = time.monotonic()
    waiter.join(15)
    assert taken and taken[0][0] is True
    assert taken[0][1] - released_at < 5.0  # pushed, not its timeout of 10 s
    theirs.release()


def test_our_waiter_never_takes_a_wake_up_meant_for_python_redis_lock_waiters(
    recipe_url, client, monkeypatch
):
    # Our waiter looks at a foreign holder every FOREIGN_POLL s; a look that fell between
    # the release's DEL and their woken waiter's SET NX would take the free key fairly,
    # by the recipe. Looks 3 s apart keep them far from the release at 0.5 s. Ours starts
    # waiting first: a waiter of ours blocked on their wake-up list would be served the
    # release's one wake-up before theirs (Redis serves blocked clients first come, first
    # served), and take the key.
    monkeypatch.setattr(recipe, "FOREIGN_POLL", 3.0)
    holder = redis_lock.Lock(client, "invoice:7", expire=10)
    holder.acquire()
    theirs, taken, ours = redis_lock.Lock(client, "invoice:7", expire=10), [], []
    mine = ExclusiveLock("lock:invoice:7", recipe_url, wait=20)

    def ours_waits() -> None:
        with mine:
            ours.append(time.monotonic())

    ours_thread = threading.Thread(target=ours_waits)
    ours_thread.start()
    time.sleep(0.3)
    waiter = threading.Thread(target=lambda: taken.append((theirs.acquire(), time.monotonic())))
    waiter.start()
    time.sleep(0.5)
    released_at = time.monotonic()
    holder.release()
    waiter.join(5)
    assert taken and taken[0][1] - released_at < 5.0  # woken by the release, not at expiry
    assert ours == []
    theirs.release()
    ours_thread.join(10)
    assert ours


# --- refusals, names, slots ---------------------------------------------------------------


def test_a_limit_is_refused_naming_the_key_and_the_fix(store):
    with pytest.raises(
        ConfigurationError, match="does not offer limits.*invoice:7.*exclusive_limit"
    ):
        acquire(store, KEY, 10, limit=2, name="billing.settle")


@pytest.mark.parametrize(
    "key",
    [
        "{exclusive:invoice:7}:fence",
        "{invoice:7}:mark:line",
        "{invoice:7}:signal:task-1",
        "{invoice:7}:record:last",
        "{user42}~{user42%7D:lock:fence",
    ],
)
def test_a_key_naming_an_entry_of_the_store_is_refused_naming_the_fix(store, key):
    refused = "names one of the store's own entries.*change exclusive_key"
    with pytest.raises(ConfigurationError, match=refused):
        store.try_acquire(key, owner(), 10)


@pytest.mark.parametrize("key", ["{user42}:lock", "{user42}:fencing", "{user42}lock", "{a}:b:c"])
def test_a_key_with_a_hash_tag_and_more_is_a_key_of_its_own(store, client, key):
    lease = store.try_acquire(key, owner(), 10)
    assert lease is not None
    assert [info.key for info in store.holders(key)] == [key]
    assert client.get(key).startswith(f"{len(lease.owner)}:{lease.owner} ".encode())
    assert store.release(lease) is True


def test_every_entry_of_either_layout_is_refused_as_a_key():
    """What no key may take: each name the store gives a key's entries, in its own
    layout and beside a key of the recipe's, for plain and hash-tagged keys."""
    for key in ("invoice:7", "{user42}:lock", "a}b", "50%"):
        entries = [layout.fence(key), layout.holders(key), layout.waiting(key)]
        entries += [layout.signal(key), layout.signal(key, "t-1"), layout.mark(key, "line")]
        entries += [layout.record(key, "last"), layout.events(key)]
        beside_it = RecipeLayout()
        entries += [*beside_it.entries(key)[1:], beside_it.signal(key, "t-1")]
        entries += [beside_it.mark(key, "done"), beside_it.record(key, "last")]
        assert [name for name in entries if not recipe.internal(name)] == []


def test_an_unknown_recipe_is_refused_naming_the_ones_there_are(redis_url):
    with pytest.raises(ConfigurationError, match="recipe='redlock'.*its recipes: set-nx"):
        _load(redis_url + "?recipe=redlock")


@pytest.mark.parametrize(
    "key",
    ["plain:key", "lock:{invoice}:7", "{tagged}", "{user42}:lock", "a}b", "{}x", "50%", "k{x"],
)
def test_every_entry_beside_a_key_shares_its_hash_slot_and_no_other_key_s(key):
    names = [*RecipeLayout().entries(key), RecipeLayout().record(key, "r")]
    assert {key_slot(name.encode()) for name in names} == {key_slot(key.encode())}
    others = {beside(other) for other in ("plain:key2", key + "x", "a%7Db")}
    assert beside(key) not in others


def test_a_plain_key_keeps_its_fence_across_the_recipe(redis_url, recipe_url):
    plain, recipe = _load(redis_url), _load(recipe_url)
    first = plain.try_acquire(KEY, owner(), 10)
    plain.release(first)
    second = recipe.try_acquire(KEY, owner(), 10)
    assert second.fencing_token > first.fencing_token
    recipe.release(second)
    plain.close()
    recipe.close()


def test_the_recipe_on_a_cluster_keeps_every_key_s_entries_on_its_node(redis_cluster_url):
    store = _load(redis_cluster_url + "?recipe=set-nx")
    host, port = redis_cluster_url.split("//")[1].split(",")[0].split(":")
    cluster = redis.RedisCluster(host=host, port=int(port))
    try:
        leases = [store.try_acquire(k, owner(), 10) for k in ("a", "b}", "lock:{c}", "d%")]
        assert all(leases)
        assert store.renew(leases) == set()
        assert store.swap_mark("a", "line", None, "[]", 10)
        assert all(store.release(lease) for lease in leases)
        theirs = cluster.lock("a", timeout=10)
        assert theirs.acquire(blocking=False)
        assert store.try_acquire("a", owner(), 10) is None
        assert store.holders_of("a")[0].holder["foreign"]
        theirs.release()
    finally:
        store.close()
        cluster.close()


def test_a_hash_tagged_key_on_a_cluster_and_a_redis_py_lock_exclude_each_other(
    redis_cluster_url,
):
    """``{user42}:lock``, as Cluster users name a lock: the recipe takes that very key
    and keeps its own entries beside it, in its slot (a script spanning slots would be
    refused with CROSSSLOT)."""
    url, key = redis_cluster_url + "?recipe=set-nx", "{user42}:lock"
    host, port = redis_cluster_url.split("//")[1].split(",")[0].split(":")
    cluster = redis.RedisCluster(host=host, port=int(port))
    try:
        with ExclusiveLock(key, url) as lease:
            assert cluster.lock(key, timeout=5).acquire(blocking=False) is False
            assert cluster.get(key).startswith(f"{len(lease.grant.owner)}:".encode())
        theirs = cluster.lock(key, timeout=10)
        assert theirs.acquire(blocking=False)
        refused = pytest.raises(LockHeld, match="not taken by celery-exclusive")
        with refused, ExclusiveLock(key, url):
            pytest.fail("the block ran beside the redis-py Lock")
        theirs.release()
        with ExclusiveLock(key, url, wait=5):
            assert cluster.lock(key, timeout=5).acquire(blocking=False) is False
    finally:
        cluster.close()


def test_a_lease_lost_to_a_foreign_taker_is_found_by_the_heartbeat(recipe_url, client):
    raised_at_exit = pytest.raises(LeaseLost, match="was lost while its block ran")
    with raised_at_exit, ExclusiveLock(KEY, recipe_url, ttl=0.5) as lease:
        client.delete(KEY)  # an operator's DEL...
        client.set(KEY, "theirs", px=10_000)  # ...and a foreign client takes it
        heartbeat().beat()
        assert lease.lost
    assert client.get(KEY) == b"theirs"


def test_a_stale_lease_object_cannot_free_a_foreign_holder(store, client):
    client.set(KEY, "theirs", px=10_000)
    stale = Lease(KEY, "theirs", 1, 10.0)  # even naming its value as an owner
    assert store.release(stale) is False
    assert client.get(KEY) == b"theirs"
