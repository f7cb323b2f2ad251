"""The watcher of pool children (celery_exclusive.celery.children), on real processes:
it calls back as a watched process exits, and only for the call it runs then."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from celery_exclusive.celery import children

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open")


class Exits:
    """What the watcher called back with, and when."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []
        self.event = threading.Event()

    def __call__(self, pid: int) -> None:
        self.seen.append((pid, time.monotonic()))
        self.event.set()


@pytest.fixture
def watcher():
    return children.Children()


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_a_watched_child_killed_is_reported_at_once(watcher, child):
    exits = Exits()
    assert watcher.watch(child.pid, "call", exits)
    killed = time.monotonic()
    child.kill()
    assert exits.event.wait(5)
    [(pid, seen)] = exits.seen
    assert pid == child.pid
    assert seen - killed < 1.0  # a poll of the pool, or the parent's wait, takes longer


def test_the_exit_is_reported_before_the_parent_waits_for_the_child(watcher, child):
    exits = Exits()
    watcher.watch(child.pid, "call", exits)
    child.kill()
    assert exits.event.wait(5)
    assert child.returncode is None, "nobody waited for it: it is a zombie, and that is an exit"


def test_a_child_whose_call_ended_exits_without_a_call_back(watcher, child):
    exits = Exits()
    watcher.watch(child.pid, "call", exits)
    watcher.unwatch(child.pid, "call")
    child.kill()
    child.wait()
    time.sleep(0.2)
    assert exits.seen == []


def test_the_end_of_an_earlier_call_does_not_unwatch_the_next(watcher, child):
    first, second = object(), object()
    earlier, later = Exits(), Exits()
    watcher.watch(child.pid, first, earlier)
    watcher.watch(child.pid, second, later)  # the child took its next call
    watcher.unwatch(child.pid, first)  # Celery reports the first call's end late
    child.kill()
    assert later.event.wait(5)
    assert earlier.seen == []


def test_a_process_gone_and_waited_for_is_not_watched(watcher, child):
    child.kill()
    child.wait()
    assert not watcher.watch(child.pid, "call", Exits())


def test_the_watching_process_itself_is_not_watched(watcher):
    assert not watcher.watch(os.getpid(), "call", Exits())


def test_a_process_not_a_child_of_the_watcher_is_not_watched(watcher):
    assert not watcher.watch(1, "call", Exits())


def test_a_greenlets_id_in_place_of_a_pid_is_not_watched(watcher):
    # Celery's gevent and eventlet pools hand on_accepted the id of the task's greenlet.
    assert not watcher.watch(id(object()), "call", Exits())


def test_the_watcher_lives_on_after_a_call_back_raises(watcher):
    processes = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)
    ]
    try:

        def fails(pid: int) -> None:
            raise RuntimeError("boom")

        exits = Exits()
        watcher.watch(processes[0].pid, "first", fails)
        watcher.watch(processes[1].pid, "second", exits)
        processes[0].kill()
        processes[0].wait()
        time.sleep(0.1)
        processes[1].kill()
        assert exits.event.wait(5)
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_without_pidfd_open_nothing_is_watched(watcher, child, monkeypatch):
    def refused(pid: int) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "pidfd_open", refused)
    assert not watcher.watch(child.pid, "call", Exits())
    monkeypatch.undo()
    assert not watcher.watch(child.pid, "call", Exits()), "tried again after a refusal"
