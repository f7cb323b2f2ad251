"""What the Consul backend does beyond the contract suite, and the emulator's own rules.

Most tests look inside the emulator (its sessions, its request log); they are skipped
when the suite runs against a real agent (CONSUL_HTTP_ADDR or a ``consul`` binary).

python-consul2 (the ``consul`` extra) and py-consul install the same module; to run
these tests on py-consul, use a clean virtualenv (not --system-site-packages)::

    python3 -m venv /tmp/pyconsul && /tmp/pyconsul/bin/pip install -e . celery redis \
        pytest pytest-timeout py-consul
    /tmp/pyconsul/bin/python -m pytest tests/test_backend_contract.py \
        tests/test_consul_backend.py -k consul
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import pytest
import requests

from celery_exclusive import marks
from celery_exclusive.backends.consul import (
    MIN_SESSION_TTL,
    ConsulBackend,
    parse_duration,
    settings_from_url,
    timeout_keyword,
)
from celery_exclusive.backends.line import line_mark
from celery_exclusive.errors import ConfigurationError
from tests.consul_emulator import ConsulEmulator, EmulatedConsul


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
        made.append(ConsulBackend(consul_url + query))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def session_of(backend: ConsulBackend) -> str:
    return backend._process().session_id


# --- URL and environment -------------------------------------------------------------


def test_url_gives_address_token_dc_and_session_options():
    settings = settings_from_url(
        "consuls://consul.example:8443/tenants/a?token=t0k&dc=eu1&behavior=delete&lock_delay=2.5",
        environ={"CONSUL_HTTP_ADDR": "elsewhere:1", "CONSUL_HTTP_TOKEN": "env"},
    )
    assert (settings.scheme, settings.host, settings.port) == ("https", "consul.example", 8443)
    assert (settings.token, settings.dc, settings.root) == ("t0k", "eu1", "tenants/a/")
    assert (settings.behavior, settings.lock_delay) == ("delete", 2.5)


def test_an_empty_url_falls_back_to_the_environment_then_defaults():
    env = {"CONSUL_HTTP_ADDR": "https://10.0.0.5:8501", "CONSUL_HTTP_TOKEN": "env-token"}
    settings = settings_from_url("consul://", environ=env)
    assert (settings.scheme, settings.host, settings.port) == ("https", "10.0.0.5", 8501)
    assert settings.token == "env-token"
    assert settings.behavior == "release" and settings.lock_delay == 0
    bare = settings_from_url("consul://", environ={"CONSUL_HTTP_ADDR": "127.0.0.2:9500"})
    assert (bare.scheme, bare.host, bare.port, bare.token) == ("http", "127.0.0.2", 9500, None)
    default = settings_from_url("consuls://", environ={})
    assert (default.scheme, default.host, default.port) == ("https", "127.0.0.1", 8501)


@pytest.mark.parametrize("query", ["behavior=keep", "lock_delay=-1", "lock_delay=soon", "ttl=5"])
def test_bad_url_options_are_configuration_errors(query):
    with pytest.raises(ConfigurationError, match="exclusive_backend_url"):
        settings_from_url(f"consul://h:8500?{query}", environ={})


def test_the_url_wins_over_consul_http_addr_and_token(monkeypatch, emulator):
    # python-consul2 lets CONSUL_HTTP_ADDR override the host it is given; the URL must win.
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "from-env")
    backend = ConsulBackend(f"{emulator.url}/{uuid.uuid4().hex}?token=from-url")
    try:
        client = backend._client()
        assert client.http.base_uri == f"http://127.0.0.1:{emulator.port}"
        assert client.token == "from-url"
        assert backend.try_acquire("k", owner(), 10) is not None
    finally:
        backend.close()


def test_go_durations_parse():
    assert parse_duration("10s") == 10
    assert parse_duration("1m30s") == 90
    assert parse_duration("500ms") == 0.5


# --- the client's timeout keyword ------------------------------------------------------
# Stand-ins: python-consul2 and py-consul install the same `consul` module, so only
# one of them can be installed at a time. These fakes copy the two signatures.


class FakePythonConsul2:
    """Stand-in for python-consul2: ``timeout`` travels through **kwargs to http_connect."""

    def __init__(self, host="127.0.0.1", port=8500, token=None, **kwargs):
        pass

    @staticmethod
    def http_connect(host, port, scheme, verify=True, cert=None, timeout=None):
        pass


class FakePyConsul:
    """Stand-in for py-consul 1.8: an explicit ``connections_timeout`` keyword."""

    def __init__(self, *args, connections_timeout=30, **kwargs):
        pass

    def http_connect(self, host, port, scheme, verify=True, cert=None):
        pass


class FakeClientWithoutTimeout:
    def __init__(self, host=None, port=None):
        pass

    def http_connect(self, host, port, scheme, verify=True, cert=None):
        pass


def test_the_timeout_keyword_is_detected_for_either_client():
    assert timeout_keyword(FakePythonConsul2) == "timeout"
    assert timeout_keyword(FakePyConsul) == "connections_timeout"
    with pytest.raises(ConfigurationError, match="timeout"):
        timeout_keyword(FakeClientWithoutTimeout)


def test_the_installed_client_gets_a_request_timeout(backends):
    http = backends()._client().http
    assert getattr(http, "timeout", None) == 5.0 or getattr(http, "connections_timeout", 0) == 5.0


# --- sessions -------------------------------------------------------------------------


def test_a_short_ttl_is_clamped_to_consuls_minimum_with_one_warning(
    backends, monkeypatch, caplog, emulator
):
    monkeypatch.setattr(ConsulBackend, "min_session_ttl", MIN_SESSION_TTL)
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
    holders = {entry["Session"] for entry in emulator.state.kv.values() if entry["Session"]}
    assert holders == {session_of(backend)}


def test_the_session_ttl_comes_from_the_first_lease_and_bounds_later_leases(backends, emulator):
    backend = backends()
    backend.try_acquire("a", owner(), 12)
    later = backend.try_acquire("b", owner(), 60)
    assert emulator.sessions[session_of(backend)].ttl == 12
    assert later.ttl == 12  # so the heartbeat renews often enough for the session


def test_a_forked_child_opens_its_own_session(backends, monkeypatch):
    backend = backends()
    backend.try_acquire("a", owner(), 10)
    parent = session_of(backend)
    monkeypatch.setattr("os.getpid", lambda: 999_999)
    backend.try_acquire("b", owner(), 10)
    assert session_of(backend) not in (None, parent)


def test_behavior_and_lock_delay_come_from_the_url(backends, emulator):
    backend = backends("?behavior=delete&lock_delay=0.5")
    backend.try_acquire("a", owner(), 10)
    session = emulator.sessions[session_of(backend)]
    assert (session.behavior, session.lock_delay) == ("delete", 0.5)


def test_renewal_answered_404_loses_every_lease_and_a_new_session_follows(backends, emulator):
    backend = backends()
    leases = [backend.try_acquire(k, owner(), 10) for k in ("a", "b")]
    leases.append(backend.try_acquire("c", owner(), 10, limit=2))
    old = session_of(backend)
    with emulator.changed:
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
    with emulator.changed:
        emulator.invalidate(old)  # the process does not know yet
    assert backend.try_acquire("b", owner(), 10) is not None
    assert session_of(backend) not in (None, old)


def test_close_destroys_the_session_and_frees_its_keys(consul_url, backends, emulator):
    backend = ConsulBackend(consul_url)
    backend.try_acquire("a", owner(), 10)
    session = session_of(backend)
    backend.close()
    assert session not in emulator.sessions
    assert backends().try_acquire("a", owner(), 10) is not None


# --- fencing tokens, semaphores, wait ----------------------------------------------------


def test_fencing_tokens_are_modify_indexes_that_keep_growing_across_deletes(backends, emulator):
    backend = backends()
    tokens = []
    for _ in range(3):
        lease = backend.try_acquire("k", owner(), 10)
        entry = emulator.state.kv[backend.settings.root + "k"]
        assert lease.fencing_token == entry["ModifyIndex"]
        tokens.append(lease.fencing_token)
        backend.force_release("k")  # deletes the key: LockIndex would start again at 1
    assert tokens == sorted(set(tokens))


def test_a_dead_contender_is_pruned_from_the_semaphore(backends, emulator):
    doomed, alive, newcomer = backends(), backends(), backends()
    dead = doomed.try_acquire("k", owner(), 10, limit=2)
    assert alive.try_acquire("k", owner(), 10, limit=2) is not None
    assert newcomer.try_acquire("k", owner(), 10, limit=2) is None
    with emulator.changed:
        emulator.invalidate(session_of(doomed))  # its contender key is released
    granted = newcomer.try_acquire("k", owner(), 10, limit=2)
    assert granted is not None
    lock = emulator.state.kv[newcomer.settings.root + "k/.lock"]
    holders = json.loads(lock["Value"])["Holders"]
    assert dead.owner not in holders and granted.owner in holders and len(holders) == 2
    assert granted.fencing_token == lock["ModifyIndex"]


@pytest.mark.parametrize("first, second", [(2, 3), (1, 2), (2, 1)])
def test_processes_disagreeing_on_the_limit_get_a_configuration_error(backends, first, second):
    backends().try_acquire("k", owner(), 10, limit=first)
    with pytest.raises(ConfigurationError, match="exclusive_limit"):
        backends().try_acquire("k", owner(), 10, limit=second)


def test_wait_is_woken_by_a_release_through_a_blocking_query(backends, emulator):
    holder, waiter = backends(), backends()
    lease = holder.try_acquire("k", owner(), 10)
    before = len(emulator.requests)
    threading.Timer(0.4, holder.release, [lease]).start()
    started = time.monotonic()
    waiter.wait("k", timeout=2.5)
    waited = time.monotonic() - started
    assert 0.3 < waited < 1.5
    reads = [r for r in emulator.requests[before:] if r[0] == "GET"]
    assert len(reads) <= 3  # one read, one blocking query: no polling


def test_a_semaphore_wait_is_woken_when_a_slot_frees(backends):
    holder, waiter = backends(), backends()
    leases = [holder.try_acquire("k", owner(), 10, limit=2) for _ in range(2)]
    threading.Timer(0.3, holder.release, [leases[0]]).start()
    started = time.monotonic()
    waiter.wait("k", timeout=2.5)
    assert time.monotonic() - started < 1.5
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
    [info] = cli.holders("app:")
    assert (info.owner, info.fencing_token, info.task_id) == (
        lease.owner,
        lease.fencing_token,
        "t-9",
    )
    assert info.expires_in == 15


# --- the emulator's own rules ---------------------------------------------------------


def _http(emulator: ConsulEmulator) -> str:
    return f"http://127.0.0.1:{emulator.port}"


def _session(base: str, ttl: str = "10s") -> str:
    return requests.put(f"{base}/v1/session/create", json={"TTL": ttl}, timeout=5).json()["ID"]


def test_emulator_modify_index_keeps_growing_across_a_delete_but_lock_index_restarts(emulator):
    base, key = _http(emulator), f"rules/{uuid.uuid4().hex}"
    session = _session(base)
    assert requests.put(f"{base}/v1/kv/{key}?acquire={session}", data="x", timeout=5).json()
    first = requests.get(f"{base}/v1/kv/{key}", timeout=5).json()[0]
    requests.delete(f"{base}/v1/kv/{key}", timeout=5)
    requests.put(f"{base}/v1/kv/{key}?acquire={session}", data="y", timeout=5)
    second = requests.get(f"{base}/v1/kv/{key}", timeout=5).json()[0]
    assert second["ModifyIndex"] > first["ModifyIndex"]
    assert first["LockIndex"] == second["LockIndex"] == 1


def test_emulator_renewing_an_unknown_session_is_a_404(emulator):
    response = requests.put(f"{_http(emulator)}/v1/session/renew/{uuid.uuid4()}", timeout=5)
    assert response.status_code == 404


def test_emulator_acquiring_with_an_invalid_session_is_a_500(emulator):
    key = f"rules/{uuid.uuid4().hex}"
    response = requests.put(f"{_http(emulator)}/v1/kv/{key}?acquire={uuid.uuid4()}", timeout=5)
    assert response.status_code == 500 and "invalid session" in response.text


def test_emulator_cas_zero_creates_only(emulator):
    base, key = _http(emulator), f"rules/{uuid.uuid4().hex}"
    assert requests.put(f"{base}/v1/kv/{key}?cas=0", data="a", timeout=5).json() is True
    assert requests.put(f"{base}/v1/kv/{key}?cas=0", data="b", timeout=5).json() is False


def test_emulator_enforces_the_minimum_ttl_and_invalidates_within_twice_the_ttl():
    strict = ConsulEmulator().start()
    try:
        base = f"http://127.0.0.1:{strict.port}"
        assert (
            requests.put(f"{base}/v1/session/create", json={"TTL": "5s"}, timeout=5).status_code
            == 500
        )
    finally:
        strict.stop()
    fast = ConsulEmulator(min_session_ttl=0.1).start()
    try:
        base = f"http://127.0.0.1:{fast.port}"
        session = _session(base, "0.2s")
        time.sleep(0.5)
        assert requests.put(f"{base}/v1/session/renew/{session}", timeout=5).status_code == 404
    finally:
        fast.stop()


def test_emulator_blocking_query_returns_on_change_not_before(emulator):
    base, key = _http(emulator), f"rules/{uuid.uuid4().hex}"
    requests.put(f"{base}/v1/kv/{key}", data="a", timeout=5)
    index = requests.get(f"{base}/v1/kv/{key}", timeout=5).headers["X-Consul-Index"]
    started = time.monotonic()
    requests.get(f"{base}/v1/kv/{key}?index={index}&wait=300ms", timeout=5)
    assert time.monotonic() - started >= 0.28
    threading.Timer(0.2, requests.put, [f"{base}/v1/kv/{key}"], {"data": "b", "timeout": 5}).start()
    started = time.monotonic()
    response = requests.get(f"{base}/v1/kv/{key}?index={index}&wait=5s", timeout=10)
    assert time.monotonic() - started < 2
    assert int(response.headers["X-Consul-Index"]) > int(index)


def test_emulator_txn_is_all_or_nothing_with_every_error(emulator):
    base, key = _http(emulator), f"rules/{uuid.uuid4().hex}"
    ops = [
        {"KV": {"Verb": "set", "Key": key, "Value": "eA=="}},
        {"KV": {"Verb": "check-index", "Key": key + "/x", "Index": 1}},
        {"KV": {"Verb": "get", "Key": key + "/y"}},
    ]
    response = requests.put(f"{base}/v1/txn", json=ops, timeout=5)
    assert response.status_code == 409
    assert [e["OpIndex"] for e in response.json()["Errors"]] == [1, 2]
    assert requests.get(f"{base}/v1/kv/{key}", timeout=5).status_code == 404


# --- marks and lines ---------------------------------------------------------------------


def _line_for(backend: ConsulBackend, key: str, claimant: str, ttl: float = 10) -> str:
    """Put ``claimant`` in the line of ``key``; return the line's mark."""
    marks.take_place(backend, key, claimant, ttl)
    return line_mark(key)


def _since(emulator: ConsulEmulator, before: int) -> list[tuple[str, str]]:
    return emulator.requests[before:]


def _after_first_read(monkeypatch, backend: ConsulBackend, method: str, meddle) -> None:
    """Run ``meddle`` right after ``backend``'s first ``method`` read: another writer
    slipping in between a read and the write it guards."""
    read = getattr(backend, method)
    done = []

    def read_then_meddle(*args, **kwargs):
        result = read(*args, **kwargs)
        if not done:
            done.append(True)
            meddle()
        return result

    monkeypatch.setattr(backend, method, read_then_meddle)


def test_a_mark_is_json_with_its_expiry_under_the_root_path(backends, emulator):
    backend = backends()
    before = time.time()
    backend.swap_mark("app/jobs:7:~queued", None, "yes", 30)
    entry = emulator.state.kv[backend.settings.root + "app/jobs:7:~queued"]
    stored = json.loads(entry["Value"])
    assert stored["value"] == "yes" and before + 30 <= stored["expires_at"] <= time.time() + 30
    assert entry["Session"] is None


def test_names_with_slashes_and_colons_are_marks_of_their_own(backends):
    backend = backends()
    assert backend.swap_mark("app/jobs:7:~queued", None, "a", 10)
    assert backend.swap_mark("app/jobs:7:~queued/x", None, "b", 10)
    assert backend.read_mark("app/jobs:7:~queued") == "a"
    assert backend.read_mark("app/jobs:7:~queued/x") == "b"
    assert backend.read_mark("app/jobs") is None


def test_a_swap_is_one_read_and_one_transaction(backends, emulator):
    backend = backends()
    before = len(emulator.requests)
    backend.swap_mark("m:~x", None, "a", 10)
    assert [method for method, _ in _since(emulator, before)] == ["GET", "PUT"]


def test_a_swap_whose_write_loses_to_an_equal_value_compares_again(backends, monkeypatch):
    backend, rival = backends(), backends()
    backend.swap_mark("m:~x", None, "a", 10)
    # The rival refreshes the mark (same value, new ModifyIndex) between read and CAS.
    _after_first_read(
        monkeypatch, backend, "_read_key", lambda: rival.swap_mark("m:~x", "a", "a", 10)
    )
    assert backend.swap_mark("m:~x", "a", "b", 10) is True
    assert backend.read_mark("m:~x") == "b"


def test_a_swap_whose_write_loses_to_another_value_fails(backends, monkeypatch):
    backend, rival = backends(), backends()
    backend.swap_mark("m:~x", None, "a", 10)
    _after_first_read(
        monkeypatch, backend, "_read_key", lambda: rival.swap_mark("m:~x", "a", "c", 10)
    )
    assert backend.swap_mark("m:~x", "a", "b", 10) is False
    assert backend.read_mark("m:~x") == "c"


def test_concurrent_creates_have_exactly_one_winner(backends):
    stores = [backends() for _ in range(6)]
    barrier = threading.Barrier(len(stores))
    won: list[bool] = []

    def create(store, value):
        barrier.wait()
        won.append(store.swap_mark("m:~x", None, value, 10))

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
                current = store.read_mark("m:~count")
                if store.swap_mark("m:~count", current, str(int(current or 0) + 1), 30):
                    break

    threads = [threading.Thread(target=increment, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stores[0].read_mark("m:~count") == "40"


def test_an_expired_mark_is_replaced_in_place_or_deleted(backends, emulator):
    backend = backends()
    kv = backend.settings.root + "m:~x"
    backend.swap_mark("m:~x", None, "a", 0.1)
    time.sleep(0.2)
    assert kv in emulator.state.kv  # KV has no TTL: it lingers, reading as absent
    assert backend.swap_mark("m:~x", None, None, 10) is True
    assert kv not in emulator.state.kv


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
    mark = _line_for(backend, "k", "nightly")
    before = len(emulator.requests)
    assert backend.try_acquire("k", owner(), 10, claimant="nightly") is not None
    mark_path = f"/v1/kv/{backend.settings.root}{mark}"
    assert _since(emulator, before) == [("PUT", "/v1/txn"), ("GET", mark_path), ("PUT", "/v1/txn")]


def test_a_semaphore_acquire_reads_the_line_with_its_tree(backends, emulator):
    backend = backends()
    backend.try_acquire("warm-up", owner(), 10)
    _line_for(backend, "k", "nightly")
    before = len(emulator.requests)
    assert backend.try_acquire("k", owner(), 10, limit=2, claimant="nightly") is not None
    assert [method for method, _ in _since(emulator, before)] == ["GET", "PUT"]


@pytest.mark.parametrize("limit", [1, 2])
def test_a_refusing_line_writes_nothing(backends, emulator, limit):
    backend = backends()
    backend.try_acquire("warm-up", owner(), 10)  # opens the session
    for claimant in ("nightly", "repair"):  # as many waiters as free slots, or more
        _line_for(backend, "k", claimant)
    index = emulator.state.index
    assert backend.try_acquire("k", owner(), 10, limit=limit) is None
    assert emulator.state.index == index
    assert not any(k.startswith(backend.settings.root + "k/") for k in emulator.state.kv)


@pytest.mark.parametrize("limit, read", [(1, "_read_key"), (2, "_read_tree")])
def test_a_line_changed_between_read_and_grant_refuses_the_grant(
    backends, monkeypatch, limit, read
):
    backend, rival = backends(), backends()
    if limit > 1:
        rival.try_acquire("k", owner(), 10, limit=limit)  # one slot left
    _line_for(backend, "k", "nightly")
    _after_first_read(
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
    mark = _line_for(backend, "k", "nightly", ttl=0.1)
    time.sleep(0.2)
    assert backend.try_acquire("k", owner(), 10, limit=limit) is not None
    assert backend.settings.root + mark not in emulator.state.kv


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


def test_emulator_check_not_exists_and_delete_cas_follow_consul(emulator):
    base, key = _http(emulator), f"rules/{uuid.uuid4().hex}"

    def txn(verb, **kv):
        ops = [{"KV": {"Verb": verb, "Key": key, **kv}}]
        return requests.put(f"{base}/v1/txn", json=ops, timeout=5).status_code

    assert txn("check-not-exists") == 200
    assert txn("delete-cas", Index=7) == 200  # an absent key counts as deleted
    requests.put(f"{base}/v1/kv/{key}", data="x", timeout=5)
    index = requests.get(f"{base}/v1/kv/{key}", timeout=5).json()[0]["ModifyIndex"]
    assert txn("check-not-exists") == 409
    assert txn("delete-cas", Index=index - 1) == 409
    assert txn("delete-cas", Index=index) == 200
    assert requests.get(f"{base}/v1/kv/{key}", timeout=5).status_code == 404
