"""The Consul store under what production brings: ACL tokens, lost answers, leader
elections, node deregistration, other datacenters, TLS, IPv6, connection limits,
namespaces, large values.

Each test starts the emulator it needs (tests/consul_emulator), configured with the
rule it exercises; none of them can run against a real agent.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid

import pytest
from click.testing import CliRunner

from celery_exclusive.backends.consul import (
    ConsulBackend,
    ConsulConnection,
    ConsulDatacenterError,
    ConsulPermissionDenied,
    ConsulValueTooLarge,
)
from celery_exclusive.backends.consul.http import REQUEST_TIMEOUT
from celery_exclusive.cli.commands import exclusive
from celery_exclusive.core import marks
from celery_exclusive.errors import BackendUnavailable, ConfigurationError
from tests.support.consul_emulator import ConsulEmulator


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def start(monkeypatch):
    """Start an emulator with the given options; stop it (and its backends) after."""
    monkeypatch.setattr(ConsulConnection, "min_session_ttl", 0.25)
    started, made = [], []

    def start(**options) -> ConsulEmulator:
        started.append(ConsulEmulator(min_session_ttl=0.25, **options).start())
        return started[-1]

    def backend(emulator: ConsulEmulator, query: str = "lock_delay=0", root="leases"):
        made.append(ConsulBackend(f"{emulator.url}/{root}?{query}"))
        return made[-1]

    start.backend = backend
    yield start
    for each in made:
        each.close()
    for emulator in started:
        emulator.stop()


@pytest.fixture
def consul(start) -> ConsulEmulator:
    return start()


# --- ACL tokens ------------------------------------------------------------------------------


@pytest.fixture
def acl(start) -> ConsulEmulator:
    emulator = start(acl=True)
    emulator.add_token("full", key_prefix={"leases/": "write"}, session_prefix={"": "write"})
    emulator.add_token("read-only", key_prefix={"leases/": "read"}, session_prefix={"": "write"})
    emulator.add_token("no-sessions", key_prefix={"leases/": "write"})
    return emulator


def test_a_token_without_key_write_is_a_named_error_not_a_held_key(start, acl):
    backend = start.backend(acl, "lock_delay=0&token=read-only")
    with pytest.raises(ConsulPermissionDenied, match='key_prefix "leases/"') as info:
        backend.try_acquire("k", owner(), 10)
    assert "session_prefix" in str(info.value)  # the whole policy to grant


def test_a_token_without_session_write_is_a_named_error_not_an_outage(start, acl):
    backend = start.backend(acl, "lock_delay=0&token=no-sessions")
    with pytest.raises(ConsulPermissionDenied, match="session:write"):
        backend.try_acquire("k", owner(), 10)


def test_a_token_without_key_write_cannot_change_marks(start, acl):
    backend = start.backend(acl, "lock_delay=0&token=read-only")
    with pytest.raises(ConsulPermissionDenied):
        backend.swap_mark("k", "rerun", None, "x", 10)


@pytest.mark.parametrize("token", ["read-only", "no-sessions", "unknown"])
def test_the_start_up_check_names_the_missing_permission(start, acl, token):
    with pytest.raises(ConsulPermissionDenied, match="permission denied"):
        start.backend(acl, f"lock_delay=0&token={token}").check("exclusive:~check")


def test_the_start_up_check_passes_with_the_documented_policy(start, acl):
    assert start.backend(acl, "token=full").check("exclusive:~check") == []


def test_the_start_up_check_warns_about_no_lock_delay_and_a_skewed_agent_clock(start, consul):
    consul.clock_offset = 30.0
    warnings = start.backend(consul, "lock_delay=0").check("exclusive:~check")
    assert [w.split(": ")[1][:10] for w in warnings] == ["lock_delay", "the Consul"]


def test_the_cli_release_with_a_read_only_token_says_so_in_one_line(start, acl):
    start.backend(acl, "lock_delay=0&token=full").try_acquire("exclusive:k", owner(), 10)
    url = f"{acl.url}/leases?token=read-only"
    result = CliRunner().invoke(exclusive, ["--backend", url, "release", "k", "--yes"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: the Consul ACL token")
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


# --- answers that were lost --------------------------------------------------------------------


def leaderless_for(emulator: ConsulEmulator, seconds: float, hold: float) -> None:
    """The cluster loses its leader now and elects one ``seconds`` later; meanwhile the
    agent holds each request up to ``hold`` seconds (Consul: 7 s)."""
    emulator.rpc_hold = hold
    emulator.set_leaderless(True)
    threading.Timer(seconds, emulator.set_leaderless, [False]).start()


def test_a_release_answered_no_cluster_leader_is_retried_until_it_is_done(start, consul):
    holder, other = start.backend(consul), start.backend(consul)
    lease = holder.try_acquire("a", owner(), 10)
    kept = holder.try_acquire("b", owner(), 10)
    leaderless_for(consul, 0.8, hold=0.1)
    assert holder.release(lease) is True
    assert holder.renew([kept]) == set()  # the heartbeat keeps the session alive
    assert other.try_acquire("a", owner(), 10) is not None


def test_a_release_whose_answer_is_lost_frees_the_key_by_the_next_heartbeat(start, consul):
    holder, other = start.backend(consul), start.backend(consul)
    holder.connection.http.retry_budget, holder.connection.settle_budget = 0.2, 0.2
    lease = holder.try_acquire("a", owner(), 10)
    kept = holder.try_acquire("b", owner(), 10)
    leaderless_for(consul, 1.0, hold=0.05)
    with pytest.raises(BackendUnavailable):
        holder.release(lease)
    time.sleep(1.0)
    assert holder.renew([kept]) == set()  # the heartbeat: renews b, frees a
    assert other.try_acquire("a", owner(), 10) is not None


def test_an_acquire_whose_commit_lands_after_the_timeout_never_orphans_the_key(start, consul):
    holder, other = start.backend(consul), start.backend(consul)
    kept = holder.try_acquire("b", owner(), 10)
    holder.connection.http.timeout = 0.3
    leaderless_for(consul, 0.6, hold=3.0)  # the lock is held 0.6 s, then commits
    try:
        lease = holder.try_acquire("a", owner(), 10)
    except BackendUnavailable:
        lease = None
    if lease is not None:  # the read-back found the late commit: a lease like any other
        assert holder.holders_of("a")[0].owner == lease.owner
        assert holder.release(lease)
    else:  # not known in time: the next heartbeat frees it if it landed
        time.sleep(0.5)
        holder.renew([kept])
    assert other.try_acquire("a", owner(), 10) is not None


def test_a_mark_swap_whose_answer_is_lost_is_read_back(start, consul, monkeypatch):
    backend = start.backend(consul)
    backend.connection.http.timeout = 0.3
    backend.store_time()
    read = backend.connection.get

    def read_then_lose_the_leader(*args, **kwargs):
        entry = read(*args, **kwargs)
        leaderless_for(consul, 0.6, hold=3.0)  # the write is held, then lands late
        monkeypatch.setattr(backend.connection, "get", read)
        return entry

    monkeypatch.setattr(backend.connection, "get", read_then_lose_the_leader)
    assert backend.swap_mark("k", "rerun", None, "pending", 30) is True
    assert backend.read_mark("k", "rerun") == "pending"


def test_429_and_no_cluster_leader_are_retried_with_backoff(start, consul):
    backend = start.backend(consul)
    consul.throttle(3)
    assert backend.try_acquire("a", owner(), 10) is not None
    leaderless_for(consul, 0.5, hold=0.05)
    assert backend.try_acquire("b", owner(), 10) is not None


def test_a_store_leaderless_past_the_retry_budget_is_unavailable_not_held(start, consul):
    backend = start.backend(consul)
    backend.connection.http.retry_budget = 0.3
    leaderless_for(consul, 2.0, hold=0.05)
    with pytest.raises(BackendUnavailable, match="No cluster leader"):
        backend.try_acquire("a", owner(), 10)


def test_requests_wait_longer_than_consul_holds_them_for_a_leader():
    assert REQUEST_TIMEOUT > 7.0  # agent/consul/config.go RPCHoldTimeout


# --- node health, lock delay, datacenters -------------------------------------------------------


def test_a_failing_serf_check_does_not_take_a_running_workers_lease(start, consul):
    backend = start.backend(consul)
    lease = backend.try_acquire("k", owner(), 10)
    consul.set_check("serfHealth", "critical")
    assert backend.renew([lease]) == set()


def test_after_a_node_deregistration_nobody_takes_the_key_before_its_holder_notices(start, consul):
    holder, other = start.backend(consul, ""), start.backend(consul, "")
    lease = holder.try_acquire("k", owner(), 10)
    session = consul.sessions[holder.connection.process().session_id]
    assert session.lock_delay == pytest.approx(10 / 3 + REQUEST_TIMEOUT, abs=0.01)
    consul.deregister_node()  # the agent left: Consul destroys every session of its node
    consul.register_node()
    assert other.try_acquire("k", owner(), 10) is None  # lock delay
    assert holder.renew([lease]) == {lease}  # the holder learns at its next beat


def test_a_tiny_lock_delay_is_sent_in_a_form_go_parses(start, consul):
    backend = start.backend(consul, "lock_delay=0.00001")
    assert backend.try_acquire("k", owner(), 10) is not None


def test_another_datacenter_is_a_named_configuration_error(start, consul):
    backend = start.backend(consul, "dc=dc2")
    with pytest.raises(ConsulDatacenterError, match="dc2"):
        backend.check("exclusive:~check")


# --- TLS, IPv6, namespaces, connections -------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, by openssl."""
    d = tmp_path_factory.mktemp("pki")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
    )
    for name, extra in (
        ("server", "subjectAltName=IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        (d / f"{name}.ext").write_text(extra + "\n")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return d


@pytest.fixture
def tls(start, pki) -> ConsulEmulator:
    return start(
        tls={
            "certfile": str(pki / "server.pem"),
            "keyfile": str(pki / "server.key"),
            "client_ca": str(pki / "ca.pem"),
        }
    )


def test_tls_with_a_private_ca_and_a_client_certificate_from_the_url(start, tls, pki):
    query = (
        f"lock_delay=0&cacert={pki}/ca.pem&client_cert={pki}/client.pem&client_key={pki}/client.key"
    )
    assert start.backend(tls, query).try_acquire("k", owner(), 10) is not None


def test_tls_files_from_the_consul_environment(start, tls, pki, monkeypatch):
    monkeypatch.setenv("CONSUL_CACERT", str(pki / "ca.pem"))
    monkeypatch.setenv("CONSUL_CLIENT_CERT", str(pki / "client.pem"))
    monkeypatch.setenv("CONSUL_CLIENT_KEY", str(pki / "client.key"))
    assert start.backend(tls).try_acquire("k", owner(), 10) is not None


def test_an_unknown_ca_is_a_configuration_error_not_an_outage(start, tls, pki):
    backend = start.backend(tls, f"client_cert={pki}/client.pem&client_key={pki}/client.key")
    with pytest.raises(ConfigurationError, match="TLS verification failed"):
        backend.try_acquire("k", owner(), 10)


def test_an_ipv6_agent(start):
    emulator = start(host="::1")
    assert emulator.url.startswith("consul://[::1]:")
    assert start.backend(emulator).try_acquire("k", owner(), 10) is not None


def test_namespace_and_partition_are_passed_through(start):
    enterprise = start(enterprise=True)
    backend = start.backend(enterprise, "lock_delay=0&ns=team&partition=eu")
    assert backend.try_acquire("k", owner(), 10) is not None
    assert enterprise.store(ns="team", partition="eu").kv.entries
    assert not enterprise.state.kv.entries
    assert all(q.get("ns") == "team" and q.get("partition") == "eu" for q in enterprise.queries)


def test_a_namespace_on_community_edition_is_a_configuration_error(start, consul):
    with pytest.raises(ConfigurationError, match="Enterprise"):
        start.backend(consul, "ns=team").try_acquire("k", owner(), 10)


def test_one_process_keeps_one_small_pool_of_connections_whatever_its_threads(start, consul):
    backend = start.backend(consul)

    def work(n: int) -> None:
        for i in range(5):
            lease = backend.try_acquire(f"k{n}-{i}", owner(), 10)
            backend.release(lease)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(consul.peers) <= 8


# --- large values: a rerun's arguments ------------------------------------------------------------


def test_a_rerun_with_327_kib_of_arguments_is_stored_and_its_duplicates_coalesce(start, consul):
    backend = start.backend(consul)
    rows = [{"id": i, "name": f"row {i}", "tags": ["a", "b"]} for i in range(6260)]
    arguments = json.dumps({"args": [rows], "kwargs": {}})
    assert 327 * 1024 <= len(arguments) < 340 * 1024  # JSON: quotes to escape once more
    assert marks.join_rerun(backend, "k", "first", arguments, 30) == "first"
    assert marks.join_rerun(backend, "k", "second", arguments, 30) == "first"
    assert marks.take_rerun(backend, "k", "first") == arguments


def test_a_value_past_consuls_limit_is_a_named_error(start, consul):
    backend = start.backend(consul)
    with pytest.raises(ConsulValueTooLarge, match="512 KiB"):
        backend.swap_mark("k", "rerun", None, "x" * (600 * 1024), 30)
