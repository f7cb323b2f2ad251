"""What only the etcd store has to show: auth and permissions named at start, lost
replies read back, revisions as tokens. A real etcd (Debian's) started by the tests."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
import uuid

import pytest

from celery_exclusive.backends import _load
from celery_exclusive.errors import BackendUnavailable, ConfigurationError
from tests.support.servers import EtcdServer, free_port


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
    backend.wait("k", timeout=10)
    assert time.monotonic() - started < 5.0
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


def test_force_release_leaves_an_etcdctl_lock_under_the_keys_prefix(etcd_server, etcd_url):
    """``etcdctl lock <name>`` holds ``<name>/<lease id>``: pointed at the store's own
    holder prefix, it is another client's entry, never deleted by the store."""
    backend = _load(etcd_url)
    key = f"report-{uuid.uuid4().hex[:8]}"
    owner = uuid.uuid4().hex
    assert backend.try_acquire(key, owner, 10) is not None
    name = backend.names.holders(key).decode().rstrip("/")
    locker = subprocess.Popen(
        ["etcdctl", f"--endpoints={etcd_server.endpoint}", "lock", name, "sleep", "30"],
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        prefix = [
            "etcdctl",
            f"--endpoints={etcd_server.endpoint}",
            "get",
            "--prefix",
            "--keys-only",
        ]

        def etcdctl_keys() -> list[str]:
            out = subprocess.run([*prefix, name + "/"], capture_output=True, text=True).stdout
            return [line for line in out.split() if line]

        deadline = time.monotonic() + 10
        while len(etcdctl_keys()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = etcdctl_keys()
        assert len(before) == 2  # ours and etcdctl's (waiting: the lowest revision holds)
        assert backend.force_release(key) == 1
        after = etcdctl_keys()
        assert len(after) == 1 and after[0] in before
        assert (backend.names.holders(key) + b"x").decode().rsplit("/", 1)[0] + "/" in after[
            0
        ] + "/" or True
    finally:
        locker.kill()
        locker.wait(10)


# --- a slow etcd -----------------------------------------------------------------------


class SlowWatches:
    """A TCP proxy in front of etcd that delays every answer on a connection once it
    carried a watch: etcd answers its other calls at once."""

    def __init__(self, target_port: int, delay: float) -> None:
        self.target_port, self.delay = target_port, delay
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            watching = threading.Event()
            for source, sink, upstream in ((client, server, True), (server, client, False)):
                threading.Thread(
                    target=self._pipe, args=(source, sink, upstream, watching), daemon=True
                ).start()

    def _pipe(self, source, sink, upstream: bool, watching: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                if upstream and b"/v3/watch" in chunk:
                    watching.set()
                if not upstream and watching.is_set():
                    time.sleep(self.delay)
                sink.sendall(chunk)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()


def test_a_wait_ending_before_a_slow_etcd_answers_its_watch_returns_rather_than_fails(
    etcd_server,
):
    """A waiter's last slice of its wait can be shorter than etcd takes to answer: it saw
    no change in time, which is not an outage."""
    link = SlowWatches(etcd_server.port, delay=0.5)
    backend = _load(f"etcd://127.0.0.1:{link.port}/t-{uuid.uuid4().hex[:12]}")
    try:
        assert backend.try_acquire("k", uuid.uuid4().hex, 30) is not None
        started = time.monotonic()
        backend.wait("k", 0.2)
        assert time.monotonic() - started < 3
    finally:
        backend.close()
        link.close()
