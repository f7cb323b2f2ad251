"""A release with a write (a task's result stored with the release of its lease) where
the server restricts or refuses it: under a user whose ACL limits key names, and when
the step is refused before it runs. A refused step is a release like any other: it says
whether the store still had the lease."""

from __future__ import annotations

import uuid

from celery_exclusive.backends import End, FinalWrite, MarkSwap, backend_for_url
from celery_exclusive.core.lease import acquire

KEY = "exclusive:invoice:9"


def write_to(key: str) -> FinalWrite:
    return FinalWrite(key=key, value='{"status": "SUCCESS"}', ttl=60, publish=True)


def limited_user(redis_server, redis_url, keys: list[str]) -> str:
    """The URL of ``redis_url`` as a user who may touch only ``keys`` (patterns)."""
    user, password = f"results-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    redis_server.client(0).acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{password}"],
        keys=keys,
        channels=["*"],
        commands=["+@all"],
    )
    return redis_url.replace("redis://", f"redis://{user}:{password}@", 1)


def test_a_user_limited_to_its_key_patterns_stores_the_result_with_the_release(
    redis_server, redis_url
):
    url = limited_user(redis_server, redis_url, ["{exclusive:*", "celery-task-meta-*"])
    backend = backend_for_url(url)
    lease = acquire(backend, KEY, 30, name="billing.settle", task_id="t-9")
    mark = MarkSwap("exclusive:invoice:9", "finished", None, "0", 60.0)
    assert lease.release(End(mark, write_to("celery-task-meta-t-9"))) is True
    assert lease.written
    assert backend.holders_of(KEY) == []
    assert backend.read_mark("exclusive:invoice:9", "finished") == "0"
    assert backend.connection.client.get("celery-task-meta-t-9") == b'{"status": "SUCCESS"}'


def test_a_refused_write_whose_lease_was_taken_meanwhile_is_a_lost_lease(redis_server, redis_url):
    """The server refuses the step before it runs (the write's key is outside the user's
    patterns): the plain release that follows finds the lease gone, and that is a loss,
    not a release whose answer was lost."""
    backend = backend_for_url(limited_user(redis_server, redis_url, ["{exclusive:*"]))
    lease = acquire(backend, KEY, 30, name="billing.settle", task_id="t-9")
    backend_for_url(redis_url).force_release(KEY)  # an operator, while the body ran
    assert lease.release(End(write=write_to("celery-task-meta-t-9"))) is False
    assert not lease.written
    assert lease.lost
