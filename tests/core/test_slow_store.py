"""A slow store costs no lease it keeps: renewals go on schedule whether or not the
ones before them have answered, each confirmation extending the lease from its own
send time, so a round trip under half the ttl loses nothing; and a store that answers
nothing gets no more than a few renewals at once.

Holders take leases one after another through our fault proxy, in front of a real
server, with bodies shorter than the ttl, each in a thread of the test process (one
heartbeat renews them all). The link is slowed only once the clients have the
connections they need (a connection opened under the slow link pays its own handshake's
round trips) and the store has its scripts and prepared statements.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest

from celery_exclusive import lease_lost
from celery_exclusive.backends import backend_for_url
from celery_exclusive.core.heartbeat import IN_FLIGHT
from celery_exclusive.core.lease import acquire, heartbeat
from tests.support.proxy import Proxy

TTL = 3.0
HOLDERS = 8
LEASES = 48
#: Bodies shorter than the ttl, yet too long to end within the grant's own deadline
#: once the grant was slow to answer: they need a renewal confirmed in time.
BODIES = (0.5, 1.0, 1.5, 2.0, 2.5)


@dataclass(frozen=True)
class SlowLink:
    """How slow the link to a store is made, each way, and how holders reach it."""

    low: float
    high: float
    #: Whether each holder has a connection of its own (a store instance of its own),
    #: as each pool child of a worker has; else all share one client, as threads do.
    own_connection: bool


LINKS = {
    # A round trip of 0.4-1.4 s, the longest under half the ttl: a grant and its
    # first renewal together always end before the grant's deadline (3 s less the
    # 0.15 s margin). At 0.8 s each way, 3.2 s would sometimes pass.
    "redis": SlowLink(0.2, 0.7, own_connection=False),
    # A grant is a transaction of five round trips here, and each process has one
    # connection that carries one call at a time: a link a quarter as slow makes the
    # grants as slow as Redis's (1.2-2.2 s), and each holder has its own connection.
    "postgresql": SlowLink(0.12, 0.22, own_connection=True),
}


@pytest.fixture(params=list(LINKS))
def store(request):
    """The store's URL, the proxy in front of it, and how slow to make the link."""
    url = request.getfixturevalue(f"{request.param}_url")
    proxy = Proxy(urlsplit(url).port)
    yield proxy.url_for(url), proxy, LINKS[request.param]
    proxy.close()


@pytest.fixture
def losses():
    """The keys of every ``lease_lost`` sent during the test, with its cause."""
    seen: list[tuple[str, str]] = []

    def receiver(sender, key, cause, **kwargs):
        seen.append((key, cause))

    lease_lost.connect(receiver)
    yield seen
    lease_lost.disconnect(receiver)


def holder_urls(url: str, link: SlowLink) -> list[str]:
    """The store URL each holder uses: one each (a connection of its own) or the same."""
    if not link.own_connection:
        return [url] * HOLDERS
    separator = "&" if "?" in url else "?"
    return [f"{url}{separator}application_name=holder-{i}" for i in range(HOLDERS)]


def in_threads(work, args: list) -> None:
    threads = [threading.Thread(target=work, args=(arg,)) for arg in args]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)


def warm_up(urls: list[str], proxy: Proxy, link: SlowLink) -> None:
    """Have the clients open the connections they will use, and the store load its
    scripts and prepare its statements (psycopg prepares one at its fifth use): threads
    taking, renewing and releasing a lease seven times each, with a short delay on the
    link so that they overlap. A shared client gets three threads per holder, for the
    holders' calls and the renewals in flight beside them."""
    proxy.delay(0.05)

    def cycles(url: str) -> None:
        for _ in range(7):
            lease = acquire(backend_for_url(url), f"warm-{uuid.uuid4().hex}", TTL)
            heartbeat().beat([lease.backend])
            lease.release()

    in_threads(cycles, urls if link.own_connection else urls * 3)


def test_leases_held_by_bodies_shorter_than_the_ttl_are_never_lost_to_a_slow_store(store, losses):
    url, proxy, link = store
    urls = holder_urls(url, link)
    warm_up(urls, proxy, link)
    proxy.delay(link.low, link.high)
    losses.clear()
    bodies = queue.SimpleQueue()
    for i in range(LEASES):
        bodies.put(BODIES[i % len(BODIES)])
    runs: list[tuple[float, float]] = []  # the grant's round trip, the body's length

    def hold(url: str) -> None:
        backend = backend_for_url(url)
        while not bodies.empty():
            body = bodies.get()
            sent_at = time.monotonic()
            lease = acquire(backend, f"slow-{uuid.uuid4().hex}", TTL, name="slow.holder")
            runs.append((time.monotonic() - sent_at, body))
            time.sleep(body)
            lease.release()

    in_threads(hold, urls)
    assert len(runs) == LEASES
    # The link was slow enough that the bodies needed their renewals...
    late = [(grant, body) for grant, body in runs if grant + body > TTL - 0.06]
    assert late, "no body outlasted its grant's deadline: the link is too fast for the test"
    # ...and every one of them was confirmed in time.
    assert losses == [], f"{len(losses)} of {LEASES} leases lost: {losses}"


def test_a_store_that_answers_nothing_gets_no_more_renewals_at_once_than_the_bound(
    redis_url,
):
    """Renewals go on schedule, but not without end: a black-holed store holds at most
    IN_FLIGHT of them (each a thread and a connection), while its leases last."""
    proxy = Proxy(urlsplit(redis_url).port)
    # Clients wait 30 s for an answer: nothing ends the stuck renewals meanwhile.
    backend = backend_for_url(proxy.url_for(redis_url) + "?socket_timeout=30")
    before = set(threading.enumerate())
    # Renewed every 0.2 s (a third of the shortest ttl held on the store), for 30 s.
    short = acquire(backend, f"short-{uuid.uuid4().hex}", 0.6, name="t")
    long = acquire(backend, f"long-{uuid.uuid4().hex}", 30, name="t")
    try:
        proxy.black_hole()
        time.sleep(3.0)  # fifteen renewals due
        in_flight = [
            thread
            for thread in set(threading.enumerate()) - before
            if thread.name == "celery-exclusive-renewal"
        ]
    finally:
        proxy.close()  # the stuck renewals fail, and end
        short.release()
        long.release()
    assert len(in_flight) == IN_FLIGHT


def test_a_renewal_answered_after_its_lease_was_released_changes_nothing(redis_url):
    proxy = Proxy(urlsplit(redis_url).port)
    backend = backend_for_url(proxy.url_for(redis_url))
    lease = acquire(backend, f"released-{uuid.uuid4().hex}", 30, name="t")
    renewed_at = lease.renewed_at
    try:
        proxy.delay(0.3)
        beat = threading.Thread(target=heartbeat().beat, args=([backend],))
        beat.start()  # its answer comes 0.6 s later...
        time.sleep(0.1)
        lease.release()  # ...while the release is on its way
        beat.join(timeout=10)
    finally:
        proxy.close()
    assert lease.renewed_at == renewed_at
    assert not lease.lost
