"""What a worker checks about its lease stores before the first task, and how a store
that cannot be used is reported."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from celery import Celery

from celery_exclusive import ConfigurationError, ExclusiveTask, LayoutMismatch
from celery_exclusive.backends.sqlite import SQLiteBackend
from tests.support.apps import ledger as ledger_app
from tests.support.cluster import Stack, wait_until
from tests.support.layouts import record_layout, recorded_layout
from tests.support.servers import RedisServer, free_port


def test_a_worker_whose_store_does_not_answer_warns_once_at_start_then_requeues(
    redis_server, client_dbs, tmp_path_factory
):
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    stack = Stack(redis_server, *client_dbs, unreachable, tmp_path_factory)
    with stack.running(stack.worker("w1", concurrency=1)) as running:
        [worker] = running.workers
        ledger_app.hold_requeue.delay("nobody-home", 0)
        worker.wait_for_log("requeued until the lease store answers", timeout=20)
    output = worker.output()
    warnings = [line for line in output.splitlines() if "does not answer at start" in line]
    assert len(warnings) == 1, warnings
    assert "WARNING" in warnings[0] and "requeued" in warnings[0]
    assert "duplicate requeued" not in output


def test_a_sqlite_store_that_names_a_directory_is_refused_naming_the_path(tmp_path):
    with pytest.raises(ConfigurationError, match="names a directory") as info:
        SQLiteBackend(f"sqlite:///{tmp_path}").check("exclusive:probe")
    assert str(tmp_path) in str(info.value)


def test_a_sqlite_store_that_names_another_kind_of_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a database, but long enough to have a header")
    with pytest.raises(ConfigurationError, match="not a SQLite database") as info:
        SQLiteBackend(f"sqlite:///{path}").check("exclusive:probe")
    assert "exclusive_backend_url" in str(info.value)


@contextlib.contextmanager
def unwritable(path: str):
    """Make the file at ``path`` unwritable even for root (the immutable attribute), or
    by mode for anyone else."""
    if os.getuid() != 0:
        os.chmod(path, 0o444)
        yield
        os.chmod(path, 0o644)
        return
    if subprocess.run(["chattr", "+i", path], capture_output=True).returncode != 0:
        pytest.skip("root cannot make a file unwritable here (chattr +i refused)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", path], check=True)


def test_a_database_this_user_cannot_write_is_a_configuration_error_not_an_outage(tmp_path):
    url = f"sqlite:///{tmp_path}/leases.db"
    setup = SQLiteBackend(url)
    setup.release(setup.try_acquire("k", "owner", 10))
    setup.close()
    with unwritable(f"{tmp_path}/leases.db"), pytest.raises(ConfigurationError) as raised:
        SQLiteBackend(url).try_acquire("k", "me", 10)
    assert "readonly" in str(raised.value) and "exclusive_backend_url" in str(raised.value)


@pytest.fixture
def store_of_another_version(redis_server, client_dbs, tmp_path_factory):
    """A stack whose store holds a layout version other than this one's, as a worker of
    another celery-exclusive version left it."""

    def make(version: int) -> Stack:
        stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
        record_layout(stack.store, "exclusive:", version)
        return stack

    return make


def refused_start(worker) -> str:
    """Start ``worker``, which must exit at start; its log's last line."""
    worker.start(wait=False)
    assert worker.process.wait(60) != 0, worker.output()
    assert "Traceback" not in worker.output()
    return worker.output().strip().splitlines()[-1]


def test_a_worker_meeting_a_newer_layout_refuses_to_start_naming_the_upgrade(
    store_of_another_version,
):
    stack = store_of_another_version(99)
    last = refused_start(stack.worker("w1", concurrency=1))
    assert "celery-exclusive: LayoutMismatch:" in last
    assert "layout version 99" in last and "upgrade this process" in last


def test_a_worker_meeting_an_older_layout_refuses_until_it_is_migrated(store_of_another_version):
    stack = store_of_another_version(0)
    last = refused_start(stack.worker("w1", concurrency=1))
    assert "celery-exclusive: LayoutMismatch:" in last and "migrate" in last
    migrate = subprocess.run(
        [
            str(Path(sys.executable).with_name("celery-exclusive")),
            "--backend",
            stack.store,
            "migrate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert migrate.returncode == 0, migrate.stderr
    with stack.running(stack.worker("w2", concurrency=1)):
        ledger_app.hold_skip.delay("migrated", 0)
        assert wait_until(lambda: stack.ledger.llen("ledger") == 1, timeout=30)


def test_the_first_worker_records_its_layout_version(redis_server, client_dbs, tmp_path_factory):
    stack = Stack(redis_server, *client_dbs, "redis", tmp_path_factory)
    assert recorded_layout(stack.store, "exclusive:") is None
    with stack.running(stack.worker("w1", concurrency=1)):
        assert recorded_layout(stack.store, "exclusive:") == "1"


def test_a_producer_meeting_a_newer_layout_is_refused_at_its_first_deduplicated_send():
    store = f"memory://{uuid.uuid4().hex}"
    app = Celery("producer", set_as_current=False)
    app.conf.update(broker_url="memory://", exclusive_backend_url=store)

    @app.task(base=ExclusiveTask, exclusive_key="{n}", exclusive_scope="enqueue")
    def settle(n):
        return n

    record_layout(store, "exclusive:", 99)
    with pytest.raises(LayoutMismatch, match="layout version 99"):
        settle.delay(1)


@pytest.mark.parametrize("on_backend_error", ["requeue", "run"])
def test_a_worker_that_meets_a_newer_layout_after_its_start_never_runs_a_call(
    redis_server, client_dbs, tmp_path_factory, on_backend_error
):
    # The store does not answer as the worker starts; once it does, it holds a layout
    # this worker cannot share: its calls go back to the queue, never run here, not even
    # where a store that does not answer would let them run unlocked.
    store = RedisServer()
    try:
        stack = Stack(redis_server, *client_dbs, store.url, tmp_path_factory)
        worker = stack.worker("w1", {"on_backend_error": on_backend_error}, concurrency=1)
        with stack.running(worker) as running:
            [worker] = running.workers
            store.start()
            record_layout(store.url, "exclusive:", 99)
            call = ledger_app.hold_skip.delay("later", 0)
            worker.wait_for_log(f"[{call.id}]: not run by this process", timeout=30)
            worker.wait_for_log("requeued: 'exclusive:later' this process cannot share", timeout=30)
            assert stack.ledger.llen("ledger") == 0
            assert "layout version 99" in worker.output()
    finally:
        store.cleanup()
