"""A write whose reply the network lost is read back, never guessed at: on every store
reached over a network that answers "was it done?" by reading (PostgreSQL, etcd,
MongoDB, Consul), by one rule (``celery_exclusive.backends.readback``). The store is
reached through a proxy that forwards the request and drops the one reply carrying a
marker of its success; another client looks directly."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest

from celery_exclusive.backends import Backend, _load
from tests.support.mongo_standin import MongoStandIn
from tests.support.proxy import Proxy


@dataclass
class Lossy:
    backend: Backend  # through the proxy
    direct: Backend  # straight to the server
    proxy: Proxy
    #: A byte string only in the reply to a granted acquire, and to a release.
    acquire_reply: bytes
    release_reply: bytes


def _postgresql(request) -> Lossy:
    server = request.getfixturevalue("postgres_server")
    proxy = Proxy(server.port)
    schema = f"lost_{uuid.uuid4().hex[:10]}"
    backend = _load(f"{server.url_for(port=proxy.port)}?schema={schema}")
    backend.store_time()  # connected, tables made
    # The COMMIT's reply ends an acquire's transaction; a release is one statement.
    return Lossy(
        backend, _load(f"{server.url}?schema={schema}"), proxy, b"COMMIT\x00", b"SELECT 1\x00"
    )


def _etcd(request) -> Lossy:
    server = request.getfixturevalue("etcd_server")
    proxy = Proxy(server.port)
    prefix = f"lost-{uuid.uuid4().hex[:8]}"
    backend = _load(f"etcd://127.0.0.1:{proxy.port}/{prefix}")
    direct = _load(f"etcd://127.0.0.1:{server.port}/{prefix}")
    return Lossy(backend, direct, proxy, b'"succeeded":true', b'"deleted":"1"')


def _mongodb(request) -> Lossy:
    server = request.getfixturevalue("mongo_server")
    if not isinstance(server, MongoStandIn):
        pytest.skip("the proxy is put in front of the stand-in's port")
    proxy = Proxy(server.port)
    name = f"lost_{uuid.uuid4().hex[:8]}"
    backend = _load(f"mongodb://127.0.0.1:{proxy.port}/{name}?retryWrites=false")
    backend.store_time()  # connected
    return Lossy(backend, _load(f"{server.url}/{name}"), proxy, b"lastErrorObject", b"nModified")


def _consul(request) -> Lossy:
    server = request.getfixturevalue("consul_server")
    url = request.getfixturevalue("consul_url")  # a folder of its own, no lock delay
    proxy = Proxy(urlsplit(server.url).port)
    backend = _load(proxy.url_for(url))
    backend.store_time()  # connected
    # An acquire and a release are each one transaction, whose reply lists its results.
    return Lossy(backend, _load(url), proxy, b'"Results"', b'"Results"')


@pytest.fixture(
    params=[_postgresql, _etcd, _mongodb, _consul], ids=["postgresql", "etcd", "mongodb", "consul"]
)
def lossy(request):
    store = request.param(request)
    yield store
    store.backend.close()
    store.direct.close()
    store.proxy.close()


def test_an_acquire_whose_reply_was_lost_is_read_back_as_granted(lossy):
    owner = uuid.uuid4().hex
    lossy.proxy.drop_reply_containing(lossy.acquire_reply)
    lease = lossy.backend.try_acquire("k", owner, 10)
    assert lossy.proxy.dropped == 1
    assert lease is not None
    assert [(i.owner, i.fencing_token) for i in lossy.direct.holders_of("k")] == [
        (owner, lease.fencing_token)
    ]


def test_a_release_whose_reply_was_lost_is_read_back_and_frees_the_key(lossy):
    lease = lossy.backend.try_acquire("k", uuid.uuid4().hex, 10)
    lossy.proxy.drop_reply_containing(lossy.release_reply)
    assert lossy.backend.release(lease) is True
    assert lossy.proxy.dropped == 1
    assert lossy.direct.holders_of("k") == []


def test_an_acquire_that_lands_after_its_client_gave_up_is_read_back_as_granted(request):
    """The grant reaches the store a second after the client stopped waiting for it:
    the read-back goes on while the owner is not there yet, and finds it. (MongoDB:
    its client gives up after ``socketTimeoutMS``; the proxy holds the request.)"""
    server = request.getfixturevalue("mongo_server")
    if not isinstance(server, MongoStandIn):
        pytest.skip("the proxy is put in front of the stand-in's port")
    proxy = Proxy(server.port)
    name = f"late_{uuid.uuid4().hex[:8]}"
    backend = _load(
        f"mongodb://127.0.0.1:{proxy.port}/{name}?retryWrites=false&socketTimeoutMS=300"
    )
    direct = _load(f"{server.url}/{name}")
    try:
        backend.store_time()  # connected
        owner = uuid.uuid4().hex
        proxy.deliver_late(b"findAndModify", 1.0)
        lease = backend.try_acquire("k", owner, 10)
        assert proxy.delivered_late == 1
        assert lease is not None
        assert [(i.owner, i.fencing_token) for i in direct.holders_of("k")] == [
            (owner, lease.fencing_token)
        ]
    finally:
        backend.close()
        direct.close()
        proxy.close()
