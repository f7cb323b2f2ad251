"""A SQLite database deleted, moved or replaced under the processes using it: refused
with an error that says so, never silently started afresh, and no fencing token goes
down.

Real files and real processes: forked children, and fresh interpreters where a test
needs a process that has not seen the database before.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import uuid

import pytest

from celery_exclusive.backends import backend_for_url
from celery_exclusive.backends.sqlite import SQLiteBackend
from celery_exclusive.errors import ConfigurationError
from tests.support.cluster import wait_until
from tests.support.workers import ROOT


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def path(tmp_path) -> str:
    return str(tmp_path / "leases.db")


def url(path: str) -> str:
    return f"sqlite:///{path}"


def in_fresh_process(code: str, *args: str) -> str:
    """Run ``code`` in a new interpreter (one that never opened the database); its output."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout


def test_a_deleted_database_refuses_every_call_and_is_not_created_again(path):
    store = SQLiteBackend(url(path))
    store.try_acquire("k", owner(), 30)
    os.unlink(path)
    with pytest.raises(ConfigurationError, match="was deleted or moved away") as refused:
        store.try_acquire("other", owner(), 30)
    assert path in str(refused.value) and "Restart every worker" in str(refused.value)
    with pytest.raises(ConfigurationError, match="was deleted"):
        store.holders("")
    assert not os.path.exists(path), "a new, empty database took its place"


def test_a_replaced_database_refuses_every_call(path, tmp_path):
    store = SQLiteBackend(url(path))
    store.try_acquire("k", owner(), 30)
    other = tmp_path / "other.db"
    sqlite3.connect(other).close()
    os.replace(other, path)
    with pytest.raises(ConfigurationError, match="was replaced by another file"):
        store.try_acquire("k", owner(), 30)


def test_leases_in_a_deleted_database_are_reported_lost_at_the_next_renewal(path):
    store = SQLiteBackend(url(path))
    lease = store.try_acquire("k", owner(), 30)
    assert store.renew([lease]) == set()
    os.unlink(path)
    assert store.renew([lease]) == {lease}


def test_the_loss_of_the_database_is_logged_once_per_process(path, caplog):
    store = SQLiteBackend(url(path))
    lease = store.try_acquire("k", owner(), 30)
    os.unlink(path)
    with caplog.at_level(logging.ERROR, logger="celery_exclusive"):
        store.renew([lease])
        for _ in range(3):
            with pytest.raises(ConfigurationError):
                store.try_acquire("k", owner(), 30)
    [record] = [r for r in caplog.records if "was deleted" in r.getMessage()]
    assert record.levelno == logging.ERROR and path in record.getMessage()


def _acquire_in_child(store_url: str, answers) -> None:
    try:
        backend_for_url(store_url).try_acquire("k", owner(), 30)
        answers.put("granted")
    except ConfigurationError as exc:
        answers.put(str(exc))


def test_a_child_forked_after_the_database_was_deleted_does_not_start_a_new_one(path):
    """A worker's pool child forked after the deletion (a replaced child, a new one under
    max-tasks-per-child) works with the file its parent found, not a new one."""
    backend_for_url(url(path)).check("exclusive:~check")  # as a worker does at start
    os.unlink(path)
    fork = multiprocessing.get_context("fork")
    answers = fork.Queue()
    child = fork.Process(target=_acquire_in_child, args=(url(path), answers))
    child.start()
    child.join(30)
    assert "was deleted" in answers.get(timeout=5)
    assert not os.path.exists(path)


def test_a_new_process_refuses_a_database_deleted_while_another_had_it_open(path):
    """The database is gone but its write-ahead log is still there: processes still
    work in the deleted file, and a new database would share their log."""
    still_open = sqlite3.connect(path, isolation_level=None)
    still_open.execute("PRAGMA journal_mode = WAL")
    still_open.execute("CREATE TABLE t (x)")
    os.unlink(path)
    output = in_fresh_process(
        "import sys\n"
        "from celery_exclusive.backends.sqlite import SQLiteBackend\n"
        "from celery_exclusive.errors import ConfigurationError\n"
        "try:\n"
        "    SQLiteBackend(sys.argv[1]).try_acquire('k', 'o', 30)\n"
        "except ConfigurationError as exc:\n"
        "    print(exc)\n",
        url(path),
    )
    assert "is missing" in output and f"{path}-wal" in output
    assert not os.path.exists(path)
    still_open.close()


def test_fencing_tokens_keep_rising_in_a_database_that_replaced_another(path):
    """Workers restarted on a new database (the old one deleted) grant tokens above
    every token of the old one: a fenced storage refuses the old holders' writes."""
    grant = (
        "import sys, uuid\n"
        "from celery_exclusive.backends.sqlite import SQLiteBackend\n"
        "store = SQLiteBackend(sys.argv[1])\n"
        "for _ in range(3):\n"
        "    lease = store.try_acquire('k', uuid.uuid4().hex, 30)\n"
        "    print(lease.fencing_token)\n"
        "    store.release(lease)\n"
    )
    before = [int(token) for token in in_fresh_process(grant, url(path)).split()]
    for name in (path, f"{path}-wal", f"{path}-shm"):
        if os.path.exists(name):
            os.unlink(name)
    after = [int(token) for token in in_fresh_process(grant, url(path)).split()]
    assert before == sorted(set(before))
    assert min(after) > max(before)


# --- under real workers ------------------------------------------------------------------


def take_away(path: str, fault: str, tmp_path) -> None:
    if fault == "deleted":
        os.unlink(path)
    else:
        fresh = tmp_path / "fresh.db"
        sqlite3.connect(fresh).close()
        os.replace(fresh, path)


@pytest.mark.parametrize("fault", ["deleted", "replaced"])
def test_workers_refuse_a_database_taken_away_under_them_and_no_token_goes_down(
    host, tmp_path, fault
):
    """Every task in a new pool child (max-tasks-per-child 1), as after a recycled child."""
    ttl = 3.0
    worker = host.worker("w", ttl=ttl, extra=("--max-tasks-per-child", "1")).start()
    keys = ["k1", "k2", "k3", "k4"]
    for result in [host.hold("w", key, 0.1) for key in keys]:
        result.get(timeout=30)
    before = {entry["key"]: entry["token"] for entry in host.read("ledger")}
    holders = [host.hold("w", key, 8.0) for key in ("long-a", "long-b")]
    assert wait_until(lambda: len(host.read("started")) == 6, timeout=30)

    seconds, micros = host.ledger.time()
    taken_at = seconds + micros / 1e6
    take_away(host.path, fault, tmp_path)
    for result in [host.hold("w", key, 0.1) for key in keys]:
        with pytest.raises(ConfigurationError, match=f"{host.path} was (deleted|replaced)"):
            result.get(timeout=30)
    # The running holders are stopped at their lease's deadline, and their calls, sent
    # again (requeue_lost), are refused like any other.
    for result in holders:
        with pytest.raises(ConfigurationError, match=f"{host.path} was (deleted|replaced)"):
            result.get(timeout=30)

    assert len(host.read("ledger")) == len(keys), "a call ran after its database was taken away"
    stopped = host.read("stopped")
    assert len(stopped) == 2
    assert all(f["at"] - taken_at < ttl for f in stopped), "a holder ran on past its lease"
    assert "ERROR" in worker.output() and f"{host.path} was" in worker.output()

    # Restarted after the operator cleared what the old database left beside it.
    worker.stop()
    for leftover in (f"{host.path}-wal", f"{host.path}-shm"):
        if os.path.exists(leftover):
            os.unlink(leftover)
    host.worker("w2", ttl=ttl).start()
    after = {key: host.hold("w2", key, 0.1).get(timeout=30)["token"] for key in keys}
    assert all(after[key] > before[key] for key in keys), (before, after)
