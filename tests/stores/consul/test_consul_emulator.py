"""The Consul emulator's rules, one test each: what the store's tests rely on it to do
as hashicorp/consul does (each rule cites its source in tests/support/consul_emulator/)."""

from __future__ import annotations

import base64
import http.client
import threading
import time
import uuid
from email.utils import parsedate_to_datetime

import pytest
import requests

from tests.support.consul_emulator import (
    MAX_TXN_BYTES,
    ConsulEmulator,
    clean_path,
    parse_go_duration,
)


@pytest.fixture
def start():
    """Start an emulator with the given options; stop it after the test."""
    started = []

    def start(**options) -> ConsulEmulator:
        started.append(ConsulEmulator(**options).start())
        return started[-1]

    yield start
    for emulator in started:
        emulator.stop()


@pytest.fixture
def consul(start) -> ConsulEmulator:
    return start(min_session_ttl=0.1)


def base(emulator: ConsulEmulator) -> str:
    return f"http://127.0.0.1:{emulator.port}"


def session(emulator: ConsulEmulator, headers=None, **body) -> requests.Response:
    return requests.put(
        f"{base(emulator)}/v1/session/create", json=body, headers=headers, timeout=5
    )


def txn(emulator: ConsulEmulator, *ops, headers=None) -> requests.Response:
    body = [{"KV": {"Verb": verb, "Key": key, **kv}} for verb, key, kv in ops]
    return requests.put(f"{base(emulator)}/v1/txn", json=body, headers=headers, timeout=5)


def key() -> str:
    return f"rules/{uuid.uuid4().hex}"


# --- KV and transactions (agent/consul/state/kvs.go, txn.go) ---------------------------


def test_modify_index_keeps_growing_across_a_delete_but_lock_index_restarts(consul):
    url, k = base(consul), key()
    sid = session(consul, TTL="10s").json()["ID"]
    assert requests.put(f"{url}/v1/kv/{k}?acquire={sid}", data="x", timeout=5).json()
    first = requests.get(f"{url}/v1/kv/{k}", timeout=5).json()[0]
    requests.delete(f"{url}/v1/kv/{k}", timeout=5)
    requests.put(f"{url}/v1/kv/{k}?acquire={sid}", data="y", timeout=5)
    second = requests.get(f"{url}/v1/kv/{k}", timeout=5).json()[0]
    assert second["ModifyIndex"] > first["ModifyIndex"]
    assert first["LockIndex"] == second["LockIndex"] == 1


def test_writing_an_equal_entry_keeps_its_modify_index(consul):
    k = key()
    txn(consul, ("set", k, {"Value": "eA=="}))
    before = requests.get(f"{base(consul)}/v1/kv/{k}", timeout=5).json()[0]["ModifyIndex"]
    txn(consul, ("set", k, {"Value": "eA=="}))
    assert requests.get(f"{base(consul)}/v1/kv/{k}", timeout=5).json()[0]["ModifyIndex"] == before


def test_cas_zero_creates_only(consul):
    url, k = base(consul), key()
    assert requests.put(f"{url}/v1/kv/{k}?cas=0", data="a", timeout=5).json() is True
    assert requests.put(f"{url}/v1/kv/{k}?cas=0", data="b", timeout=5).json() is False


def test_a_txn_is_all_or_nothing_and_reports_every_failed_operation(consul):
    k = key()
    answer = txn(
        consul,
        ("set", k, {"Value": "eA=="}),
        ("check-index", k + "/x", {"Index": 1}),
        ("get", k + "/y", {}),
    )
    assert answer.status_code == 409
    assert [e["OpIndex"] for e in answer.json()["Errors"]] == [1, 2]
    assert requests.get(f"{base(consul)}/v1/kv/{k}", timeout=5).status_code == 404


def test_check_not_exists_fails_on_a_key_and_delete_cas_passes_on_none(consul):
    k = key()
    assert txn(consul, ("check-not-exists", k, {})).status_code == 200
    assert txn(consul, ("delete-cas", k, {"Index": 7})).status_code == 200  # absent: deleted
    requests.put(f"{base(consul)}/v1/kv/{k}", data="x", timeout=5)
    index = requests.get(f"{base(consul)}/v1/kv/{k}", timeout=5).json()[0]["ModifyIndex"]
    assert txn(consul, ("check-not-exists", k, {})).status_code == 409
    assert txn(consul, ("delete-cas", k, {"Index": index - 1})).status_code == 409
    assert txn(consul, ("delete-cas", k, {"Index": index})).status_code == 200


def test_a_lock_naming_an_unknown_session_fails(consul):
    k = key()
    answer = txn(consul, ("lock", k, {"Session": str(uuid.uuid4())}))
    assert answer.status_code == 409 and "invalid session" in answer.text
    acquire = requests.put(f"{base(consul)}/v1/kv/{k}?acquire={uuid.uuid4()}", timeout=5)
    assert acquire.status_code == 500 and "invalid session" in acquire.text


def test_a_blocking_query_returns_on_a_change_not_before(consul):
    url, k = base(consul), key()
    requests.put(f"{url}/v1/kv/{k}", data="a", timeout=5)
    index = requests.get(f"{url}/v1/kv/{k}", timeout=5).headers["X-Consul-Index"]
    started = time.monotonic()
    requests.get(f"{url}/v1/kv/{k}?index={index}&wait=300ms", timeout=5)
    assert time.monotonic() - started >= 0.28
    threading.Timer(0.2, requests.put, [f"{url}/v1/kv/{k}"], {"data": "b", "timeout": 5}).start()
    started = time.monotonic()
    answer = requests.get(f"{url}/v1/kv/{k}?index={index}&wait=5s", timeout=10)
    assert time.monotonic() - started < 2
    assert int(answer.headers["X-Consul-Index"]) > int(index)


def test_a_keys_listing_names_keys_without_values(consul):
    url, k = base(consul), key()
    requests.put(f"{url}/v1/kv/{k}/a", data="x" * 1000, timeout=5)
    answer = requests.get(f"{url}/v1/kv/{k}/?keys", timeout=5)
    assert answer.json() == [f"{k}/a"] and int(answer.headers["X-Consul-Index"]) > 0


#: api/lock.go LockFlagValue and api/semaphore.go SemaphoreFlagValue: flags Go's client
#: writes and checks, which the whole of uint64 must survive.
LOCK_FLAG, SEMAPHORE_FLAG = 0x2DDCCBC058A50C18, 0xE0F69A2BAA414DE0


def flags_of(emulator: ConsulEmulator, k: str) -> int:
    return requests.get(f"{base(emulator)}/v1/kv/{k}", timeout=5).json()[0]["Flags"]


def test_flags_of_a_put_are_stored_and_a_put_without_them_stores_0(consul):
    url, k = base(consul), key()
    assert requests.put(f"{url}/v1/kv/{k}?flags={SEMAPHORE_FLAG}", data="x", timeout=5).json()
    assert flags_of(consul, k) == SEMAPHORE_FLAG
    requests.put(f"{url}/v1/kv/{k}", data="y", timeout=5)
    assert flags_of(consul, k) == 0


def test_acquire_and_release_write_their_flags_and_the_released_key_stays(consul):
    url, k = base(consul), key()
    sid = session(consul, TTL="10s").json()["ID"]
    assert requests.put(f"{url}/v1/kv/{k}?acquire={sid}&flags={LOCK_FLAG}", timeout=5).json()
    assert flags_of(consul, k) == LOCK_FLAG
    assert requests.put(f"{url}/v1/kv/{k}?release={sid}&flags={LOCK_FLAG}", timeout=5).json()
    [entry] = requests.get(f"{url}/v1/kv/{k}", timeout=5).json()
    assert (entry["Flags"], entry["Session"]) == (LOCK_FLAG, None)


def test_a_cas_writes_its_flags(consul):
    url, k = base(consul), key()
    assert requests.put(f"{url}/v1/kv/{k}?cas=0&flags={SEMAPHORE_FLAG}", timeout=5).json()
    assert flags_of(consul, k) == SEMAPHORE_FLAG


def test_flags_go_cannot_parse_are_a_500(consul):
    for bad, reason in (("x", "invalid syntax"), (str(2**64), "value out of range")):
        answer = requests.put(f"{base(consul)}/v1/kv/{key()}?flags={bad}", timeout=5)
        assert answer.status_code == 500 and reason in answer.text


def test_txn_flags_are_stored_by_set_cas_lock_and_unlock(consul):
    k, sid = key(), session(consul, TTL="10s").json()["ID"]
    assert txn(consul, ("set", f"{k}/set", {"Flags": 7})).ok
    assert txn(consul, ("cas", f"{k}/cas", {"Index": 0, "Flags": SEMAPHORE_FLAG})).ok
    assert txn(consul, ("lock", f"{k}/lock", {"Session": sid, "Flags": LOCK_FLAG})).ok
    assert flags_of(consul, f"{k}/set") == 7
    assert flags_of(consul, f"{k}/cas") == SEMAPHORE_FLAG
    assert flags_of(consul, f"{k}/lock") == LOCK_FLAG
    assert txn(consul, ("unlock", f"{k}/lock", {"Session": sid})).ok
    assert flags_of(consul, f"{k}/lock") == 0  # the unlock's entry is written whole


def test_reads_say_whether_a_leader_is_known_and_when_it_was_last_heard(consul):
    url, k = base(consul), key()
    requests.put(f"{url}/v1/kv/{k}/a", data="x", timeout=5)
    reads = [
        requests.get(f"{url}/v1/kv/{k}/a", timeout=5),
        requests.get(f"{url}/v1/kv/{k}/missing", timeout=5),
        requests.get(f"{url}/v1/kv/{k}?recurse", timeout=5),
        requests.get(f"{url}/v1/kv/{k}/?keys", timeout=5),
        requests.get(f"{url}/v1/session/list", timeout=5),
        requests.get(f"{url}/v1/session/info/{uuid.uuid4()}", timeout=5),
        txn(consul, ("get", f"{k}/a", {})),
    ]
    for answer in reads:
        assert answer.headers["X-Consul-KnownLeader"] == "true", answer.url
        assert answer.headers["X-Consul-LastContact"] == "0", answer.url
    write = txn(consul, ("set", f"{k}/b", {}))
    assert "X-Consul-KnownLeader" not in write.headers
    consul.set_leaderless(True)
    stale = requests.get(f"{url}/v1/kv/{k}/a?stale", timeout=5)
    assert stale.headers["X-Consul-KnownLeader"] == "false"


def test_the_session_list_names_every_session_and_the_node_list_a_nodes(consul):
    url = base(consul)
    ids = {session(consul, TTL="10s", Name=f"s{i}").json()["ID"] for i in range(2)}
    listed = requests.get(f"{url}/v1/session/list", timeout=5)
    assert {s["ID"] for s in listed.json()} == ids
    assert int(listed.headers["X-Consul-Index"]) > 1
    mine = requests.get(f"{url}/v1/session/node/{consul.node}", timeout=5).json()
    assert {s["ID"] for s in mine} == ids and {s["Node"] for s in mine} == {consul.node}
    assert requests.get(f"{url}/v1/session/node/elsewhere", timeout=5).json() == []
    assert requests.get(f"{url}/v1/session/node/", timeout=5).status_code == 400


def test_the_agent_names_its_node_and_datacenter(consul):
    config = requests.get(f"{base(consul)}/v1/agent/self", timeout=5).json()["Config"]
    assert (config["NodeName"], config["Datacenter"]) == (consul.node, consul.datacenter)


def test_the_session_list_blocks_until_a_session_is_created_or_destroyed(consul):
    url = base(consul)
    sid = session(consul, TTL="10s").json()["ID"]
    index = requests.get(f"{url}/v1/session/list", timeout=5).headers["X-Consul-Index"]
    requests.put(f"{url}/v1/kv/{key()}", data="a KV write is no session change", timeout=5)
    started = time.monotonic()
    requests.get(f"{url}/v1/session/list?index={index}&wait=300ms", timeout=5)
    assert time.monotonic() - started >= 0.28
    destroy = f"{url}/v1/session/destroy/{sid}"
    threading.Timer(0.2, requests.put, [destroy], {"timeout": 5}).start()
    answer = requests.get(f"{url}/v1/session/list?index={index}&wait=5s", timeout=10)
    assert answer.json() == [] and int(answer.headers["X-Consul-Index"]) > int(index)


def test_the_session_list_shows_only_sessions_the_token_may_read(start):
    acl = start(acl=True, min_session_ttl=0.1)
    acl.add_token("writer", session_prefix={"": "write"})
    acl.add_token("blind", key_prefix={"": "read"})
    writer = {"X-Consul-Token": "writer"}
    session(acl, headers=writer, TTL="10s")
    url = f"{base(acl)}/v1/session/list"
    assert len(requests.get(url, headers=writer, timeout=5).json()) == 1
    assert requests.get(url, headers={"X-Consul-Token": "blind"}, timeout=5).json() == []


# --- Go's ServeMux (net/http server.go) --------------------------------------------------


@pytest.mark.parametrize(
    "path, clean",
    [
        ("/v1/kv/a//b", "/v1/kv/a/b"),
        ("/v1/kv/a/./b", "/v1/kv/a/b"),
        ("/v1/kv/a/../b", "/v1/kv/b"),
        ("/v1/kv/a/", "/v1/kv/a/"),
        ("/v1/kv/a%2F%2Fb", "/v1/kv/a/b"),
    ],
)
def test_an_unclean_path_is_redirected_to_the_cleaned_one(consul, path, clean):
    connection = http.client.HTTPConnection("127.0.0.1", consul.port, timeout=5)
    connection.request("GET", path + "?recurse")
    response = connection.getresponse()
    response.read()
    if clean == path:
        assert response.status == 404
    else:
        assert response.status == 301
        assert response.getheader("Location") == clean + "?recurse"
    assert clean_path(path.replace("%2F", "/")) == clean


def test_requests_follows_the_redirect_on_get_and_reads_another_key(consul):
    # A transaction carries the raw key in its body; a GET of the same key is rewritten.
    txn(consul, ("set", "app/a//b", {"Value": "eA=="}))
    answer = requests.get(f"{base(consul)}/v1/kv/app/a//b", timeout=5)
    assert answer.history and answer.history[0].status_code == 301
    assert answer.status_code == 404  # it read app/a/b, not app/a//b
    assert "app/a//b" in consul.kv


# --- ACLs (agent/consul/txn_endpoint.go preCheck, kvs_endpoint.go kvsPreApply) ---------------


@pytest.fixture
def acl(start) -> ConsulEmulator:
    emulator = start(acl=True, min_session_ttl=0.1)
    emulator.add_token("full", key_prefix={"app/": "write"}, session_prefix={"": "write"})
    emulator.add_token("reader", key_prefix={"app/": "read"}, session_prefix={"": "write"})
    emulator.add_token("kv-only", key_prefix={"app/": "write"})
    return emulator


def token(secret: str) -> dict:
    return {"X-Consul-Token": secret}


def test_a_txn_without_key_write_fails_each_write_with_permission_denied(acl):
    answer = txn(
        acl,
        ("check-not-exists", "app/line", {}),
        ("set", "app/x", {"Value": "eA=="}),
        ("check-index", "app/x", {"Index": 1}),
        headers=token("reader"),
    )
    assert answer.status_code == 409
    errors = {e["OpIndex"]: e["What"] for e in answer.json()["Errors"]}
    assert errors == {0: "Permission denied", 1: "Permission denied"}  # check-index: read


def test_a_session_without_session_write_is_a_403(acl):
    assert session(acl, headers=token("kv-only"), TTL="10s").status_code == 403
    sid = session(acl, headers=token("full"), TTL="10s").json()["ID"]
    renew = requests.put(f"{base(acl)}/v1/session/renew/{sid}", headers=token("kv-only"), timeout=5)
    assert renew.status_code == 403


def test_kv_reads_need_key_read_and_listings_are_filtered(acl):
    txn(acl, ("set", "app/x", {"Value": "eA=="}), headers=token("full"))
    url = base(acl)
    assert requests.get(f"{url}/v1/kv/app/x", timeout=5).status_code == 403  # anonymous
    assert requests.get(f"{url}/v1/kv/app/?recurse", timeout=5).status_code == 404
    assert requests.get(f"{url}/v1/kv/app/x", headers=token("reader"), timeout=5).ok
    assert requests.put(f"{url}/v1/kv/app/x", headers=token("reader"), timeout=5).status_code == 403


def test_an_unknown_token_is_a_403(acl):
    answer = requests.get(f"{base(acl)}/v1/kv/app/x", headers=token("nope"), timeout=5)
    assert answer.status_code == 403 and "ACL not found" in answer.text


# --- limits (agent/txn_endpoint.go convertOps, kvs_endpoint.go KVSPut, go-connlimit) ----------


def test_a_txn_over_512_kib_is_a_413(consul):
    value = base64.b64encode(b"x" * (MAX_TXN_BYTES * 3 // 4)).decode()
    assert txn(consul, ("set", key(), {"Value": value})).status_code == 413


def test_a_txn_of_more_than_64_operations_is_a_413(consul):
    answer = txn(consul, *[("get-tree", f"k{i}", {}) for i in range(65)])
    assert answer.status_code == 413 and "too many operations" in answer.text


def test_a_kv_value_over_512_kib_is_a_413(consul):
    big = b"x" * (512 * 1024 + 1)
    assert requests.put(f"{base(consul)}/v1/kv/{key()}", data=big, timeout=5).status_code == 413


def test_a_client_over_its_connection_limit_gets_429s(consul):
    consul.throttle(2)
    codes = [requests.get(f"{base(consul)}/v1/status/leader", timeout=5).status_code for _ in "abc"]
    assert codes == [429, 429, 200]


# --- leader elections (agent/consul/rpc.go forward) -----------------------------------------


def test_without_a_leader_a_request_is_held_then_answered_500(consul):
    consul.rpc_hold = 0.3
    consul.set_leaderless(True)
    started = time.monotonic()
    answer = requests.get(f"{base(consul)}/v1/kv/{key()}", timeout=5)
    assert answer.status_code == 500 and answer.text == "No cluster leader"
    assert time.monotonic() - started >= 0.28
    assert requests.get(f"{base(consul)}/v1/kv/{key()}?stale", timeout=5).status_code == 404


def test_a_commit_can_land_after_the_client_gave_up(consul):
    k = key()
    consul.rpc_hold = 3.0
    consul.set_leaderless(True)
    threading.Timer(0.6, consul.set_leaderless, [False]).start()
    with pytest.raises(requests.Timeout):
        requests.put(f"{base(consul)}/v1/kv/{k}", data="late", timeout=0.3)
    assert k not in consul.kv
    deadline = time.monotonic() + 3
    while k not in consul.kv and time.monotonic() < deadline:
        time.sleep(0.02)
    assert consul.kv[k]["Value"] == b"late"


# --- sessions (agent/session_endpoint.go, state/session.go, state/catalog.go) -----------------


def test_the_minimum_ttl_is_enforced_and_a_session_dies_within_twice_its_ttl(start):
    strict = start()
    assert session(strict, TTL="5s").status_code == 500
    fast = start(min_session_ttl=0.1)
    sid = session(fast, TTL="200ms").json()["ID"]
    time.sleep(0.5)
    assert requests.put(f"{base(fast)}/v1/session/renew/{sid}", timeout=5).status_code == 404


def test_renewing_an_unknown_session_is_a_404(consul):
    answer = requests.put(f"{base(consul)}/v1/session/renew/{uuid.uuid4()}", timeout=5)
    assert answer.status_code == 404


def test_a_default_session_dies_with_the_serf_health_check_and_checks_unbind_it(consul):
    bound = session(consul, TTL="10s").json()["ID"]
    unbound = session(consul, TTL="10s", Checks=[], NodeChecks=[]).json()["ID"]
    consul.set_check("serfHealth", "critical")
    assert bound not in consul.sessions and unbound in consul.sessions
    assert session(consul, TTL="10s").status_code == 500  # a critical check refuses


def test_deregistering_the_node_destroys_every_session_of_it(consul):
    unbound = session(consul, TTL="10s", Checks=[]).json()["ID"]
    consul.deregister_node()
    assert unbound not in consul.sessions
    answer = session(consul, TTL="10s", Checks=[])
    assert answer.status_code == 500 and "Missing node registration" in answer.text


def test_an_invalidated_sessions_keys_are_refused_for_its_lock_delay_capped_at_60s(consul):
    k = key()
    sid = session(consul, TTL="10s", LockDelay="200ms").json()["ID"]
    assert txn(consul, ("lock", k, {"Session": sid})).ok
    consul.invalidate(sid)
    other = session(consul, TTL="10s").json()["ID"]
    refused = txn(consul, ("lock", k, {"Session": other}))
    assert refused.status_code == 409 and "lock delay" in refused.text
    time.sleep(0.25)
    assert txn(consul, ("lock", k, {"Session": other})).ok
    long = session(consul, TTL="10s", LockDelay="120s").json()["ID"]
    txn(consul, ("lock", "long", {"Session": long}))
    consul.invalidate(long)
    assert consul.state.lock_delays["long"] - time.monotonic() <= 60


def test_a_delete_sessions_keys_are_deleted_when_it_dies(consul):
    k = key()
    sid = session(consul, TTL="10s", Behavior="delete").json()["ID"]
    txn(consul, ("lock", k, {"Session": sid}))
    consul.invalidate(sid)
    assert k not in consul.kv


@pytest.mark.parametrize(
    "lock_delay, seconds", [("1e-05s", None), ("250ms", 0.25), (5, 5.0), ("0", 0.0)]
)
def test_lock_delays_are_read_as_go_reads_them(consul, lock_delay, seconds):
    answer = session(consul, TTL="10s", LockDelay=lock_delay)
    if seconds is None:
        assert answer.status_code == 400 and "invalid duration" in answer.text
    else:
        assert consul.sessions[answer.json()["ID"]].lock_delay == seconds


def test_go_durations_parse_as_go_parses_them():
    assert parse_go_duration("1m30s") == 90 and parse_go_duration("250ms") == 0.25
    assert parse_go_duration("1e-05s") is None and parse_go_duration("10") is None


# --- datacenters and Enterprise (structs errors, agent/http_ce.go) ----------------------------


def test_a_session_in_another_datacenter_has_no_node_and_unknown_ones_no_path(consul):
    other = requests.put(f"{base(consul)}/v1/session/create?dc=dc2", json={}, timeout=5)
    assert other.status_code == 500 and other.text == "Missing node registration"
    unknown = requests.get(f"{base(consul)}/v1/kv/x?dc=nowhere", timeout=5)
    assert unknown.status_code == 500 and unknown.text == "No path to datacenter"


def test_community_edition_refuses_namespaces_and_enterprise_keeps_them_apart(start):
    ce, ent = start(), start(enterprise=True)
    refused = requests.get(f"{base(ce)}/v1/kv/x?ns=team", timeout=5)
    assert refused.status_code == 400 and "Enterprise" in refused.text
    requests.put(f"{base(ent)}/v1/kv/x?ns=team", data="a", timeout=5)
    assert requests.get(f"{base(ent)}/v1/kv/x?ns=team", timeout=5).ok
    assert requests.get(f"{base(ent)}/v1/kv/x", timeout=5).status_code == 404


# --- the agent's clock ---------------------------------------------------------------------


def test_every_answer_carries_the_agents_clock(consul):
    consul.clock_offset = 3600
    answer = requests.get(f"{base(consul)}/v1/status/leader", timeout=5)
    stamped = parsedate_to_datetime(answer.headers["Date"]).timestamp()
    assert abs(stamped - (time.time() + 3600)) < 2
