"""A write whose reply the network lost is read back, never guessed at: on every store
reached over a network that answers "was it done?" by reading (PostgreSQL, etcd,
MongoDB). The store is reached through a proxy that forwards the request and drops
the one reply carrying a marker of its success; another client looks directly."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest

from celery_exclusive.backends import Backend, _load
from tests.mongo_standin import MongoStandIn
from tests.servers import ReplyDropper


@dataclass
class Lossy:
    backend: Backend  # through the proxy
    direct: Backend  # straight to the server
    proxy: ReplyDropper
    #: A byte string only in the reply to a granted acquire, and to a release.
    acquire_reply: bytes
    release_reply: bytes


def _postgresql(request) -> Lossy:
    server = request.getfixturevalue("postgres_server")
    proxy = ReplyDropper(server.port)
    schema = f"lost_{uuid.uuid4().hex[:10]}"
    backend = _load(f"{server.url_for(port=proxy.port)}?schema={schema}")
    backend.store_time()  # connected, tables made
    # The COMMIT's reply ends an acquire's transaction; a release is one statement.
    return Lossy(
        backend, _load(f"{server.url}?schema={schema}"), proxy, b"COMMIT\x00", b"SELECT 1\x00"
    )


def _etcd(request) -> Lossy:
    server = request.getfixturevalue("etcd_server")
    proxy = ReplyDropper(server.port)
    prefix = f"lost-{uuid.uuid4().hex[:8]}"
    backend = _load(f"etcd://127.0.0.1:{proxy.port}/{prefix}")
    direct = _load(f"etcd://127.0.0.1:{server.port}/{prefix}")
    return Lossy(backend, direct, proxy, b'"succeeded":true', b'"deleted":"1"')


def _mongodb(request) -> Lossy:
    server = request.getfixturevalue("mongo_server")
    if not isinstance(server, MongoStandIn):
        pytest.skip("the proxy is put in front of the stand-in's port")
    proxy = ReplyDropper(server.port)
    name = f"lost_{uuid.uuid4().hex[:8]}"
    backend = _load(f"mongodb://127.0.0.1:{proxy.port}/{name}?retryWrites=false")
    backend.store_time()  # connected
    return Lossy(backend, _load(f"{server.url}/{name}"), proxy, b"lastErrorObject", b"nModified")


@pytest.fixture(params=[_postgresql, _etcd, _mongodb], ids=["postgresql", "etcd", "mongodb"])
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
