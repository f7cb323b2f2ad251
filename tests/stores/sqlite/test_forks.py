"""A process that forks while threads of its own use the SQLite store (a worker's main
process frees a killed child's lease in a thread while its pool forks the child's
replacement): every forked child opens its own connection and answers. Forked in the
middle of another thread's SQLite call, a child would find the library's mutexes
copied locked, and hang on its first call.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

from celery_exclusive.backends import backend_for_url

#: Children forked while the threads call the store, and how long each may take.
CHILDREN, CHILD_TIMEOUT = 150, 20.0


def test_children_forked_while_threads_use_the_store_all_answer(tmp_path):
    url = f"sqlite:///{tmp_path}/leases.db"
    backend_for_url(url).holders_of("exclusive:k")
    stop = threading.Event()

    def call_the_store() -> None:
        while not stop.is_set():
            backend_for_url(url).holders_of("exclusive:k")

    threads = [threading.Thread(target=call_the_store) for _ in range(2)]
    for thread in threads:
        thread.start()
    hung, failed = [], []
    try:
        for _ in range(CHILDREN):
            pid = os.fork()
            if pid == 0:  # the child: its own backend, its own connection
                answered = False
                try:
                    answered = backend_for_url(url).holders_of("exclusive:k") == []
                finally:
                    os._exit(0 if answered else 1)
            status = ended_within(pid, CHILD_TIMEOUT)
            if status is None:
                hung.append(pid)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            elif status != 0:
                failed.append(pid)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert hung == [], f"{len(hung)} of {CHILDREN} forked children hung on their first call"
    assert failed == [], f"{len(failed)} of {CHILDREN} forked children failed their first call"


def ended_within(pid: int, timeout: float) -> Optional[int]:
    """The exit status of child ``pid``, or None if it still runs after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    return None
