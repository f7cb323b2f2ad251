"""The memory store keeps a holder record as a store that keeps JSON would: a copy of
what it was given, with JSON's values, and refuses what JSON cannot hold."""

from __future__ import annotations

import uuid

import pytest

from celery_exclusive.backends.memory import MemoryBackend


@pytest.fixture
def store() -> MemoryBackend:
    return MemoryBackend(f"memory://records-{uuid.uuid4().hex}")


def test_a_record_changed_by_its_caller_after_the_grant_is_not_changed_in_the_store(store):
    record = {"task": "t", "task_id": "a", "pid": 1, "ttl": 30.0, "note": None}
    store.try_acquire("k", "owner", 30.0, 1, record)
    record["task_id"] = "changed"
    (held,) = store.holders()
    assert held.holder == {"task": "t", "task_id": "a", "pid": 1, "ttl": 30.0, "note": None}


def test_a_record_with_other_values_than_plain_ones_is_kept_as_json_gives_it_back(store):
    store.try_acquire("k", "owner", 30.0, 1, {"task": "t", "slots": (1, 2), "tags": {"a": [1]}})
    (held,) = store.holders()
    assert held.holder == {"task": "t", "slots": [1, 2], "tags": {"a": [1]}}
    assert type(held.holder["slots"]) is list


def test_a_record_json_cannot_hold_is_refused(store):
    with pytest.raises(TypeError):
        store.try_acquire("k", "owner", 30.0, 1, {"task": "t", "when": object()})
