"""Go clients locking one key back to back, in a process of their own.

    python -m tests.support.consul_relay URL KEY COUNT HOLD

``COUNT`` clients (``tests/support/consul_api.py``, api/lock.go transcribed) take the
key in turn, each holding it ``HOLD`` seconds and each calling ``Lock`` again as soon as
the one before unlocked, until stdin closes. Each lock taken is printed as the
``time.monotonic()`` it was taken at (one clock for every process of the host).

A process of its own, as Go clients are: in the test's process their threads and the
test's waiter would share one interpreter lock, and which of them runs first after a
release would be decided by the lock's switch interval, not by the requests each makes.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

from tests.support import consul_api as api


def main(url: str, key: str, count: int, hold: float) -> None:
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    go = api.Client(url)
    for turn in itertools.count():
        options = api.LockOptions(Key=key, Value=b"go worker")
        options.LockTryOnce, options.LockWaitTime = True, hold
        lock = api.Lock(go, options)
        lock.opts.SessionName = f"Go client {turn % count}"
        if lock.Lock(stop) is not None:
            print(time.monotonic(), flush=True)
            stop.wait(hold)
            lock.Unlock()
        if stop.is_set():
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
