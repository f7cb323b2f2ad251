"""Errors that point to their own fix: an eager or direct call whose store does not answer
points to an in-process store, and a Redis broker without the ``redis`` extra names the
extra, in one line, before kombu's import fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from celery import Celery

from celery_exclusive import BackendUnavailable, ConfigurationError, ExclusiveTask
from celery_exclusive.rq import exclusive
from tests.support.servers import free_port
from tests.support.workers import ROOT, LoggedProcess


def test_an_eager_call_whose_store_does_not_answer_points_to_the_test_fixture():
    dead = f"redis://127.0.0.1:{free_port()}/0"
    app = Celery("billing", broker=dead, set_as_current=False)
    app.conf.task_always_eager = True

    @app.task(base=ExclusiveTask, name="billing.settle", shared=False)
    def settle(invoice_id):
        return invoice_id

    with pytest.raises(BackendUnavailable) as raised:
        settle.delay(7).get()
    message = str(raised.value)
    assert "called eagerly, runs in this process" in message
    assert "exclusive_store fixture" in message
    assert "exclusive_backend_url='memory://'" in message
    assert "exclusive_on_backend_error" not in message  # no worker would requeue it


def test_a_direct_call_of_a_marked_rq_function_points_to_the_test_fixture():
    dead = f"redis://127.0.0.1:{free_port()}/0"

    @exclusive(backend_url=dead)
    def refund(order_id):
        return order_id

    with pytest.raises(BackendUnavailable) as raised:
        refund(7)
    assert "called directly, runs in this process" in str(raised.value)
    assert "exclusive_store fixture" in str(raised.value)
    assert "@exclusive(backend_url='memory://')" in str(raised.value)


QUICKSTART_ON_REDIS = """
from celery import Celery
from celery_exclusive import ExclusiveTask

app = Celery("tasks", broker="redis://127.0.0.1:{port}/0")


@app.task(base=ExclusiveTask, exclusive_key="invoice:{{invoice_id}}")
def settle(invoice_id):
    return invoice_id
"""


@pytest.fixture
def without_the_redis_extra(tmp_path):
    """The quick start moved to a Redis broker, in a Python where the ``redis`` extra
    is not installed."""
    (tmp_path / "tasks.py").write_text(QUICKSTART_ON_REDIS.format(port=free_port()))
    path = os.pathsep.join([str(ROOT / "tests/support/without_redis"), str(tmp_path), str(ROOT)])
    return tmp_path, {"PYTHONPATH": path}


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_a_redis_broker_without_the_extra_stops_the_worker_in_one_line(
    without_the_redis_extra, command
):
    folder, env = without_the_redis_extra
    args = [sys.executable, "-m", "celery", "-A", "tasks", command]
    if command == "beat":
        args += ["-s", str(folder / "schedule")]
    process = LoggedProcess(args, env, f"no-redis-{command}")
    process.start(wait=False)
    assert process.process.wait(60) != 0
    output = process.output()
    assert "celery-exclusive: ConfigurationError: the broker redis://" in output
    assert "pip install 'celery-exclusive[redis]'" in output
    assert "Traceback" not in output


def test_a_producer_without_the_extra_is_told_the_extra_at_its_first_call(
    without_the_redis_extra,
):
    folder, env = without_the_redis_extra
    out = subprocess.run(
        [sys.executable, "-c", "from tasks import settle; settle.delay(7)"],
        cwd=folder,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{ConfigurationError.__module__}.ConfigurationError: the broker")
    assert "pip install 'celery-exclusive[redis]'" in last
