"""A rolling upgrade never splits exclusion.

In a rolling upgrade, workers of the previous release and of the current one run side
by side on one lease store, each reading and writing what the other wrote. This guards
that they still exclude each other: the previous release is the package as of the
commit before the current store layout, installed from the repository's own history
into a venv of its own (see ``tests/support/previous_release.py``), and run as a real
``celery worker`` next to a worker of this checkout.

Under a steady stream of calls on a few keys (in pairs on one key, so that calls meet
each other's leases; each call with an id of its own, sent by name as any producer
sends), one Redis server being broker, store and ledger:

1. a worker of the previous release runs alone,
2. a worker of the current release starts beside it, and both run for several seconds,
3. the old worker is drained (SIGTERM: a warm shutdown), as a deploy does,
4. the new worker runs alone; then the calls stop and every one sent is waited for.

Each run notes in a ledger its key, call id, fencing token, start, end and the release
(and package file) that ran it, and each duplicate met the holder it met; the tests below
read the one upgrade's ledger.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_exclusive.backends.redis import RedisBackend
from tests.support.layouts import recorded_layout
from tests.support.previous_release import ROOT, PreviousRelease, previous_release
from tests.support.servers import RedisServer
from tests.support.workers import Worker, overlaps, read_ledger, runs_by_key

KEYS = [f"k{i}" for i in range(4)]
TASK = "rolling_upgrade.hold"
#: The app's module name in the previous release's worker (a copy of tests/upgrade/app.py).
OLD_APP = "rolling_upgrade_app"

#: Seconds of each phase, once its worker is ready (a worker's start adds its own).
OLD_ALONE, MIXED, NEW_ALONE = 3.0, 6.0, 3.0
#: Seconds between two pairs of calls sent (both on one key), and how long a run holds
#: its key.
SEND_EVERY, HOLD = 0.2, (0.05, 0.15)


class PreviousReleaseWorker(Worker):
    """A ``celery worker`` of the previous release: its venv's python, its cwd and
    PYTHONPATH a directory holding only the app, so that nothing of this checkout comes
    before the venv's own copy of the package."""

    def __init__(self, release: PreviousRelease, app_dir: Path, env: dict, name: str):
        super().__init__(OLD_APP, env, name=name)
        self.args[0] = str(release.python)
        self.env = {**release.env(pythonpath=app_dir), **env}
        self.cwd = app_dir


class Producer(threading.Thread):
    """Sends two calls on one key every ``SEND_EVERY`` seconds, round the keys, until
    stopped."""

    def __init__(self, broker: str):
        super().__init__(daemon=True)
        self.client = Celery("rolling_upgrade_producer", broker=broker)
        self.client.conf.broker_connection_retry_on_startup = True
        self.sent: list[str] = []
        self.stopped = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        keys = itertools.cycle(KEYS)
        try:
            while not self.stopped.is_set():
                key = next(keys)
                for _ in range(2):
                    call = uuid.uuid4().hex
                    duration = round(random.uniform(*HOLD), 3)
                    self.client.send_task(TASK, args=(key, call, duration))
                    self.sent.append(call)
                self.stopped.wait(SEND_EVERY)
        except BaseException as error:  # noqa: BLE001 - the test reports it
            self.error = error
        finally:
            self.client.close()

    def stop(self) -> list[str]:
        self.stopped.set()
        self.join(30)
        if self.error is not None:
            raise self.error
        return list(self.sent)


@dataclass
class Upgrade:
    """What one rolling upgrade left: the ledger, the calls sent, the phases' moments."""

    release: PreviousRelease
    sent: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    duplicates: list[dict] = field(default_factory=list)
    mixed: tuple[float, float] = (0.0, 0.0)
    old_exit: int | None = None
    old_log: str = ""
    new_log: str = ""
    #: The layout version the store holds once the upgrade is over.
    layout: str | None = None

    def ran_while_mixed(self, release: str) -> list[dict]:
        start, end = self.mixed
        return [e for e in self.entries if e["release"] == release and start <= e["start"] < end]


def wait_for(predicate, timeout: float, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(step)
    return predicate()


@pytest.fixture(scope="module")
def upgrade(tmp_path_factory) -> Upgrade:
    """One rolling upgrade under load, from the previous release to this checkout."""
    release = previous_release()
    app_dir = tmp_path_factory.mktemp("previous-release-app")
    shutil.copy(ROOT / "tests" / "upgrade" / "app.py", app_dir / f"{OLD_APP}.py")

    server = RedisServer(appendonly=True)
    producer = None
    workers: list[Worker] = []
    try:
        server.start()
        store, broker, ledger_url = (server.url_for_db(db) for db in (0, 1, 2))
        ledger = redis.Redis.from_url(ledger_url)
        env = {
            "ROLLING_UPGRADE_BROKER": broker,
            "ROLLING_UPGRADE_STORE": store,
            "ROLLING_UPGRADE_LEDGER": ledger_url,
        }
        old = PreviousReleaseWorker(
            release, app_dir, {**env, "ROLLING_UPGRADE_RELEASE": "previous"}, name="old"
        )
        new = Worker("tests.upgrade.app", {**env, "ROLLING_UPGRADE_RELEASE": "current"}, name="new")
        workers += [old, new]
        result = Upgrade(release)

        # 1. The previous release alone, under load.
        old.start()
        producer = Producer(broker)
        producer.start()
        time.sleep(OLD_ALONE)

        # 2. The current release beside it.
        new.start()
        mixed_from = time.time()
        time.sleep(MIXED)

        # 3. The old worker drained: a warm shutdown finishes what it runs.
        mixed_until = time.time()
        result.old_exit = old.stop(signal.SIGTERM, timeout=30)
        result.mixed = (mixed_from, mixed_until)

        # 4. The current release alone; then every call sent must have run.
        time.sleep(NEW_ALONE)
        result.sent = producer.stop()
        wanted = set(result.sent)
        wait_for(lambda: wanted <= {e["call"] for e in read_ledger(ledger)}, timeout=60)
        time.sleep(0.5)  # a call run twice would show now
        result.entries = read_ledger(ledger)
        result.duplicates = [json.loads(raw) for raw in ledger.lrange("duplicates", 0, -1)]
        result.old_log, result.new_log = old.output(), new.output()
        result.layout = recorded_layout(store, "exclusive:")
        return result
    finally:
        if producer is not None:
            producer.stopped.set()
        for worker in reversed(workers):
            worker.stop()
        server.cleanup()


def test_the_old_worker_runs_the_previous_release_installed_from_history(upgrade):
    package = str(upgrade.release.package)
    assert f"the previous release imports celery_exclusive from {package}" in upgrade.old_log
    assert "the current release imports celery_exclusive from " + str(ROOT) in upgrade.new_log
    by_release = {(e["release"], str(Path(e["package"]).parent)) for e in upgrade.entries}
    assert by_release == {("previous", package), ("current", str(ROOT / "celery_exclusive"))}


def test_old_and_new_workers_both_run_calls_while_mixed(upgrade):
    assert upgrade.ran_while_mixed("previous"), "the old worker ran nothing beside the new"
    assert upgrade.ran_while_mixed("current"), "the new worker ran nothing beside the old"


def test_the_old_worker_drains_with_a_warm_shutdown(upgrade):
    assert upgrade.old_exit == 0, upgrade.old_log[-3000:]


def test_each_release_meets_keys_held_by_the_other(upgrade):
    release_of = {entry["task_id"]: entry["release"] for entry in upgrade.entries}
    met = Counter(
        (duplicate["release"], release_of.get(duplicate["holder_task_id"]))
        for duplicate in upgrade.duplicates
    )
    assert met[("previous", "current")] and met[("current", "previous")], met


def test_no_two_runs_of_a_key_overlap_across_releases(upgrade):
    assert overlaps(upgrade.entries) == []


def test_fencing_tokens_of_a_key_increase_in_run_order_across_releases(upgrade):
    for runs in runs_by_key(upgrade.entries):
        tokens = [run["token"] for run in runs]
        assert all(a < b for a, b in zip(tokens, tokens[1:])), (
            runs[0]["key"],
            [(run["release"], run["token"]) for run in runs],
        )


def test_every_call_sent_runs_exactly_once(upgrade):
    ran = Counter(entry["call"] for entry in upgrade.entries)
    assert len(upgrade.sent) > 50, "too few calls to tell anything"
    assert set(ran) == set(upgrade.sent), {
        "never ran": len(set(upgrade.sent) - set(ran)),
        "never sent": len(set(ran) - set(upgrade.sent)),
    }
    assert [call for call, times in ran.items() if times > 1] == []


def test_the_current_release_records_its_layout_version_which_the_previous_never_read(
    upgrade,
):
    assert upgrade.layout == str(RedisBackend.layout_version.version)
