"""HashiCorp's own recipes (api.Lock, api.Semaphore, ``consul lock``), transcribed in
tests/support/consul_api.py, run against the emulator as against Consul: contenders
take turns, the limit holds, the layout is Consul's, and the recipes' own conflict
checks fire only where Go's do."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from tests.support import consul_api as api
from tests.support.consul_emulator import ConsulEmulator


@pytest.fixture
def consul():
    emulator = ConsulEmulator(min_session_ttl=0.1).start()
    yield emulator
    emulator.stop()


@pytest.fixture
def client(consul) -> api.Client:
    return api.Client(f"http://127.0.0.1:{consul.port}")


def prefix() -> str:
    return f"service/{uuid.uuid4().hex[:8]}"


def contend(count: int, body) -> tuple[list[tuple[float, float]], list[str]]:
    """Run ``body(i)`` in ``count`` threads; the (start, end) of each hold and the errors."""
    spans: list[tuple[float, float]] = []
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            spans.append(body(i))
        except api.ConsulAPIError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return spans, errors


def most_at_once(spans: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def test_lock_contenders_take_turns_and_none_fails(client):
    key = prefix() + "/leader"

    def hold(_):
        lock = api.Lock(client, api.LockOptions(Key=key))
        lock.Lock()
        start = time.monotonic()
        time.sleep(0.2)
        end = time.monotonic()
        lock.Unlock()
        return start, end

    spans, errors = contend(3, hold)
    assert errors == [] and len(spans) == 3
    assert most_at_once(spans) == 1


def test_an_unlocked_lock_key_stays_with_its_flag_until_destroyed(client, consul):
    key = prefix() + "/leader"
    lock = api.Lock(client, api.LockOptions(Key=key, Value=b"me"))
    lock.Lock()
    assert consul.kv[key]["Flags"] == api.LOCK_FLAG_VALUE and consul.kv[key]["Session"]
    lock.Unlock()
    assert consul.kv[key]["Session"] is None and consul.kv[key]["Value"] == b"me"
    lock.Destroy()
    assert key not in consul.kv


def test_a_lock_on_a_key_with_other_flags_is_a_conflict(client):
    key = prefix() + "/config"
    client.kv().Put(api.KVPair(Key=key, Value=b"not a lock"))
    with pytest.raises(api.ConsulAPIError, match="Existing key does not match lock use"):
        api.Lock(client, api.LockOptions(Key=key)).Lock()


def test_a_lock_is_lost_when_its_session_is_invalidated(client, consul):
    key = prefix() + "/leader"
    lost = api.Lock(client, api.LockOptions(Key=key)).Lock()
    consul.invalidate(consul.kv[key]["Session"])
    assert lost.wait(5)


def test_semaphore_admits_its_limit_and_none_fails(client):
    where = prefix()

    def hold(_):
        semaphore = api.Semaphore(client, api.SemaphoreOptions(Prefix=where, Limit=2))
        semaphore.Acquire()
        start = time.monotonic()
        time.sleep(0.3)
        end = time.monotonic()
        semaphore.Release()
        return start, end

    spans, errors = contend(4, hold)
    assert errors == [] and len(spans) == 4
    assert most_at_once(spans) == 2


def test_a_semaphore_keeps_consuls_layout(client, consul):
    where = prefix()
    semaphore = api.Semaphore(client, api.SemaphoreOptions(Prefix=where, Limit=3))
    semaphore.Acquire()
    [session] = [s.id for s in consul.sessions.values()]
    record = consul.kv[f"{where}/.lock"]
    assert json.loads(record["Value"]) == {"Limit": 3, "Holders": {session: True}}
    assert record["Flags"] == api.SEMAPHORE_FLAG_VALUE and record["Session"] is None
    contender = consul.kv[f"{where}/{session}"]
    assert contender["Session"] == session and contender["Flags"] == api.SEMAPHORE_FLAG_VALUE
    semaphore.Release()
    assert json.loads(consul.kv[f"{where}/.lock"]["Value"])["Holders"] == {}
    semaphore.Destroy()
    assert not [k for k in consul.kv if k.startswith(where)]


def test_a_holder_without_a_live_contender_entry_is_pruned(client, consul):
    where = prefix()
    first = api.Semaphore(client, api.SemaphoreOptions(Prefix=where, Limit=1))
    first.Acquire()
    [session] = [s.id for s in consul.sessions.values()]
    consul.invalidate(session)  # a delete session: its contender entry goes with it
    second = api.Semaphore(client, api.SemaphoreOptions(Prefix=where, Limit=1))
    assert second.Acquire() is not None
    holders = json.loads(consul.kv[f"{where}/.lock"]["Value"])["Holders"]
    assert session not in holders and len(holders) == 1


def test_consul_lock_locks_prefix_dot_lock_and_cleans_it_up(client, consul):
    where = prefix()
    seen = {}

    def child(lost):
        seen.update(consul.kv)
        return "ran"

    outcome = api.consul_lock(client, where, child, child_name="./job")
    assert outcome == {"acquired": True, "lost": False, "result": "ran", "error": None}
    assert seen[f"{where}/.lock"]["Flags"] == api.LOCK_FLAG_VALUE
    assert f"{where}/.lock" not in consul.kv  # Destroy after the release


def test_consul_lock_and_consul_lock_n_on_one_prefix_conflict(client):
    where = prefix()

    def nested(lost):
        return api.consul_lock(client, where, lambda lost: None, limit=2, timeout=1)

    outcome = api.consul_lock(client, where, nested)
    assert outcome["result"]["error"] == (
        "Lock acquisition failed: Existing key does not match semaphore use"
    )
