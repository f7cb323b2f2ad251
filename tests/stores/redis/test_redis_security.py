"""TLS with a private CA and a least-privilege ACL user, on real redis-servers: the right
settings work, and each wrong one gets a ConfigurationError naming it (never an
outage that requeues forever)."""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import threading
import uuid

import pytest

from celery_exclusive.backends import MarkRead
from celery_exclusive.backends.redis import RedisBackend
from celery_exclusive.backends.redis.checks import speaks_tls
from celery_exclusive.backends.redis.failures import ACL_COMMANDS
from celery_exclusive.core.marks import DONE, finished_key
from celery_exclusive.errors import BackendUnavailable, ConfigurationError
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack
from tests.support.servers import RedisServer, TLSFiles, free_port
from tests.support.workers import read_ledger

PASSWORD = "leases-secret"
#: What the store needs on a database 0 without min_replicas (docs/how-to/stores/redis.md).
NEEDED = ACL_COMMANDS


def owner() -> str:
    return uuid.uuid4().hex


# --- TLS --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tls"))
    return TLSFiles(directory, "ca"), TLSFiles(directory, "other")


@pytest.fixture(scope="module")
def tls_server(tls):
    server = RedisServer(tls=tls[0])
    server.start()
    yield server
    server.cleanup()


def tls_url(server, ca: str, **options) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"ssl_ca_certs": ca, **options}.items())
    return f"rediss://127.0.0.1:{server.port}/0?{query}"


@pytest.mark.parametrize(
    "cert_reqs", ["required", "CERT_REQUIRED", "optional", "CERT_OPTIONAL", "cert_required"]
)
def test_tls_with_the_private_ca_works_in_every_spelling_celery_accepts(tls, tls_server, cert_reqs):
    backend = RedisBackend(tls_url(tls_server, tls[0].ca, ssl_cert_reqs=cert_reqs))
    backend.check("exclusive:~check")
    assert backend.try_acquire(owner(), owner(), 10) is not None
    backend.close()


@pytest.mark.parametrize("cert_reqs", ["required", "CERT_REQUIRED"])
def test_a_certificate_from_another_ca_is_a_named_configuration_error_at_check(
    tls, tls_server, cert_reqs
):
    backend = RedisBackend(tls_url(tls_server, tls[1].ca, ssl_cert_reqs=cert_reqs))
    with pytest.raises(ConfigurationError, match="TLS.*ssl_ca_certs"):
        backend.check("exclusive:~check")


@pytest.mark.parametrize("cert_reqs", ["none", "CERT_NONE"])
def test_cert_reqs_none_connects_without_verifying(tls, tls_server, cert_reqs):
    backend = RedisBackend(tls_url(tls_server, tls[1].ca, ssl_cert_reqs=cert_reqs))
    assert backend.try_acquire(owner(), owner(), 10) is not None


def test_a_missing_ca_file_is_named_when_the_url_is_read(tls_server, tmp_path):
    with pytest.raises(ConfigurationError, match="ssl_ca_certs.*not a readable file"):
        RedisBackend(tls_url(tls_server, str(tmp_path / "nowhere.crt")))


def test_an_unknown_cert_reqs_value_is_named(tls, tls_server):
    with pytest.raises(ConfigurationError, match="ssl_cert_reqs='CERT_MAYBE'"):
        RedisBackend(tls_url(tls_server, tls[0].ca, ssl_cert_reqs="CERT_MAYBE"))


def test_a_plain_text_url_to_a_tls_port_is_a_configuration_error_naming_rediss(tls_server):
    backend = RedisBackend(f"redis://127.0.0.1:{tls_server.port}/0")
    with pytest.raises(ConfigurationError, match=f"127.0.0.1:{tls_server.port}, which speaks TLS"):
        backend.check("exclusive:~check")
    with pytest.raises(ConfigurationError, match="rediss://"):
        backend.check("exclusive:~check")


def test_a_plain_text_url_to_a_closed_port_is_still_an_outage():
    backend = RedisBackend(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(BackendUnavailable, match="did not answer"):
        backend.check("exclusive:~check")


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_tls_port_that_asks_for_a_client_certificate_is_known_as_tls(tls, version):
    """It refuses the probe's handshake with an alert: still TLS."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls[0].cert, tls[0].key)
    context.load_verify_locations(tls[0].ca)
    context.verify_mode = ssl.CERT_REQUIRED
    context.maximum_version = version
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            client, _ = listener.accept()
            with contextlib.suppress(OSError), context.wrap_socket(client, server_side=True):
                pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        assert speaks_tls("127.0.0.1", listener.getsockname()[1])
    finally:
        listener.close()


# --- ACL --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def acl_server():
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


def acl_user(server, name: str, commands: list[str]) -> str:
    """Create (or reset) ACL user ``name`` allowed only ``commands`` on the store's keys;
    return the store URL that logs in as it."""
    server.client().execute_command(
        "ACL",
        "SETUSER",
        name,
        "reset",
        "on",
        f">{PASSWORD}",
        "~{exclusive:*",
        *(f"+{command}" for command in commands),
    )
    server.client().script_flush()  # so that the first call loads its script
    return f"redis://{name}:{PASSWORD}@127.0.0.1:{server.port}/0"


def test_a_least_privilege_acl_user_passes_the_check_and_keeps_leases(acl_server):
    backend = RedisBackend(acl_user(acl_server, "leases", NEEDED))
    backend.check("exclusive:~check")
    lease = backend.try_acquire("exclusive:k", owner(), 10, limit=2)
    assert [info.key for info in backend.holders("exclusive:")] == ["exclusive:k"]
    assert backend.release(lease)
    backend.close()


@pytest.mark.parametrize("missing", NEEDED)
def test_a_user_missing_one_command_gets_the_named_error_at_check(acl_server, missing):
    url = acl_user(
        acl_server, f"without-{missing.replace('|', '-')}", [c for c in NEEDED if c != missing]
    )
    with pytest.raises(ConfigurationError, match="lacks a permission.*ACL SETUSER"):
        RedisBackend(url).check("exclusive:~check")


def test_a_key_outside_the_granted_pattern_is_a_configuration_error(acl_server):
    backend = RedisBackend(acl_user(acl_server, "leases", NEEDED))
    with pytest.raises(ConfigurationError, match="ACL SETUSER"):
        backend.try_acquire("elsewhere:k", owner(), 10)


def test_a_wrong_password_is_a_named_configuration_error_at_check(acl_server):
    acl_user(acl_server, "leases", NEEDED)
    url = f"redis://leases:wrong@127.0.0.1:{acl_server.port}/0"
    with pytest.raises(ConfigurationError, match="credentials.*user name and password"):
        RedisBackend(url).check("exclusive:~check")


def refused_start(stack, name: str) -> str:
    """Start a worker on ``stack`` that must refuse to start; return its output."""
    worker = stack.worker(name, pool="solo").start(wait=False)
    assert worker.process.wait(60) != 0, "the worker started"
    output = worker.output()
    assert "Traceback" not in output
    return output


def test_a_worker_refuses_to_start_with_a_user_missing_a_command(
    acl_server, redis_server, client_dbs, tmp_path_factory
):
    url = acl_user(acl_server, "no-ltrim", [c for c in NEEDED if c != "ltrim"])
    output = refused_start(Stack(redis_server, *client_dbs, url, tmp_path_factory), "acl")
    assert "ConfigurationError" in output and "ACL SETUSER" in output


def test_a_worker_refuses_to_start_with_a_ca_that_did_not_sign_the_server(
    tls, tls_server, redis_server, client_dbs, tmp_path_factory
):
    url = tls_url(tls_server, tls[1].ca, ssl_cert_reqs="CERT_REQUIRED")
    output = refused_start(Stack(redis_server, *client_dbs, url, tmp_path_factory), "tls")
    assert "ConfigurationError" in output and "ssl_ca_certs" in output


def test_a_worker_refuses_to_start_with_a_plain_text_url_to_a_tls_port(
    tls_server, redis_server, client_dbs, tmp_path_factory
):
    url = f"redis://127.0.0.1:{tls_server.port}/0"
    output = refused_start(Stack(redis_server, *client_dbs, url, tmp_path_factory), "plain")
    assert "ConfigurationError" in output and "speaks TLS" in output and "rediss://" in output


@pytest.mark.parametrize("granted", [[], ["cluster|slots"]], ids=["plain-rule", "no-command"])
def test_a_cluster_user_given_the_rule_its_error_names_starts_its_worker(
    redis_server, client_dbs, redis_cluster, redis_cluster_url, tmp_path_factory, granted
):
    """On a real Redis Cluster, a user granted the rule for a plain Redis (and, at most,
    CLUSTER SLOTS): its worker refuses to start, naming a rule; granted that rule on
    every node, the worker starts and runs a task."""
    user = f"cluster-{uuid.uuid4().hex[:8]}"

    def grant(commands: list[str]) -> None:
        for node in redis_cluster.nodes:
            node.client().execute_command(
                "ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", "~{exclusive:*",
                *(f"+{command}" for command in commands),
            )  # fmt: skip

    grant(NEEDED + granted)
    url = redis_cluster_url.replace("redis+cluster://", f"redis+cluster://{user}:{PASSWORD}@")
    stack = Stack(redis_server, *client_dbs, url, tmp_path_factory)
    try:
        output = refused_start(stack, "cluster-acl")
        rule = re.search(r"ACL SETUSER <user> ~\{<key_prefix>\* ((?:\+\S+ )*\+\S+)", output)
        assert "ConfigurationError" in output and rule, output
        grant([word[1:] for word in rule[1].split()])
        stack.reset()
        with stack.running(stack.worker("cluster-acl", concurrency=1)):
            entry = ledger_app.hold_skip.delay("cluster-acl", 0).get(timeout=30)
        assert entry["token"] and entry["held"]
        assert [entry["key"] for entry in read_ledger(stack.ledger)] == ["cluster-acl"]
    finally:
        for node in redis_cluster.nodes:
            node.client().execute_command("ACL", "DELUSER", user)


def test_a_permission_revoked_at_run_time_fails_the_task_instead_of_requeueing_it(
    acl_server, redis_server, client_dbs, tmp_path_factory
):
    url = acl_user(acl_server, "revoked", NEEDED)
    stack = Stack(redis_server, *client_dbs, url, tmp_path_factory)
    with stack.running(stack.worker("w1", concurrency=1)):
        acl_server.client().execute_command("ACL", "SETUSER", "revoked", "-zadd")
        result = ledger_app.hold_two.delay("limited", 0)
        with pytest.raises(ConfigurationError, match="lacks a permission"):
            result.get(timeout=30)
        assert result.state == "FAILURE"
        assert read_ledger(stack.ledger) == []


def test_a_grant_whose_wait_is_refused_is_given_back(acl_server):
    """With min_replicas, the grant and its WAIT go in one round trip: a WAIT the user
    may not run fails the acquire, and the grant it follows must not stay behind."""
    url = acl_user(acl_server, "no-wait", NEEDED) + "?min_replicas=1"
    with pytest.raises(ConfigurationError, match="ACL SETUSER"):
        RedisBackend(url).try_acquire("exclusive:replicated", owner(), 30)
    admin = RedisBackend(f"redis://127.0.0.1:{acl_server.port}/0")
    assert admin.holders_of("exclusive:replicated") == []
    admin.close()


def test_a_grant_whose_finished_mark_may_not_be_read_is_given_back(acl_server):
    """The finished mark of a task id lives beside its key, not among the key's own
    entries: a user granted only the key's entries gets the grant, then a refusal."""
    user = "one-key"
    acl_server.client().execute_command(
        "ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", "~{exclusive:k}*",
        *(f"+{command}" for command in NEEDED),
    )  # fmt: skip
    backend = RedisBackend(f"redis://{user}:{PASSWORD}@127.0.0.1:{acl_server.port}/0")
    read = MarkRead(finished_key("exclusive:k", "task-1"), DONE)
    with pytest.raises(ConfigurationError, match="ACL SETUSER"):
        backend.try_acquire("exclusive:k", owner(), 30, read=read)
    assert backend.holders_of("exclusive:k") == []
    backend.close()
