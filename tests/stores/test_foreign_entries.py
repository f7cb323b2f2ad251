"""Never touch what you did not write: every cleanup path of each store (a release, an
expired holder pruned, a line tidied, force_release) leaves a foreign entry beside the
store's own entries as it found it.

Each spec puts in place what another client of the same store writes next to ours,
runs every kind of write the store makes on that key (:func:`exercise`), and checks
the foreign entries afterwards. Consul has its own (tests/stores/consul); SQLite and
memory stores are files and dicts of this library's own.
"""

from __future__ import annotations

import base64
import json
import time
import uuid

import pymongo
import redis
import requests

from celery_exclusive.backends import _load
from celery_exclusive.backends.line import LINE

KEY = "exclusive:k"


def owner() -> str:
    return uuid.uuid4().hex


def exercise(store, key: str) -> None:
    """Every cleanup path: grant, renewal, record, a line stood in and left, a wait, a
    release that wakes the line, a grant that takes its claimant out of the line, a
    semaphore pruning an expired holder, and force_release."""
    lease = store.try_acquire(key, owner(), 10)
    assert lease is not None
    store.renew([lease])
    store.write_record(lease, "r", "1")
    until = store.store_time() + 10
    store.swap_mark(key, LINE, None, json.dumps([{"id": "w", "until": until}]), 10)
    store.wait(key, 0.05, "w")
    store.release(lease)
    taken = store.try_acquire(key, owner(), 10, claimant="w")
    assert taken is not None
    store.force_release(key)
    semaphore = key + ":pool"
    store.try_acquire(semaphore, owner(), 0.001, limit=2)
    time.sleep(0.05)  # expired: the next grant prunes it
    store.try_acquire(semaphore, owner(), 10, limit=2)
    store.force_release(semaphore)


def test_redis_leaves_foreign_keys_beside_its_own(redis_url):
    client = redis.Redis.from_url(redis_url)
    theirs = client.lock(KEY, timeout=60)  # redis-py's Lock on the key's literal name
    assert theirs.acquire(blocking=False)
    client.set("{exclusive:k}:theirs", "x")  # inside the store's own stem
    client.rpush("{exclusive:k:pool}:signal:theirs", "y")
    store = _load(redis_url)
    exercise(store, KEY)
    assert client.get(KEY) == theirs.local.token
    assert client.ttl(KEY) > 50
    assert client.get("{exclusive:k}:theirs") == b"x"
    assert client.lrange("{exclusive:k:pool}:signal:theirs", 0, -1) == [b"y"]
    store.close()


def test_etcd_never_deletes_a_foreign_entry_among_a_key_s_holders(etcd_url, etcd_server):
    store = _load(etcd_url)
    foreign = store.names.holders(KEY) + b"theirs"  # what etcd's own mutex would write
    gateway = f"http://{etcd_server.endpoint}/v3/kv"

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    requests.post(f"{gateway}/put", json={"key": b64(foreign), "value": ""}, timeout=5)
    assert store.try_acquire(KEY, owner(), 10) is None  # it counts as a holder...
    assert store.force_release(KEY) == 0  # ...which is not ours to free
    exercise(store, "exclusive:other")
    found = requests.post(f"{gateway}/range", json={"key": b64(foreign)}, timeout=5).json()
    assert found.get("count") == "1"
    store.close()


def test_mongodb_leaves_foreign_documents_and_fields_as_they_were(mongodb_url):
    client = pymongo.MongoClient(mongodb_url)
    collection = client.get_default_database()["exclusive_leases"]
    theirs = [{"$set": {"keeper": "theirs"}}]
    collection.update_one({"_id": KEY + ":theirs"}, theirs, upsert=True)
    store = _load(mongodb_url)
    store.swap_mark(KEY, "x", None, "1", 10)  # the key's document exists...
    collection.update_one({"_id": KEY}, [{"$set": {"theirs": {"keeper": "x"}}}])  # ...with theirs
    exercise(store, KEY)
    assert collection.find_one({"_id": KEY + ":theirs"})["keeper"] == "theirs"
    assert collection.find_one({"_id": KEY})["theirs"] == {"keeper": "x"}
    store.close()
    client.close()


def test_postgresql_leaves_foreign_rows_of_its_tables_alone(postgresql_url):
    """A row another tool wrote in the store's tables, with a key_id no key of ours can
    have (the SHA-256 of a key is 32 bytes), survives every cleanup, though expired."""
    store = _load(postgresql_url)
    store.try_acquire("warm-up", owner(), 10)  # creates the tables
    rows = _foreign_rows(store)
    exercise(store, KEY)
    assert _foreign_rows(store) == rows
    store.close()


def _foreign_rows(store) -> list:
    now = "clock_timestamp() - interval '1 hour'"  # expired: what a tidy-up would take

    def rows(conn):
        table = f"{store.connection.settings.schema}.exclusive_leases"
        conn.execute(
            f"INSERT INTO {table} VALUES (%s, 'theirs', %s, 1, 1, {now}, '{{}}') "
            "ON CONFLICT DO NOTHING",
            (b"theirs", b"theirs"),
        )
        return conn.execute(
            f"SELECT owner FROM {table} WHERE key_id = %s",
            (b"theirs",),
        ).fetchall()

    return store.connection.call("test", rows)
