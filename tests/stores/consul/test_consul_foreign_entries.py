"""The Consul store never deletes or rewrites an entry it did not write: another
client's entries under a key's folder (HashiCorp's Go client, transcribed in
tests/support/consul_api.py) survive the store's acquires, releases, tidying and
force-releases, and its holders keep their slots."""

from __future__ import annotations

import json
import uuid
from urllib.parse import urlsplit

import pytest

from celery_exclusive.backends.consul import ConsulBackend
from celery_exclusive.errors import ConfigurationError
from tests.support import consul_api as api
from tests.support.consul_emulator import ConsulEmulator, EmulatedConsul


@pytest.fixture
def emulator(consul_server) -> ConsulEmulator:
    if not isinstance(consul_server, EmulatedConsul):
        pytest.skip("looks inside the emulator")
    return consul_server.emulator


@pytest.fixture
def go(consul_server) -> api.Client:
    """HashiCorp's client, on the same agent."""
    parts = urlsplit(consul_server.url)
    return api.Client(f"http://{parts.hostname}:{parts.port}")


@pytest.fixture
def backend(consul_url):
    made = ConsulBackend(consul_url)
    yield made
    made.close()


def test_a_go_semaphore_in_a_keys_folder_keeps_its_record_and_its_holders_their_slots(
    backend, go, emulator
):
    key = f"reports:{uuid.uuid4().hex}"
    where = backend.layout.sem(key)  # Go pointed at the store's own path
    go_holders = [api.Semaphore(go, api.SemaphoreOptions(Prefix=where, Limit=2)) for _ in "ab"]
    lost = [holder.Acquire() for holder in go_holders]
    record = emulator.kv[f"{where}/.lock"]["Value"]

    lease = backend.try_acquire(key, uuid.uuid4().hex, 10.0, limit=2)
    assert lease is not None
    assert backend.release(lease)

    assert emulator.kv[f"{where}/.lock"]["Value"] == record
    assert not any(event.is_set() for event in lost), "a Go holder was told it lost its slot"
    for holder in go_holders:
        holder.Release()


def test_force_release_deletes_only_the_stores_own_entries(backend, go, emulator):
    key = f"reports:{uuid.uuid4().hex}"
    where = backend.layout.sem(key)
    go_holder = api.Semaphore(go, api.SemaphoreOptions(Prefix=where, Limit=2))
    lost = go_holder.Acquire()
    assert backend.try_acquire(key, uuid.uuid4().hex, 10.0, limit=2) is not None

    assert backend.force_release(key) == 1
    assert f"{where}/.lock" in emulator.kv and not lost.is_set()
    go_holder.Release()


def test_a_go_lock_left_at_a_keys_lock_path_is_refused_by_name_and_left_as_it_is(
    backend, go, emulator
):
    key = f"invoice:{uuid.uuid4().hex}"
    path = backend.layout.lock(key)
    lock = api.Lock(go, api.LockOptions(Key=path, Value=b"go service"))
    lock.Lock()
    assert backend.try_acquire(key, uuid.uuid4().hex, 10.0) is None  # held: a duplicate
    lock.Unlock()  # api.Lock's release leaves the key, unlocked

    with pytest.raises(ConfigurationError, match="written by another client") as info:
        backend.try_acquire(key, uuid.uuid4().hex, 10.0)
    assert path in str(info.value)
    entry = emulator.kv[path]
    assert (entry["Value"], entry["Flags"]) == (b"go service", api.LOCK_FLAG_VALUE)


def test_the_stores_own_unlocked_leftover_is_taken_over(consul_url, emulator):
    """A ``behavior=release`` session that died leaves its lock entry unlocked."""
    key = f"invoice:{uuid.uuid4().hex}"
    first = ConsulBackend(consul_url + "&behavior=release")
    lease = first.try_acquire(key, uuid.uuid4().hex, 10.0)
    emulator.invalidate(first.connection.process().session_id)
    leftover = emulator.kv[first.layout.lock(key)]
    assert leftover["Session"] is None and json.loads(leftover["Value"])["owner"] == lease.owner

    second = ConsulBackend(consul_url)
    grant = second.try_acquire(key, uuid.uuid4().hex, 10.0)
    assert grant is not None and grant.fencing_token > lease.fencing_token
    assert grant.fencing_token == emulator.kv[second.layout.lock(key)]["ModifyIndex"]
    for made in (first, second):
        made.close()
