"""What operators' views read from every store: pages of held keys with their marks,
the time since a lease was last renewed, and the feed of events workers report.

Runs once per store in ``conftest.BACKEND_CASES`` against the real store.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from celery_exclusive.backends import Backend
from celery_exclusive.backends.line import LINE
from celery_exclusive.core.feed import append_events, read_events
from celery_exclusive.errors import ConfigurationError


def owner() -> str:
    return uuid.uuid4().hex


def every_page(backend: Backend, prefix: str, count: int, kinds=()) -> list:
    """Every page under ``prefix``, following the cursors to the last one."""
    pages, cursor = [], None
    for _ in range(1000):
        page = backend.holders_page(prefix, cursor, count, kinds)
        pages.append(page)
        cursor = page.cursor
        if cursor is None:
            return pages
    raise AssertionError("the pages never ended")


# --- pages of held keys ------------------------------------------------------------------


def test_pages_list_every_held_key_under_the_prefix_once(backend):
    keys = [f"app:k{i:02d}" for i in range(23)]
    for key in keys:
        backend.try_acquire(key, owner(), 30)
    backend.try_acquire("other:k", owner(), 30)
    pages = every_page(backend, "app:", 5)
    listed = [held.key for page in pages for held in page.keys]
    assert sorted(set(listed)) == keys
    assert len(pages) > 1


def test_a_page_holds_about_as_many_keys_as_asked_for(backend):
    for i in range(30):
        backend.try_acquire(f"app:k{i:02d}", owner(), 30)
    first = backend.holders_page("app:", None, 10)
    # Stores listing in their own order (Redis's SCAN) may give a few more or fewer.
    assert 1 <= len(first.keys) <= 10 + 100
    assert first.cursor is not None


def test_a_page_gives_each_key_with_all_its_holders(backend):
    if not backend.capabilities.limits:
        pytest.skip(f"{type(backend).__name__} keeps one holder per key (no limits)")
    leases = [backend.try_acquire("app:sem", owner(), 30, limit=3) for _ in range(2)]
    backend.try_acquire("app:mutex", owner(), 30, holder={"task_id": "t-1"})
    [page] = every_page(backend, "app:", 100)
    by_key = {held.key: held for held in page.keys}
    assert sorted(by_key) == ["app:mutex", "app:sem"]
    assert sorted(info.owner for info in by_key["app:sem"].leases) == sorted(
        lease.owner for lease in leases
    )
    [mutex] = by_key["app:mutex"].leases
    assert mutex.task_id == "t-1"
    assert 0 < mutex.expires_in <= 30


def test_a_page_gives_the_marks_asked_for_with_each_key(backend):
    backend.try_acquire("app:k", owner(), 30)
    line = json.dumps([{"id": "w-1", "until": backend.store_time() + 30}])
    assert backend.swap_mark("app:k", LINE, None, line, 30)
    assert backend.swap_mark("app:k", "rerun", None, '{"task_id": "r-1"}', 30)
    [page] = every_page(backend, "app:", 100, kinds=(LINE, "rerun", "queued"))
    [held] = page.keys
    assert held.marks == {LINE: line, "rerun": '{"task_id": "r-1"}'}


def test_a_page_leaves_out_released_and_expired_leases(backend, backend_case):
    ttl = backend_case.short_ttl
    backend.try_acquire("app:expired", owner(), ttl)
    backend.release(backend.try_acquire("app:released", owner(), ttl))
    assert [held.key for held in backend.holders_page("app:").keys] == ["app:expired"]
    time.sleep(ttl * 2.5)
    assert every_page(backend, "app:", 100)[0].keys == []


@pytest.mark.parametrize(
    "hostile", ["<script>alert(1)</script>", "a'\"b", "line\nbreak", "nul\x00byte", "x" * 2000]
)
def test_a_page_gives_back_any_key_exactly(backend, hostile):
    key = "app:" + hostile
    try:
        backend.try_acquire(key, owner(), 30)
    except ConfigurationError:
        # A recipe locks the key as its ecosystem's clients name it (Backend.recipe),
        # and may refuse one they cannot (Consul's: a KV path, never this).
        assert backend.recipe is not None
        return
    listed = [held.key for page in every_page(backend, "app:", 100) for held in page.keys]
    assert listed == [key]


def test_an_empty_prefix_has_one_empty_last_page(backend):
    page = backend.holders_page("nothing-here:", None, 10)
    assert (page.keys, page.cursor) == ([], None)


# --- the time since the last renewal -----------------------------------------------------


def test_a_renewal_shows_as_the_time_since_the_lease_was_last_extended(backend):
    lease = backend.try_acquire("app:k", owner(), 30, holder={"ttl": 30})
    time.sleep(2.0)
    [before] = backend.holders_of("app:k")
    backend.renew([lease])
    [after] = backend.holders_of("app:k")
    since_before, since_after = before.renewed_ago, after.renewed_ago
    if since_before is None:  # the store cannot tell (etcd, Consul): it says so, always
        assert since_after is None
        return
    assert 1.9 < since_before < 8
    assert 0 <= since_after < 1.5


def test_the_time_since_renewal_is_unknown_without_the_leases_ttl(backend):
    backend.try_acquire("app:k", owner(), 30, holder={"task_id": "t"})
    [info] = backend.holders_of("app:k")
    assert info.renewed_ago is None


# --- the feed of events ------------------------------------------------------------------


def test_events_come_back_in_the_order_they_were_added(backend):
    append_events(backend, "app:", ["one", "two"], 100, 60)
    append_events(backend, "app:", ["three"], 100, 60)
    assert read_events(backend, "app:") == ["one", "two", "three"]


def test_a_feed_keeps_only_its_newest_events(backend):
    for i in range(5):
        append_events(backend, "app:", [f"e{i}a", f"e{i}b"], 4, 60)
    events = read_events(backend, "app:")
    # Redis trims its streams approximately: a few more may stay, never the oldest first.
    assert events[-4:] == ["e3a", "e3b", "e4a", "e4b"]
    assert events == [f"e{i}{x}" for i in range(5) for x in "ab"][-len(events) :]


def test_a_feed_expires_after_its_ttl(backend, backend_case):
    ttl = backend_case.short_ttl
    append_events(backend, "app:", ["soon gone"], 100, ttl)
    time.sleep(ttl * 2.5)
    assert read_events(backend, "app:") == []


def test_feeds_of_two_prefixes_are_apart_and_apart_from_keys(backend):
    append_events(backend, "app:", ["mine"], 100, 60)
    append_events(backend, "other:", ["theirs"], 100, 60)
    backend.try_acquire("app:", owner(), 30)
    assert read_events(backend, "app:") == ["mine"]
    assert read_events(backend, "other:") == ["theirs"]
    assert [held.key for held in backend.holders_page("app:").keys] == ["app:"]


def test_events_hold_any_text(backend):
    events = ['{"key": "<script>\\u0000"}', "line\nbreak", "é" * 500]
    append_events(backend, "app:", events, 100, 60)
    assert read_events(backend, "app:") == events
