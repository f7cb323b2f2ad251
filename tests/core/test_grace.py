"""The grace a body gets to stop after its lease is lost counts the time its process
runs, not the time it spends stopped: a body cleaning up when its process is stopped
(SIGSTOP, a frozen VM) gets the rest of its grace once resumed, and a body that
overruns its grace while running is still killed.

The holder is a real process (tests/support/grace_holder.py) under
``stop_on_loss(kill_process=True)``; its lease is taken away by an operator's release,
which its next renewal finds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from celery_exclusive.backends import backend_for_url
from tests.support.deadlines import read_ledger
from tests.support.servers import kill_tree

ROOT = Path(__file__).resolve().parents[2]
KEY = "exclusive:grace"


class Holder:
    def __init__(self, url: str, ledger: Path, cleanup: float, grace: float) -> None:
        self.ledger = ledger
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.grace_holder", url, KEY]
            + [str(cleanup), str(grace), str(ledger)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )

    def noted(self, event: str) -> bool:
        return any(name == event for name, _, _ in read_ledger(self.ledger))

    def wait_for(self, event: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.noted(event):
            assert self.process.poll() is None, f"the holder ended before {event!r}"
            assert time.monotonic() < deadline, f"no {event!r} within {timeout}s"
            time.sleep(0.01)

    def lose_lease(self, url: str) -> None:
        self.wait_for("granted", 30)
        backend_for_url(url).force_release(KEY)
        self.wait_for("cleanup", 10)  # its next renewal found it gone, and it was told


@pytest.fixture
def holder(redis_url, tmp_path):
    made: list[Holder] = []

    def start(cleanup: float, grace: float) -> Holder:
        made.append(Holder(redis_url, tmp_path / "ledger", cleanup, grace))
        return made[-1]

    yield start
    for each in made:
        kill_tree(each.process, signal.SIGKILL)
        each.process.wait(10)


def test_a_body_stopped_during_its_grace_gets_the_rest_of_it_once_resumed(holder, redis_url):
    cleaning = holder(cleanup=1.0, grace=2.0)
    cleaning.lose_lease(redis_url)
    time.sleep(0.3)
    os.kill(cleaning.process.pid, signal.SIGSTOP)
    time.sleep(3.0)  # longer than the grace
    os.kill(cleaning.process.pid, signal.SIGCONT)
    assert cleaning.process.wait(15) == 0, "killed on resume: the pause used up its grace"
    assert cleaning.noted("cleaned")


def test_a_body_that_overruns_its_grace_while_running_is_killed(holder, redis_url):
    stubborn = holder(cleanup=30.0, grace=1.0)
    started = time.monotonic()
    stubborn.lose_lease(redis_url)
    assert stubborn.process.wait(15) == -signal.SIGKILL
    assert not stubborn.noted("cleaned")
    assert time.monotonic() - started < 10
