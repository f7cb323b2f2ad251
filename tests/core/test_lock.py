"""The lock for any code: its API, on the in-memory store (every store: tests/contract)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from celery import Celery

from celery_exclusive import (
    BackendUnavailable,
    ConfigurationError,
    ExclusiveError,
    ExclusiveLock,
    ExclusiveTask,
    LayoutMismatch,
    LockHeld,
    backend_for_url,
    exclusive_lock,
)
from celery_exclusive.core.lease import acquire
from celery_exclusive.rq import exclusive
from tests.support.layouts import record_layout


@pytest.fixture
def url():
    return f"memory://{uuid.uuid4().hex}"


@pytest.fixture
def app(url):
    app = Celery("billing", set_as_current=False)
    app.conf.update(exclusive_backend_url=url, exclusive_lease_ttl=7.0)
    return app


def holders(url: str, key: str) -> list:
    return backend_for_url(url).holders_of(key)


# --- which lease a lock takes -------------------------------------------------------------


def test_a_task_s_lock_takes_the_key_of_the_same_call(app):
    @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}")
    def settle(invoice_id: int, dry_run: bool = False) -> None: ...

    lock = settle.exclusive_lock(7)
    assert lock.key == "exclusive:invoice:7" == settle.exclusive_key_for((7,), {})
    assert (lock.backend_url, lock.ttl, lock.limit, lock.name) == (
        app.conf.exclusive_backend_url,
        7.0,
        1,
        settle.name,
    )


def test_a_task_s_lock_without_a_key_format_keys_on_every_argument(app):
    @app.task(base=ExclusiveTask, exclusive_limit=2)
    def refresh(account: str, full: bool = False) -> None: ...

    assert refresh.exclusive_lock(account="a").key == refresh.exclusive_key_for(("a", False), {})
    assert refresh.exclusive_lock("a").limit == 2


def test_a_task_s_lock_refuses_arguments_the_task_would_refuse(app):
    @app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}")
    def settle(invoice_id: int) -> None: ...

    with pytest.raises(TypeError, match="missing a required argument: 'invoice_id'"):
        settle.exclusive_lock(invoice=7)


def test_a_key_locked_with_an_app_s_settings_gets_its_prefix_and_store(app):
    app.conf.exclusive_key_prefix = "billing:"
    lock = exclusive_lock("invoice:7", app=app, wait=3)
    assert (lock.key, lock.backend_url, lock.ttl, lock.wait) == (
        "billing:invoice:7",
        app.conf.exclusive_backend_url,
        7.0,
        3,
    )


def test_a_key_locked_with_overrides_checks_them_as_settings(app):
    with pytest.raises(ConfigurationError, match="exclusive_lease_ttl=-1"):
        exclusive_lock("invoice:7", app=app, ttl=-1)
    assert exclusive_lock("invoice:7", app=app, ttl=3, limit=2).limit == 2


def test_an_rq_function_s_lock_takes_the_key_of_the_same_job(url):
    @exclusive(key="invoice:{invoice_id}", backend_url=url, lease_ttl=4)
    def settle(invoice_id: int) -> None: ...

    lock = settle.exclusive_lock(invoice_id=7)
    assert (lock.key, lock.backend_url, lock.ttl) == ("exclusive:invoice:7", url, 4.0)


@pytest.mark.parametrize(
    "options, wrong",
    [({"ttl": 0}, "ttl=0"), ({"wait": -1}, "wait=-1"), ({"limit": 0}, "limit=0")],
)
def test_a_lock_with_a_bad_option_is_refused_by_name(url, options, wrong):
    with pytest.raises(ConfigurationError, match=wrong):
        ExclusiveLock("k", url, **options)


# --- with, async with, decorators ---------------------------------------------------------


def test_a_lock_is_reusable_and_each_entry_takes_a_lease_of_its_own(url):
    lock = ExclusiveLock("k", url, limit=2)
    seen, inside = [], threading.Barrier(2)

    def enter() -> None:
        with lock as lease:
            seen.append(lease)
            inside.wait(5)

    threads = [threading.Thread(target=enter) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len({lease.fencing_token for lease in seen}) == 2
    assert all(lease.released for lease in seen)
    assert holders(url, "k") == []


def test_a_decorated_function_runs_under_a_lease_it_can_read(url):
    lock = ExclusiveLock("nightly", url)

    @lock
    def rebuild() -> tuple:
        lease = lock.lease
        return lease.fencing_token, lease.grant.owner, [i.owner for i in holders(url, "nightly")]

    token, owner, owners = rebuild()
    assert owners == [owner]
    assert lock.lease is None
    assert holders(url, "nightly") == []
    assert rebuild()[0] > token


def test_a_decorated_function_is_refused_while_its_key_is_held(url):
    lock = ExclusiveLock("nightly", url)
    calls, raised = [], []

    @lock
    def rebuild() -> None:
        calls.append(1)

    def call() -> None:
        try:
            rebuild()
        except LockHeld as exc:
            raised.append(exc)

    with lock:
        thread = threading.Thread(target=call)
        thread.start()
        thread.join(5)
    assert calls == []
    assert len(raised) == 1


def test_a_decorated_coroutine_function_runs_under_async_with(url):
    lock = ExclusiveLock("nightly", url)

    @lock
    async def rebuild() -> int:
        await asyncio.sleep(0)
        return len(holders(url, "nightly"))

    assert asyncio.run(rebuild()) == 1
    assert holders(url, "nightly") == []


def test_asyncio_tasks_entering_one_lock_take_turns(url):
    lock = ExclusiveLock("k", url, wait=10)
    spans = []

    async def turn() -> None:
        async with lock:
            start = time.monotonic()
            await asyncio.sleep(0.1)
            spans.append((start, time.monotonic()))

    async def main() -> None:
        await asyncio.gather(*(turn() for _ in range(3)))

    asyncio.run(main())
    spans.sort()
    assert len(spans) == 3
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_a_child_task_waits_for_its_parent_s_lock_rather_than_share_it(url):
    lock = ExclusiveLock("k", url, wait=10)
    order = []

    async def child() -> None:
        async with lock:
            order.append("child")

    async def main() -> None:
        async with lock:
            task = asyncio.create_task(child())
            await asyncio.sleep(0.2)
            order.append("parent")
        await task

    asyncio.run(main())
    assert order == ["parent", "child"]


def test_entering_a_lock_one_already_holds_is_refused_at_once(url):
    lock = ExclusiveLock("k", url, wait=30)
    started = time.monotonic()
    with lock, pytest.raises(ExclusiveError, match="not re-entrant"), ExclusiveLock("k", url):
        pass
    assert time.monotonic() - started < 5


def test_a_lock_cancelled_while_it_waits_gives_back_what_it_then_gets(url):
    backend = backend_for_url(url)
    held = acquire(backend, "k", 10, name="holder")
    lock = ExclusiveLock("k", url, wait=10)

    async def main() -> None:
        waiting = asyncio.create_task(lock.__aenter__())
        await asyncio.sleep(0.2)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        held.release()  # the waiting thread now gets the key, and must give it back
        await asyncio.sleep(1.0)

    asyncio.run(main())
    assert holders(url, "k") == []


def test_an_exception_in_the_block_passes_through_and_the_key_is_freed(url):
    with pytest.raises(ValueError, match="boom"), ExclusiveLock("k", url):
        raise ValueError("boom")
    assert holders(url, "k") == []


# --- a store that does not answer ---------------------------------------------------------


def test_a_lock_whose_store_does_not_answer_names_itself_and_no_task_setting():
    from tests.support.servers import free_port

    url = f"redis://127.0.0.1:{free_port()}/0?socket_connect_timeout=0.5"  # nothing listens
    with (
        pytest.raises(BackendUnavailable) as raised,
        exclusive_lock("reports:nightly", backend_url=url),
    ):
        pytest.fail("a block ran without its lease")
    message = str(raised.value)
    assert "could not be taken: its key 'exclusive:reports:nightly' went unanswered" in message
    assert "never runs without the lease" in message
    assert "on_backend_error" not in message  # a task's setting, which a lock ignores


def test_a_lock_meeting_a_layout_it_cannot_share_is_refused_and_its_block_never_runs(url):
    record_layout(url, "", 99)
    ran = []
    with pytest.raises(LayoutMismatch, match="layout version 99"), ExclusiveLock("k", url):
        ran.append(True)
    assert ran == [] and holders(url, "k") == []
