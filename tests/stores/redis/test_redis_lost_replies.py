"""An acquire whose reply the network lost is the same grant when the client sends it
again: redis-py sends a command again after a connection error, and the acquire
script finds the key held by the very owner asking (owners are unique per attempt), so
it answers that grant again instead of refusing the caller its own lease. The store is
reached through a proxy that forwards the request and drops the reply carrying the
grant's token (closing the connection instead); another client looks directly. A
release sent again the same way is a release, not a loss; one with a write reads the write back."""

from __future__ import annotations

import json
import re
import uuid

import pytest
from celery import Celery

from celery_exclusive import ExclusiveTask
from celery_exclusive.backends import End, FinalWrite, MarkRead, MarkSwap, _load
from celery_exclusive.backends.line import LINE
from celery_exclusive.core import policies
from celery_exclusive.core.config import Settings
from tests.support.proxy import Proxy

#: The start of an integer reply (RESP): a grant's fencing token, and nothing else an
#: acquire is answered with (a refusal is a null, a missing script an error).
TOKEN_REPLY = b":"


@pytest.fixture
def proxy(redis_server):
    proxy = Proxy(redis_server.port)
    yield proxy
    proxy.close()


@pytest.fixture(params=["store", "set-nx"])
def url(request, redis_url):
    """The store's own layout, and Redis's lock recipe on the key's own name."""
    return redis_url if request.param == "store" else redis_url + "?recipe=set-nx"


@pytest.fixture
def lossy(proxy, url):
    """The store through the proxy, connected and with its scripts loaded: the next
    integer reply it gets is an acquire's."""
    backend = _load(proxy.url_for(url))
    backend.store_time()
    backend.release(backend.try_acquire("warm-up", uuid.uuid4().hex, 5))
    yield backend
    backend.close()


@pytest.fixture
def direct(url):
    backend = _load(url)
    yield backend
    backend.close()


def _token_lost(proxy) -> int:
    """The fencing token of the grant whose reply the proxy dropped: the one that landed."""
    assert proxy.dropped == 1
    reply = re.match(rb"(?:\*2\r\n)?:(\d+)\r\n", proxy.lost[0])  # a token, or a token and a mark
    assert reply is not None, proxy.lost
    return int(reply[1])


def _held(direct, key: str) -> list[tuple[str, int]]:
    return [(info.owner, info.fencing_token) for info in direct.holders_of(key)]


def test_an_acquire_sent_again_after_its_reply_was_lost_gets_the_grant_that_landed(
    proxy, lossy, direct
):
    owner = uuid.uuid4().hex
    proxy.drop_reply_containing(TOKEN_REPLY)
    lease = lossy.try_acquire("k", owner, 10)
    assert lease is not None and lease.fencing_token == _token_lost(proxy)
    assert _held(direct, "k") == [(owner, lease.fencing_token)]


def test_the_grant_answered_again_is_released_and_leaves_no_orphan(proxy, lossy, direct):
    proxy.drop_reply_containing(TOKEN_REPLY)
    lease = lossy.try_acquire("k", uuid.uuid4().hex, 10)
    assert lease.fencing_token == _token_lost(proxy)
    assert lossy.release(lease) is True
    assert direct.holders_of("k") == []
    assert direct.try_acquire("k", uuid.uuid4().hex, 10) is not None


def test_a_caller_that_left_the_line_with_the_lost_grant_gets_it_again(proxy, lossy, direct):
    """The first send took the caller out of the line: sent again, it stands behind
    the rest of the line, and is still answered with its own grant."""
    until = direct.store_time() + 60
    waiters = [{"id": claimant, "until": until} for claimant in ("first", "second")]
    assert direct.swap_mark("k", LINE, None, json.dumps(waiters), 60)
    owner = uuid.uuid4().hex
    proxy.drop_reply_containing(TOKEN_REPLY)
    lease = lossy.try_acquire("k", owner, 10, claimant="first")
    assert lease is not None and lease.fencing_token == _token_lost(proxy)
    assert _held(direct, "k") == [(owner, lease.fencing_token)]
    assert [w["id"] for w in json.loads(direct.read_mark("k", LINE))] == ["second"]


def test_an_acquire_and_mark_read_sent_again_gets_the_grant_and_the_mark(proxy, lossy, direct):
    assert direct.swap_mark("k", "done", None, "yes", 60)
    owner = uuid.uuid4().hex
    proxy.drop_reply_containing(TOKEN_REPLY)
    read = MarkRead("k", "done")
    lease = lossy.try_acquire("k", owner, 10, read=read)
    assert lease is not None and lease.fencing_token == _token_lost(proxy)
    assert (read.value, read.done) == ("yes", True)
    assert _held(direct, "k") == [(owner, lease.fencing_token)]


def test_a_skip_call_whose_grant_reply_was_lost_runs_and_is_not_its_own_duplicate(
    proxy, lossy, direct, url
):
    settings = Settings(backend_url=url, lease_ttl=10.0, on_duplicate="skip")
    proxy.drop_reply_containing(TOKEN_REPLY)
    outcome = policies.claim(settings, lossy, "k", "billing.settle", "task-1")
    assert isinstance(outcome, policies.Granted), outcome
    assert outcome.lease.fencing_token == _token_lost(proxy)
    assert [(i.task_id, i.fencing_token) for i in direct.holders_of("k")] == [
        ("task-1", outcome.lease.fencing_token)
    ]


# --- semaphores (the store's own layout: the recipe has one holder per key) -----------


@pytest.fixture
def semaphore(proxy, redis_url):
    backend = _load(proxy.url_for(redis_url))
    backend.store_time()
    backend.release(backend.try_acquire("warm-up", uuid.uuid4().hex, 5, limit=2))
    yield backend
    backend.close()


@pytest.fixture
def direct_store(redis_url):
    backend = _load(redis_url)
    yield backend
    backend.close()


def test_a_semaphore_slot_sent_again_is_the_one_slot_that_landed_with_its_token(
    proxy, semaphore, direct_store
):
    owner = uuid.uuid4().hex
    proxy.drop_reply_containing(TOKEN_REPLY)
    lease = semaphore.try_acquire("k", owner, 10, limit=3)
    assert lease is not None and lease.fencing_token == _token_lost(proxy)
    assert _held(direct_store, "k") == [(owner, lease.fencing_token)]


def test_a_semaphore_slot_sent_again_is_answered_when_it_took_the_last_slot(
    proxy, semaphore, direct_store
):
    other = direct_store.try_acquire("k", uuid.uuid4().hex, 10, limit=2)
    owner = uuid.uuid4().hex
    proxy.drop_reply_containing(TOKEN_REPLY)
    lease = semaphore.try_acquire("k", owner, 10, limit=2)
    assert lease is not None and lease.fencing_token == _token_lost(proxy)
    assert sorted(_held(direct_store, "k")) == sorted(
        [(other.owner, other.fencing_token), (owner, lease.fencing_token)]
    )


def test_an_eager_skip_task_whose_grant_reply_was_lost_runs_under_that_grant(proxy, url, direct):
    app = Celery("lost-replies", set_as_current=False)
    app.conf.update(task_always_eager=True, exclusive_backend_url=proxy.url_for(url))

    @app.task(
        base=ExclusiveTask,
        bind=True,
        name="billing.settle",
        exclusive_key="invoice:7",
        exclusive_on_duplicate="skip",
    )
    def settle(self):
        return [self.lease.key, self.lease.fencing_token]

    key, _ = settle.delay().get()  # connected, scripts loaded
    proxy.drop_reply_containing(TOKEN_REPLY)
    assert settle.delay().get() == [key, _token_lost(proxy)]
    assert direct.holders_of(key) == []


def test_a_release_sent_again_after_its_reply_was_lost_is_a_release(proxy, lossy, direct):
    """The first send freed the lease; the second finds nothing to free. That is the
    release the holder asked for, not a lost lease (which would send its call again)."""
    lease = lossy.try_acquire("settled", uuid.uuid4().hex, 30)
    proxy.drop_reply_containing(b":1\r\n")
    assert lossy.release(lease) is True
    assert proxy.dropped == 1
    assert _held(direct, "settled") == []


def test_an_end_mark_and_release_sent_again_after_its_reply_was_lost_is_a_release(
    proxy, lossy, direct
):
    """The end of an ``acks_late`` attempt: the first send set the mark and freed the
    lease; the second finds its own mark and nothing to free."""
    if not lossy.capabilities.marks:
        pytest.skip("the store keeps no marks")
    lease = lossy.try_acquire("acked", uuid.uuid4().hex, 30)
    proxy.drop_reply_containing(b":1\r\n")
    end = End(mark=MarkSwap("acked", "finished", None, "done", 30))
    assert lossy.release(lease, end) is True
    assert proxy.dropped == 1
    assert _held(direct, "acked") == []
    assert direct.read_mark("acked", "finished") == "done"


def test_a_release_with_a_write_sent_again_after_its_reply_was_lost_reads_its_write_back(
    proxy, lossy, direct
):
    """The first send freed the lease and stored the result; the second finds nothing
    to free, and the result stored: a release, whose write was made."""
    if not lossy.capabilities.final_writes:
        pytest.skip("the store makes no writes with a release")
    lease = lossy.try_acquire("with-result", uuid.uuid4().hex, 30)
    write = FinalWrite(key="result:with-result", value='{"status": "SUCCESS"}', ttl=60)
    proxy.drop_reply_containing(b":1\r\n")
    assert lossy.release(lease, End(write=write)) is True
    assert proxy.dropped == 1
    assert _held(direct, "with-result") == []
    assert direct.connection.client.get("result:with-result") == b'{"status": "SUCCESS"}'


def test_a_release_with_a_write_sent_again_whose_lease_was_gone_is_not_a_release(
    proxy, lossy, direct
):
    """The lease was freed by an operator meanwhile: the first send wrote nothing, the
    second finds nothing to free and no result stored. Not a release, however often it
    was sent, and nothing written."""
    if not lossy.capabilities.final_writes:
        pytest.skip("the store makes no writes with a release")
    lease = lossy.try_acquire("with-result", uuid.uuid4().hex, 30)
    direct.force_release("with-result")
    write = FinalWrite(key="result:with-result", value='{"status": "SUCCESS"}', ttl=60)
    proxy.drop_reply_containing(b":0\r\n")
    assert lossy.release(lease, End(write=write)) is False
    assert proxy.dropped == 1
    assert direct.connection.client.get("result:with-result") is None
