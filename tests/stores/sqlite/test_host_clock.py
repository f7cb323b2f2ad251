"""SQLite leases expire by the host's kernel clock, which every process reads alike:
a worker shown a clock of its own (libfaketime), a clock step, a reboot or an older
database file change nothing about who holds a key.

libfaketime fakes ``time()`` and every ``clock_gettime()`` clock of the processes it
is preloaded in, CLOCK_MONOTONIC included: the store's clock must hold even then. The
workers here fake only the wall clock (``FAKETIME_DONT_FAKE_MONOTONIC=1``), as a host
whose wall clock is wrong or stepped: with a faked monotonic clock, libfaketime 0.9.10
leaves Python 3.11's timed thread waits (``sem_clockwait``) unfaked, and a heartbeat
thread would never wake.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest

from celery_exclusive.backends.sqlite import SQLiteBackend
from celery_exclusive.backends.sqlite.schema import SCHEMA_VERSION
from tests.stores.sqlite.conftest import faked_wall_clock, needs_faketime
from tests.support.cluster import wait_until
from tests.support.workers import ROOT, overlaps


def owner() -> str:
    return uuid.uuid4().hex


def runs_in_order(ledger: list[dict]) -> dict[str, list[dict]]:
    by_key: dict[str, list[dict]] = {}
    for entry in sorted(ledger, key=lambda e: e["start"]):
        by_key.setdefault(entry["key"], []).append(entry)
    return by_key


def assert_one_holder_at_a_time(ledger: list[dict]) -> None:
    assert overlaps(ledger) == [], "two workers held one key at once"
    for runs in runs_in_order(ledger).values():
        tokens = [run["token"] for run in runs]
        assert tokens == sorted(set(tokens)), f"tokens not rising in order of runs: {tokens}"


# --- one worker's clock is not the host's --------------------------------------------------


@needs_faketime
def test_the_store_reads_the_kernel_clock_whatever_time_a_process_is_shown(tmp_path):
    store = f"sqlite:///{tmp_path}/leases.db"
    here = SQLiteBackend(store)
    before = here.store_time()
    shown = subprocess.run(
        ["faketime", "-f", "+3600s", sys.executable, "-c"]
        + [
            "import sys, time; from celery_exclusive.backends.sqlite import SQLiteBackend;"
            "print(time.time(), SQLiteBackend(sys.argv[1]).store_time())",
            store,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout.split()
    after = here.store_time()
    own_time, store_time = (float(x) for x in shown)
    assert own_time - time.time() > 3000, "faketime did not fake the process's clock"
    assert before <= store_time <= after


@needs_faketime
@pytest.mark.parametrize("skew", ["+30s", "-30s"])
def test_a_worker_whose_clock_is_30s_off_never_holds_a_key_beside_another(host, skew):
    """Each round one worker holds a key and the other asks for it: the asker waits for
    the release, whichever of them has the odd clock."""
    plain = host.worker("plain", ttl=5.0)
    skewed = host.worker("skewed", ttl=5.0, env=faked_wall_clock(FAKETIME=skew))
    plain.start()
    skewed.start()
    results = []
    for round_, (first, second) in enumerate([("plain", "skewed"), ("skewed", "plain")] * 2):
        key = f"round-{round_}"
        results.append(host.hold(first, key, 1.5))
        assert wait_until(lambda k=key: any(e["key"] == k for e in host.read("started")), 30)
        results.append(host.hold(second, key, 0.1))
    for result in results:
        result.get(timeout=60)
    ledger = host.read("ledger")
    assert len(ledger) == 8
    assert {entry["worker"] for entry in ledger} == {"plain", "skewed"}
    assert_one_holder_at_a_time(ledger)


@needs_faketime
def test_a_clock_step_on_every_worker_expires_no_lease(host, tmp_path):
    """Both workers' clocks jump an hour ahead while one holds a key with a 30 s lease."""
    clock_file = tmp_path / "faketime.rc"
    clock_file.write_text("+0\n")
    stepped = faked_wall_clock(FAKETIME_TIMESTAMP_FILE=str(clock_file), FAKETIME_CACHE_DURATION="1")
    for name in ("first", "second"):
        host.worker(name, ttl=30.0, env=stepped).start()
    holder = host.hold("first", "k", 6.0)
    assert wait_until(lambda: host.read("started"), 30)
    clock_file.write_text("+3600s\n")
    time.sleep(2.5)  # past libfaketime's cache of the clock file
    asker = host.hold("second", "k", 0.1)
    holder.get(timeout=60)
    asker.get(timeout=60)
    ledger = host.read("ledger")
    assert len(ledger) == 2
    assert_one_holder_at_a_time(ledger)


# --- a reboot, and a database of the previous schema -----------------------------------------


def test_leases_of_a_previous_boot_are_gone_when_the_database_is_next_opened(tmp_path):
    url = f"sqlite:///{tmp_path}/leases.db"
    SQLiteBackend(url).try_acquire("k", owner(), 30)
    db = sqlite3.connect(tmp_path / "leases.db", isolation_level=None)
    # As the previous boot left it: its holders are dead, their expiry far ahead of the
    # uptime the new boot starts counting from.
    db.execute("UPDATE exclusive_clock SET boot_id = 'a-previous-boot', origin = 0")
    db.execute("UPDATE exclusive_leases SET expires_at = 1e12")
    db.close()
    after_reboot = SQLiteBackend(url)
    assert after_reboot.holders_of("k") == []
    assert after_reboot.try_acquire("k", owner(), 30) is not None


def test_marks_and_records_outlive_a_reboot(tmp_path):
    url = f"sqlite:///{tmp_path}/leases.db"
    store = SQLiteBackend(url)
    lease = store.try_acquire("beat:app", owner(), 30)
    store.write_record(lease, "tick", "42")
    store.swap_mark("k", "rerun", None, "pending", 3600)
    db = sqlite3.connect(tmp_path / "leases.db", isolation_level=None)
    db.execute("UPDATE exclusive_clock SET boot_id = 'a-previous-boot'")
    db.close()
    after_reboot = SQLiteBackend(url)
    assert after_reboot.read_record("beat:app", "tick") == "42"
    assert after_reboot.read_mark("k", "rerun") == "pending"


def _version_2_database(path) -> None:
    """A database as the previous release left it: no clock table, wall-clock expiry."""
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(
        """
        CREATE TABLE exclusive_leases (key TEXT NOT NULL, owner TEXT NOT NULL,
            fencing_token INTEGER NOT NULL, lease_limit INTEGER NOT NULL,
            expires_at REAL NOT NULL, holder TEXT NOT NULL,
            PRIMARY KEY (key, owner)) WITHOUT ROWID;
        CREATE TABLE exclusive_fences (key TEXT PRIMARY KEY, counter INTEGER NOT NULL)
            WITHOUT ROWID;
        CREATE TABLE exclusive_records (lease_key TEXT NOT NULL, name TEXT NOT NULL,
            value TEXT NOT NULL, PRIMARY KEY (lease_key, name)) WITHOUT ROWID;
        CREATE TABLE exclusive_marks (key TEXT NOT NULL, kind TEXT NOT NULL,
            value TEXT NOT NULL, expires_at REAL NOT NULL,
            PRIMARY KEY (key, kind)) WITHOUT ROWID;
        PRAGMA user_version = 2;
        """
    )
    expires = time.time() + 30
    db.execute(
        "INSERT INTO exclusive_leases VALUES ('k', 'old-owner', 7, 1, ?, ?)",
        (expires, json.dumps({"task_id": "t-1"})),
    )
    db.execute("INSERT INTO exclusive_fences VALUES ('k', 7)")
    db.execute("INSERT INTO exclusive_records VALUES ('beat:app', 'tick', '42')")
    db.close()


def test_a_database_of_the_previous_schema_is_upgraded_in_place_keeping_its_leases(tmp_path):
    path = tmp_path / "leases.db"
    _version_2_database(path)
    store = SQLiteBackend(f"sqlite:///{path}")
    [holder] = store.holders_of("k")
    assert holder.task_id == "t-1" and 25 < holder.expires_in < 32
    assert store.try_acquire("k", owner(), 30) is None
    assert store.read_record("beat:app", "tick") == "42"
    store.force_release("k")
    assert store.try_acquire("k", owner(), 30).fencing_token > 7
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    db.close()
