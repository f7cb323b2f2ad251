"""``?recipe=ttl-lease``: the store and MongoDB's TTL-lease document exclude each other,
both ways, with pymongo writing the lease document as "Leader Election with MongoDB TTL
Leases" builds it (:class:`ArticleLease`) as the foreign client.

On the wire-protocol stand-in (tests/support/mongo_standin.py), or the real server at
MONGODB_URL. Real workers: test_mongodb_recipe_workers.py.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
import warnings

import pymongo
import pytest

from celery_exclusive import ConfigurationError, ExclusiveLock, LockHeld, backend_for_url
from celery_exclusive.backends import _load
from celery_exclusive.backends.mongodb.connection import COLLECTION
from celery_exclusive.backends.mongodb.recipe import FIELD, TtlLeaseBackend
from celery_exclusive.core import lease as leases_of_core
from celery_exclusive.core import outcomes, policies
from celery_exclusive.core.config import Settings
from tests.support.cluster import wait_until

KEY = "exclusive:invoice:7"


def owner() -> str:
    return uuid.uuid4().hex


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class ArticleLease:
    """A lease as the article's nodes keep it, in pymongo: insert the document to take
    it, take over one whose ``expiresAt`` has passed (by this client's clock, as the
    article's nodes compare it), renew by moving ``expiresAt`` where ``owner`` is itself,
    delete it to give it back."""

    def __init__(self, collection, name: str, node: str, ttl: float = 30.0) -> None:
        self.collection, self.name, self.node, self.ttl = collection, name, node, ttl

    def acquire(self) -> bool:
        now = utcnow()
        expires = now + datetime.timedelta(seconds=self.ttl)
        try:
            self.collection.insert_one(
                {"_id": self.name, "owner": self.node, "generation": 1, "expiresAt": expires}
            )
            return True
        except pymongo.errors.DuplicateKeyError:
            pass
        taken = self.collection.update_one(
            {"_id": self.name, "expiresAt": {"$lt": now}},
            {"$set": {"owner": self.node, "expiresAt": expires}, "$inc": {"generation": 1}},
        )
        return taken.modified_count == 1

    def acquire_waiting(self, timeout: float, every: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout
        while not self.acquire():
            if time.monotonic() > deadline:
                return False
            time.sleep(every)
        return True

    def renew(self) -> bool:
        expires = utcnow() + datetime.timedelta(seconds=self.ttl)
        kept = self.collection.update_one(
            {"_id": self.name, "owner": self.node}, {"$set": {"expiresAt": expires}}
        )
        return kept.matched_count == 1

    def release(self) -> bool:
        return self.collection.delete_one({"_id": self.name, "owner": self.node}).deleted_count == 1


@pytest.fixture
def database(mongo_server):
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def recipe_url(mongo_server, database):
    return f"{mongo_server.url}/{database}?recipe=ttl-lease"


@pytest.fixture
def recipe_store(recipe_url):
    store = _load(recipe_url)
    yield store
    store.close()


@pytest.fixture
def leases(mongo_server, database):
    """The article's ``job_leases`` collection, as a pymongo user has it."""
    client = pymongo.MongoClient(mongo_server.url, tz_aware=True)
    yield client[database]["job_leases"]
    client.close()


def node(leases, name: str = KEY, ttl: float = 30.0) -> ArticleLease:
    return ArticleLease(leases, name, f"node-{uuid.uuid4().hex[:6]}", ttl)


def held_by_foreign(store, key: str) -> bool:
    infos = store.holders_of(key)
    return bool(infos) and infos[0].fencing_token is None


def task_call(url: str, task_id: str, policy: str = "skip"):
    settings = Settings(backend_url=url, lease_ttl=10.0, on_duplicate=policy)
    return policies.claim(settings, backend_for_url(url), KEY, "billing.settle", task_id)


def test_the_recipe_url_makes_a_store_that_speaks_it_and_pymongo_never_sees_its_options(
    recipe_url, leases
):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pymongo warns of an option it does not know
        store = _load(recipe_url + "&collection=locks")
        assert isinstance(store, TtlLeaseBackend)
        lease = store.try_acquire(KEY, owner(), 10)
        assert lease is not None
    assert leases.database["locks"].find_one({"_id": KEY})["owner"] == lease.owner
    store.close()


def test_our_lease_is_the_article_s_document_with_a_ttl_index(mongo_server, recipe_store, leases):
    lease = recipe_store.try_acquire(KEY, owner(), 10, holder={"task_id": "t-1"})
    doc = leases.find_one({"_id": KEY})
    assert doc["owner"] == lease.owner and doc["generation"] == 1
    assert 9 < (doc["expiresAt"] - utcnow()).total_seconds() <= 10.5
    assert doc[FIELD]["token"] == lease.fencing_token
    assert doc[FIELD]["holder"] == {"task_id": "t-1"}
    if hasattr(mongo_server, "store"):  # the stand-in (it has no listIndexes)
        ttl = mongo_server.store.ttl_indexes[(leases.database.name, "job_leases")]
        assert ttl == {"expiresAt": 0.0}
    else:
        assert leases.index_information()["expiresAt_1"]["expireAfterSeconds"] == 0


# --- a foreign holder ---------------------------------------------------------------------


def test_an_article_lease_held_makes_a_task_call_skip_and_name_it(recipe_url, recipe_store, leases):
    theirs = node(leases)
    assert theirs.acquire()
    outcome = task_call(recipe_url, "task-1")
    assert isinstance(outcome, outcomes.Skipped)
    assert f"TTL-lease document in job_leases (owner '{theirs.node}', generation 1" in (
        outcome.holder
    )
    with pytest.raises(LockHeld, match=theirs.node), ExclusiveLock(KEY, recipe_url):
        pytest.fail("the block ran beside the article's lease")
    assert theirs.renew()  # still theirs, untouched


def test_a_waiting_lock_takes_the_key_as_soon_as_the_article_lease_is_released(
    recipe_url, recipe_store, leases
):
    theirs = node(leases)
    assert theirs.acquire()
    released_at = []

    def release_later() -> None:
        time.sleep(1.0)
        released_at.append(time.time())
        theirs.release()

    threading.Thread(target=release_later).start()
    with ExclusiveLock(KEY, recipe_url, wait=20):
        taken_at = time.time()
    assert released_at[0] <= taken_at < released_at[0] + 0.5


def test_an_expired_article_lease_is_taken_over_by_its_expiry_not_the_ttl_monitor(
    recipe_store, leases
):
    theirs = node(leases, ttl=1.0)
    assert theirs.acquire()
    assert recipe_store.try_acquire(KEY, owner(), 10) is None
    time.sleep(1.2)  # expired; the TTL monitor (every 60 s) has not deleted it
    assert leases.find_one({"_id": KEY})["owner"] == theirs.node
    lease = recipe_store.try_acquire(KEY, owner(), 10)
    assert lease is not None
    doc = leases.find_one({"_id": KEY})
    assert (doc["owner"], doc["generation"]) == (lease.owner, 2)  # the recipe's takeover
    assert theirs.renew() is False  # the article's node learns it lost it


def test_a_document_without_an_expiry_date_is_never_taken_nor_rewritten(recipe_store, leases):
    leases.insert_one({"_id": KEY, "owner": "someone", "expiresAt": "tomorrow"})
    before = leases.find_one({"_id": KEY})
    assert recipe_store.try_acquire(KEY, owner(), 10) is None
    assert recipe_store.force_release(KEY) == 0
    assert "never expires" in recipe_store.holders_of(KEY)[0].holder["foreign"]
    assert leases.find_one({"_id": KEY}) == before


def test_a_foreign_holder_is_named_by_every_field_its_document_has(recipe_url, leases):
    # Lease documents of other clients carry more than the article's: who, where, since.
    expires = utcnow().replace(microsecond=0) + datetime.timedelta(seconds=30)
    leases.insert_one(
        {
            "_id": KEY,
            "owner": "node-a",
            "host": "billing-7.internal",
            "pid": 4242,
            "generation": 3,
            "expiresAt": expires,
        }
    )
    outcome = task_call(recipe_url, "task-1")
    assert isinstance(outcome, outcomes.Skipped)
    assert (
        "a MongoDB TTL-lease document in job_leases (owner 'node-a', "
        "host 'billing-7.internal', pid 4242, generation 3, "
        f"expiresAt {expires.strftime('%Y-%m-%dT%H:%M:%S')}.000Z)"
    ) in outcome.holder


def test_a_foreign_takeover_is_named_without_the_record_we_left_in_it(recipe_store, leases):
    ours = recipe_store.try_acquire(KEY, owner(), 0.3, holder={"task_id": "ours-1"})
    time.sleep(0.4)
    theirs = node(leases)
    assert theirs.acquire()  # their takeover keeps the fields it does not set
    [info] = recipe_store.holders_of(KEY)
    assert f"owner '{theirs.node}'" in info.holder["foreign"]
    assert ours.owner not in info.holder["foreign"]
    assert "ours-1" not in info.holder["foreign"]


def test_a_foreign_document_s_long_fields_are_cut_in_its_name(recipe_store, leases):
    fields = {f"field{i}": "x" * 10_000 for i in range(20)}
    expires = utcnow() + datetime.timedelta(seconds=60)
    leases.insert_one({"_id": KEY, "owner": "node-a", **fields, "expiresAt": expires})
    named = recipe_store.holders_of(KEY)[0].holder["foreign"]
    assert named.startswith("a MongoDB TTL-lease document in job_leases (owner 'node-a', ")
    assert "more fields" in named and len(named) < 1_000


# --- our holder ---------------------------------------------------------------------------


def test_our_holder_makes_the_article_s_acquire_fail_until_we_release(recipe_url, leases):
    theirs = node(leases)
    with ExclusiveLock(KEY, recipe_url, ttl=2.0) as lease:
        assert theirs.acquire() is False
        time.sleep(3.0)  # renewed past its ttl: still ours
        assert theirs.acquire() is False
        assert lease.held
    assert theirs.acquire()
    assert leases.find_one({"_id": KEY})["generation"] == 1  # a new document


def test_our_lease_left_to_expire_is_taken_over_by_the_article_and_reported_lost(
    recipe_store, leases
):
    lease = recipe_store.try_acquire(KEY, owner(), 1.0)
    theirs = node(leases)
    assert theirs.acquire() is False
    time.sleep(1.2)  # our holder hung: no renewal
    assert theirs.acquire()
    assert recipe_store.renew([lease]) == {lease}
    assert recipe_store.release(lease) is False
    assert theirs.renew()  # our release left their document alone
    assert held_by_foreign(recipe_store, KEY)


def test_force_release_deletes_ours_and_leaves_a_foreign_lease(recipe_store, leases):
    ours = recipe_store.try_acquire(KEY, owner(), 10)
    assert recipe_store.force_release(KEY) == 1
    assert recipe_store.renew([ours]) == {ours}
    theirs = node(leases)
    assert theirs.acquire()
    assert recipe_store.force_release(KEY) == 0
    assert theirs.renew()


def test_the_ttl_monitor_collects_an_expired_lease_and_nothing_of_the_store_s_own(
    mongo_server, recipe_store, leases
):
    if not hasattr(mongo_server, "store"):
        pytest.skip("a real server's TTL monitor runs on its own schedule")
    lease = recipe_store.try_acquire(KEY, owner(), 0.2)
    recipe_store.write_record(lease, "r", "1")
    time.sleep(0.3)
    assert mongo_server.store.ttl_pass() >= 1
    assert leases.find_one({"_id": KEY}) is None
    assert recipe_store.read_record(KEY, "r") == "1"
    assert recipe_store.try_acquire(KEY, owner(), 10).fencing_token > lease.fencing_token


def test_a_ttl_index_of_the_user_s_own_on_expires_at_is_kept(recipe_url, leases):
    leases.create_index("expiresAt", expireAfterSeconds=3600)
    store = _load(recipe_url)
    assert store.try_acquire(KEY, owner(), 10) is not None  # no IndexOptionsConflict
    store.close()


# --- what the recipe refuses --------------------------------------------------------------


def test_a_limit_is_refused_naming_the_fix(recipe_store):
    with pytest.raises(ConfigurationError, match="does not offer limits.*use a store that does"):
        leases_of_core.acquire(recipe_store, KEY, 10, limit=2)


@pytest.mark.parametrize("collection", [COLLECTION, "system.js", "a$b"])
def test_a_collection_that_cannot_hold_lease_documents_is_refused(recipe_url, collection):
    with pytest.raises(ConfigurationError, match="collection="):
        _load(f"{recipe_url}&collection={collection}")


def test_an_unknown_recipe_is_refused_naming_the_one_there_is(mongo_server):
    with pytest.raises(ConfigurationError, match="its recipes: ttl-lease"):
        _load(f"{mongo_server.url}/db?recipe=lease")


# --- both kinds at once -------------------------------------------------------------------


def test_tasks_and_article_nodes_on_one_key_never_overlap(recipe_url, leases):
    spans, lock = [], ExclusiveLock(KEY, recipe_url, wait=60)

    def ours() -> None:
        with lock:
            start = time.time()
            time.sleep(0.1)
            spans.append((start, time.time()))

    def theirs() -> None:
        lease = node(leases)
        for _ in range(2):
            assert lease.acquire_waiting(60)
            start = time.time()
            time.sleep(0.1)
            spans.append((start, time.time()))
            lease.release()

    threads = [threading.Thread(target=f) for f in (ours, theirs) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    spans.sort()
    assert len(spans) == 9
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_our_waiter_never_sees_the_key_free_while_the_article_holds_it(recipe_store, leases):
    theirs = node(leases)
    assert theirs.acquire()
    started = time.monotonic()
    recipe_store.wait(KEY, 0.5)
    assert time.monotonic() - started >= 0.45
    assert wait_until(lambda: theirs.release(), timeout=10)
