"""What the Redis store costs the server: how long its scripts block Redis, and what
entries a burst of keys leaves behind. Every server here is a real redis-server."""

from __future__ import annotations

import math
import uuid

import pytest

from celery_exclusive.backends.redis import RedisBackend, layout
from celery_exclusive.backends.redis.connection import RENEW_CHUNK
from celery_exclusive.backends.redis.scripts import FENCE_TTL_MS
from tests.support.redis_sends import sent_by_this_thread


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def backend(redis_url):
    backend = RedisBackend(redis_url)
    yield backend
    backend.close()


def test_renewing_many_leases_runs_scripts_of_at_most_a_chunk_each(backend, monkeypatch):
    """1,250 leases, as one of four processes holding 5,000 renews them: in scripts of
    at most RENEW_CHUNK leases each, so Redis serves other clients between them (what
    one such script costs Redis, about 0.4 ms, is measured by ``python -m benchmarks
    breakdown``, not here: a loaded machine stretches any time)."""
    leases = [backend.try_acquire(f"many:{i}", owner(), 30) for i in range(1250)]
    assert backend.renew(leases) == set()  # loads the script
    sent = sent_by_this_thread(monkeypatch)
    assert backend.renew(leases) == set()
    scripts = sum(packed.count(b"$7\r\nEVALSHA\r\n") for packed in sent)
    assert scripts == math.ceil(1250 / RENEW_CHUNK)


def test_renewing_many_leases_is_one_round_trip(backend, monkeypatch):
    leases = [backend.try_acquire(f"trip:{i}", owner(), 30) for i in range(3 * RENEW_CHUNK)]
    sent = sent_by_this_thread(monkeypatch)
    assert backend.renew(leases) == set()
    assert len(sent) == 1


def test_renewal_reports_exactly_the_lost_leases_of_every_script(backend):
    leases = [backend.try_acquire(f"lost:{i}", owner(), 30) for i in range(3 * RENEW_CHUNK + 7)]
    gone = {
        leases[i] for i in (0, RENEW_CHUNK - 1, RENEW_CHUNK, 2 * RENEW_CHUNK + 5, len(leases) - 1)
    }
    for lease in gone:
        backend.force_release(lease.key)
    assert backend.renew(leases) == gone
    held = [lease for lease in leases if lease not in gone]
    assert all(backend.connection.client.pttl(layout.lease(lease.key)) > 29_000 for lease in held)


def test_a_burst_of_distinct_keys_leaves_its_fences_for_minutes_not_a_day(backend):
    """Each grant keeps the key's last token (its fence) a while after the lease ends;
    a burst of 1,000 keys used once must not leave 1,000 entries for a day."""
    for i in range(1000):
        backend.release(backend.try_acquire(f"burst:{i}", owner(), 30))
    client = backend.connection.client
    left = list(client.scan_iter(match="*", count=1000))
    assert len(left) == 1000  # one fence per key: the lease itself is gone
    assert all(name.endswith(b":fence") for name in left)
    longest = max(client.pttl(name) for name in left)
    assert longest <= 30_000 + FENCE_TTL_MS
    assert FENCE_TTL_MS <= 15 * 60 * 1000


def test_a_grant_after_its_fence_expired_still_gets_a_higher_token(backend):
    """Forgetting a fence is safe: the next token is floored by the store's clock, and
    the last token was the clock when it was granted."""
    first = backend.try_acquire("forgotten", owner(), 30)
    backend.release(first)
    backend.connection.client.delete(layout.fence("forgotten"))  # what its expiry does
    second = backend.try_acquire("forgotten", owner(), 30)
    assert second.fencing_token > first.fencing_token
