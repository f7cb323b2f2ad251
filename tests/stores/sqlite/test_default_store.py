"""The default lease store: a SQLite file private to the app and the user.

Workers here use a filesystem broker (not Redis), so the default store applies; each
test points ``XDG_STATE_HOME`` at a directory of its own.
"""

from __future__ import annotations

import json
import os
import stat

import redis

from tests.support.apps.private_store import make_app
from tests.support.cluster import wait_until
from tests.support.workers import Worker


def private_worker(name: str, tmp_path, ledger_url: str, state_home) -> Worker:
    env = {
        "EXCLUSIVE_TEST_APP": name,
        "EXCLUSIVE_TEST_QUEUE": str(tmp_path / f"{name}-queue"),
        "EXCLUSIVE_TEST_LEDGER": ledger_url,
        "XDG_STATE_HOME": str(state_home),
    }
    return Worker("tests.support.apps.private_store", env, concurrency=1, name=name)


def test_two_apps_with_the_same_key_on_the_default_store_run_independently(tmp_path, redis_url):
    state = tmp_path / "state"
    workers = [private_worker(name, tmp_path, redis_url, state) for name in ("alpha", "beta")]
    ledger = redis.Redis.from_url(redis_url)
    try:
        for worker in workers:
            worker.start()
        for name in ("alpha", "beta"):
            make_app(name, str(tmp_path / f"{name}-queue")).send_task("private.hold", (7, 2.0))
        assert wait_until(lambda: ledger.llen("ledger") == 2, timeout=30)
    finally:
        for worker in workers:
            worker.stop()
    alpha, beta = sorted((json.loads(raw) for raw in ledger.lrange("ledger", 0, -1)), key=str)
    assert (alpha["app"], beta["app"]) == ("alpha", "beta")
    assert alpha["key"] == beta["key"] == "exclusive:invoice:7"
    assert alpha["start"] < beta["end"] and beta["start"] < alpha["end"], "they excluded each other"
    assert alpha["store"] != beta["store"]
    uid = os.getuid()
    directory = state / "celery-exclusive"
    assert sorted(os.listdir(directory)) >= [f"alpha-uid{uid}.sqlite3", f"beta-uid{uid}.sqlite3"]
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    for worker in workers:
        warning = [line for line in worker.output().splitlines() if "the default store" in line]
        assert len(warning) == 1 and "WARNING" in warning[0]
        assert "only this host" in warning[0] and "exclusive_backend_url" in warning[0]


def test_an_unwritable_default_path_stops_the_worker_at_start_naming_the_setting(
    tmp_path, redis_url
):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the state directory should go")
    worker = private_worker("alpha", tmp_path, redis_url, blocker / "state")
    worker.start(wait=False)
    try:
        assert worker.process.wait(60) != 0
    finally:
        worker.stop()
    output = worker.output()
    line = next(line for line in output.splitlines() if "ConfigurationError" in line)
    assert line.startswith("celery-exclusive: ConfigurationError: ")
    assert "exclusive_backend_url" in line
    assert str(blocker / "state" / "celery-exclusive") in line
    assert "Traceback" not in output
