"""What only the etcd store has to show: auth and permissions named at start, lost
replies read back, revisions as tokens. A real etcd (Debian's) started by the tests."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid

import pytest

from celery_exclusive.backends import _load
from celery_exclusive.errors import BackendUnavailable, ConfigurationError
from tests.servers import EtcdServer, free_port


@pytest.fixture(scope="module")
def secured_etcd():
    """An etcd with auth enabled: user ``worker`` may read and write under ``allowed/``."""
    server = EtcdServer()
    server.start()

    def etcdctl(*args: str) -> None:
        subprocess.run(
            ["etcdctl", f"--endpoints={server.endpoint}", *args],
            check=True,
            capture_output=True,
            env={"ETCDCTL_API": "3"},
        )

    etcdctl("user", "add", "root", "--new-user-password=rootpw")
    etcdctl("role", "add", "root")
    etcdctl("user", "grant-role", "root", "root")
    etcdctl("user", "add", "worker", "--new-user-password=pw")
    etcdctl("role", "add", "workers")
    etcdctl("role", "grant-permission", "workers", "--prefix=true", "readwrite", "allowed/")
    etcdctl("user", "grant-role", "worker", "workers")
    etcdctl("auth", "enable")
    yield server
    server.cleanup()


def test_a_user_with_readwrite_on_the_prefix_keeps_leases(secured_etcd):
    backend = _load(f"etcd://worker:pw@{secured_etcd.endpoint}/allowed")
    backend.check("exclusive:~check")
    assert backend.try_acquire("k", uuid.uuid4().hex, 5) is not None


def test_a_wrong_password_is_a_configuration_error_at_start(secured_etcd):
    backend = _load(f"etcd://worker:wrong@{secured_etcd.endpoint}/allowed")
    with pytest.raises(ConfigurationError, match="user and password"):
        backend.check("exclusive:~check")


def test_no_credentials_on_a_server_with_auth_is_a_configuration_error(secured_etcd):
    backend = _load(f"etcd://{secured_etcd.endpoint}/allowed")
    with pytest.raises(ConfigurationError):
        backend.check("exclusive:~check")


def test_a_prefix_the_user_may_not_write_is_named_with_the_permission_to_grant(secured_etcd):
    backend = _load(f"etcd://worker:pw@{secured_etcd.endpoint}/elsewhere")
    with pytest.raises(ConfigurationError, match="readwrite"):
        backend.check("exclusive:~check")


def test_a_server_that_does_not_answer_is_unavailable_not_misconfigured():
    backend = _load(f"etcd://127.0.0.1:{free_port()}")
    with pytest.raises(BackendUnavailable):
        backend.check("exclusive:~check")


def test_tls_files_on_a_plain_url_are_refused():
    with pytest.raises(ConfigurationError, match="etcds://"):
        _load("etcd://127.0.0.1:2379?cacert=/etc/ca.pem")


def test_fencing_tokens_are_the_clusters_revisions(etcd_url):
    backend = _load(etcd_url)
    first = backend.try_acquire("k", uuid.uuid4().hex, 5)
    backend.release(first)
    other = backend.try_acquire("other", uuid.uuid4().hex, 5)
    second = backend.try_acquire("k", uuid.uuid4().hex, 5)
    assert first.fencing_token < other.fencing_token < second.fencing_token


def test_wait_is_woken_by_the_watch_not_by_polling(etcd_url, monkeypatch):
    backend = _load(etcd_url)
    lease = backend.try_acquire("k", uuid.uuid4().hex, 10)
    reads = []
    free_for = backend._free_for
    monkeypatch.setattr(backend, "_free_for", lambda *a: reads.append(1) or free_for(*a))
    threading.Timer(0.6, backend.release, [lease]).start()
    started = time.monotonic()
    backend.wait("k", timeout=5)
    assert time.monotonic() - started < 1.5
    assert len(reads) == 2, "one read before the release, one after the watch saw it"


def test_a_grant_on_an_etcd_lease_idle_for_most_of_its_life_still_lives_its_ttl(etcd_url):
    """A process's keys share one etcd lease, which only the heartbeat of held leases
    keeps alive: a key put on it late in its life would die before its own ttl."""
    backend = _load(etcd_url)
    first = backend.try_acquire("idle-a", uuid.uuid4().hex, 2.0)
    backend.release(first)
    time.sleep(1.5)  # the etcd lease, granted with the first acquire, is near its end
    late = backend.try_acquire("idle-b", uuid.uuid4().hex, 2.0)
    time.sleep(1.0)  # within the new lease's ttl, past the etcd lease's old deadline
    assert backend.renew([late]) == set()
    backend.close()


def test_a_key_whose_release_failed_in_an_outage_is_deleted_once_etcd_answers():
    """The process's etcd lease outlives the outage (etcd keeps leases across a restart)
    and its acquires keep it alive, so the key would never expire by itself."""
    server = EtcdServer()
    server.start()
    try:
        backend = _load(f"{server.url}/released")
        stuck = backend.try_acquire("stuck", uuid.uuid4().hex, 2.0)
        server.stop()
        with pytest.raises(BackendUnavailable):
            backend.release(stuck)
        server.start()
        for i in range(8):  # other work of the same process, 4 s: two ttls
            other = backend.try_acquire(f"other-{i}", uuid.uuid4().hex, 2.0)
            backend.release(other)
            time.sleep(0.5)
        assert backend.holders_of("stuck") == []
        backend.close()
    finally:
        server.cleanup()
