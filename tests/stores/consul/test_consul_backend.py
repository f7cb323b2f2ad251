"""What the Consul backend does beyond the contract suite.

Tests that look inside the emulator (its sessions, KV, request log) are skipped when the
suite runs against a real agent (CONSUL_HTTP_ADDR, or a ``consul`` binary).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from celery_exclusive.backends import Lease
from celery_exclusive.backends.consul import MIN_SESSION_TTL, ConsulBackend, ConsulConnection
from celery_exclusive.backends.consul.kv import pack_mark, unpack_mark
from celery_exclusive.backends.line import LINE
from celery_exclusive.core import marks
from tests.support.consul_emulator import ConsulEmulator, EmulatedConsul


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def emulator(consul_server) -> ConsulEmulator:
    if not isinstance(consul_server, EmulatedConsul):
        pytest.skip("looks inside the emulator")
    return consul_server.emulator


@pytest.fixture
def backends(consul_url):
    """Build backends on the test's KV folder (one per simulated process); closes them."""
    made = []

    def make(query: str = "") -> ConsulBackend:
        made.append(ConsulBackend(consul_url + (f"&{query}" if query else "")))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def session_of(backend: ConsulBackend) -> str:
    return backend.connection.process().session_id


def folder_entries(emulator: ConsulEmulator, backend: ConsulBackend) -> list[str]:
    return [k for k in emulator.kv if k.startswith(backend.connection.settings.root)]


# --- sessions -------------------------------------------------------------------------


def test_a_short_ttl_is_clamped_to_consuls_minimum_with_one_warning(
    backends, monkeypatch, caplog, emulator
):
    monkeypatch.setattr(ConsulConnection, "min_session_ttl", MIN_SESSION_TTL)
    backend = backends()
    with caplog.at_level(logging.WARNING, logger="celery_exclusive"):
        first = backend.try_acquire("a", owner(), 2)
        second = backend.try_acquire("b", owner(), 2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "10s" in warnings[0].getMessage()
    assert emulator.sessions[session_of(backend)].ttl == MIN_SESSION_TTL
    assert first.ttl == second.ttl == 2


def test_leases_of_one_process_share_one_session(backends, emulator):
    backend = backends()
    creates = sum(1 for r in emulator.requests if r == ("PUT", "/v1/session/create"))
    backend.try_acquire("a", owner(), 10)
    backend.try_acquire("b", owner(), 30)
    backend.try_acquire("c", owner(), 10, limit=3)
    after = sum(1 for r in emulator.requests if r == ("PUT", "/v1/session/create"))
    assert after - creates == 1
    holders = {
        e["Session"]
        for k, e in emulator.kv.items()
        if e["Session"] and k.startswith(backend.connection.settings.root)
    }
    assert holders == {session_of(backend)}


def test_the_session_ttl_comes_from_the_first_lease_and_bounds_later_leases(backends, emulator):
    backend = backends()
    backend.try_acquire("a", owner(), 12)
    later = backend.try_acquire("b", owner(), 60)
    assert emulator.sessions[session_of(backend)].ttl == 12
    assert later.ttl == 12  # so the heartbeat renews often enough for the session


def test_a_grant_on_a_session_idle_for_most_of_its_life_still_lives_its_ttl(backends):
    """An idle process's heartbeat renews nothing; Consul invalidates a session 2 x TTL
    after its last renewal, so a key locked late in that span would die early."""
    backend = backends()
    first = backend.try_acquire("idle-a", owner(), 1.0)
    backend.release(first)
    time.sleep(1.6)  # the session, last renewed at its creation, has 0.4 s left
    late = backend.try_acquire("idle-b", owner(), 1.0)
    time.sleep(0.9)  # within the new lease's ttl, past the session's old deadline
    assert backend.renew([late]) == set()


def test_a_forked_child_opens_its_own_session(backends, monkeypatch):
    backend = backends()
    backend.try_acquire("a", owner(), 10)
    parent = session_of(backend)
    monkeypatch.setattr("os.getpid", lambda: 999_999)
    backend.try_acquire("b", owner(), 10)
    assert session_of(backend) not in (None, parent)


def test_sessions_are_not_bound_to_node_health_and_delete_their_keys(backends, emulator):
    backend = backends()
    backend.try_acquire("a", owner(), 10)
    session = emulator.sessions[session_of(backend)]
    assert (session.checks, session.behavior) == ([], "delete")


def test_renewal_answered_404_loses_every_lease_and_a_new_session_follows(backends, emulator):
    backend = backends()
    leases = [backend.try_acquire(k, owner(), 10) for k in ("a", "b")]
    leases.append(backend.try_acquire("c", owner(), 10, limit=2))
    old = session_of(backend)
    emulator.invalidate(old)
    assert backend.renew(leases) == set(leases)
    assert session_of(backend) is None
    again = backend.try_acquire("a", owner(), 10)
    assert again is not None and session_of(backend) not in (None, old)
    assert backend.renew([again]) == set()


def test_an_acquire_on_a_dead_session_opens_a_new_one_and_retries(backends, emulator):
    backend = backends()
    backend.try_acquire("a", owner(), 10)
    old = session_of(backend)
    emulator.invalidate(old)  # the process does not know yet
    assert backend.try_acquire("b", owner(), 10) is not None
    assert session_of(backend) not in (None, old)


def test_close_frees_its_keys_at_once_even_with_a_lock_delay(consul_url, emulator):
    url = consul_url.replace("?lock_delay=0", "")
    backend, other = ConsulBackend(url), ConsulBackend(url)
    try:
        backend.try_acquire("a", owner(), 10)
        session = session_of(backend)
        backend.close()
        assert session not in emulator.sessions
        assert other.try_acquire("a", owner(), 10) is not None
    finally:
        other.close()


# --- KV: exact reads, nothing left behind ---------------------------------------------------


def test_release_deletes_the_key(backends, emulator):
    backend = backends()
    backend.release(backend.try_acquire("a", owner(), 10))
    backend.release(backend.try_acquire("b", owner(), 10, limit=2))
    assert folder_entries(emulator, backend) == []


def test_kv_stays_flat_over_10000_acquire_release_cycles(backends, emulator):
    workers = [backends() for _ in range(4)]
    sizes: list[int] = []
    failures: list[str] = []

    def cycle(backend: ConsulBackend, offset: int) -> None:
        for i in range(2500):  # x 4 workers: 10,000 cycles over 40 keys, 1 in 10 a semaphore
            key = f"job:{(offset + i) % 40}"
            # ttl 60: no heartbeat runs here, and the session must outlive the loop
            lease = backend.try_acquire(key, owner(), 60, limit=2 if i % 10 == 0 else 1)
            if lease is not None and not backend.release(lease):
                failures.append(key)
            if i % 500 == 0:
                sizes.append(len(folder_entries(emulator, backend)))

    threads = [threading.Thread(target=cycle, args=(w, n * 10)) for n, w in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert max(sizes) <= 8  # at most the keys held at that instant (two per semaphore)
    assert folder_entries(emulator, workers[0]) == []


def test_a_renewal_reads_only_its_own_keys(backends, emulator):
    worker, neighbour = backends(), backends()
    lease = worker.try_acquire("invoice:1", owner(), 10)
    for i in range(100):
        neighbour.try_acquire(f"invoice:1{i:04d}", owner(), 10, holder={"x": "y" * 200})
    before = len(emulator.answer_sizes)
    assert worker.renew([lease]) == set()
    assert sum(emulator.answer_sizes[before:]) < 2000


def test_wait_reads_only_its_own_key(backends, emulator):
    worker, neighbour = backends(), backends()
    for i in range(100):
        neighbour.try_acquire(f"invoice:1{i:04d}", owner(), 10, holder={"x": "y" * 200})
    before = len(emulator.answer_sizes)
    started = time.monotonic()
    worker.wait("invoice:1", timeout=10)
    assert time.monotonic() - started < 5.0  # free: no wait for the timeout
    assert sum(emulator.answer_sizes[before:]) < 2000


# --- fencing tokens, semaphores, wait ----------------------------------------------------


def test_fencing_tokens_are_modify_indexes_that_keep_growing_across_deletes(backends, emulator):
    backend = backends()
    tokens = []
    for _ in range(3):
        lease = backend.try_acquire("k", owner(), 10)
        assert lease.fencing_token == emulator.kv[backend.layout.lock("k")]["ModifyIndex"]
        tokens.append(lease.fencing_token)
        backend.release(lease)  # deletes the key: LockIndex would start again at 1
    assert tokens == sorted(set(tokens))


def test_a_dead_contender_is_pruned_from_the_semaphore(backends, emulator):
    doomed, alive, newcomer = backends(), backends(), backends()
    dead = doomed.try_acquire("k", owner(), 10, limit=2)
    assert alive.try_acquire("k", owner(), 10, limit=2) is not None
    assert newcomer.try_acquire("k", owner(), 10, limit=2) is None
    emulator.invalidate(session_of(doomed))  # behavior=delete: its contender entry goes
    granted = newcomer.try_acquire("k", owner(), 10, limit=2)
    assert granted is not None
    import json

    sem = emulator.kv[newcomer.layout.sem("k")]
    holders = json.loads(sem["Value"])["Holders"]
    assert dead.owner not in holders and granted.owner in holders and len(holders) == 2
    assert granted.fencing_token == sem["ModifyIndex"]


def test_wait_is_woken_by_a_release_through_a_blocking_query(backends, emulator):
    holder, waiter = backends(), backends()
    lease = holder.try_acquire("k", owner(), 10)
    waiter.wait("k", timeout=0.01)  # warm up: the session, the connection
    before = len(emulator.requests)
    threading.Timer(0.4, holder.release, [lease]).start()
    started = time.monotonic()
    waiter.wait("k", timeout=10)
    waited = time.monotonic() - started
    assert 0.3 < waited < 5.0
    reads = [r for r in emulator.requests[before:] if r[0] == "GET"]
    assert len(reads) <= 3  # an index, one blocking query: no polling


def test_a_semaphore_wait_is_woken_when_a_slot_frees(backends):
    holder, waiter = backends(), backends()
    leases = [holder.try_acquire("k", owner(), 10, limit=2) for _ in range(2)]
    threading.Timer(0.3, holder.release, [leases[0]]).start()
    started = time.monotonic()
    waiter.wait("k", timeout=10)
    assert time.monotonic() - started < 5.0
    assert waiter.try_acquire("k", owner(), 10, limit=2) is not None


def test_an_operator_force_release_is_reported_by_the_next_renewal(backends):
    worker, operator = backends(), backends()
    lease = worker.try_acquire("k", owner(), 10)
    assert operator.force_release("k") == 1
    assert worker.renew([lease]) == {lease}
    assert worker.release(lease) is False


def test_holders_show_other_processes_leases_with_their_session_ttl(backends):
    worker, cli = backends(), backends()
    lease = worker.try_acquire("app:k", owner(), 15, holder={"task_id": "t-9"})
    worker.try_acquire("app:kk", owner(), 15)
    infos = [info for info in cli.holders("app:") if info.key == "app:k"]
    assert [(i.owner, i.fencing_token, i.task_id, i.expires_in) for i in infos] == [
        (lease.owner, lease.fencing_token, "t-9", 15)
    ]


# --- another process frees a lease (the worker's main process, for a killed child) ---------


@pytest.mark.parametrize("limit", [1, 2])
def test_another_process_frees_a_lease_with_its_owner_and_token_at_once(backends, limit):
    child, main, newcomer = backends(), backends(), backends()
    held = child.try_acquire("k", owner(), 30, limit=limit)
    [info] = main.holders_of("k")
    assert main.release(Lease("k", info.owner, info.fencing_token or 0, 0.0, limit)) is True
    assert main.holders_of("k") == []
    assert newcomer.try_acquire("k", owner(), 10, limit=limit) is not None
    assert child.renew([held]) == {held}


def test_another_process_cannot_free_a_lease_without_its_owner(backends):
    child, main = backends(), backends()
    held = child.try_acquire("k", owner(), 30)
    assert main.release(Lease("k", owner(), held.fencing_token, 0.0, 1)) is False
    assert child.renew([held]) == set()


# --- the store's clock ---------------------------------------------------------------------


def test_store_time_is_the_agents_clock(backends, emulator, monkeypatch):
    monkeypatch.setattr(emulator, "clock_offset", 3600.0)
    backend = backends()
    first = backend.store_time()
    assert abs(first - (time.time() + 3600)) < 2
    time.sleep(0.05)
    assert backend.store_time() > first


def test_marks_expire_by_the_agents_clock_not_the_workers(backends, emulator, monkeypatch):
    writer = backends()
    assert writer.swap_mark("m", "x", None, "v", 30)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)  # this worker's clock: 1 h fast
    monkeypatch.setattr(emulator, "clock_offset", -3600.0)  # the agent's: right
    assert backends().read_mark("m", "x") == "v"


# --- marks and lines ---------------------------------------------------------------------


def _line_for(backend: ConsulBackend, key: str, claimant: str, ttl: float = 10) -> None:
    marks.take_place(backend, key, claimant, ttl)


def _since(emulator: ConsulEmulator, before: int) -> list[tuple[str, str]]:
    return emulator.requests[before:]


def _after_first(monkeypatch, backend: ConsulBackend, method: str, meddle) -> None:
    """Run ``meddle`` right after ``backend``'s first ``method`` read (of its
    connection): another writer slipping in between a read and the write it guards."""
    read = getattr(backend.connection, method)
    done = []

    def read_then_meddle(*args, **kwargs):
        result = read(*args, **kwargs)
        if not done:
            done.append(True)
            meddle()
        return result

    monkeypatch.setattr(backend.connection, method, read_then_meddle)


def test_a_mark_is_its_expiry_and_raw_value_in_the_keys_folder(backends, emulator):
    backend = backends()
    before = backend.store_time()
    backend.swap_mark("app/jobs:7", "queued", None, 'say "hi"', 30)
    entry = emulator.kv[backend.layout.mark("app/jobs:7", "queued")]
    value, expires_at = unpack_mark(entry["Value"])
    assert value == 'say "hi"' and before + 29 <= expires_at <= backend.store_time() + 30
    assert entry["Session"] is None and unpack_mark(pack_mark("a\nb", 1.5)) == ("a\nb", 1.5)


def test_names_with_slashes_and_colons_are_marks_of_their_own(backends):
    backend = backends()
    assert backend.swap_mark("app/jobs:7", "queued", None, "a", 10)
    assert backend.swap_mark("app/jobs:7/x", "queued", None, "b", 10)
    assert backend.read_mark("app/jobs:7", "queued") == "a"
    assert backend.read_mark("app/jobs:7/x", "queued") == "b"
    assert backend.read_mark("app/jobs", "queued") is None


def test_a_swap_is_one_read_and_one_write(backends, emulator):
    backend = backends()
    backend.store_time()
    before = len(emulator.requests)
    backend.swap_mark("m", "x", None, "a", 10)
    assert [method for method, _ in _since(emulator, before)] == ["GET", "PUT"]


def test_a_swap_whose_write_loses_to_an_equal_value_compares_again(backends, monkeypatch):
    backend, rival = backends(), backends()
    backend.swap_mark("m", "x", None, "a", 10)
    # The rival refreshes the mark (same value, new ModifyIndex) between read and CAS.
    _after_first(monkeypatch, backend, "get", lambda: rival.swap_mark("m", "x", "a", "a", 10))
    assert backend.swap_mark("m", "x", "a", "b", 10) is True
    assert backend.read_mark("m", "x") == "b"


def test_a_swap_whose_write_loses_to_another_value_fails(backends, monkeypatch):
    backend, rival = backends(), backends()
    backend.swap_mark("m", "x", None, "a", 10)
    _after_first(monkeypatch, backend, "get", lambda: rival.swap_mark("m", "x", "a", "c", 10))
    assert backend.swap_mark("m", "x", "a", "b", 10) is False
    assert backend.read_mark("m", "x") == "c"


def test_concurrent_creates_have_exactly_one_winner(backends):
    stores = [backends() for _ in range(6)]
    barrier = threading.Barrier(len(stores))
    won: list[bool] = []

    def create(store, value):
        barrier.wait()
        won.append(store.swap_mark("m", "x", None, value, 10))

    threads = [threading.Thread(target=create, args=(s, str(i))) for i, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(won) == [False] * 5 + [True]


def test_concurrent_increments_by_compare_and_swap_lose_no_update(backends):
    stores = [backends() for _ in range(4)]

    def increment(store):
        for _ in range(10):
            while True:
                current = store.read_mark("m", "count")
                if store.swap_mark("m", "count", current, str(int(current or 0) + 1), 30):
                    break

    threads = [threading.Thread(target=increment, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stores[0].read_mark("m", "count") == "40"


def test_an_expired_mark_is_replaced_in_place_or_deleted(backends, emulator):
    backend = backends()
    path = backend.layout.mark("m", "x")
    backend.swap_mark("m", "x", None, "a", 0.1)
    time.sleep(0.2)
    assert path in emulator.kv  # KV has no TTL: it lingers, reading as absent
    assert backend.swap_mark("m", "x", None, None, 10) is True
    assert path not in emulator.kv


def test_force_release_leaves_the_line_alone(backends):
    backend = backends()
    backend.try_acquire("k", owner(), 10)
    _line_for(backend, "k", "nightly")
    assert backend.force_release("k") == 1
    assert marks.line_of(backend, "k") == ["nightly"]


def test_an_acquire_with_no_line_is_one_transaction(backends, emulator):
    backend = backends()
    backend.try_acquire("warm-up", owner(), 10)  # opens the session
    before = len(emulator.requests)
    assert backend.try_acquire("k", owner(), 10) is not None
    assert _since(emulator, before) == [("PUT", "/v1/txn")]


def test_an_acquire_past_a_line_reads_it_and_transacts_again(backends, emulator):
    backend = backends()
    backend.try_acquire("warm-up", owner(), 10)
    _line_for(backend, "k", "nightly")
    before = len(emulator.requests)
    assert backend.try_acquire("k", owner(), 10, claimant="nightly") is not None
    line = "/v1/kv/" + backend.layout.mark("k", LINE)
    assert _since(emulator, before) == [("PUT", "/v1/txn"), ("GET", line), ("PUT", "/v1/txn")]


def test_a_semaphore_acquire_reads_the_line_with_its_folder(backends, emulator):
    backend = backends()
    backend.try_acquire("warm-up", owner(), 10)
    _line_for(backend, "k", "nightly")
    before = len(emulator.requests)
    assert backend.try_acquire("k", owner(), 10, limit=2, claimant="nightly") is not None
    assert _since(emulator, before) == [("PUT", "/v1/txn"), ("PUT", "/v1/txn")]


@pytest.mark.parametrize("limit", [1, 2])
def test_a_refusing_line_writes_nothing(backends, emulator, limit):
    backend = backends()
    backend.try_acquire("warm-up", owner(), 10)  # opens the session
    for claimant in ("nightly", "repair"):  # as many waiters as free slots, or more
        _line_for(backend, "k", claimant)
    index = emulator.state.kv.index
    assert backend.try_acquire("k", owner(), 10, limit=limit) is None
    assert emulator.state.kv.index == index


@pytest.mark.parametrize("limit, read", [(1, "get"), (2, "read")])
def test_a_line_changed_between_read_and_grant_refuses_the_grant(
    backends, monkeypatch, limit, read
):
    backend, rival = backends(), backends()
    if limit > 1:
        rival.try_acquire("k", owner(), 10, limit=limit)  # one slot left
    _line_for(backend, "k", "nightly")
    _after_first(
        monkeypatch,
        backend,
        read,
        lambda: marks.take_place(rival, "k", "repair", 10, priority=True),
    )
    assert backend.try_acquire("k", owner(), 10, limit=limit, claimant="nightly") is None
    assert marks.line_of(rival, "k") == ["repair", "nightly"]
    assert rival.try_acquire("k", owner(), 10, limit=limit, claimant="repair") is not None


@pytest.mark.parametrize("limit", [1, 2])
def test_an_expired_line_is_tidied_by_the_next_grant(backends, emulator, limit):
    backend = backends()
    _line_for(backend, "k", "nightly", ttl=0.1)
    time.sleep(0.2)
    assert backend.try_acquire("k", owner(), 10, limit=limit) is not None
    assert backend.layout.mark("k", LINE) not in emulator.kv


def test_a_place_in_line_survives_a_refused_grant(backends):
    holder, claimant = backends(), backends()
    holder.try_acquire("k", owner(), 10)
    _line_for(holder, "k", "nightly")
    assert claimant.try_acquire("k", owner(), 10, claimant="nightly") is None  # still held
    assert marks.line_of(claimant, "k") == ["nightly"]


def test_a_grant_past_a_longer_line_keeps_the_rest_of_it_in_one_transaction(backends, emulator):
    backend = backends()
    backend.try_acquire("warm-up", owner(), 10)
    for claimant in ("first", "second"):
        _line_for(backend, "k", claimant)
    before = len(emulator.requests)
    assert backend.try_acquire("k", owner(), 10, claimant="first") is not None
    assert [method for method, _ in _since(emulator, before)] == ["PUT", "GET", "PUT"]
    assert marks.line_of(backend, "k") == ["second"]
